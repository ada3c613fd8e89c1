"""The inputs of one ``indexer_topk`` call, as every backend receives them.

Shape legend: ``T`` tokens, ``Hi`` indexer heads, ``R`` requests, ``B`` pages per block-table
row, ``L = B * page_size`` entries a row can address.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from compile_ops.indexer.cache import IndexFormat


TRITON_MAX_K = 4096  # the Triton top-k sorts a row's k kept entries in one program's registers
TRITON_MAX_HEADS = 128  # the scores kernel holds a token's [Hi, 128] queries in registers


def triton_args_unsupported(args: "IndexerArgs") -> Optional[str]:
    """The ``triton`` backend's limits: ``None`` when its kernels take this call, else why not."""
    if args.k > TRITON_MAX_K:
        return f"the Triton indexer takes k <= {TRITON_MAX_K}, got k = {args.k}"
    if args.q.shape[1] > TRITON_MAX_HEADS:
        return f"the Triton indexer takes at most {TRITON_MAX_HEADS} heads, got {args.q.shape[1]}"
    return None


class IndexerArgs(NamedTuple):
    """A validated, normalized ``indexer_topk`` call.

    ``q [T, Hi, 128]`` in the dtype the products are taken in (e4m3 for an ``fp8`` cache,
    bf16 for ``bf16``) and ``weights [T, Hi]`` fp32 with q's per-row scale folded in, so
    ``score[t, c] = scale[c] * sum_h weights[t, h] * relu(<q[t, h], key[c]>)``; ``cache``
    the index-key cache of format ``fmt``; ``block_table [R, B]`` int32; ``rows [T]`` int64
    request rows, clamped into ``[0, R)`` (``n`` is 0 where the row was invalid); ``n [T]``
    int32 entries each token scores (``0 <= n <= L``); ``k`` ids per token. A backend's
    ``indexer_topk(args)`` returns ``(ids [T, k] int32, scores [T, k] fp32)``: ids in
    descending score, ties by the lower id, ``-1`` (score ``-inf``) past the valid entries.

    Two-level selection (DeepSeek-V4.1's candidate blocks): ``candidates [T, C]`` int32
    global block ids (``-1`` = none) restrict each token to the entries of those blocks of
    ``candidate_block`` consecutive global ids (``None``: no restriction); a backend's
    ``indexer_candidates(args)`` instead returns the ``k`` best such blocks ``(blocks [T,
    k] int32, block scores [T, k])``, a block scoring the max of its entries and block
    ``pin[t]`` (``-1``: none) scoring ``+inf``. ``shard = (rank, world, interleave)``: the
    cache holds DCP rank ``rank``'s entries (:func:`compile_ops.indexer.ops.global_ids`),
    so blocks are of global ids.
    """

    q: Tensor
    weights: Tensor
    cache: Tensor
    fmt: IndexFormat
    block_table: Tensor
    rows: Tensor
    n: Tensor
    k: int
    candidates: Optional[Tensor] = None
    candidate_block: int = 1
    pin: Optional[Tensor] = None
    shard: tuple[int, int, int] = (0, 1, 1)


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


def restrict_to_candidates(scores: Tensor, args: IndexerArgs, lo: int, hi: int) -> Tensor:
    """``scores [hi - lo, L]`` of tokens ``lo:hi`` with every entry outside the tokens'
    ``args.candidates`` blocks at ``-inf`` (``scores`` itself without candidates)."""
    if args.candidates is None:
        return scores
    L = scores.shape[1]
    col, nb = _column_blocks(args, L, scores.device)
    cand = args.candidates[lo:hi].long()
    cand = torch.where((cand >= 0) & (cand < nb), cand, nb)  # -1 (none) to a spare column
    allowed = torch.zeros(hi - lo, nb + 1, dtype=torch.bool, device=scores.device).scatter_(1, cand, True)
    return scores.masked_fill(~allowed[:, col], float("-inf"))


def block_scores(scores: Tensor, args: IndexerArgs, lo: int, hi: int) -> Tensor:
    """``[hi - lo, nb]`` fp32: each block's max score over the entries of tokens ``lo:hi``
    (``-inf``: none visible), block ``args.pin[t]`` at ``+inf``; columns past a token's
    ``n`` are not read (a backend need not have written them)."""
    L = scores.shape[1]
    col, nb = _column_blocks(args, L, scores.device)
    scores = scores.masked_fill(torch.arange(L, device=scores.device) >= args.n[lo:hi].unsqueeze(1), float("-inf"))
    out = scores.new_full((hi - lo, nb), float("-inf"))
    out = out.scatter_reduce(1, col.expand(hi - lo, L), scores, "amax")
    pinned = torch.arange(nb, device=scores.device) == args.pin[lo:hi].unsqueeze(1)  # pin -1: none
    return out.masked_fill(pinned, float("inf"))
