"""The inputs of one ``indexer_topk`` call, as every backend receives them.

Shape legend: ``T`` tokens, ``Hi`` indexer heads, ``R`` requests, ``B`` pages per block-table
row, ``L = B * page_size`` entries a row can address.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

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
    ``run(args)`` returns ``(ids [T, k] int32, scores [T, k] fp32)``: ids in descending
    score, ties by the lower id, ``-1`` (score ``-inf``) past the valid entries.
    """

    q: Tensor
    weights: Tensor
    cache: Tensor
    fmt: IndexFormat
    block_table: Tensor
    rows: Tensor
    n: Tensor
    k: int
