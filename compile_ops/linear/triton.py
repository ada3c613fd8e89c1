"""Triton kernels of ``fp8_linear``: the token quantizer and a block-scaled FP8 GEMM.

* :func:`quantize_tokens_triton` is :func:`compile_ops.linear.quant.quantize_tokens` in one
  launch: e4m3 values ``[M, K]`` and fp32 scales ``[M, ceil(K/block)]`` stored
  outer-dim-major (stride ``(1, M)``), the layout ``torch.nn.functional.scaled_mm`` takes.
* :func:`fp8_linear_triton`: ``C = (A * a_scale) (B * b_scale)^T`` in either weight layout
  (``block`` 128 with fp32 scales, 32 with ue8m0 bytes turned into ``2 ** (e - 127)`` from
  their exponent bits). Program ``(m, n, s)`` owns a ``BM x BN`` tile of ``C`` and split
  ``s`` of the K blocks; per ``block``-wide K block it
  ``tl.dot``\\ s the e4m3 tiles of the tokens and the weight rows and adds the product
  scaled by both blocks' scales, in fp32 (precise accumulation: Hopper's fast FP8
  accumulation keeps too few bits). Decode steps have few tokens, so an ``M x N`` grid
  alone would leave most SMs idle on the narrow projections (``wq_a``: 10 tiles): the K
  blocks are then split over programs that write fp32 partials, and one reduction sums
  them in split order (deterministic). Up to the layout's ``weight_only_tokens`` the call
  is weight-only: bf16 tokens against the weight tile dequantized in registers, in the tiles
  of :func:`weight_only_tile` for 32-blocks.
  A call of :data:`GEMV_TOKENS` tokens is a GEMV on the CUDA cores instead
  (``_fp8_gemv_kernel``, tiles of :func:`gemv_tile`): each e4m3 byte widened to fp32 through
  an f16 pair (:func:`compile_ops._triton_quant.e4m3_to_fp32`) and one fp32 FMA per weight
  value.

The quantizer rounds to e4m3 in fp32 arithmetic (:mod:`compile_ops._triton_quant`), so it
equals ``quantize_tokens`` bit for bit on the GPU and in the interpreter alike. Both run on CUDA tensors, or on CPU
tensors under ``TRITON_INTERPRET=1`` (loops then have compile-time trip counts). Nothing syncs, and the only allocations are the outputs and the
partials, so CUDA graphs capture them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from compile_ops._launch import INTERPRET, launchable
from compile_ops._triton_quant import e4m3_to_bf16, e4m3_to_bf16_bits, e4m3_to_fp32, round_to_e4m3
from compile_ops.linear.quant import BLOCK, E4M3_MAX, TILE_N, layout_of_block, layout_of_scale

# enough programs to cover the H200's 132 SMs twice; fewer tiles than this split K
TARGET_PROGRAMS = 264
QUANT_ROWS = 16  # token rows per program of the quantizer
# calls of at most this many tokens are GEMVs on the CUDA cores: one FMA per weight element
# leaves issue slots that the MMA path spends widening weight tiles into operand layouts;
# from two tokens on the MMA path is faster (docs/performance-decode.md has the sweep)
GEMV_TOKENS = 1
GEMV_PROGRAMS = 3 * TARGET_PROGRAMS // 2  # three per SM
GEMV_STEP = 8192  # weights per program and K step: more rows a step held a program's loads longer
# a bf16 weight row is twice an e4m3 one: the bf16 GEMV's tiles hold 8 rows at most (the
# best of an H100 sweep of 8-32 rows, 512-1024 wide K steps, 1-4 splits, 4-8 warps)
BF16_GEMV_ROWS = 8
# 32-blocks past their weight-only calls: the weight dequantized to bf16 once and the tokens
# rounded to their e4m3 values, both exact in bf16, so cuBLAS's bf16 product is the op's;
# the block-scaled MMA path rescales its accumulator every 32 of K, which keeps the tensor
# cores waiting (docs/performance-decode.md has the sweep)
DEQUANT_TILE = (32, 512)  # weight rows x columns per program of the dequantizer


def weight_only_tile(M: int) -> tuple[int, int, int, bool, int]:
    """``(BM, BN, BK, swap, programs)`` of a weight-only call of ``M`` tokens with 32-blocks,
    the best of H200 sweeps (``docs/performance-decode.md``): narrow weight tiles and twice
    :data:`TARGET_PROGRAMS` keep more weight loads in flight; up to 16 tokens the tile is
    accumulated transposed; past 64, 128 tokens per tile widen each weight tile for twice
    the tokens."""
    if M <= 16:
        return 16, 64, 128, True, 2 * TARGET_PROGRAMS
    return (64 if M <= 64 else 128), 64, 64, False, 2 * TARGET_PROGRAMS


@triton.jit
def _quantize_kernel(x, q, s, M, K, stride_xm, BM: tl.constexpr, BK: tl.constexpr, QMAX: tl.constexpr,
                     POW2: tl.constexpr, ROUNDED: tl.constexpr = False):
    # ROUNDED: q is bf16 and takes each value as its e4m3 code times the scale (exact in bf16
    # for power-of-two scales), s is not written
    i_m, i_k = tl.program_id(0), tl.program_id(1)
    o_m = i_m * BM + tl.arange(0, BM)
    o_k = i_k * BK + tl.arange(0, BK)
    mask = (o_m < M)[:, None] & (o_k < K)[None, :]
    v = tl.load(x + o_m[:, None].to(tl.int64) * stride_xm + o_k[None, :], mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(v), axis=1)
    scale = tl.math.div_rn(amax, tl.full(amax.shape, QMAX, tl.float32))
    if POW2:  # 2 ** ceil(log2(scale)): the next exponent unless the mantissa is zero
        bits = scale.to(tl.int32, bitcast=True)
        scale = (((bits >> 23) + ((bits & 0x7FFFFF) != 0).to(tl.int32)) << 23).to(tl.float32, bitcast=True)
    scale = tl.where(amax > 0, scale, 1.0)
    # rounded before the cast, which then is exact: Triton's fp32 -> e4m3 cast may round
    # twice (through fp16) on the GPU, and does not carry into the exponent in the interpreter
    v = round_to_e4m3(tl.clamp(tl.math.div_rn(v, scale[:, None]), -QMAX, QMAX))
    if ROUNDED:
        tl.store(q + o_m[:, None].to(tl.int64) * K + o_k[None, :], (v * scale[:, None]).to(tl.bfloat16), mask=mask)
    else:
        tl.store(q + o_m[:, None].to(tl.int64) * K + o_k[None, :], v.to(tl.float8e4nv), mask=mask)
        tl.store(s + i_k.to(tl.int64) * M + o_m, scale, mask=o_m < M)


def quantize_tokens_triton(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` (bf16 or fp32) -> ``(float8_e4m3fn [M, K], fp32 scale [M, ceil(K/block)])``
    equal to ``quantize_tokens(x, block)``; the scale is a transposed view (stride ``(1, M)``)."""
    layout = layout_of_block(block)
    M, K = x.shape
    x = x.contiguous()
    q = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(triton.cdiv(K, block), M, dtype=torch.float32, device=x.device)
    launchable(_quantize_kernel, x)[(triton.cdiv(M, QUANT_ROWS), triton.cdiv(K, block))](
        x, q, scale, M, K, x.stride(0), BM=QUANT_ROWS, BK=block, QMAX=E4M3_MAX, POW2=layout.power_of_two)
    return q, scale.t()


