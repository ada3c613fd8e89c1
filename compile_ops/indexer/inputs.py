"""The inputs of one ``indexer_topk`` call, as every backend receives them.

Shape legend: ``T`` tokens, ``Hi`` indexer heads, ``R`` requests, ``B`` pages per block-table
row, ``L = B * page_size`` entries a row can address.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from compile_ops.indexer.cache import IndexFormat, dequantize_e2m1, quantize_e2m1, quantize_e4m3


TRITON_MAX_K = 4096  # the Triton top-k sorts a row's k kept entries in one program's registers
TRITON_MAX_HEADS = 128  # the scores kernel holds a token's [Hi, 128] queries in registers
ORDERS = ("score", "id")  # the orders indexer_topk gives a token's ids in


def triton_args_unsupported(args: "IndexerArgs") -> Optional[str]:
    """The ``triton`` backend's limits: ``None`` when its kernels take this call, else why not."""
    if max(args.k, args.n_blocks) > TRITON_MAX_K:
        return (f"the Triton indexer takes k <= {TRITON_MAX_K} and n_blocks <= {TRITON_MAX_K}, got k = {args.k}, "
                f"n_blocks = {args.n_blocks}")
    if args.q.shape[1] > TRITON_MAX_HEADS:
        return f"the Triton indexer takes at most {TRITON_MAX_HEADS} heads, got {args.q.shape[1]}"
    return None


class IndexerArgs(NamedTuple):
    """A validated ``indexer_topk`` / ``indexer_candidates`` call, as every backend receives it.

    The tensors are the op's own arguments, unchanged (a backend derives what it needs, so
    the op adds no kernels before the backend's): ``q [T, Hi, 128]`` bf16, ``weights [T,
    Hi]`` fp32, ``cache`` the index-key cache of format ``fmt``, ``block_table [R, B]``
    int32, ``token_to_req [T]`` int32 (a row outside ``[0, R)`` picks nothing),
    ``n_entries [T]`` int32 global entry counts (of the whole sequence, all DCP ranks);
    ``k`` ids per token. :func:`local_counts` and :func:`product_query` state what they
    mean: ``score[t, c] = scale[c] * sum_h w[t, h] * relu(<q[t, h], key[c]>)`` over this
    shard's first ``n[t]`` entries. A backend's ``indexer_topk(args)`` returns ``(ids [T, k]
    int32, scores [T, k] fp32)``: ids in descending score, ties by the lower id (``order``
    ``"score"``), or the same ids in ascending id order (``"id"``); ``-1`` (score ``-inf``)
    past the valid entries.

    Two-level selection (DeepSeek-V4.1's candidate blocks): ``candidates [T, C]`` int32
    global block ids (``-1`` = none) restrict each token to the entries of those blocks of
    ``candidate_block`` consecutive global ids (``None``: no restriction); a backend's
    ``indexer_candidates(args)`` instead returns the ``k`` best such blocks ``(blocks [T,
    k] int32, block scores [T, k])``, a block scoring the max of its entries and block
    :func:`pinned_blocks` ``[t]`` scoring ``+inf``; ``indexer_topk_and_candidates(args)``
    returns both from one scoring, ``((ids, scores) [T, k], (blocks, block scores) [T,
    n_blocks])``. ``shard = (rank, world, interleave)``:
    the cache holds DCP rank ``rank``'s entries (:func:`global_ids`), so blocks are of
    global ids.
    """

    q: Tensor
    weights: Tensor
    cache: Tensor
    fmt: IndexFormat
    block_table: Tensor
    token_to_req: Tensor
    n_entries: Tensor
    k: int
    candidates: Optional[Tensor] = None
    candidate_block: int = 1
    shard: tuple[int, int, int] = (0, 1, 1)
    order: str = "score"
    n_blocks: int = 0


def local_counts(args: IndexerArgs) -> tuple[Tensor, Tensor]:
    """``(rows [T] int64, n [T] int32)``: each token's request row (0 where it picks nothing)
    and how many entries it scores on this shard, ``0 <= n <= L = B * page_size`` (0 for an
    invalid row or a count ``<= 0``)."""
    R, L = args.block_table.shape[0], args.block_table.shape[1] * args.cache.shape[1]
    rank, world, interleave = args.shard
    n = local_entries(args.n_entries.clamp_min(0), rank, world, interleave).clamp(max=L)
    ok = (args.token_to_req >= 0) & (args.token_to_req < R) & (n > 0)
    return torch.where(ok, args.token_to_req, 0).long(), torch.where(ok, n, 0).to(torch.int32)


