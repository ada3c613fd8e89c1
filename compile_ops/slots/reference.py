"""Plain-torch slot conversion: the meaning of ``topk_to_slots``, ``dcp_topk_to_slots`` and
``swa_indices`` (int64 math, CPU and CUDA, no host syncs). The layer's write-slot mapping is
:mod:`compile_ops.slots.mapping`."""

from __future__ import annotations

import torch


def _compact(slots: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Move valid entries to the front of each row in input order, fill the rest with -1.

    Invalid entries are scattered into a spare last column that is dropped, so the
    result is deterministic.
    """
    T, K = slots.shape
    target = torch.where(valid, valid.long().cumsum(1) - 1, K)
    out = torch.full((T, K + 1), -1, dtype=torch.int32, device=slots.device)
    out.scatter_(1, target, torch.where(valid, slots, -1).int())
    return out[:, :K].contiguous(), valid.sum(1, dtype=torch.int32)


def _lookup(block_table: torch.Tensor, req: torch.Tensor, page_index: torch.Tensor, ok: torch.Tensor):
    """``block_table[req, page_index]`` where ``ok``, else -1, reading only in-range cells."""
    R, B = block_table.shape
    if R == 0 or B == 0:
        return torch.full_like(page_index, -1)
    page = block_table[torch.where(ok, req, 0), torch.where(ok, page_index, 0)].long()
    return torch.where(ok, page, -1)


def _rows_ok(token_to_req, block_table, is_valid):
    req = token_to_req.long()
    return req, is_valid & (req >= 0) & (req < block_table.shape[0])


def _ids_to_slots(ids, req, row_ok, block_table, block_size):
    """Request-local compressed ids ``[T, K]`` -> (slots, valid) through the page table."""
    page_index = ids.div(block_size, rounding_mode="floor")
    ok = row_ok.unsqueeze(1) & (ids >= 0) & (page_index < block_table.shape[1])
    page = _lookup(block_table, req.unsqueeze(1).expand_as(ids), page_index, ok)
    ok = ok & (page >= 0)
    return page * block_size + ids % block_size, ok


def topk_to_slots_reference(topk, token_to_req, block_table, block_size, is_valid):
    req, row_ok = _rows_ok(token_to_req, block_table, is_valid)
    slots, ok = _ids_to_slots(topk.long(), req, row_ok, block_table, block_size)
    return _compact(slots, ok)


def dcp_topk_to_slots_reference(topk, token_to_req, block_table, block_size, is_valid, rank, world, interleave):
    req, row_ok = _rows_ok(token_to_req, block_table, is_valid)
    ids = topk.long()
    owned = (ids >= 0) & ((ids // interleave) % world == rank)
    local = (ids // (world * interleave)) * interleave + ids % interleave
    slots, ok = _ids_to_slots(torch.where(owned, local, -1), req, row_ok, block_table, block_size)
    return _compact(slots, ok)


def swa_indices_reference(positions, token_to_req, block_table, page_size, window):
    pos = positions.long()
    req, row_ok = _rows_ok(token_to_req, block_table, pos >= 0)
    lens = torch.where(row_ok, torch.clamp(pos + 1, max=window), 0)
    column = torch.arange(window, device=pos.device)
    x = (pos - lens + 1).unsqueeze(1) + column
    ok = column < lens.unsqueeze(1)
    page_index = x.div(page_size, rounding_mode="floor")
    ok = ok & (page_index < block_table.shape[1])
    page = _lookup(block_table, req.unsqueeze(1).expand_as(x), page_index, ok)
    ok = ok & (page >= 0)
    indices = torch.where(ok, page * page_size + x % page_size, -1)
    return indices.int(), lens.int()
