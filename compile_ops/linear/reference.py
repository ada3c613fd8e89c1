"""Plain-torch meaning of ``fp8_linear`` (any device): dequantize both operands, one fp32 matmul."""

from __future__ import annotations

import torch

from compile_ops.linear.quant import BLOCK, dequantize_blocks


def fp8_linear_reference(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor,
                         weight_scale: torch.Tensor) -> torch.Tensor:
    """``(xq * x_scale) @ (weight * weight_scale)^T`` in fp32, bf16 ``[M, N]`` out."""
    x = xq.float() * x_scale.repeat_interleave(BLOCK, dim=1)[:, : xq.shape[1]]
    return (x @ dequantize_blocks(weight, weight_scale).t()).to(torch.bfloat16)
