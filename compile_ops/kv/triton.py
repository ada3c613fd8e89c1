"""Triton row store of ``write_kv``: one masked store per row (same bytes as
:mod:`compile_ops.kv.reference`). Runs on CUDA tensors, or on CPU tensors under
``TRITON_INTERPRET=1``; nothing syncs or allocates, so CUDA graphs capture it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from compile_ops._launch import launchable
from compile_ops.formats import KVFormat


@triton.jit
def _write_rows_kernel(
    cache_ptr, stride_cp, rows_ptr, slots_ptr, stride_s, n_slots, page_size,
    DATA: tl.constexpr, SCALE: tl.constexpr, BLOCK: tl.constexpr,
):
    # one program stores one row; DATA / SCALE are the row's data and scale widths in cache
    # elements (a page holds its data rows, then its scale rows)
    i_n = tl.program_id(0).to(tl.int64)
    b_slot = tl.load(slots_ptr + i_n * stride_s).to(tl.int64)
    m_row = (b_slot >= 0) & (b_slot < n_slots)
    b_slot = tl.where(m_row, b_slot, 0)
    b_page = b_slot // page_size
    b_off = b_slot - b_page * page_size
    o_e = tl.arange(0, BLOCK)
    m_e = o_e < DATA + SCALE
    o_dst = tl.where(o_e < DATA, b_off * DATA + o_e, page_size * DATA + b_off * SCALE + (o_e - DATA))
    b_x = tl.load(rows_ptr + i_n * (DATA + SCALE) + o_e, mask=m_e)
    tl.store(cache_ptr + b_page * stride_cp + o_dst, b_x, mask=tl.where(m_row, m_e, False))


def write_rows_triton(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, fmt: KVFormat) -> None:
    """Store encoded rows ``rows [N, bytes_per_token]`` uint8 at ``slots [N]`` of ``cache``;
    rows whose slot is ``-1`` or out of range store nothing (masked, never addressed)."""
    size = cache.element_size()
    rows = rows.contiguous().view(cache.dtype)
    data, scale = fmt.data_bytes // size, fmt.scale_bytes // size
    launchable(_write_rows_kernel, cache)[(slots.shape[0],)](
        cache, cache.stride(0), rows, slots, slots.stride(0), cache.shape[0] * cache.shape[1], cache.shape[1],
        DATA=data, SCALE=scale, BLOCK=triton.next_power_of_2(data + scale),
    )
