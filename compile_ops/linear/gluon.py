"""Gluon weight-only FP8 GEMM of 32-blocks on Hopper (sm_90): a few to 256 bf16 tokens.

``y [M, N] = x [M, K] @ (W [N, K] * 2 ** (e - 127))^T`` with e4m3 ``W`` and ue8m0 bytes
``e`` per 32 x 32 block (DeepSeek-V4.1's layout), bf16 ``x``, as the portable kernel's
weight-only path computes it (:mod:`compile_ops.linear.triton`), but with the weight rows as
the ``wgmma``'s M and the widened weights as its register operand, so no weight tile goes
back through shared memory behind a barrier:

* a program owns ``64 * WG`` weight rows (``WG`` warpgroups) and ``BT`` tokens; a ring of
  ``STAGES`` K steps of ``BK`` in shared memory (``cp.async``, 16 bytes a copy, the next
  ``STAGES - 1`` steps in flight): the weight rows' e4m3 bytes, swizzled so that a warp's
  2-byte loads hit 32 banks, and the tokens' bf16 values in the ``wgmma`` operand's layout;
* each thread loads, for its rows of the product, the byte pairs the bf16 register operand
  wants there, widens each pair to bf16 by the integer moves of
  :func:`compile_ops._triton_quant.e4m3_to_bf16_bits` (the value times ``2 ** -120``) and
  multiplies it by its block's scale times ``2 ** 64`` (one bf16 multiply a pair, exact),
  then one 32-deep bf16 ``wgmma`` a scale block into the one fp32 accumulator;
* ``2 ** 56`` then scales each output: exact for block scales of ``2 ** -68`` to ``2 ** 63``.

K may be split over programs that write fp32 partials, summed after in split order, as the
portable kernel does.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from compile_ops._launch import launchable
from compile_ops._triton_quant import E4M3X2_TO_BF16X2
from compile_ops.linear.quant import layout_of_scale
from compile_ops.linear.triton import TARGET_PROGRAMS, fp8_linear_triton, split_k, sum_splits
from compile_ops.mla.gluon import _async_load, _cta_barrier

BK = 128  # K a step: four 32-blocks of scales, one 128-byte row of each weight row's bytes


@gluon.jit
def _widen(w):
    """uint8 e4m3 bytes ``w`` (two consecutive ones a thread) -> bf16, each the byte's value
    times ``2 ** -120``, exactly (:func:`compile_ops._triton_quant.e4m3_to_bf16_bits`)."""
    return gl.inline_asm_elementwise(E4M3X2_TO_BF16X2, "=r,h", [w], dtype=gl.bfloat16, is_pure=True, pack=2)


@gluon.jit
def _copy_step(wbuf, xbuf, stage, w, x, n0, m0, k0, x_col, M, N, k_end, stride_wn, stride_xm,
               ROWS: gl.constexpr, BT: gl.constexpr, BK: gl.constexpr, num_warps: gl.constexpr):
    """Start copying K step ``k0 ..`` of the program's weight rows and tokens into slot
    ``stage`` (nothing past ``k_end``, the end of the program's split of K)."""
    WL: gl.constexpr = gl.BlockedLayout([1, 16], [32 * 16 // BK, BK // 16], [num_warps, 1], [1, 0])
    o_r = n0 + gl.arange(0, ROWS, gl.SliceLayout(1, WL))
    o_k = k0 + gl.arange(0, BK, gl.SliceLayout(0, WL))
    _async_load(wbuf.index(stage), w + o_r[:, None].to(gl.int64) * stride_wn + o_k[None, :],
                mask=(o_r < N)[:, None] & (o_k < k_end)[None, :])
    XL: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BK, BK // 8], [num_warps, 1], [1, 0])
    o_t = m0 + gl.arange(0, BT, gl.SliceLayout(1, XL))
    o_c = k0 + gl.arange(0, BK, gl.SliceLayout(0, XL))
    _async_load(xbuf.index(stage), x + o_t[:, None].to(gl.int64) * stride_xm + (x_col + o_c)[None, :],
                mask=(o_t < M)[:, None] & (o_c < k_end)[None, :])
    async_copy.commit_group()


@gluon.jit
def _weight_only_kernel(x, w, w_s, c, M, N, K, stride_xm, stride_wn, stride_sn, stride_cm, GROUP_N, BLOCKS_PER_SPLIT,
                        WG: gl.constexpr, BT: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                        PARTIAL: gl.constexpr):
    """Program ``(t, n, s)``: tokens ``t BT ..``, weight rows ``n 64 WG ..``, K steps
    ``s BLOCKS_PER_SPLIT ..`` of ``BK`` (fp32 partials where ``PARTIAL``, else bf16 ``c``)."""
    ROWS: gl.constexpr = 64 * WG
    NW: gl.constexpr = 4 * WG
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BT, 16])
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
    ROW: gl.constexpr = gl.SliceLayout(1, A_L)

    i_t, i_n, i_s = gl.program_id(0), gl.program_id(1), gl.program_id(2)
    m0, n0 = i_t * BT, i_n * ROWS
    x_col = (n0 // GROUP_N) * K  # grouped: the tile's group reads its own K columns of x
    steps = gl.minimum(BLOCKS_PER_SPLIT, gl.cdiv(K, BK) - i_s * BLOCKS_PER_SPLIT)
    kf = i_s * BLOCKS_PER_SPLIT * BK
    k_end = gl.minimum(K, kf + steps * BK)

    # the weight rows' pairs: 16-byte chunk j of row r at chunk j ^ r % 8 (a warp's 8 rows, 32 banks)
    wbuf = gl.allocate_shared_memory(gl.uint8, [STAGES, ROWS, BK], gl.SwizzledSharedLayout(16, 1, 8, [1, 0]))
    xbuf = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BT, BK],
                                     gl.NVMMASharedLayout.get_default_for([BT, BK], gl.bfloat16))
    for p in gl.static_range(STAGES - 1):
        _copy_step(wbuf, xbuf, p, w, x, n0, m0, kf + p * BK, x_col, M, N, k_end, stride_wn, stride_xm, ROWS, BT, BK,
                   NW)

    o_r = n0 + gl.arange(0, ROWS, ROW)
    s_row = w_s + (o_r // 32).to(gl.int64) * stride_sn
    acc = gl.zeros([ROWS, BT], gl.float32, ACC)
    for i in range(steps):
        k0 = kf + i * BK
        async_copy.wait_group(STAGES - 2)  # this thread's copies of step i have landed ...
        fence_async_shared()  # ... visible to the tensor cores' reads ...
        _cta_barrier()  # ... and every thread's; the slot refilled below was read one step ago
        _copy_step(wbuf, xbuf, (i + STAGES - 1) % STAGES, w, x, n0, m0, k0 + (STAGES - 1) * BK, x_col, M, N,
                   k_end, stride_wn, stride_xm, ROWS, BT, BK, NW)
        st = i % STAGES
        weights = wbuf.index(st)
        tokens = xbuf.index(st)
        for j in gl.static_range(BK // 32):
            a = _widen(weights.slice(32 * j, 32, dim=1).load(A_L))  # the operand's byte pairs, 2-byte loads
            # the block's scale times 2 ** 64 as bf16 (the weights' 2 ** 120: 64 here, 56 at the end)
            e = gl.load(s_row + (k0 // 32 + j), mask=(o_r < N) & (k0 + 32 * j < K), other=0).to(gl.int32)
            scale = ((e + 64) << 7).to(gl.int16).to(gl.bfloat16, bitcast=True)
            acc = warpgroup_mma(a * scale[:, None], tokens.slice(32 * j, 32, dim=1).permute((1, 0)), acc,
                                is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    async_copy.wait_group(0)  # the masked copies past the last step: nothing left in flight

    acc = acc * 72057594037927936.0  # 2 ** 56
    o_n = n0 + gl.arange(0, ROWS, gl.SliceLayout(1, ACC))
    o_m = m0 + gl.arange(0, BT, gl.SliceLayout(0, ACC))
    out = c + o_m[None, :].to(gl.int64) * stride_cm + o_n[:, None]
    mask = (o_n < N)[:, None] & (o_m < M)[None, :]
    if PARTIAL:
        gl.store(out + i_s.to(gl.int64) * M * N, acc, mask=mask)
    else:
        gl.store(out, acc.to(gl.bfloat16), mask=mask)


def weight_only_tile(M: int) -> tuple[int, int, int, int]:
    """``(WG, BT, STAGES, programs)`` of a call of ``M`` tokens: warpgroups a
    program (``64 * WG`` weight rows), tokens a program, K steps in the ring, and the programs
    K is split to reach (:func:`compile_ops.linear.triton.k_splits`); the best of H100 sweeps
    at 2 to 256 tokens (``docs/ops.md``). Up to 64 tokens a program takes 64 weight rows and K
    is split to twice the target: more programs wait on more partial sums, fewer leave
    the loads too few to cover HBM's latency; past 64 tokens, 128 x 128 tiles."""
    if M <= 64:
        return 1, max(16, triton.next_power_of_2(M)), 2, 2 * TARGET_PROGRAMS
    return 2, 128, 3, TARGET_PROGRAMS


def gemm_unsupported(args: tuple) -> Optional[str]:
    """``None`` where the Gluon GEMM takes the validated ``fp8_linear`` call ``args``, else why
    not (:func:`fp8_linear_gluon` then runs the ``triton`` backend's kernels)."""
    x, weight, weight_scale, groups = args
    layout = layout_of_scale(weight_scale)
    if not layout.power_of_two:
        return "the Gluon GEMM takes 32-blocks (ue8m0 scales) only"
    if not 2 <= x.shape[0] <= layout.weight_only_tokens:
        return f"the Gluon GEMM takes weight-only calls of 2 to {layout.weight_only_tokens} tokens, got {x.shape[0]}"
    if weight.shape[1] % 16:
        return f"the Gluon GEMM copies 16-byte rows: K must be a multiple of 16, got {weight.shape[1]}"
    return None


def fp8_linear_gluon(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """:func:`compile_ops.linear.fp8_linear`, bf16 ``[M, N]``: the Gluon GEMM where it takes the
    call (:func:`gemm_unsupported`), else the ``triton`` backend (one token's GEMV, the token
    quantizer past ``weight_only_tokens``, 128-blocks)."""
    if gemm_unsupported((x, weight, weight_scale, groups)) is not None:
        return fp8_linear_triton(x, weight, weight_scale, groups)
    M, (N, K) = x.shape[0], weight.shape
    x = x.contiguous().to(torch.bfloat16)
    weight, scale = weight.contiguous(), weight_scale.contiguous().view(torch.uint8)
    WG, BT, STAGES, programs = weight_only_tile(M)
    out = torch.empty(M, N, dtype=torch.bfloat16, device=x.device)
    splits, per_split, target = split_k(out, K, BK, 64 * WG, programs, BT)
    launchable(_weight_only_kernel, x)[(triton.cdiv(M, BT), triton.cdiv(N, 64 * WG), splits)](
        x, weight, scale, target, M, N, K, x.stride(0), weight.stride(0), scale.stride(0), N, N // groups,
        per_split, WG=WG, BT=BT, BK=BK, STAGES=STAGES, PARTIAL=splits > 1, num_warps=4 * WG)
    return sum_splits(target, out)
