"""Plain-torch meaning of ``fp8_linear`` (any device): dequantize both operands, one fp32 matmul."""

from __future__ import annotations

import torch

from compile_ops.linear.quant import BLOCK, dequantize_blocks


def fp8_linear_reference(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor,
                         weight_scale: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """``(xq * x_scale) @ (weight * weight_scale)^T`` in fp32 (per group), bf16 ``[M, N]`` out."""
    x = xq.float() * x_scale.repeat_interleave(BLOCK, dim=1)[:, : xq.shape[1]]
    w = dequantize_blocks(weight, weight_scale)
    if groups == 1:
        return (x @ w.t()).to(torch.bfloat16)
    M, (N, K) = x.shape[0], w.shape
    out = torch.einsum("mgk,gnk->mgn", x.view(M, groups, K), w.view(groups, N // groups, K))
    return out.reshape(M, N).to(torch.bfloat16)
