"""Cache-write slot mappings: where each token's new row lands in a paged cache.

Plain tensor math with no host sync, run inside a layer's (compiled, captured) step.
"""

from __future__ import annotations

import torch


def compressed_slot_mapping(positions, token_to_req, block_table, block_size, compress_ratio, rank=0, world=1,
                            interleave=1):
    """Cache slot that each token's write lands in (``-1``: no write), int32 ``[T]``.

    A token at position ``p >= 0`` of request ``r = token_to_req[t]`` closes compressed
    entry ``c = p // compress_ratio`` when ``(p + 1) % compress_ratio == 0``; that entry
    lives in slot ``block_table[r, c // block_size] * block_size + c % block_size``.
    Tokens that close no entry, padding tokens (``p < 0``), requests outside ``[0, R)``,
    pages outside the table row and negative table entries give ``-1``. With
    ``compress_ratio=1`` this is the SWA cache's slot mapping (``c = p``). Under DCP
    (``world > 1``) only entries rank ``rank`` owns are written, at their local id
    ``(c // (world * interleave)) * interleave + c % interleave`` (``dcp_topk_to_slots``'s
    rule); the others give ``-1``.

    Example::

        >>> import torch
        >>> i32 = lambda *v: torch.tensor(v, dtype=torch.int32)
        >>> compressed_slot_mapping(i32(0, 1, 3, 5, -1), i32(0, 0, 0, 0, 0), i32([5, 2]).view(1, 2), 2, 2).tolist()
        [-1, 10, 11, 4, -1]
    """
    pos, req = positions.long(), token_to_req.long()
    R, B = block_table.shape
    entry = torch.div(pos, compress_ratio, rounding_mode="floor")
    ok = (pos >= 0) & ((pos + 1) % compress_ratio == 0) & (req >= 0) & (req < R)
    if world > 1:
        ok = ok & ((entry // interleave) % world == rank)
        entry = (entry // (world * interleave)) * interleave + entry % interleave
    page_index = torch.div(entry, block_size, rounding_mode="floor")
    ok = ok & (page_index < B)
    if R == 0 or B == 0:
        return torch.full_like(positions, -1, dtype=torch.int32)
    page = block_table[torch.where(ok, req, 0), torch.where(ok, page_index, 0)].long()
    ok = ok & (page >= 0)
    return torch.where(ok, page * block_size + entry % block_size, -1).to(torch.int32)
