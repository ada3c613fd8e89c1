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
  is folded into the score scale and the output instead, which is exact. ``fp4_dsv41``
  entries are e2m1 values times their e4m3 scale, also exact in bf16. A call of two formats
  (``cmp_kv_format``) runs the block loop twice, over the window's blocks in its format and
  then over the compressed blocks in theirs.
* Online softmax in base 2 with a running max and sum (FlashAttention-2).
* Small ``T``: the entries of a token are split over ``n_split`` programs whose partial
  ``(o, lse)`` land in the call's workspace and are merged by LSE in a second kernel,
  with the sink folded in as one more partial whose output is zero (flash-decoding split-K).
  Split bounds are computed from ``swa_lens`` / ``cmp_lens`` inside the kernel: no host sync.

Empty rows give ``out = 0`` and ``lse = sink * log2(e)`` (``-inf`` without sink); entries
that are ``-1``, past ``lens`` or outside their cache are masked and never read.

The kernel is the portable one (any CUDA GPU), the one Inductor inlines into its own code,
and the interpreter twin the CPU tests run; on sm_90 the warp-specialized Gluon kernel
(:mod:`compile_ops.mla.gluon`, backend ``"gluon"``) computes the same with the same launch
plan (:mod:`compile_ops.mla.plan`) and merge (:mod:`compile_ops.mla.merge`). With 64 heads
Triton puts both warpgroups on M for ``Q K^T`` (its chained-dot heuristic), so QK runs twice
per program with n32 wgmma reading Q from shared memory, and the fp8 formats dequantize in
the same warps that multiply: what the Gluon kernel's warp specialization avoids
(figures: ``docs/performance-sparse-mla.md``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from compile_ops import formats
from compile_ops._launch import INTERPRET, launchable
from compile_ops._triton_quant import e2m1_value
from compile_ops.mla.inputs import SparseMLAArgs
from compile_ops.mla.merge import merge
from compile_ops.mla.plan import BH, BN, UNSPECIALIZED, plan

LOG2E = tl.constexpr(formats.LOG2E)


@dataclass(frozen=True)
class Config:
    """Launch shape of the ``tl`` kernel: ``bn`` gathered rows per step, ``dsplit`` programs
    per head block (each owning ``512 / dsplit`` output columns), warps and
    software-pipelining stages."""

    bn: int = BN
    dsplit: int = 1
    num_warps: int = 8
    num_stages: int = 3


@triton.jit
def _load_kv(p_row, p_scale, m_row, col0, NOPE: tl.constexpr, BLOCK: tl.constexpr, FP4: tl.constexpr,
             BN: tl.constexpr, DW: tl.constexpr, ROPE_BYTES: tl.constexpr):
    """Columns ``[col0, col0 + DW)`` of ``BN`` gathered keys, dequantized: ``[BN, DW]`` bf16.

    ``p_row`` / ``p_scale`` ``[BN]`` point at each row's data / scale bytes; rows where
    ``m_row`` is False are never read and come back as zeros. ``NOPE`` / ``BLOCK`` / ``FP4``
    are the format's (:class:`compile_ops.formats.KVFormat`): ``NOPE`` e4m3 values per row in
    blocks of ``BLOCK`` under one UE8M0 scale each (``BLOCK == 0``: none, or one per-tensor
    scale), the remaining ``512 - NOPE`` RoPE values bf16; ``FP4``: e2m1 values instead, two
    per byte (the even column in the low nibble), under one e4m3 scale per block.
    """
    if FP4:
        # an e2m1 value (at most 2 significant bits) times an e4m3 scale (4) is exact in bf16
        o_b = col0 // 2 + tl.arange(0, DW // 2)
        # [BN, DW // 2] bytes: two columns each
        b_x = tl.load(p_row[:, None] + o_b[None, :], mask=m_row[:, None], other=0).to(tl.int32)
        b_v = tl.reshape(tl.join(e2m1_value(b_x & 15), e2m1_value(b_x >> 4)), (BN, DW // BLOCK, BLOCK))
        o_c = col0 // BLOCK + tl.arange(0, DW // BLOCK)
        # [BN, DW // BLOCK] e4m3 scales
        b_s = tl.load(p_scale[:, None] + o_c[None, :], mask=m_row[:, None], other=0)
        b_s = b_s.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        b_k = tl.reshape(b_v * b_s[:, :, None], (BN, DW)).to(tl.bfloat16)
    elif BLOCK == 0:  # bf16 rows (NOPE == 0), or fp8 under one per-tensor kv_scale
        o_d = col0 + tl.arange(0, DW)
        # [BN, DW]
        b_k = tl.load(p_row[:, None] + o_d[None, :], mask=m_row[:, None], other=0.0)
        if NOPE > 0:  # e4m3 -> bf16 is exact; kv_scale is applied to scores and output
            b_k = b_k.to(tl.bfloat16)
    else:
        # blocks of BLOCK e4m3 values with one UE8M0 scale byte each; with bf16 RoPE values
        # (NOPE < 512) the block after the last e4m3 one holds them (bytes NOPE..NOPE+127)
        NQ: tl.constexpr = NOPE // BLOCK
        o_c = col0 // BLOCK + tl.arange(0, DW // BLOCK)[None, :, None]
        o_d = tl.arange(0, BLOCK)[None, None, :]
        m_q = m_row[:, None, None] & (o_c < NQ)
        # [BN, DW // BLOCK, BLOCK]
        b_x = tl.load(p_row[:, None, None] + o_c * BLOCK + o_d, mask=m_q, other=0)
        # [BN, DW // BLOCK, 1]: 2^(e - 127) built from its exponent bits
        b_e = tl.load(p_scale[:, None, None] + o_c, mask=m_q, other=127)
        b_scale = (b_e.to(tl.int32) << 23).to(tl.float32, bitcast=True)
        b_k = b_x.to(tl.float8e4nv, bitcast=True).to(tl.float32) * b_scale
        if NOPE < 512:
            ROPE: tl.constexpr = 512 - NOPE
            tl.static_assert(ROPE == BLOCK, "the bf16 RoPE values take the place of one e4m3 block")
            o_r = tl.arange(0, ROPE)
            m_rope = tl.where(col0 + DW > NOPE, m_row, False)[:, None]
            if ROPE_BYTES:  # odd page stride: the bf16 values are not 2-byte aligned
                p_lo = p_row[:, None] + NOPE + 2 * o_r[None, :]
                b_lo = tl.load(p_lo, mask=m_rope, other=0).to(tl.uint16)
                b_hi = tl.load(p_lo + 1, mask=m_rope, other=0).to(tl.uint16)
                b_rope = ((b_hi << 8) | b_lo).to(tl.bfloat16, bitcast=True)
            else:
                p_rope = (p_row + NOPE).to(tl.pointer_type(tl.bfloat16))
                # [BN, ROPE]
                b_rope = tl.load(p_rope[:, None] + o_r[None, :], mask=m_rope, other=0.0)
            b_k = tl.where(o_c == NQ, b_rope.to(tl.float32)[:, None, :], b_k)
        # e4m3 * 2^k is exact in bf16
        b_k = tl.reshape(b_k, (BN, DW)).to(tl.bfloat16)
    return b_k


@triton.jit
def _attend(b_m, b_l, b_acc, b_q, b_qo, i_lo, i_hi, n_iter, i_t, nb_swa, n_swa, n_cmp, col, qk_scale, seg,
            NOPE: tl.constexpr, BLOCK: tl.constexpr, FP4: tl.constexpr, DATA: tl.constexpr, SCALE: tl.constexpr,
            BN: tl.constexpr, DSPLIT: tl.constexpr, PAGE_SHIFT: tl.constexpr, ROPE_BYTES: tl.constexpr,
            UPCAST: tl.constexpr):
    """The online softmax state ``(b_m, b_l, b_acc)`` after blocks ``[i_lo, i_hi)`` of
    ``BN`` entries (SWA blocks first), read in one format (``NOPE``, ``BLOCK``, ``FP4``,
    ``DATA``, ``SCALE``); ``n_iter >= i_hi - i_lo`` steps, the ones past ``i_hi`` masked.
    ``seg`` = (swa_kv, swa_idx, s_swa_t, s_swa_n, swa_page, swa_stride, swa_slots, and the
    same seven for the compressed segment)."""
    DV: tl.constexpr = 512 // DSPLIT
    swa_kv, swa_idx, s_swa_t, s_swa_n, swa_page, swa_stride, swa_slots, \
        cmp_kv, cmp_idx, s_cmp_t, s_cmp_n, cmp_page, cmp_stride, cmp_slots = seg
    for i_i in range(0, n_iter):
        i_b = i_lo + i_i
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
        b_slot = tl.load(p_idx + o_n * s_n, mask=tl.where(i_b < i_hi, o_n < n_len, False), other=-1)
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
        b_k = _load_kv(p_row, p_scale, m_n, col, NOPE, BLOCK, FP4, BN, DV, ROPE_BYTES)
        if UPCAST:
            b_k = b_k.to(tl.float32)
        # [BH, BN]
        if DSPLIT == 2:
            b_ko = _load_kv(p_row, p_scale, m_n, DV - col, NOPE, BLOCK, FP4, BN, DV, ROPE_BYTES)
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
    return b_m, b_l, b_acc


@triton.jit(do_not_specialize=UNSPECIALIZED)
def _sparse_mla_kernel(
    q, out, lse, part_o, part_lse, sink,
    swa_kv, swa_idx, swa_len, cmp_kv, cmp_idx, cmp_len,
    T, H, W, K, n_split, has_sink, qk_scale, kv_scale,
    s_qt, s_qh, s_swa_t, s_swa_n, s_cmp_t, s_cmp_n,
    swa_page, swa_stride, swa_slots, cmp_page, cmp_stride, cmp_slots,
    NOPE: tl.constexpr, BLOCK: tl.constexpr, FP4: tl.constexpr, DATA: tl.constexpr, SCALE: tl.constexpr,
    CMP_NOPE: tl.constexpr, CMP_BLOCK: tl.constexpr, CMP_FP4: tl.constexpr, CMP_DATA: tl.constexpr,
    CMP_SCALE: tl.constexpr, MIXED: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr,
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
    b_qo = b_q
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
    seg = (swa_kv, swa_idx, s_swa_t, s_swa_n, swa_page, swa_stride, swa_slots,
           cmp_kv, cmp_idx, s_cmp_t, s_cmp_n, cmp_page, cmp_stride, cmp_slots)
    # the interpreter wants a Python int trip count (ITERS); the tail is masked
    if MIXED:  # each segment's blocks in its own format: the window's, then the compressed cache's
        i_mid = tl.minimum(tl.maximum(nb_swa, i_b0), i_b1)
        b_m, b_l, b_acc = _attend(b_m, b_l, b_acc, b_q, b_qo, i_b0, i_mid, ITERS if ITERS > 0 else i_mid - i_b0,
                                  i_t, nb_swa, n_swa, n_cmp, col, qk_scale, seg, NOPE, BLOCK, FP4, DATA, SCALE,
                                  BN, DSPLIT, PAGE_SHIFT, ROPE_BYTES, UPCAST)
        b_m, b_l, b_acc = _attend(b_m, b_l, b_acc, b_q, b_qo, i_mid, i_b1, ITERS if ITERS > 0 else i_b1 - i_mid,
                                  i_t, nb_swa, n_swa, n_cmp, col, qk_scale, seg, CMP_NOPE, CMP_BLOCK, CMP_FP4,
                                  CMP_DATA, CMP_SCALE, BN, DSPLIT, PAGE_SHIFT, ROPE_BYTES, UPCAST)
    else:
        b_m, b_l, b_acc = _attend(b_m, b_l, b_acc, b_q, b_qo, i_b0, i_b1, ITERS if ITERS > 0 else i_b1 - i_b0,
                                  i_t, nb_swa, n_swa, n_cmp, col, qk_scale, seg, NOPE, BLOCK, FP4, DATA, SCALE,
                                  BN, DSPLIT, PAGE_SHIFT, ROPE_BYTES, UPCAST)

    # this program's partial: normalised output and base-2 LSE (-inf when it saw nothing)
    b_o = tl.where(b_l[:, None] > 0, b_acc * (kv_scale / b_l[:, None]), 0.0)
    b_lse = tl.where(b_l > 0, tl.where(b_m == float("-inf"), 0.0, b_m) + tl.log2(b_l), float("-inf"))
    m_lse = tl.where(i_dv == 0, m_h, False)
    if n_split == 1:
        # fold the sink in: it is one more partial, with lse = sink * log2(e) and output 0
        b_sink = tl.load(sink + o_h, mask=tl.where(has_sink != 0, m_h, False), other=float("-inf")) * LOG2E
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


def sparse_mla_triton(
    args: SparseMLAArgs,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    n_split: Optional[int] = None,
    config: Optional[Config] = None,
) -> None:
    """Fill ``out [T, H, 512]`` bf16 and ``lse [T, H]`` fp32 (base 2); inputs already validated.

    ``args`` as :func:`compile_ops.mla.reference.sparse_mla_reference` takes them; the split-K
    partials go to ``args.workspace`` (:func:`compile_ops.mla.plan.plan`); ``n_split`` and ``config`` (for tests and benchmarks) override the
    split-K count and the launch shape. Only shapes steer the launch: no host sync.

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
    cfg = config or Config()
    launch = plan(args, out, lse, bn=cfg.bn, dsplit=cfg.dsplit, n_split=n_split)
    if launch is None:
        return
    fmt, cmp = launch.fmt, launch.cmp_fmt
    iters = triton.cdiv(launch.blocks, launch.n_split) + 1 if INTERPRET else 0
    launchable(_sparse_mla_kernel, args.q)[launch.grid](
        *launch.args,
        NOPE=fmt.nope, BLOCK=fmt.block, FP4=fmt.fp4, DATA=fmt.data_elems, SCALE=fmt.scale_bytes,
        CMP_NOPE=cmp.nope, CMP_BLOCK=cmp.block, CMP_FP4=cmp.fp4, CMP_DATA=cmp.data_elems, CMP_SCALE=cmp.scale_bytes,
        MIXED=cmp != fmt, BH=BH, BN=cfg.bn, DSPLIT=launch.dsplit,
        PAGE_SHIFT=launch.page_shift, ROPE_BYTES=launch.rope_bytes, UPCAST=INTERPRET, ITERS=iters,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    merge(launch, out, lse, after_gluon=False)
