"""Plain-torch indexer: the meaning of ``indexer_topk`` (CPU and CUDA, no host syncs).

Scores are fp32 (products of the dequantized values, accumulated in fp32); the top-k is a
stable descending sort, so equal scores keep ascending id order. Tokens and entries are
processed in chunks whose sizes come from shapes only, so memory stays bounded.
"""

from __future__ import annotations

import torch
from torch import Tensor

from compile_ops.indexer.cache import read_index_keys
from compile_ops.indexer.inputs import IndexerArgs, block_scores, local_counts, product_query, restrict_to_candidates

SCORE_CHUNK = 1 << 22  # scores of one token chunk, elements (16 MiB of fp32)
KEY_CHUNK = 1 << 20  # dequantized keys gathered at once, elements (4 MiB of fp32)


def scores_reference(args: IndexerArgs, lo: int, hi: int) -> Tensor:
    """fp32 scores ``[hi - lo, L]`` of tokens ``lo:hi``; ``-inf`` at ``c >= n`` and at holes."""
    cache, fmt, block_table = args.cache, args.fmt, args.block_table
    q, weights = product_query(args)
    rows, n = local_counts(args)
    page_size, num_slots = cache.shape[1], cache.shape[0] * cache.shape[1]
    L = block_table.shape[1] * page_size
    qf, w, row, count = q[lo:hi].float(), weights[lo:hi], rows[lo:hi], n[lo:hi]
    out = torch.empty(hi - lo, L, dtype=torch.float32, device=q.device)
    step = max(1, KEY_CHUNK // max(1, (hi - lo) * q.shape[2]))
    for c0 in range(0, L, step):
        ids = torch.arange(c0, min(L, c0 + step), device=q.device)
        pages = block_table[row][:, ids // page_size].long()  # [T, E]
        slots = pages * page_size + ids % page_size
        valid = (ids < count.unsqueeze(1)) & (pages >= 0) & (slots < num_slots)
        keys = read_index_keys(cache, torch.where(valid, slots, -1), fmt.name)  # [T, E, 128]
        dots = torch.einsum("thd,ted->the", qf, keys)
        score = (dots.clamp_min(0) * w.unsqueeze(-1)).sum(1)
        out[:, c0 : c0 + ids.shape[0]] = torch.where(valid, score, float("-inf"))
    return out


def topk_of_scores(scores: Tensor, k: int, ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The ``k`` highest of ``scores [T, N]`` (``-inf`` = none), descending, ties by the lower
    id (``ids [T, N]`` int32, or the column when ``None``): ``(ids [T, k] int32, scores [T, k])``,
    ``-1`` / ``-inf`` past the valid ones."""
    T, N = scores.shape
    if ids is not None:  # order by id first: the stable sort below then breaks ties by it
        ids, order = torch.sort(ids, dim=1, stable=True)
        scores = scores.gather(1, order)
    values, order = torch.sort(scores, dim=1, descending=True, stable=True)
    picked = order if ids is None else ids.gather(1, order)
    if N < k:
        values = torch.cat([values, values.new_full((T, k - N), float("-inf"))], 1)
        picked = torch.cat([picked, picked.new_full((T, k - N), -1)], 1)
    values, picked = values[:, :k], picked[:, :k]
    return torch.where(values > float("-inf"), picked, -1).to(torch.int32), values


def _per_chunk(args: IndexerArgs, select) -> tuple[Tensor, ...]:
    """``select(scores, lo, hi) -> (tensor, ...)`` over token chunks of bounded scores,
    each output joined over the chunks."""
    T = args.q.shape[0]
    L = args.block_table.shape[1] * args.cache.shape[1]
    chunk = max(1, SCORE_CHUNK // max(1, L))
    chunks = [(lo, min(T, lo + chunk)) for lo in range(0, T, chunk)] or [(0, 0)]
    parts = [select(scores_reference(args, lo, hi), lo, hi) for lo, hi in chunks]
    return tuple(torch.cat(outputs) for outputs in zip(*parts))


def by_id(ids: Tensor) -> tuple[Tensor, Tensor]:
    """``ids [T, k]`` int32 in ascending id order, the ``-1`` ones last, and ``order [T, k]``
    int64, the columns they came from."""
    none = torch.iinfo(torch.int32).max
    ids, order = torch.where(ids >= 0, ids, none).sort(dim=1)
    return torch.where(ids < none, ids, -1), order


def _ordered(args: IndexerArgs, ids: Tensor, scores: Tensor) -> tuple[Tensor, Tensor]:
    """``(ids, scores)`` of a top-k by score (entries or blocks), in ``args.order``."""
    if args.order == "id":
        ids, order = by_id(ids)
        scores = scores.gather(1, order)
    return ids, scores


def indexer_topk_reference(args: IndexerArgs) -> tuple[Tensor, Tensor]:
    """``(ids [T, k] int32, scores [T, k] fp32)`` of :class:`IndexerArgs`."""
    return _ordered(args, *_per_chunk(args, lambda s, lo, hi: topk_of_scores(restrict_to_candidates(s, args, lo, hi),
                                                                             args.k)))


def indexer_candidates_reference(args: IndexerArgs) -> tuple[Tensor, Tensor]:
    """``(blocks [T, k] int32, block scores [T, k] fp32)`` of :class:`IndexerArgs`."""
    return _per_chunk(args, lambda s, lo, hi: topk_of_scores(block_scores(s, args, lo, hi), args.k))


def indexer_topk_and_candidates_reference(args: IndexerArgs) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """``((ids, scores) [T, k], (blocks, block scores) [T, n_blocks])`` of :class:`IndexerArgs`
    (no ``candidates``), from one scoring."""
    ids, scores, blocks, block_values = _per_chunk(args, lambda s, lo, hi: (
        *topk_of_scores(s, args.k), *topk_of_scores(block_scores(s, args, lo, hi), args.n_blocks)))
    return _ordered(args, ids, scores), _ordered(args, blocks, block_values)
