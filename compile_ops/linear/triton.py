"""Triton block-scaled FP8 GEMM of ``fp8_linear``: ``C = (A * a_scale) (B * b_scale)^T``.

Program ``(m, n)`` owns a ``BM x BN`` tile of ``C``; per 128-wide K block it loads the
e4m3 tiles of ``A`` (tokens) and ``B`` (weight rows), ``tl.dot``\\ s them (fp32
accumulation) and adds the product scaled by the tokens' 1 x 128 scales and the weight
rows' 128 x 128 block scales. Runs on CUDA tensors, or on CPU tensors under
``TRITON_INTERPRET=1`` (the K loop then has a compile-time trip count); nothing syncs or
allocates beyond the output, so CUDA graphs capture it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from compile_ops._launch import INTERPRET, launchable
from compile_ops.linear.quant import BLOCK


@triton.jit
def _fp8_gemm_kernel(
    a, a_s, b, b_s, c, M, N, K, stride_am, stride_as, stride_bn, stride_bs, stride_cm, GROUP_N,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ITERS: tl.constexpr,
):
    i_m, i_n = tl.program_id(0), tl.program_id(1)
    o_m = i_m * BM + tl.arange(0, BM)
    o_n = i_n * BN + tl.arange(0, BN)
    o_k = tl.arange(0, BK)
    m_m, m_n = o_m < M, o_n < N
    # grouped: this tile's output columns belong to group (i_n * BN) // GROUP_N, which reads
    # its own K columns of A and their scales (BN divides GROUP_N)
    i_g = (i_n * BN) // GROUP_N
    a += i_g.to(tl.int64) * K
    a_s += i_g * tl.cdiv(K, BK)
    acc = tl.zeros([BM, BN], tl.float32)
    steps = ITERS if ITERS > 0 else tl.cdiv(K, BK)
    for i in range(0, steps):
        k = i * BK + o_k
        m_k = k < K
        b_a = tl.load(a + o_m[:, None].to(tl.int64) * stride_am + k[None, :], mask=m_m[:, None] & m_k[None, :], other=0.0)
        b_b = tl.load(b + o_n[:, None].to(tl.int64) * stride_bn + k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.0)
        part = tl.dot(b_a, tl.trans(b_b))
        s_a = tl.load(a_s + o_m * stride_as + i, mask=m_m, other=0.0)
        s_b = tl.load(b_s + (o_n // BK) * stride_bs + i, mask=m_n, other=0.0)
        acc += part * s_a[:, None] * s_b[None, :]
    tl.store(c + o_m[:, None].to(tl.int64) * stride_cm + o_n[None, :], acc.to(tl.bfloat16),
             mask=m_m[:, None] & m_n[None, :])


def fp8_linear_triton(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor,
                      weight_scale: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """bf16 ``[M, N]`` of e4m3 ``xq [M, groups * K]`` (scales ``[M, ceil(groups * K / 128)]``)
    times e4m3 ``weight [N, K]`` (scales ``[ceil(N/128), ceil(K/128)]``) transposed, per group."""
    M = xq.shape[0]
    N, K = weight.shape
    xq, weight = xq.contiguous(), weight.contiguous()
    x_scale, weight_scale = x_scale.contiguous(), weight_scale.contiguous()
    out = torch.empty(M, N, dtype=torch.bfloat16, device=xq.device)
    BM = 16 if M <= 16 else 64  # decode batches are small: fewer wasted rows per tile
    BN = BLOCK
    launchable(_fp8_gemm_kernel, xq)[(triton.cdiv(M, BM), triton.cdiv(N, BN))](
        xq, x_scale, weight, weight_scale, out, M, N, K, xq.stride(0), x_scale.stride(0), weight.stride(0),
        weight_scale.stride(0), out.stride(0), N // groups,
        BM=BM, BN=BN, BK=BLOCK, ITERS=triton.cdiv(K, BLOCK) if INTERPRET else 0,
    )
    return out
