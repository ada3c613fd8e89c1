"""Triton sparse MLA: the CUDA fast path of ``dsv41::sparse_mla`` (tuned for Hopper).

For token ``t`` and head ``h`` over the valid entries ``J`` of both segments (docs/ops.md)::

    s_j      = sm_scale * <q[t,h], k_j> * log2(e)                      (base-2 logits)
    out[t,h] = sum_j 2^s_j k_j / (sum_j 2^s_j + 2^(sink_h log2 e))     (value = key)
    lse[t,h] = log2(sum_j 2^s_j + 2^(sink_h log2 e))

How it is computed (sources of the technique):

* One program owns one token and ``BH = 64`` of its heads, so the heads are the M dimension
  of both matrix products and every gathered, dequantized KV row feeds 64 heads (MQA-style
  MLA decode: FlashMLA's SM90 kernels; TileLang's ``examples/deepseek_v32/sparse_mla_fwd.py``
  uses the same ``[heads, 512] x [512, block_I]`` tiling with ``block_I = 64``, 256 threads).
* Keys are gathered ``BN`` rows at a time through the slot -> (page, offset) map, dequantized
  in registers to bf16 (UE8M0 scale = exponent bits, so ``e4m3 * 2^e`` is exact in bf16),
  and consumed twice: ``S = Q K^T`` and ``O += P K`` (FlashMLA's Hopper FP8 sparse-decoding
  notes: dequantize to bf16 once per tile, MMA in bf16). ``fp8``'s per-tensor ``kv_scale``
  is folded into the score scale and the output instead, which is exact.
* Online softmax in base 2 with a running max and sum (FlashAttention-2).
* Small ``T``: the entries of a token are split over ``n_split`` programs whose partial
  ``(o, lse)`` land in a static per-device scratch and are merged by LSE in a second kernel,
  with the sink folded in as one more partial whose output is zero (flash-decoding split-K).
  Split bounds are computed from ``swa_lens`` / ``cmp_lens`` inside the kernel: no host sync.

Empty rows give ``out = 0`` and ``lse = sink * log2(e)`` (``-inf`` without sink); entries
that are ``-1``, past ``lens`` or outside their cache are masked and never read.

Limits (H200 numbers and the reasons in ``docs/performance-sparse-mla.md`` and
``docs/notes-sparse-mla.md``): with 64 heads Triton puts both warpgroups on M for
``Q K^T`` (its chained-dot heuristic), so QK runs twice per program with n32 wgmma reading Q
from shared memory; the fp8 formats add ~600 dequantization instructions per thread and
64-row block. Result: 0.3-0.7x FlashMLA's fp8_ds_mla time. On sm_90 the warp-specialized
Gluon kernel (:mod:`compile_ops.mla.gluon`, backend ``"gluon"``, ``Config(gluon=True)``)
reuses this host side and is 1.3-3.5x faster; this kernel stays the portable one, the one
Inductor inlines, and the interpreter twin the CPU tests run.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from torch._subclasses.functional_tensor import FunctionalTensor

from compile_ops._launch import launchable
from compile_ops.formats import HEAD_DIM, get_format, num_slots

LOG2E = 1.0 / math.log(2.0)
# Under TRITON_INTERPRET=1 (CPU) tl.dot on bf16 operands returns garbage (docs/design.md, testing): upcast
# the operands to fp32 there, and only there. Decided once, at import, like Triton itself.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# sizes, strides and counts that change from call to call: specializing on them (== 1,
# divisible by 16) would recompile the attention kernels (this one and the Gluon one)
UNSPECIALIZED = [
    "T", "H", "W", "K", "n_split", "has_sink", "s_swa_t", "s_cmp_t",
    "swa_page", "swa_slots", "cmp_page", "cmp_slots",
]
BH = 64  # heads per program: the M of both products (wgmma needs 64 rows per warpgroup)


@dataclass(frozen=True)
class Config:
    """Launch shape: ``bn`` gathered rows per step, ``dsplit`` programs per head block (each
    owning ``512 / dsplit`` output columns), warps and software-pipelining stages.

    ``gluon=True`` runs the warp-specialized kernel of :mod:`compile_ops.mla.gluon` instead
    (sm_90 only; its shape is fixed there: ``bn`` 64, 8 + 4 warps; ``dsplit`` 1 or 2, and
    :func:`sparse_mla_triton` makes it 2 while that still leaves one block per program)."""

    bn: int = 64
    dsplit: int = 1
    num_warps: int = 8
    num_stages: int = 3
    gluon: bool = False


GLUON = Config(gluon=True)


CONFIGS = {name: Config() for name in ("bf16", "fp8", "fp8_ds_mla", "fp8_dsv41")}
# kv_format -> (FMT id, data elements per row, scale bytes per row)
_FORMATS = {"bf16": (0, 512, 0), "fp8": (1, 512, 0), "fp8_ds_mla": (2, 576, 8), "fp8_dsv41": (3, 512, 16)}


@triton.jit
def _load_kv(p_row, p_scale, m_row, col0,
             FMT: tl.constexpr, BN: tl.constexpr, DW: tl.constexpr, ROPE_BYTES: tl.constexpr):
    """Columns ``[col0, col0 + DW)`` of ``BN`` gathered keys, dequantized: ``[BN, DW]`` bf16.

    ``p_row`` / ``p_scale`` ``[BN]`` point at each row's data / scale bytes; rows where
    ``m_row`` is False are never read and come back as zeros.
    """
    if FMT == 0 or FMT == 1:
        o_d = col0 + tl.arange(0, DW)
        # [BN, DW]
        b_k = tl.load(p_row[:, None] + o_d[None, :], mask=m_row[:, None], other=0.0)
        if FMT == 1:  # e4m3 -> bf16 is exact; kv_scale is applied to scores and output
            b_k = b_k.to(tl.bfloat16)
    else:
        # blocks of BLK e4m3 values with one UE8M0 scale byte each; fp8_ds_mla's block 7
        # holds the 64 RoPE values as bf16 (bytes 448..575) instead.
        BLK: tl.constexpr = 64 if FMT == 2 else 32
        NQ: tl.constexpr = 7 if FMT == 2 else 16
        o_c = col0 // BLK + tl.arange(0, DW // BLK)[None, :, None]
        o_d = tl.arange(0, BLK)[None, None, :]
        m_q = m_row[:, None, None] & (o_c < NQ)
        # [BN, DW // BLK, BLK]
        b_x = tl.load(p_row[:, None, None] + o_c * BLK + o_d, mask=m_q, other=0)
        # [BN, DW // BLK, 1]: 2^(e - 127) built from its exponent bits
        b_e = tl.load(p_scale[:, None, None] + o_c, mask=m_q, other=127)
        b_scale = (b_e.to(tl.int32) << 23).to(tl.float32, bitcast=True)
        b_k = b_x.to(tl.float8e4nv, bitcast=True).to(tl.float32) * b_scale
        if FMT == 2:
            o_r = tl.arange(0, 64)
            m_rope = tl.where(col0 + DW > 448, m_row, False)[:, None]
            if ROPE_BYTES:  # odd page stride: the bf16 values are not 2-byte aligned
                p_lo = p_row[:, None] + 448 + 2 * o_r[None, :]
                b_lo = tl.load(p_lo, mask=m_rope, other=0).to(tl.uint16)
                b_hi = tl.load(p_lo + 1, mask=m_rope, other=0).to(tl.uint16)
                b_rope = ((b_hi << 8) | b_lo).to(tl.bfloat16, bitcast=True)
            else:
                p_rope = (p_row + 448).to(tl.pointer_type(tl.bfloat16))
                # [BN, 64]
                b_rope = tl.load(p_rope[:, None] + o_r[None, :], mask=m_rope, other=0.0)
            b_k = tl.where(o_c == NQ, b_rope.to(tl.float32)[:, None, :], b_k)
        # e4m3 * 2^k is exact in bf16
        b_k = tl.reshape(b_k, (BN, DW)).to(tl.bfloat16)
    return b_k


@triton.jit(do_not_specialize=UNSPECIALIZED)
def _sparse_mla_kernel(
    q, out, lse, part_o, part_lse, sink,
    swa_kv, swa_idx, swa_len, cmp_kv, cmp_idx, cmp_len,
    T, H, W, K, n_split, has_sink, qk_scale, kv_scale,
    s_qt, s_qh, s_swa_t, s_swa_n, s_cmp_t, s_cmp_n,
    swa_page, swa_stride, swa_slots, cmp_page, cmp_stride, cmp_slots,
    FMT: tl.constexpr, DATA: tl.constexpr, SCALE: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr,
    DSPLIT: tl.constexpr, PAGE_SHIFT: tl.constexpr, ROPE_BYTES: tl.constexpr, UPCAST: tl.constexpr,
    ITERS: tl.constexpr,
):
    # program (token t, head block, column half) x split: with DSPLIT = 2 two programs share
    # the scores of a head block and each owns 256 of the 512 output columns
    DV: tl.constexpr = 512 // DSPLIT
    # Inductor passes Python floats to user kernels as fp64 scalars: keep the math in fp32
    qk_scale = tl.cast(qk_scale, tl.float32)
    kv_scale = tl.cast(kv_scale, tl.float32)
    i_p, i_s = tl.program_id(0), tl.program_id(1)
    n_hb = tl.cdiv(H, BH)
    i_dv, i_p = i_p % DSPLIT, i_p // DSPLIT
    i_t, i_hb = i_p // n_hb, i_p % n_hb
    o_h = i_hb * BH + tl.arange(0, BH)
    m_h = o_h < H
    col = i_dv * DV
    o_v = col + tl.arange(0, DV)
    p_q = q + i_t * s_qt + o_h[:, None] * s_qh
    # [BH, DV]: this program's columns of q, and (DSPLIT = 2) the other half
    b_q = tl.load(p_q + o_v[None, :], mask=m_h[:, None], other=0.0)
    if UPCAST:
        b_q = b_q.to(tl.float32)
    if DSPLIT == 2:
        b_qo = tl.load(p_q + (DV - col) + tl.arange(0, DV)[None, :], mask=m_h[:, None], other=0.0)
        if UPCAST:
            b_qo = b_qo.to(tl.float32)

    # blocks of BN columns: the SWA segment's first, then the compressed segment's
    n_swa = tl.minimum(tl.maximum(tl.load(swa_len + i_t), 0), W)
    n_cmp = tl.minimum(tl.maximum(tl.load(cmp_len + i_t), 0), K)
    nb_swa = tl.cdiv(n_swa, BN)
    nb = nb_swa + tl.cdiv(n_cmp, BN)
    i_b0 = i_s * nb // n_split
    i_b1 = (i_s + 1) * nb // n_split

    b_m = tl.full([BH], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BH], dtype=tl.float32)
    b_acc = tl.zeros([BH, DV], dtype=tl.float32)
    # the interpreter wants a Python int trip count (ITERS); the tail is masked below
    for i_i in range(0, ITERS if ITERS > 0 else i_b1 - i_b0):
        i_b = i_b0 + i_i
        is_swa = i_b < nb_swa
        o_n = tl.where(is_swa, i_b, i_b - nb_swa) * BN + tl.arange(0, BN)
        p_idx = tl.where(is_swa, swa_idx + i_t * s_swa_t, cmp_idx + i_t * s_cmp_t)
        s_n = tl.where(is_swa, s_swa_n, s_cmp_n)
        n_len = tl.where(is_swa, n_swa, n_cmp)
        n_slots = tl.where(is_swa, swa_slots, cmp_slots)
        page = tl.where(is_swa, swa_page, cmp_page)
        stride = tl.where(is_swa, swa_stride, cmp_stride)
        kv = tl.where(is_swa, swa_kv, cmp_kv)
        # [BN] slots -> (page, offset) -> row and scale pointers
        # a scalar condition joins a mask through tl.where, never `&`: Triton 3.9's
        # interpreter turns `scalar & vector` masks into integers and rejects them
        b_slot = tl.load(p_idx + o_n * s_n, mask=tl.where(i_b < i_b1, o_n < n_len, False), other=-1)
        m_n = (b_slot >= 0) & (b_slot < n_slots)
        b_slot = tl.where(m_n, b_slot, 0)
        if PAGE_SHIFT:  # page sizes are powers of two: `page` holds log2(page size)
            p_page = kv + (b_slot >> page).to(tl.int64) * stride
            b_off = b_slot & ((1 << page) - 1)
            page = 1 << page
        else:
            p_page = kv + (b_slot // page).to(tl.int64) * stride
            b_off = b_slot % page
        p_row = p_page + b_off * DATA
        p_scale = p_page + page * DATA + b_off * SCALE
        # [BN, DV]
        b_k = _load_kv(p_row, p_scale, m_n, col, FMT, BN, DV, ROPE_BYTES)
        if UPCAST:
            b_k = b_k.to(tl.float32)
        # [BH, BN]
        if DSPLIT == 2:
            b_ko = _load_kv(p_row, p_scale, m_n, DV - col, FMT, BN, DV, ROPE_BYTES)
            if UPCAST:
                b_ko = b_ko.to(tl.float32)
            b_s = tl.dot(b_q, tl.trans(b_k), tl.dot(b_qo, tl.trans(b_ko)))
        else:
            b_s = tl.dot(b_q, tl.trans(b_k))
        b_s = tl.where(m_n[None, :], b_s * qk_scale, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
        b_m_use = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
        b_p = tl.math.exp2(b_s - b_m_use[:, None])
        b_alpha = tl.math.exp2(b_m - b_m_use)
        b_l = b_l * b_alpha + tl.sum(b_p, 1)
        if not UPCAST:
            b_p = b_p.to(tl.bfloat16)
        b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p, b_k)
        b_m = b_m_new

    # this program's partial: normalised output and base-2 LSE (-inf when it saw nothing)
    b_o = tl.where(b_l[:, None] > 0, b_acc * (kv_scale / b_l[:, None]), 0.0)
    b_lse = tl.where(b_l > 0, tl.where(b_m == float("-inf"), 0.0, b_m) + tl.log2(b_l), float("-inf"))
    m_lse = tl.where(i_dv == 0, m_h, False)
    if n_split == 1:
        # fold the sink in: it is one more partial, with lse = sink * log2(e) and output 0
        b_sink = tl.load(sink + o_h, mask=tl.where(has_sink != 0, m_h, False), other=float("-inf")) * 1.4426950408889634
        b_max = tl.maximum(b_lse, b_sink)
        b_max = tl.where(b_max == float("-inf"), 0.0, b_max)
        b_all = b_max + tl.log2(tl.math.exp2(b_lse - b_max) + tl.math.exp2(b_sink - b_max))
        b_w = tl.where(b_all == float("-inf"), 0.0, tl.math.exp2(b_lse - b_all))
        p_out = out + (i_t * H + o_h[:, None]) * 512 + o_v[None, :]
        tl.store(p_out, (b_o * b_w[:, None]).to(tl.bfloat16), mask=m_h[:, None])
        tl.store(lse + i_t * H + o_h, b_all, mask=m_lse)
    else:
        o_row = (i_s * T + i_t) * H + o_h
        tl.store(part_o + o_row[:, None] * 512 + o_v[None, :], b_o, mask=m_h[:, None])
        tl.store(part_lse + o_row, b_lse, mask=m_lse)


@triton.jit(do_not_specialize=["T", "H", "n_split", "has_sink"])
def _combine_kernel(part_o, part_lse, sink, out, lse, T, H, n_split, has_sink, NSP: tl.constexpr, NSC: tl.constexpr,
                    PDL: tl.constexpr, LAUNCH_NEXT: tl.constexpr):
    """Merge the ``n_split`` partials ``(o_r, L_r)`` of one (token, head) and its sink:
    ``L = log2(sum_r 2^L_r + 2^sink)``, ``out = sum_r 2^(L_r - L) o_r``, one program per row.

    The four warps lie side by side over the 512 columns, so the sum over partials stays in
    each thread. The partials come in chunks of ``NSC`` rows (``NSP``, a power of two >=
    ``n_split``, in all), the first one loaded before the LSEs' maximum is taken, so the
    program pays about one memory latency (H200, T = 1, H = 128, 18 partials, before the
    Gluon kernel became a dependent launch: 10.0 us per call, against 10.7 with a sum across
    warps and 10.3 with 16-row chunks). Past 32 partials the chunks hold 16 rows (32-row
    chunks beside the first would take all 255 registers).

    ``PDL``: launched as a programmatic dependent of the Gluon kernel, it waits here for that
    kernel's partials. ``LAUNCH_NEXT``: it lets the stream's next kernel launch at once (a
    programmatic dependent, such as the next call's Gluon kernel, then waits on the device
    for this one; see :func:`sparse_mla_triton` for when)."""
    if LAUNCH_NEXT:
        gdc_launch_dependents()
    if PDL:
        gdc_wait()
    i_th = tl.program_id(0)
    i_t, i_h = i_th // H, i_th % H
    o_d = tl.arange(0, 512)
    o_s = tl.arange(0, NSP)
    m_s = o_s < n_split
    # [NSP]
    b_lse = tl.load(part_lse + (o_s * T + i_t) * H + i_h, mask=m_s, other=float("-inf"))
    o_c = tl.arange(0, NSC)
    # [NSC, 512]: the first chunk, loaded before the maximum below needs the LSEs
    b_o = tl.load(part_o + ((o_c * T + i_t) * H + i_h)[:, None] * 512 + o_d[None, :],
                  mask=(o_c < n_split)[:, None], other=0.0)
    b_sink = tl.load(sink + i_h + o_s * 0, mask=tl.where(has_sink != 0, o_s == 0, False), other=float("-inf")) * 1.4426950408889634
    b_max = tl.max(tl.maximum(b_lse, b_sink), 0)
    b_max = tl.where(b_max == float("-inf"), 0.0, b_max)
    b_den = tl.sum(tl.math.exp2(b_lse - b_max) + tl.math.exp2(b_sink - b_max), 0)
    b_scale = tl.where(b_den > 0, 1.0 / b_den, 0.0)
    b_out = tl.zeros([512], dtype=tl.float32)
    for s0 in tl.static_range(0, NSP, NSC):
        o_c = s0 + tl.arange(0, NSC)
        m_c = o_c < n_split
        o_row = (o_c * T + i_t) * H + i_h
        if s0 > 0:
            b_o = tl.load(part_o + o_row[:, None] * 512 + o_d[None, :], mask=m_c[:, None], other=0.0)
        # [NSC]: the chunk's LSEs again, in the layout of its partials (an L1 hit)
        b_w = tl.math.exp2(tl.load(part_lse + o_row, mask=m_c, other=float("-inf")) - b_max) * b_scale
        b_out += tl.sum(b_w[:, None] * b_o, 0)
    tl.store(out + i_th * 512 + o_d, b_out.to(tl.bfloat16))
    tl.store(lse + i_th, b_max + tl.log2(b_den))


class _Scratch:
    """Split-K partials of one device, allocated once at a fixed size, never grown.

    ``n_split * T * H <= rows`` always holds, because splitting is only used while
    ``T * ceil(H / BH) * n_split <= num_sms``; so ``rows = num_sms * BH``.
    """

    def __init__(self, device: torch.device):
        if device.type == "cuda":
            self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        else:  # the interpreter: a few "SMs" so that tests exercise the split path
            self.num_sms = 8
        self.rows = self.num_sms * BH
        self.part_o = torch.empty(self.rows, HEAD_DIM, dtype=torch.float32, device=device)
        self.part_lse = torch.empty(self.rows, dtype=torch.float32, device=device)


_SCRATCH: dict[torch.device, _Scratch] = {}


def scratch_size(device: torch.device) -> tuple[int, int]:
    """``(num_sms, rows)`` of ``device``'s split-K scratch, without allocating it."""
    device = torch.device(device)
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    return num_sms, num_sms * BH


