"""``fp8_linear`` on cuBLAS: ``torch.nn.functional.scaled_mm`` with DeepSeek's blockwise
scales (tokens 1 x 128, weights 128 x 128), on Hopper with a torch that has them.

cuBLAS takes the tokens' scales outer-dim-major (``quantize_tokens_triton`` writes them so)
and the weight's as ``[L4, N / 128]`` with stride ``(1, L4)``, ``L4`` the K blocks rounded
up to a multiple of 4 (padded with ones). It needs whole 128-blocks, one group, and enough
tokens: :func:`limits` says which calls it takes; the Triton GEMM runs the others.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from compile_ops.linear.quant import BLOCK, layout_of_scale

# Smaller calls run faster on the Triton GEMM, which splits K over the SMs: cuBLAS's
# blockwise kernels do not, and refuse 1 or 2 rows (figures in docs/ops.md).
MIN_TOKENS = 128
MIN_OUTPUTS = 1 << 19  # tokens x output columns


def available(device: torch.device, kv_format: Optional[str]) -> Optional[str]:
    """Predicate: a Hopper GPU, and a torch whose ``scaled_mm`` has blockwise scaling."""
    from compile_ops.backends import cuda_with_triton

    reason = cuda_with_triton(device, kv_format)  # the tokens' quantizer is a Triton kernel
    if reason is not None:
        return reason
    if not hasattr(getattr(F, "ScalingType", None), "BlockWise128x128"):
        return f"torch {torch.__version__} has no blockwise torch.nn.functional.scaled_mm"
    if torch.cuda.get_device_capability(device) != (9, 0):
        return "cuBLAS's 1x128 x 128x128 blockwise FP8 GEMM is the Hopper (sm_90) one"
    return None


def limits(args: tuple) -> Optional[str]:
    """Per call: 128 x 128 fp32-scaled blocks, one group, ``N`` and ``K`` whole 128-blocks, at least :data:`MIN_TOKENS`
    tokens and :data:`MIN_OUTPUTS` output values."""
    x, weight, weight_scale, groups = args
    N, K = weight.shape
    if layout_of_scale(weight_scale).block != BLOCK:
        return "cuBLAS's blockwise scaling is 128 x 128 with fp32 scales: 32 x 32 ue8m0 blocks run on the Triton GEMM"
    if groups != 1:
        return "grouped projections run on the Triton GEMM"
    if N % BLOCK or K % BLOCK:
        return f"weight [{N}, {K}] is not whole {BLOCK}-blocks"
    if x.shape[0] < MIN_TOKENS or x.shape[0] * N < MIN_OUTPUTS:
        return (f"[{x.shape[0]}, {N}] out is under {MIN_TOKENS} tokens or {MIN_OUTPUTS} values: the Triton GEMM "
                "is faster")
    return None


def fp8_linear_scaled_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         groups: int = 1) -> torch.Tensor:
    """bf16 ``[M, N]`` of ``x [M, K]`` quantized per token per 128 times ``weight [N, K]``
    (scales ``[N/128, K/128]``) transposed, by cuBLAS (fp32 accumulation)."""
    from compile_ops.linear.triton import quantize_tokens_triton

    xq, x_scale = quantize_tokens_triton(x)
    k_blocks = weight_scale.shape[1]
    padded = F.pad(weight_scale, (0, -k_blocks % 4), value=1.0)  # [N/128, L4]
    return F.scaled_mm(xq, weight.t(), x_scale, F.ScalingType.BlockWise1x128, padded.t(),
                       F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)
