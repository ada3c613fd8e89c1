"""Triton slot conversion: the CUDA kernels of ``topk_to_slots``,
``dcp_topk_to_slots`` and ``swa_indices`` (same results as
:mod:`compile_ops.slots.reference`, bit for bit).

Shape legend: ``T`` tokens, ``K`` top-k columns, ``R`` requests, ``B`` pages per block-table
row, ``W`` the SWA window. One program converts one token row, walking the row in chunks
of ``BLOCK`` columns (``CHUNKS = cdiv(K, BLOCK)`` is a compile-time constant: one for
every top-k up to 2048, and Triton's interpreter cannot loop to a run-time bound on
numpy >= 2.4).

Compaction is a stable stream compaction (Blelloch, "Prefix sums and their applications",
1990): inside a chunk, ``tl.cumsum`` of the valid mask gives every valid entry its output
column, offset by the count of valid entries in earlier chunks; each column is written by
exactly one lane, so the order is the input order and the result is deterministic (no
atomics). A second pass fills the columns past the count with ``-1``.

The launchers take any strides for the inputs and return contiguous int32 outputs; they
run on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1`` (the CPU tests).
Nothing here allocates anything whose size depends on data, and nothing syncs, so the
launches are captured by CUDA graphs as they are.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from compile_ops._launch import launchable

MAX_BLOCK = 2048


@triton.jit
def _topk_to_slots_kernel(
    topk_ptr, stride_tt, stride_tk,
    req_ptr, valid_ptr,
    table_ptr, stride_br, stride_bb,
    slots_ptr, lens_ptr,
    K, R, B, block_size, rank, world, interleave,
    DCP: tl.constexpr, BLOCK: tl.constexpr, CHUNKS: tl.constexpr,
):
    i_t = tl.program_id(0).to(tl.int64)
    b_req = tl.load(req_ptr + i_t)
    m_row = (tl.load(valid_ptr + i_t) != 0) & (b_req >= 0) & (b_req < R)
    b_req = tl.where(m_row, b_req, 0).to(tl.int64)
    b_count = tl.full([], 0, tl.int32)
    for i_c in range(CHUNKS):
        o_k = i_c * BLOCK + tl.arange(0, BLOCK)
        m_k = o_k < K
        # [BLOCK] request-local (or, with DCP, global) compressed ids
        b_id = tl.load(topk_ptr + i_t * stride_tt + o_k * stride_tk, mask=m_k, other=-1)
        # a scalar condition joins a mask through tl.where, never `&`: Triton 3.9's
        # interpreter turns `scalar & vector` masks into integers and rejects them
        m_ok = tl.where(m_row, m_k & (b_id >= 0), False)
        b_c = tl.where(m_ok, b_id, 0)  # non-negative from here on: // and % are exact
        if DCP:
            m_ok = m_ok & ((b_c // interleave) % world == rank)
            b_c = (b_c // (world * interleave)) * interleave + b_c % interleave
        b_pi = b_c // block_size
        m_ok = m_ok & (b_pi < B)
        b_page = tl.load(table_ptr + b_req * stride_br + b_pi * stride_bb, mask=m_ok, other=-1)
        m_ok = m_ok & (b_page >= 0)
        b_slot = (b_page.to(tl.int64) * block_size + b_c % block_size).to(tl.int32)
        b_col = b_count + tl.cumsum(m_ok.to(tl.int32), 0) - 1
        tl.store(slots_ptr + i_t * K + b_col, b_slot, mask=m_ok)
        b_count += tl.sum(m_ok.to(tl.int32), 0)
    for i_c in range(CHUNKS):
        o_k = i_c * BLOCK + tl.arange(0, BLOCK)
        tl.store(slots_ptr + i_t * K + o_k, tl.full([BLOCK], -1, tl.int32), mask=(o_k < K) & (o_k >= b_count))
    tl.store(lens_ptr + i_t, b_count)


@triton.jit
def _swa_indices_kernel(
    pos_ptr, req_ptr,
    table_ptr, stride_br, stride_bb,
    idx_ptr, lens_ptr,
    R, B, page_size, W,
    BLOCK: tl.constexpr, CHUNKS: tl.constexpr,
):
    i_t = tl.program_id(0).to(tl.int64)
    b_pos = tl.load(pos_ptr + i_t).to(tl.int64)
    b_req = tl.load(req_ptr + i_t)
    m_row = (b_pos >= 0) & (b_req >= 0) & (b_req < R)
    b_req = tl.where(m_row, b_req, 0).to(tl.int64)
    b_len = tl.where(m_row, tl.minimum(b_pos + 1, W), 0)
    b_first = b_pos - b_len + 1
    for i_c in range(CHUNKS):
        o_w = i_c * BLOCK + tl.arange(0, BLOCK)
        m_ok = o_w < b_len
        # [BLOCK] absolute positions of this chunk of the window, oldest first
        b_x = tl.where(m_ok, b_first + o_w, 0)
        b_pi = b_x // page_size
        m_ok = m_ok & (b_pi < B)
        b_page = tl.load(table_ptr + b_req * stride_br + b_pi * stride_bb, mask=m_ok, other=-1)
        m_ok = m_ok & (b_page >= 0)
        b_idx = tl.where(m_ok, b_page.to(tl.int64) * page_size + b_x % page_size, -1).to(tl.int32)
        tl.store(idx_ptr + i_t * W + o_w, b_idx, mask=o_w < W)
    tl.store(lens_ptr + i_t, b_len.to(tl.int32))


def _block(n: int, block: int | None) -> tuple[int, int]:
    """Chunk width (a power of two, at most ``MAX_BLOCK``) and warps for rows of ``n`` columns."""
    if block is None:
        block = min(triton.next_power_of_2(max(n, 1)), MAX_BLOCK)
    if block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block}")
    return block, 8 if block >= 1024 else 4


def _launch_topk(topk, token_to_req, block_table, block_size, is_valid, rank, world, interleave, dcp, block):
    T, K = topk.shape
    slots = torch.empty((T, K), dtype=torch.int32, device=topk.device)
    lens = torch.empty((T,), dtype=torch.int32, device=topk.device)
    if T == 0:
        return slots, lens
    if K == 0:
        return slots, lens.zero_()
    R, B = block_table.shape
    BLOCK, num_warps = _block(K, block)
    launchable(_topk_to_slots_kernel, topk)[(T,)](
        topk, topk.stride(0), topk.stride(1),
        token_to_req.contiguous(), is_valid.contiguous(),  # (bool: read as the bytes it is)
        block_table, block_table.stride(0), block_table.stride(1),
        slots, lens,
        K, R, B, block_size, rank, world, interleave,
        DCP=dcp, BLOCK=BLOCK, CHUNKS=triton.cdiv(K, BLOCK), num_warps=num_warps,
    )
    return slots, lens


def topk_to_slots_triton(topk, token_to_req, block_table, block_size, is_valid, *, block=None):
    """Triton ``topk_to_slots``; arguments and results as :func:`compile_ops.topk_to_slots`.

    ``block`` (a power of two) overrides the chunk width, for tests of multi-chunk rows.
    """
    return _launch_topk(topk, token_to_req, block_table, block_size, is_valid, 0, 1, 1, False, block)


def dcp_topk_to_slots_triton(topk, token_to_req, block_table, block_size, is_valid, rank, world, interleave, *, block=None):
    """Triton ``dcp_topk_to_slots``; arguments and results as :func:`compile_ops.dcp_topk_to_slots`."""
    return _launch_topk(topk, token_to_req, block_table, block_size, is_valid, rank, world, interleave, True, block)


def swa_indices_triton(positions, token_to_req, block_table, page_size, window, *, block=None):
    """Triton ``swa_indices``; arguments and results as :func:`compile_ops.swa_indices`."""
    T = positions.shape[0]
    indices = torch.empty((T, window), dtype=torch.int32, device=positions.device)
    lens = torch.empty((T,), dtype=torch.int32, device=positions.device)
    if T == 0:
        return indices, lens
    R, B = block_table.shape
    BLOCK, num_warps = _block(window, block)
    launchable(_swa_indices_kernel, positions)[(T,)](
        positions.contiguous(), token_to_req.contiguous(),
        block_table, block_table.stride(0), block_table.stride(1),
        indices, lens,
        R, B, page_size, window,
        BLOCK=BLOCK, CHUNKS=triton.cdiv(window, BLOCK), num_warps=num_warps,
    )
    return indices, lens