def pinned_blocks(args: IndexerArgs) -> Tensor:
    """``[T]`` int64: the global block of each token's newest entry the tables can address
    (past their end, the last), which ``indexer_candidates`` always keeps; ``-1``: none."""
    R, L = args.block_table.shape[0], args.block_table.shape[1] * args.cache.shape[1]
    newest = args.n_entries.clamp(max=L * args.shard[1]).long() - 1
    valid = (args.token_to_req >= 0) & (args.token_to_req < R) & (newest >= 0)
    return torch.where(valid, newest // args.candidate_block, -1)


def product_query(args: IndexerArgs) -> tuple[Tensor, Tensor]:
    """``(q, weights)`` in the products' terms: with an ``fp8`` cache, q quantized like the
    keys (:func:`compile_ops.indexer.cache.quantize_e4m3`, per (token, head) row) and its
    power-of-two scale folded into the weights; with ``fp4``, q fake-quantized like the keys
    (:func:`compile_ops.indexer.cache.quantize_e2m1`, per 32 values of a head), as
    DeepSeek-V4.1's indexer does; with ``bf16``, both as given."""
    if args.fmt.fp4:
        return dequantize_e2m1(*quantize_e2m1(args.q), packed=False), args.weights
    if not args.fmt.fp8:
        return args.q, args.weights
    q, scale = quantize_e4m3(args.q)
    return q, args.weights * scale


def local_entries(n: Tensor, rank: int, world: int, interleave: int) -> Tensor:
    """How many of global entries ``0 .. n - 1`` rank ``rank`` of ``world`` holds, when runs of
    ``interleave`` consecutive ids go to the ranks in turn (``dcp_topk_to_slots``'s rule)."""
    span = world * interleave
    return (n // span) * interleave + (n % span - rank * interleave).clamp(0, interleave)


def global_ids(local: Tensor, rank: int, world: int, interleave: int) -> Tensor:
    """Global ids of rank ``rank``'s local ids (``-1`` stays ``-1``); increasing in ``local``."""
    glob = ((local // interleave) * world + rank) * interleave + local % interleave
    return torch.where(local >= 0, glob, -1)


def _column_blocks(args: IndexerArgs, L: int, device) -> tuple[Tensor, int]:
    """``(block [L] int64`` of each of a row's ``L`` local columns, ``nb`` blocks that the
    global ids of ``L`` columns on each of the shard's ranks span)."""
    rank, world, interleave = args.shard
    block = args.candidate_block
    return global_ids(torch.arange(L, device=device), rank, world, interleave) // block, -(-L * world // block)


def candidate_mask(args: IndexerArgs, lo: int, hi: int) -> Tensor:
    """``[hi - lo, nb + 1]`` bool: which of the ``nb`` global blocks are among tokens
    ``lo:hi``'s ``args.candidates`` (column ``nb`` takes the ``-1`` ones, never read)."""
    nb = -(-args.block_table.shape[1] * args.cache.shape[1] * args.shard[1] // args.candidate_block)
    cand = args.candidates[lo:hi].long()
    cand = torch.where((cand >= 0) & (cand < nb), cand, nb)
    return torch.zeros(hi - lo, nb + 1, dtype=torch.bool, device=cand.device).scatter_(1, cand, True)


def restrict_to_candidates(scores: Tensor, args: IndexerArgs, lo: int, hi: int) -> Tensor:
    """``scores [hi - lo, L]`` of tokens ``lo:hi`` with every entry outside the tokens'
    ``args.candidates`` blocks at ``-inf`` (``scores`` itself without candidates)."""
    if args.candidates is None:
        return scores
    col, _ = _column_blocks(args, scores.shape[1], scores.device)
    return scores.masked_fill(~candidate_mask(args, lo, hi)[:, col], float("-inf"))


def block_scores(scores: Tensor, args: IndexerArgs, lo: int, hi: int) -> Tensor:
    """``[hi - lo, nb]`` fp32: each block's max score over the entries of tokens ``lo:hi``
    (``-inf``: none visible), block :func:`pinned_blocks` ``[t]`` at ``+inf``; columns past a
    token's count are not read (a backend need not have written them)."""
    L = scores.shape[1]
    col, nb = _column_blocks(args, L, scores.device)
    n = local_counts(args)[1][lo:hi]
    scores = scores.masked_fill(torch.arange(L, device=scores.device) >= n.unsqueeze(1), float("-inf"))
    out = scores.new_full((hi - lo, nb), float("-inf"))
    out = out.scatter_reduce(1, col.expand(hi - lo, L), scores, "amax")
    pinned = torch.arange(nb, device=scores.device) == pinned_blocks(args)[lo:hi].unsqueeze(1)  # -1: none
    return out.masked_fill(pinned, float("inf"))