def round_tokens_triton(x: torch.Tensor) -> torch.Tensor:
    """bf16 ``[M, K]``: ``x`` rounded as ``quantize_tokens(x, 32)`` rounds it, each value its
    e4m3 code times its power-of-two block scale (exact in bf16)."""
    M, K = x.shape
    x = x.contiguous()
    out = torch.empty(M, K, dtype=torch.bfloat16, device=x.device)
    launchable(_quantize_kernel, x)[(triton.cdiv(M, QUANT_ROWS), triton.cdiv(K, 32))](
        x, out, out, M, K, x.stride(0), BM=QUANT_ROWS, BK=32, QMAX=E4M3_MAX, POW2=True, ROUNDED=True)
    return out


@triton.jit
def _fp8_gemm_kernel(
    a, a_s, b, b_s, c, M, N, K, stride_am, stride_asm, stride_ask, stride_bn, stride_bs, stride_cm, GROUP_N,
    BLOCKS_PER_SPLIT,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ITERS: tl.constexpr, PARTIAL: tl.constexpr,
    BF16_A: tl.constexpr = False, UPCAST: tl.constexpr = False, SB: tl.constexpr = 0, SWAP: tl.constexpr = False,
):
    i_m, i_n, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_m = i_m * BM + tl.arange(0, BM)
    o_n = i_n * BN + tl.arange(0, BN)
    o_k = tl.arange(0, BK)
    m_m, m_n = o_m < M, o_n < N
    # grouped: this tile's output columns belong to group (i_n * BN) // GROUP_N, which reads
    # its own K columns of A and their scales (BN divides GROUP_N)
    i_g = (i_n * BN) // GROUP_N
    a += i_g.to(tl.int64) * K
    a_s += i_g.to(tl.int64) * tl.cdiv(K, BK) * stride_ask
    # SWAP: the tile is accumulated transposed, weight rows as the MMA's M (a few tokens
    # then fill its N instead of padding its 64-row M)
    acc = tl.zeros([BN, BM] if SWAP else [BM, BN], tl.float32)
    first = i_s * BLOCKS_PER_SPLIT
    for j in range(0, ITERS if ITERS > 0 else tl.minimum(BLOCKS_PER_SPLIT, tl.cdiv(K, BK) - first)):
        i = first + j
        k = i * BK + o_k
        m_k = k < K
        t_a = tl.load(a + o_m[:, None].to(tl.int64) * stride_am + k[None, :], mask=m_m[:, None] & m_k[None, :],
                      other=0.0)
        t_b = tl.load(b + o_n[:, None].to(tl.int64) * stride_bn + k[None, :], mask=m_n[:, None] & m_k[None, :],
                      other=0.0)
        # the interpreter's fixed trip count runs past the last block (as tensors shaped like
        # the masks: a scalar mask loses its boolean type in Triton 3.9's interpreter)
        live_m, live_n = i * BK + tl.zeros_like(o_m) < K, i * BK + tl.zeros_like(o_n) < K
        if SB > 0:  # weight-only, power-of-two scales of SB x SB blocks inside the step: the
            # weight tile is dequantized in registers first (exact in bf16), then one wide dot;
            # the tile's [BN / SB, BK / SB] scales are loaded once and broadcast to its elements
            NB: tl.constexpr = BN // SB
            KB: tl.constexpr = BK // SB
            o_nb = i_n * NB + tl.arange(0, NB)
            o_kb = i * KB + tl.arange(0, KB)
            e = tl.load(b_s + o_nb[:, None] * stride_bs + o_kb[None, :],
                        mask=(o_nb * SB < N)[:, None] & (o_kb * SB < K)[None, :], other=0).to(tl.int32)
            # the weights' 2 ** 120 split between the scale (2 ** 64, in its exponent) and the
            # sum (2 ** 56): exact for scales of 2 ** -68 .. 2 ** 63 and |y| past 2 ** -70
            scale = tl.reshape(tl.broadcast_to(tl.reshape(((e + 64) << 23).to(tl.float32, bitcast=True),
                                                          [NB, 1, KB, 1]), [NB, SB, KB, SB]), [BN, BK])
            if UPCAST:  # the interpreter's bf16 products are not bf16's: take them in fp32
                t_a, w = t_a.to(tl.float32), t_b.to(tl.float32) * 7.52316384526264e-37 * scale  # 2 ** -120
            else:
                w = e4m3_to_bf16_bits(t_b) * scale.to(tl.bfloat16)
            if SWAP:
                acc += tl.dot(w, tl.trans(t_a))
            else:
                acc += tl.dot(t_a, tl.trans(w))
        else:
            if BF16_A:  # weight-only: e4m3 to bf16 is exact, the block scale applies after the dot
                if UPCAST:
                    part = tl.dot(t_a.to(tl.float32), tl.trans(t_b.to(tl.float32)))
                else:
                    part = tl.dot(t_a, tl.trans(e4m3_to_bf16(t_b)))
                s_a = tl.where(m_m & live_m, 1.0, 0.0)
            else:
                part = tl.dot(t_a, tl.trans(t_b), max_num_imprecise_acc=0)
                s_a = tl.load(a_s + o_m * stride_asm + i * stride_ask, mask=m_m & live_m, other=0.0)
            s_b = tl.load(b_s + (o_n // BK) * stride_bs + i, mask=m_n & live_n, other=0.0)
            acc += part * s_a[:, None] * s_b[None, :]
    if SWAP:
        acc = tl.trans(acc)
    if SB > 0:
        acc = acc * 72057594037927936.0  # 2 ** 56
    out = c + o_m[:, None].to(tl.int64) * stride_cm + o_n[None, :]
    if PARTIAL:
        tl.store(out + i_s.to(tl.int64) * M * N, acc, mask=m_m[:, None] & m_n[None, :])
    else:
        tl.store(out, acc.to(tl.bfloat16), mask=m_m[:, None] & m_n[None, :])


@triton.jit
def _fp8_gemv_kernel(
    x, w, w_s, c, M, N, K, stride_xm, stride_wn, stride_sn, stride_cm, GROUP_N, BLOCKS_PER_SPLIT,
    BN: tl.constexpr, BK: tl.constexpr, SB: tl.constexpr, ITERS: tl.constexpr, PARTIAL: tl.constexpr,
    E8M0: tl.constexpr, UPCAST: tl.constexpr, EVEN: tl.constexpr,
):
    # program (m, n, s): token m's outputs of weight rows n * BN .., over split s of the BK
    # blocks of K, on the CUDA cores (fp32 FMAs). The token's values are loaded in the
    # weight tile's own layout (each thread the columns of its weight bytes, the rows
    # broadcast), so no step exchanges them through shared memory behind a barrier. Each
    # weight element costs its widening (two instructions a pair, then one each) and one
    # FMA; each thread's 16 consecutive products are summed in registers, and the sum takes
    # its block scale (BN divides SB: the tile's rows share one row of scales; 16 divides SB)
    i_m, i_n, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_n = i_n * BN + tl.arange(0, BN)
    o_k = tl.arange(0, BK)
    o_16 = tl.arange(0, BK // 16) * 16
    m_n = o_n < N
    rows = tl.zeros([BN, 1], tl.int32)  # broadcasts the token's columns over the tile's rows
    i_g = (i_n * BN) // GROUP_N  # grouped: this tile's group reads its own K columns of x
    x += i_m.to(tl.int64) * stride_xm + i_g.to(tl.int64) * K
    s_row = w_s + ((i_n * BN) // SB).to(tl.int64) * stride_sn
    acc = tl.zeros([BN, BK // 16], tl.float32)
    first = i_s * BLOCKS_PER_SPLIT
    for j in range(0, ITERS if ITERS > 0 else tl.minimum(BLOCKS_PER_SPLIT, tl.cdiv(K, BK) - first)):
        k = (first + j) * BK + o_k
        m_k = k < K
        if EVEN:  # no masks: the loads of the token's columns stay one per thread
            t_w = tl.load(w + o_n[:, None].to(tl.int64) * stride_wn + k[None, :])
            xs = tl.load(x + (k[None, :] + rows)).to(tl.float32)
        else:
            t_w = tl.load(w + o_n[:, None].to(tl.int64) * stride_wn + k[None, :],
                          mask=m_n[:, None] & m_k[None, :], other=0.0)
            xs = tl.load(x + (k[None, :] + rows), mask=m_k[None, :], other=0.0).to(tl.float32)
        k_16 = (first + j) * BK + o_16
        if E8M0:  # a ue8m0 byte e is 2 ** (e - 127): e as an fp32 exponent field
            scale = (tl.load(s_row + k_16 // SB, mask=k_16 < K, other=0).to(tl.int32) << 23).to(tl.float32,
                                                                                            bitcast=True)
        else:
            scale = tl.load(s_row + k_16 // SB, mask=k_16 < K, other=0.0)
        if UPCAST:
            w_2 = t_w.to(tl.float32) * 0.00390625  # 2 ** -8
        else:
            w_2 = e4m3_to_fp32(t_w)
        acc += tl.sum(tl.reshape(w_2 * xs, [BN, BK // 16, 16]), axis=2) * scale[None, :]
    y = tl.sum(acc, axis=1) * 256.0
    out = c + i_m.to(tl.int64) * stride_cm + o_n
    if PARTIAL:
        tl.store(out + i_s.to(tl.int64) * M * N, y, mask=m_n)
    else:
        tl.store(out, y.to(tl.bfloat16), mask=m_n)


@triton.jit
def _bf16_gemv_kernel(x, w, c, N, K, stride_xk, stride_wn, BLOCKS_PER_SPLIT, BN: tl.constexpr, BK: tl.constexpr,
                      ITERS: tl.constexpr, PARTIAL: tl.constexpr, EVEN: tl.constexpr):
    # program (n, s): one token's outputs of weight rows n * BN .., over split s of the BK
    # steps of K, on the CUDA cores (fp32 FMAs); the token's values loaded in the weight
    # tile's layout and each thread's 16 consecutive products summed in registers, as in
    # _fp8_gemv_kernel
    i_n, i_s = tl.program_id(0), tl.program_id(1)
    o_n = i_n * BN + tl.arange(0, BN)
    o_k = tl.arange(0, BK)
    m_n = o_n < N
    rows = tl.zeros([BN, 1], tl.int64)  # broadcasts the token's columns over the tile's rows
    acc = tl.zeros([BN, BK // 16], tl.float32)
    first = i_s * BLOCKS_PER_SPLIT
    for j in range(0, ITERS if ITERS > 0 else tl.minimum(BLOCKS_PER_SPLIT, tl.cdiv(K, BK) - first)):
        k = (first + j) * BK + o_k
        m_k = k < K
        if EVEN:  # no masks: the loads of the token's columns stay one per thread
            xs = tl.load(x + (k[None, :].to(tl.int64) * stride_xk + rows)).to(tl.float32)
            t_w = tl.load(w + o_n[:, None].to(tl.int64) * stride_wn + k[None, :]).to(tl.float32)
        else:
            xs = tl.load(x + (k[None, :].to(tl.int64) * stride_xk + rows), mask=m_k[None, :],
                         other=0.0).to(tl.float32)
            t_w = tl.load(w + o_n[:, None].to(tl.int64) * stride_wn + k[None, :], mask=m_n[:, None] & m_k[None, :],
                          other=0.0).to(tl.float32)
        acc += tl.sum(tl.reshape(t_w * xs, [BN, BK // 16, 16]), axis=2)
    y = tl.sum(acc, axis=1)
    if PARTIAL:
        tl.store(c + i_s.to(tl.int64) * N + o_n, y, mask=m_n)
    else:
        tl.store(c + o_n, y.to(c.dtype.element_ty), mask=m_n)


def bf16_gemv_triton(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``out_dtype`` ``[1, N]`` of one bf16 token ``x [1, K]`` (any strides) times a bf16
    ``weight [N, K]`` (rows contiguous) transposed, fp32 accumulation: the tiles of
    :func:`gemv_tile` (8-row tiles and 1024-wide K steps for the V4.1-Flash projections),
    K split over programs (fp32 partials summed in split order) when the rows give fewer
    than :data:`GEMV_PROGRAMS` tiles."""
    N, K = weight.shape
    out = torch.empty(1, N, dtype=out_dtype, device=x.device)
    BN, BK = gemv_tile(N, K, BF16_GEMV_ROWS)
    splits, per_split, target = split_k(out, K, BK, BN, GEMV_PROGRAMS, 1)
    launchable(_bf16_gemv_kernel, x)[(triton.cdiv(N, BN), splits)](
        x, weight, target, N, K, x.stride(1), weight.stride(0), per_split, BN=BN, BK=BK,
        ITERS=per_split if INTERPRET else 0, PARTIAL=splits > 1, EVEN=N % BN == 0 and K % BK == 0, num_warps=4)
    return sum_splits(target, out)


@triton.jit
def _dequantize_kernel(w, w_s, out, N, K, stride_wn, stride_sn, stride_on, BR: tl.constexpr, BC: tl.constexpr,
                       SB: tl.constexpr, UPCAST: tl.constexpr):
    # program (r, c): weight rows r * BR .. and columns c * BC .. times their ue8m0 block
    # scales, into bf16 (exact: an e4m3 value times a power of two is a bf16 value)
    o_r = tl.program_id(0) * BR + tl.arange(0, BR)
    o_c = tl.program_id(1) * BC + tl.arange(0, BC)
    m = (o_r < N)[:, None] & (o_c < K)[None, :]
    t_w = tl.load(w + o_r[:, None].to(tl.int64) * stride_wn + o_c[None, :], mask=m, other=0.0)
    e = tl.load(w_s + (o_r // SB)[:, None] * stride_sn + (o_c // SB)[None, :], mask=m, other=0).to(tl.int32)
    scale = (e << 23).to(tl.float32, bitcast=True)
    if UPCAST:
        y = (t_w.to(tl.float32) * scale).to(tl.bfloat16)
    else:
        y = e4m3_to_bf16(t_w) * scale.to(tl.bfloat16)
    tl.store(out + o_r[:, None].to(tl.int64) * stride_on + o_c[None, :], y, mask=m)


def dequantize_triton(weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """bf16 ``[N, K]`` of an e4m3 ``weight [N, K]`` with ue8m0 ``weight_scale [ceil(N/32),
    ceil(K/32)]`` (uint8 view), exactly ``weight * scale``."""
    N, K = weight.shape
    out = torch.empty(N, K, dtype=torch.bfloat16, device=weight.device)
    BR, BC = DEQUANT_TILE
    launchable(_dequantize_kernel, weight)[(triton.cdiv(N, BR), triton.cdiv(K, BC))](
        weight, weight_scale, out, N, K, weight.stride(0), weight_scale.stride(0), out.stride(0), BR=BR, BC=BC,
        SB=32, UPCAST=INTERPRET)
    return out


@triton.jit
def _sum_splits_kernel(partials, c, MN, SPLITS: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    o = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    m = o < MN
    acc = tl.zeros([BLOCK_SIZE], tl.float32)
    for s in tl.static_range(SPLITS):
        acc += tl.load(partials + s * MN + o, mask=m, other=0.0)
    tl.store(c + o, acc.to(c.dtype.element_ty), mask=m)


def gemv_tile(N: int, K: int, rows: int = 32) -> tuple[int, int]:
    """``(BN, BK)`` of a call of :data:`GEMV_TOKENS` tokens, the best of H100 / H200 sweeps
    (``docs/performance-decode.md``): K per step, the widest of 1024 / 512 / 256 that
    divides K (a partial last step idles lanes on every row); weight rows per program, the
    most up to ``rows`` that leave :data:`GEMV_PROGRAMS` programs per token and a step of at
    most :data:`GEMV_STEP` weights."""
    BK = next((bk for bk in (1024, 512) if K % bk == 0), 256)
    BN = min(rows, GEMV_STEP // BK)
    while BN > 4 and triton.cdiv(N, BN) < GEMV_PROGRAMS:
        BN //= 2
    return BN, BK


def tile_rows(M: int) -> int:
    """Token rows per tile: decode batches are small, fewer wasted rows per tile."""
    return 16 if M <= 16 else 64


def k_splits(M: int, N: int, K: int, block: int = BLOCK, tile_n: int = TILE_N, programs: int = TARGET_PROGRAMS,
             tile_m: int = 0) -> int:
    """How many programs share a tile's ``block``-wide K blocks: enough for ``programs``
    (tiles of ``tile_m`` tokens, :func:`tile_rows` when 0)."""
    tiles = triton.cdiv(M, tile_m or tile_rows(M)) * triton.cdiv(N, tile_n)
    k_blocks = triton.cdiv(K, block)
    per_split = triton.cdiv(k_blocks, max(1, min(k_blocks, programs // tiles)))
    return triton.cdiv(k_blocks, per_split)


def fp8_linear_triton(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      groups: int = 1) -> torch.Tensor:
    """bf16 ``[M, N]`` of ``x [M, groups * K]`` (bf16 or fp32; quantized per token per block
    past the layout's ``weight_only_tokens``, else taken in bf16 against the weight
    dequantized in registers) times e4m3 ``weight [N, K]`` (scales ``[ceil(N/block), ceil(K/block)]``, fp32
    or ue8m0) transposed, per group. With ue8m0 scales past ``weight_only_tokens``, the
    weight is dequantized to a bf16 temporary (``N * K * 2`` bytes) and the tokens rounded
    to their e4m3 values in bf16, and cuBLAS multiplies them."""
    layout = layout_of_scale(weight_scale)
    block = layout.block
    M = x.shape[0]
    N, K = weight.shape
    weight_only = M <= layout.weight_only_tokens
    weight, weight_scale = weight.contiguous(), weight_scale.contiguous()
    if layout.power_of_two:
        weight_scale = weight_scale.view(torch.uint8)
    out = torch.empty(M, N, dtype=torch.bfloat16, device=x.device)
    if layout.power_of_two and not weight_only:  # both operands in bf16, exactly, on cuBLAS
        return _dequantized_mm(round_tokens_triton(x), dequantize_triton(weight, weight_scale), groups, out)
    if weight_only:
        xq, x_scale = x.contiguous().to(torch.bfloat16), x.new_empty((0, 0), dtype=torch.float32)
    else:
        xq, x_scale = quantize_tokens_triton(x, block)
    if M <= GEMV_TOKENS:
        BN, BK = gemv_tile(N, K)
        splits, per_split, target = split_k(out, K, BK, BN, GEMV_PROGRAMS, 1)
        launchable(_fp8_gemv_kernel, x)[(M, triton.cdiv(N, BN), splits)](
            xq, weight, weight_scale, target, M, N, K, xq.stride(0), weight.stride(0), weight_scale.stride(0), N,
            N // groups, per_split, BN=BN, BK=BK, SB=block, ITERS=per_split if INTERPRET else 0,
            PARTIAL=splits > 1, E8M0=layout.power_of_two, UPCAST=INTERPRET, EVEN=N % BN == 0 and K % BK == 0,
            num_warps=4)
        return sum_splits(target, out)
    # a weight-only call of 32-blocks steps through K several scale blocks per dot
    wide = weight_only and layout.power_of_two
    BM, BN, step, swap, programs = (weight_only_tile(M) if wide
                                    else (tile_rows(M), TILE_N, block, False, TARGET_PROGRAMS))
    splits, per_split, target = split_k(out, K, step, BN, programs, BM)
    launchable(_fp8_gemm_kernel, x)[(triton.cdiv(M, BM), triton.cdiv(N, BN), splits)](
        xq, x_scale, weight, weight_scale, target, M, N, K, xq.stride(0), x_scale.stride(0), x_scale.stride(1),
        weight.stride(0), weight_scale.stride(0), N, N // groups, per_split,
        BM=BM, BN=BN, BK=step, ITERS=per_split if INTERPRET else 0, PARTIAL=splits > 1,
        BF16_A=weight_only, UPCAST=INTERPRET, SB=block if wide else 0, SWAP=swap,
        num_warps=4 if wide or BM > 16 else 8,
    )
    return sum_splits(target, out)


def _dequantized_mm(x: torch.Tensor, w: torch.Tensor, groups: int, out: torch.Tensor) -> torch.Tensor:
    """``out`` (bf16 ``[M, N]``) = ``x [M, groups * K]`` bf16 times the bf16 weight ``w [N, K]``
    transposed, per group, on cuBLAS (fp32 accumulation)."""
    if groups == 1:
        return torch.mm(x, w.t(), out=out)
    M, (N, K) = x.shape[0], w.shape
    torch.bmm(x.view(M, groups, K).transpose(0, 1), w.view(groups, N // groups, K).transpose(1, 2),
              out=out.view(M, groups, N // groups).transpose(0, 1))
    return out


def split_k(out: torch.Tensor, K: int, block: int, tile_n: int, programs: int,
            tile_m: int) -> tuple[int, int, torch.Tensor]:
    """How a GEMM into ``out`` (``[M, N]``) of ``K``-deep products splits K
    (:func:`k_splits`): the splits, the ``block``-wide K blocks of each, and where its
    programs write: ``out``, or fp32 partials ``[splits, M, N]`` (summed by
    :func:`sum_splits`) when K is split."""
    M, N = out.shape
    splits = k_splits(M, N, K, block, tile_n, programs, tile_m)
    per_split = triton.cdiv(triton.cdiv(K, block), splits)
    target = torch.empty(splits, M, N, dtype=torch.float32, device=out.device) if splits > 1 else out
    return splits, per_split, target


def sum_splits(target: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` (bf16 ``[M, N]``) holding the sum of ``target``'s partials in split order."""
    if target is not out:
        launchable(_sum_splits_kernel, out)[(triton.cdiv(out.numel(), 1024),)](
            target, out, out.numel(), SPLITS=target.shape[0], BLOCK_SIZE=1024)
    return out
