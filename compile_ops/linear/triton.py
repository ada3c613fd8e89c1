"""Triton block-scaled FP8 GEMM of ``fp8_linear``: ``C = q(X) (B * b_scale)^T``.

Program ``(m, n, s)`` owns a ``BM x BN`` tile of ``C`` and split ``s`` of the K blocks.
Per 128-wide K block it loads the tokens' bf16 tile, quantizes it per token to e4m3 as
:func:`compile_ops.linear.quant.quantize_tokens` does (scale ``amax / 448``, correctly
rounded divisions), ``tl.dot``\\ s it with the weight rows' e4m3 tile (fp32 accumulation)
and adds the product scaled by both scales. Quantizing inside the GEMM costs no launch and
no round trip of the quantized activations; a tile re-quantizes its rows once per N tile,
which is ``1 / BN`` of the dot's work.

Decode steps have few tokens, so an ``M x N`` grid alone would leave most SMs idle on the
narrow projections (``wq_a``: 10 tiles): the K blocks are then split over programs that
write fp32 partials, and one reduction sums them in split order (deterministic). Runs on
CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1`` (loops then have compile-time
trip counts, and values are rounded to e4m3 before the cast: the interpreter's cast does
not carry a mantissa that rounds up into the exponent, 125.1 becomes 64); nothing syncs, and the only allocations are the output and the partials, so
CUDA graphs capture it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from compile_ops._launch import INTERPRET, launchable
from compile_ops.linear.quant import BLOCK, E4M3_MAX

# enough programs to cover the H200's 132 SMs twice; fewer tiles than this split K
TARGET_PROGRAMS = 264


@triton.jit
def _round_to_e4m3(v):
    """``v`` (fp32, ``|v| <= 448``) rounded to the nearest e4m3 value, in fp32 arithmetic:
    3 mantissa bits (ties to even) for normals, steps of ``2**-9`` below ``2**-6``."""
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
    normal = bits.to(tl.float32, bitcast=True)
    return tl.where(tl.abs(v) < 0.015625, tl.floor(v * 512.0 + 0.5) / 512.0, normal)


@triton.jit
def _fp8_gemm_kernel(
    x, b, b_s, c, M, N, K, stride_xm, stride_bn, stride_bs, stride_cm, GROUP_N, BLOCKS_PER_SPLIT,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ITERS: tl.constexpr, PARTIAL: tl.constexpr,
    QMAX: tl.constexpr, ROUND_FIRST: tl.constexpr,
):
    i_m, i_n, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_m = i_m * BM + tl.arange(0, BM)
    o_n = i_n * BN + tl.arange(0, BN)
    o_k = tl.arange(0, BK)
    m_m, m_n = o_m < M, o_n < N
    # grouped: this tile's output columns belong to group (i_n * BN) // GROUP_N, which reads
    # its own K columns of x (BN divides GROUP_N)
    x += ((i_n * BN) // GROUP_N).to(tl.int64) * K
    acc = tl.zeros([BM, BN], tl.float32)
    first = i_s * BLOCKS_PER_SPLIT
    steps = ITERS if ITERS > 0 else tl.minimum(BLOCKS_PER_SPLIT, tl.cdiv(K, BK) - first)
    for j in range(0, steps):
        i = first + j
        k = i * BK + o_k
        m_k = k < K
        xs = tl.load(x + o_m[:, None].to(tl.int64) * stride_xm + k[None, :], mask=m_m[:, None] & m_k[None, :],
                     other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(xs), axis=1)
        s_a = tl.where(amax > 0, tl.math.div_rn(amax, tl.full(amax.shape, QMAX, tl.float32)), 1.0)
        xq = tl.clamp(tl.math.div_rn(xs, s_a[:, None]), -QMAX, QMAX)
        if ROUND_FIRST:
            xq = _round_to_e4m3(xq)
        xq = xq.to(tl.float8e4nv)
        w = tl.load(b + o_n[:, None].to(tl.int64) * stride_bn + k[None, :], mask=m_n[:, None] & m_k[None, :],
                    other=0.0)
        part = tl.dot(xq, tl.trans(w))
        s_b = tl.load(b_s + (o_n // BK) * stride_bs + i, mask=m_n & (i * BK < K), other=0.0)
        acc += part * s_a[:, None] * s_b[None, :]
    out = c + o_m[:, None].to(tl.int64) * stride_cm + o_n[None, :]
    if PARTIAL:
        tl.store(out + i_s.to(tl.int64) * M * N, acc, mask=m_m[:, None] & m_n[None, :])
    else:
        tl.store(out, acc.to(tl.bfloat16), mask=m_m[:, None] & m_n[None, :])


@triton.jit
def _sum_splits_kernel(partials, c, MN, SPLITS: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    o = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    m = o < MN
    acc = tl.zeros([BLOCK_SIZE], tl.float32)
    for s in tl.static_range(SPLITS):
        acc += tl.load(partials + s * MN + o, mask=m, other=0.0)
    tl.store(c + o, acc.to(tl.bfloat16), mask=m)


def tile_rows(M: int) -> int:
    """Token rows per tile: decode batches are small, fewer wasted rows per tile."""
    return 16 if M <= 16 else 64


def k_splits(M: int, N: int, K: int) -> int:
    """How many programs share a tile's K blocks: enough for :data:`TARGET_PROGRAMS`."""
    tiles = triton.cdiv(M, tile_rows(M)) * triton.cdiv(N, BLOCK)
    k_blocks = triton.cdiv(K, BLOCK)
    per_split = triton.cdiv(k_blocks, max(1, min(k_blocks, TARGET_PROGRAMS // tiles)))
    return triton.cdiv(k_blocks, per_split)


def fp8_linear_triton(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      groups: int = 1) -> torch.Tensor:
    """bf16 ``[M, N]`` of ``x [M, groups * K]`` (bf16 or fp32; quantized per token per 128
    in the kernel) times e4m3 ``weight [N, K]`` (scales ``[ceil(N/128), ceil(K/128)]``)
    transposed, per group."""
    M = x.shape[0]
    N, K = weight.shape
    x, weight, weight_scale = x.contiguous(), weight.contiguous(), weight_scale.contiguous()
    out = torch.empty(M, N, dtype=torch.bfloat16, device=x.device)
    BM, k_blocks = tile_rows(M), triton.cdiv(K, BLOCK)
    splits = k_splits(M, N, K)
    per_split = triton.cdiv(k_blocks, splits)
    partial = splits > 1
    target = torch.empty(splits, M, N, dtype=torch.float32, device=x.device) if partial else out
    launchable(_fp8_gemm_kernel, x)[(triton.cdiv(M, BM), triton.cdiv(N, BLOCK), splits)](
        x, weight, weight_scale, target, M, N, K, x.stride(0), weight.stride(0), weight_scale.stride(0), N,
        N // groups, per_split,
        BM=BM, BN=BLOCK, BK=BLOCK, ITERS=per_split if INTERPRET else 0, PARTIAL=partial, QMAX=E4M3_MAX,
        ROUND_FIRST=INTERPRET,
    )
    if partial:
        launchable(_sum_splits_kernel, x)[(triton.cdiv(M * N, 1024),)](target, out, M * N, SPLITS=splits,
                                                                      BLOCK_SIZE=1024)
    return out