def scratch(device: torch.device) -> _Scratch:
    """The device's split-K scratch (allocate it before CUDA-graph capture by calling once)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _SCRATCH:
        _SCRATCH[device] = _Scratch(device)
    return _SCRATCH[device]


def choose_split(T: int, H: int, blocks: int, cfg: Config, num_sms: int, rows: int) -> int:
    """Programs per (token, head block, column half): enough to fill ``num_sms``, at most one
    per block of ``bn`` entries (``blocks`` of them per token); 1 once ``T`` alone fills the
    GPU. A symbolic ``T`` (a traced launch in :func:`sparse_mla_triton`) gives a symbolic
    count and adds no guard."""
    progs = T * triton.cdiv(H, BH) * cfg.dsplit
    return torch.sym_max(1, torch.sym_min(blocks, torch.sym_min(num_sms // progs, rows // (T * H))))


def sparse_mla_triton(
    q: torch.Tensor,
    swa_cache: torch.Tensor,
    swa_indices: torch.Tensor,
    swa_lens: torch.Tensor,
    cmp_cache: Optional[torch.Tensor],
    cmp_indices: Optional[torch.Tensor],
    cmp_lens: Optional[torch.Tensor],
    sink: Optional[torch.Tensor],
    sm_scale: float,
    kv_format: str,
    kv_scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    n_split: Optional[int] = None,
    config: Optional[Config] = None,
) -> None:
    """Fill ``out [T, H, 512]`` bf16 and ``lse [T, H]`` fp32 (base 2); inputs already validated.

    Same arguments as :func:`compile_ops.mla.reference.sparse_mla_reference`; ``n_split`` and
    ``config`` (keyword only, for tests and benchmarks) override the split-K count and the
    launch shape. Only shapes steer the launch, so the call is CUDA-graph capturable once the
    device's scratch exists: the first call makes it (``num_sms * 64`` rows of 512 fp32,
    17 MB on an H200), so call once before capturing.

    Example (CUDA)::

        >>> import torch, compile_ops
        >>> from compile_ops.formats import new_cache
        >>> cache = new_cache("fp8_dsv41", num_pages=4, page_size=64, device="cuda")
        >>> q = torch.randn(2, 64, 512, dtype=torch.bfloat16, device="cuda")
        >>> idx = torch.randint(0, 256, (2, 128), dtype=torch.int32, device="cuda")
        >>> lens = torch.tensor([128, 7], dtype=torch.int32, device="cuda")
        >>> with compile_ops.use_backends(sparse_mla="triton"):
        ...     out, lse = compile_ops.sparse_mla(q, cache, idx, lens, None, None, None, None, 0.044, "fp8_dsv41")
    """
    T, H, _ = q.shape
    if T == 0 or H == 0:
        return
    if q.stride(2) != 1:
        q = q.contiguous()
    get_format(kv_format)
    fmt, data, scale_bytes = _FORMATS[kv_format]
    cfg = config or CONFIGS[kv_format]
    if cmp_cache is None:  # an empty second segment: K = 0, any valid pointers
        cmp_cache, cmp_indices, cmp_lens = swa_cache, swa_indices[:, :0], swa_lens
    W, K = swa_indices.shape[1], cmp_indices.shape[1]
    # the Gluon kernel copies rows and q's heads 16 bytes at a time: caches whose rows are
    # off 16 bytes (page strides or offsets) and q off 16 bytes run the tl kernel instead
    if cfg.gluon and (
        any(c.stride(0) * c.element_size() % 16 or c.storage_offset() * c.element_size() % 16 for c in (swa_cache, cmp_cache))
        or q.stride(0) % 8 or q.stride(1) % 8 or q.storage_offset() % 8
    ):
        cfg = CONFIGS[kv_format]
    traced = isinstance(q, FunctionalTensor)
    if traced:  # partials of this launch only: a traced graph owns its buffers (no global cache)
        num_sms, rows = scratch_size(q.device)
    else:
        buf = scratch(q.device)
        num_sms, rows = buf.num_sms, buf.rows
    blocks = triton.cdiv(W, cfg.bn) + triton.cdiv(K, cfg.bn)  # of bn entries, per token
    if cfg.gluon and not traced and T * triton.cdiv(H, BH) * 2 * blocks <= num_sms:
        # few programs (small T): two per head block, each storing half the columns, and
        # still one block each (H200, T = 1: 1.4 us faster at H=64/K=512)
        cfg = replace(cfg, dsplit=2)
    if n_split is None:
        n_split = choose_split(T, H, blocks, cfg, num_sms, rows)
    else:
        n_split = max(1, min(int(n_split), rows // (T * H)))
    if traced:
        part_o = torch.empty((n_split * T * H, HEAD_DIM), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((n_split * T * H,), dtype=torch.float32, device=q.device)
    else:
        part_o, part_lse = buf.part_o, buf.part_lse
    # fp8_ds_mla's bf16 RoPE values sit at odd addresses when a page stride is odd
    rope_bytes = fmt == 2 and any(c.stride(0) % 2 or c.storage_offset() % 2 for c in (swa_cache, cmp_cache))
    # power-of-two page sizes (the usual 64 / 256) map slots to pages with shifts
    pages = (swa_cache.shape[1], cmp_cache.shape[1])
    page_shift = all(p > 0 and p & (p - 1) == 0 for p in pages)
    if page_shift:
        pages = tuple(p.bit_length() - 1 for p in pages)
    kv_mul = float(kv_scale) if fmt == 1 else 1.0  # fp8: scores and output carry kv_scale
    iters = triton.cdiv(blocks, n_split) + 1 if INTERPRET else 0
    # without a sink the kernels get a never-read fp32 pointer that no output aliases
    no_sink = part_lse
    launch_args = (
        q, out, lse, part_o, part_lse, sink if sink is not None else no_sink,
        swa_cache, swa_indices, swa_lens, cmp_cache, cmp_indices, cmp_lens,
        T, H, W, K, n_split, int(sink is not None), float(sm_scale) * LOG2E * kv_mul, kv_mul,
        q.stride(0), q.stride(1), swa_indices.stride(0), swa_indices.stride(1),
        cmp_indices.stride(0), cmp_indices.stride(1),
        pages[0], swa_cache.stride(0), num_slots(swa_cache),
        pages[1], cmp_cache.stride(0), num_slots(cmp_cache),
    )
    grid = (T * triton.cdiv(H, BH) * cfg.dsplit, n_split)
    if cfg.gluon:
        if traced or INTERPRET:
            raise RuntimeError("the Gluon kernel runs eagerly on sm_90 only: not traced, not interpreted")
        from compile_ops.mla import gluon

        gluon.launch(grid, launch_args, fmt, data, scale_bytes, page_shift, cfg.dsplit)
    else:
        launchable(_sparse_mla_kernel, q)[grid](
            *launch_args,
            FMT=fmt, DATA=data, SCALE=scale_bytes, BH=BH, BN=cfg.bn, DSPLIT=cfg.dsplit,
            PAGE_SHIFT=page_shift, ROPE_BYTES=rope_bytes, UPCAST=INTERPRET, ITERS=iters,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    if isinstance(n_split, int):
        if n_split == 1:
            return
        nsp, combine_rows = triton.next_power_of_2(n_split), T * H
    else:  # symbolic (traced, dynamic T): no guard on n_split; an empty grid when it is 1
        nsp = triton.next_power_of_2(blocks)
        combine_rows = T * H * torch.sym_min(n_split - 1, 1)
    # after the Gluon kernel (eager, sm_90) the merge launches while that kernel still runs
    # (it triggers its dependents at its start) and waits on the device, not on a launch.
    # The merge in turn lets the next Gluon call's programs take their SMs while it runs
    # (H200: 0.2-1.3 us per call faster from T = 1 to 32), except where every program of an
    # unsplit column range has one block (H=128 T=2, H=64 T=8: 0.7-1.7 us slower, measured)
    pdl = dict(launch_pdl=True) if cfg.gluon else {}
    launch_next = cfg.gluon and (cfg.dsplit == 2 or n_split < blocks)
    launchable(_combine_kernel, q)[(combine_rows,)](
        part_o, part_lse, sink if sink is not None else no_sink, out, lse,
        T, H, n_split, int(sink is not None), NSP=nsp, NSC=nsp if nsp <= 32 else 16, PDL=cfg.gluon,
        LAUNCH_NEXT=launch_next, num_warps=4, **pdl,
    )
