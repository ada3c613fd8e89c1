"""Triton LSE combine and the fast DCP combine (same results as
:mod:`compile_ops.combine.reference`, up to fp32 summation order).

Shape legend: ``N`` partials (ranks), ``T`` tokens, ``H`` heads (``H_all = N * H`` gathered
heads in the DCP combine), ``D`` head dim. LSEs are fp32 and base 2.

Both kernels use the log-sum-exp merge of split attention (Milakov & Gimelshein, "Online
normalizer calculation for softmax", 2018; Dao et al., FlashDecoding, 2023): with
``m = max_r L_r``, ``w_r = 2**(L_r - m) / sum_s 2**(L_s - m)`` and ``L = m + log2(sum_s
2**(L_s - m))``. NaN and ``+inf`` LSEs count as ``-inf``; when every ``L_r`` is ``-inf``
the weights are 0 and ``L = -inf``. A weight of 0 contributes exactly 0, even against a
NaN or ``inf`` partial output.

* :func:`lse_combine_triton` -- one program per (token, head), reading an ``[N, BLOCK_D]``
  tile of partial outputs at a time.
* :func:`dcp_rescale_triton` -- the local step of the ``ag_rs`` DCP combine: from the
  all-gathered LSEs, scale this rank's outputs by its weight and lay them out head-slice
  major for the reduce-scatter, and write the merged LSE of this rank's heads; one kernel
  in place of a dozen elementwise ops.
* :func:`dcp_combine_triton` -- ``dcp_combine`` over c10d functional collectives with
  these kernels; the ``a2a`` mode packs each head slice's (out, lse) into one 16-byte
  aligned row of a byte buffer, so the receiver reads the partials in place, without
  unpacking copies.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from compile_ops._groups import group_rank
from compile_ops._launch import launchable
from compile_ops.combine.reference import _c10d

TILE = 4096  # elements of one [BLOCK_N, BLOCK_D] tile
ALIGN = 16  # bytes; row alignment of the a2a pack


@triton.jit
def _lse_weights(p_l, m_n):
    """``[BLOCK_N]`` normalised weights and the merged LSE of one column of LSEs."""
    b_l = tl.load(p_l, mask=m_n, other=float("-inf"))
    b_l = tl.where((b_l != b_l) | (b_l == float("inf")), float("-inf"), b_l)
    b_top = tl.max(b_l, 0)
    b_top = tl.where(b_top > float("-inf"), b_top, 0.0)
    b_w = tl.exp2(b_l - b_top)
    b_total = tl.sum(b_w, 0)
    b_w = tl.where(b_total > 0, b_w / b_total, 0.0)
    return b_w, b_top + tl.log2(b_total)


@triton.jit
def _lse_combine_kernel(
    po_ptr, s_on, s_ot, s_oh, s_od,
    pl_ptr, s_ln, s_lt, s_lh,
    out_ptr, lse_ptr,
    N, H, D,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D_CHUNKS: tl.constexpr,
):
    i_th = tl.program_id(0).to(tl.int64)
    i_t, i_h = i_th // H, i_th % H
    o_n = tl.arange(0, BLOCK_N)
    m_n = o_n < N
    b_w, b_lse = _lse_weights(pl_ptr + o_n * s_ln + i_t * s_lt + i_h * s_lh, m_n)
    m_w = b_w > 0
    for i_c in range(D_CHUNKS):
        o_d = i_c * BLOCK_D + tl.arange(0, BLOCK_D)
        m_d = o_d < D
        # [BLOCK_N, BLOCK_D]
        p_o = po_ptr + o_n[:, None] * s_on + i_t * s_ot + i_h * s_oh + o_d[None, :] * s_od
        b_o = tl.load(p_o, mask=m_w[:, None] & m_d[None, :], other=0.0).to(tl.float32)
        b_acc = tl.sum(tl.where(m_w[:, None], b_o * b_w[:, None], 0.0), 0)
        tl.store(out_ptr + i_th * D + o_d, b_acc.to(out_ptr.dtype.element_ty), mask=m_d)
    tl.store(lse_ptr + i_th, b_lse)


@triton.jit
def _dcp_rescale_kernel(
    out_ptr, s_ot, s_oh, s_od,
    gl_ptr,
    scaled_ptr, mine_ptr,
    T, N, H_all, H, D, rank,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D_CHUNKS: tl.constexpr,
):
    i_th = tl.program_id(0).to(tl.int64)
    i_t, i_g = i_th // H_all, i_th % H_all
    i_s, i_h = i_g // H, i_g % H  # head slice (destination rank) and head within it
    o_n = tl.arange(0, BLOCK_N)
    m_n = o_n < N
    # gathered LSEs are [N, T, H_all]
    b_w, b_lse = _lse_weights(gl_ptr + (o_n * T + i_t) * H_all + i_g, m_n)
    b_wr = tl.sum(tl.where(o_n == rank, b_w, 0.0), 0)
    p_dst = scaled_ptr + ((i_s * T + i_t) * H + i_h) * D
    for i_c in range(D_CHUNKS):
        o_d = i_c * BLOCK_D + tl.arange(0, BLOCK_D)
        m_d = o_d < D
        # [BLOCK_D]
        b_o = tl.load(out_ptr + i_t * s_ot + i_g * s_oh + o_d * s_od, mask=m_d, other=0.0)
        b_o = tl.where(b_wr > 0, b_o.to(tl.float32) * b_wr, 0.0)
        tl.store(p_dst + o_d, b_o.to(scaled_ptr.dtype.element_ty), mask=m_d)
    tl.store(mine_ptr + i_t * H + i_h, b_lse, mask=i_s == rank)


@triton.jit
def _a2a_pack_kernel(
    out_ptr, s_ot, s_oh, s_od,
    lse_ptr, s_lt, s_lh,
    po_ptr, s_pn, s_pt, s_ph,
    pl_ptr, s_qn, s_qt,
    H_all, H, D,
    BLOCK_D: tl.constexpr, D_CHUNKS: tl.constexpr,
):
    i_tg = tl.program_id(0).to(tl.int64)
    i_t, i_g = i_tg // H_all, i_tg % H_all
    i_s, i_h = i_g // H, i_g % H  # destination rank and its head
    for i_c in range(D_CHUNKS):
        o_d = i_c * BLOCK_D + tl.arange(0, BLOCK_D)
        m_d = o_d < D
        # [BLOCK_D]
        b_o = tl.load(out_ptr + i_t * s_ot + i_g * s_oh + o_d * s_od, mask=m_d)
        tl.store(po_ptr + i_s * s_pn + i_t * s_pt + i_h * s_ph + o_d, b_o, mask=m_d)
    b_l = tl.load(lse_ptr + i_t * s_lt + i_g * s_lh)
    tl.store(pl_ptr + i_s * s_qn + i_t * s_qt + i_h, b_l)


def _tiles(N: int, D: int, tile: int) -> tuple[int, int, int]:
    """``BLOCK_N`` (all partials), ``BLOCK_D`` (so a ``[BLOCK_N, BLOCK_D]`` tile has at most
    ``tile`` elements) and the number of ``BLOCK_D`` chunks covering ``D``."""
    BLOCK_N = triton.next_power_of_2(max(N, 1))
    BLOCK_D = max(16, min(triton.next_power_of_2(max(D, 1)), tile // BLOCK_N))
    return BLOCK_N, BLOCK_D, triton.cdiv(D, BLOCK_D)


def lse_combine_triton(partial_out: torch.Tensor, partial_lse: torch.Tensor):
    """Triton ``lse_combine``; arguments and results as :func:`compile_ops.lse_combine`.

    Reads the partials with any strides (the ``a2a`` combine passes views into its receive
    buffer); returns contiguous ``out [T, H, D]`` in ``partial_out``'s dtype, ``lse [T, H]`` fp32.
    """
    N, T, H, D = partial_out.shape
    out = torch.empty((T, H, D), dtype=partial_out.dtype, device=partial_out.device)
    lse = torch.empty((T, H), dtype=torch.float32, device=partial_out.device)
    if T * H == 0:
        return out, lse
    BLOCK_N, BLOCK_D, D_CHUNKS = _tiles(N, D, TILE)
    launchable(_lse_combine_kernel, partial_out)[(T * H,)](
        partial_out, *partial_out.stride(),
        partial_lse, *partial_lse.stride(),
        out, lse,
        N, H, D,
        BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, D_CHUNKS=D_CHUNKS, num_warps=4,
    )
    return out, lse


def dcp_rescale_triton(out: torch.Tensor, gathered_lse: torch.Tensor, rank: int):
    """Local step of the ``ag_rs`` combine.

    Args:
        out: ``[T, H_all, D]`` this rank's partial outputs (any strides).
        gathered_lse: ``[N, T, H_all]`` fp32 contiguous, every rank's LSEs.
        rank: this rank.

    Returns:
        ``scaled [N, T, H, D]`` (out's dtype; slice ``s`` holds head slice ``s`` scaled by this
        rank's weight, ready for a reduce-scatter over dim 0) and ``lse_mine [T, H]`` fp32,
        the merged LSE of this rank's heads.
    """
    T, H_all, D = out.shape
    N = gathered_lse.shape[0]
    # a wrong shape here would index out of bounds on the GPU, not raise
    if gathered_lse.dim() != 3 or tuple(gathered_lse.shape[1:]) != (T, H_all) or N < 1 or H_all % N:
        raise ValueError(
            f"gathered_lse must be [N, T, H_all] = [N, {T}, {H_all}] with N dividing H_all, got {list(gathered_lse.shape)}"
        )
    if not 0 <= rank < N:
        raise ValueError(f"rank must be in [0, {N}), got {rank}")
    H = H_all // N
    gathered_lse = gathered_lse.contiguous()
    scaled = torch.empty((N, T, H, D), dtype=out.dtype, device=out.device)
    mine = torch.empty((T, H), dtype=torch.float32, device=out.device)
    if T * H_all == 0:
        return scaled, mine
    BLOCK_N, BLOCK_D, D_CHUNKS = _tiles(1, D, TILE)  # the D loop reads one row, not N
    _dcp_rescale_kernel[(T * H_all,)](
        out, *out.stride(),
        gathered_lse,
        scaled, mine,
        T, N, H_all, H, D, rank,
        BLOCK_N=triton.next_power_of_2(N), BLOCK_D=BLOCK_D, D_CHUNKS=D_CHUNKS, num_warps=4,
    )
    return scaled, mine


def a2a_layout(T: int, H: int, D: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """Byte layout of one head slice's row in the ``a2a`` buffer: ``(out_bytes, lse_offset, row_bytes)``.

    The row holds ``out [T, H, D]`` in ``dtype`` at byte 0 and ``lse [T, H]`` fp32 at
    ``lse_offset``; both offsets and ``row_bytes`` are multiples of 16 bytes, so typed views
    of the received rows need no copy.
    """
    out_bytes = T * H * D * torch.empty((), dtype=dtype).element_size()
    lse_offset = triton.cdiv(out_bytes, ALIGN) * ALIGN
    row_bytes = lse_offset + triton.cdiv(T * H * 4, ALIGN) * ALIGN
    return out_bytes, lse_offset, row_bytes


def a2a_views(buf: torch.Tensor, T: int, H: int, D: int, dtype: torch.dtype):
    """Typed views ``(out [N, T, H, D], lse [N, T, H])`` into an ``a2a`` byte buffer ``[N * row_bytes]``."""
    out_bytes, lse_offset, row_bytes = a2a_layout(T, H, D, dtype)
    rows = buf.view(-1, row_bytes)
    N = rows.shape[0]
    part_out = rows[:, :out_bytes].view(dtype).view(N, T, H, D)
    part_lse = rows[:, lse_offset : lse_offset + T * H * 4].view(torch.float32).view(N, T, H)
    return part_out, part_lse


def a2a_pack(out: torch.Tensor, lse: torch.Tensor, world: int) -> torch.Tensor:
    """``[world * row_bytes]`` uint8: row ``s`` holds head slice ``s``'s (out, lse) of this rank."""
    T, H_all, D = out.shape
    H = H_all // world
    buf = torch.empty(world * a2a_layout(T, H, D, out.dtype)[2], dtype=torch.uint8, device=out.device)
    if T * H_all == 0:
        return buf
    part_out, part_lse = a2a_views(buf, T, H, D, out.dtype)
    _, BLOCK_D, D_CHUNKS = _tiles(1, D, TILE)
    # one kernel writes both parts (in place of two torch copies between strided views)
    _a2a_pack_kernel[(T * H_all,)](
        out, *out.stride(),
        lse, *lse.stride(),
        part_out, *part_out.stride()[:3],
        part_lse, *part_lse.stride()[:2],
        H_all, H, D,
        BLOCK_D=BLOCK_D, D_CHUNKS=D_CHUNKS, num_warps=4,
    )
    return buf


def dcp_combine_triton(out: torch.Tensor, lse: torch.Tensor, group_name: str, world: int, mode: str):
    """``dcp_combine`` with the Triton kernels; arguments and results as :func:`compile_ops.dcp_combine`.

    ``ag_rs``: all-gather of the LSEs, :func:`dcp_rescale_triton`, reduce-scatter of the
    scaled outputs (summed in ``out``'s dtype, as the reference does). ``a2a``:
    :func:`a2a_pack`, one all-to-all, :func:`lse_combine_triton` on views of the received
    rows. Every collective is a c10d functional op waited on at once, so the whole call
    is captured by a CUDA graph (after one eager call has set up the communicator).
    """
    T, H_all, D = out.shape
    H = H_all // world
    c10d = _c10d()
    if mode == "ag_rs":
        gathered = c10d.wait_tensor(c10d.all_gather_into_tensor(lse.contiguous(), world, group_name))
        scaled, mine = dcp_rescale_triton(out, gathered.view(world, T, H_all), group_rank(group_name))
        reduced = c10d.wait_tensor(c10d.reduce_scatter_tensor(scaled, "sum", world, group_name))
        return reduced.view(T, H, D), mine
    packed = a2a_pack(out, lse, world)
    splits = [packed.shape[0] // world] * world
    received = c10d.wait_tensor(c10d.all_to_all_single(packed, splits, splits, group_name))
    part_out, part_lse = a2a_views(received, T, H, D, out.dtype)
    return lse_combine_triton(part_out, part_lse)
