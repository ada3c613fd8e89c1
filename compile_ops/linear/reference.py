"""Plain-torch meaning of ``fp8_linear`` (any device): quantize the tokens (past the
layout's ``weight_only_tokens``), dequantize both operands, one fp32 matmul."""

from __future__ import annotations

import torch

from compile_ops.linear.quant import dequantize_blocks, layout_of_scale, quantize_tokens


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         groups: int = 1) -> torch.Tensor:
    """``q(x) @ (weight * weight_scale)^T`` in fp32 (per group), bf16 ``[M, N]`` out, where
    ``q(x)`` is ``x`` rounded per token per block of ``weight_scale``'s layout
    (``quantize_tokens``) when it has more than the layout's ``weight_only_tokens``, else ``x`` in bf16."""
    layout = layout_of_scale(weight_scale)
    block = layout.block
    if x.shape[0] <= layout.weight_only_tokens:
        xd = x.to(torch.bfloat16).float()
    else:
        xq, x_scale = quantize_tokens(x, block)
        xd = xq.float() * x_scale.repeat_interleave(block, dim=1)[:, : xq.shape[1]]
    w = dequantize_blocks(weight, weight_scale)
    if groups == 1:
        return (xd @ w.t()).to(torch.bfloat16)
    M, (N, K) = xd.shape[0], w.shape
    out = torch.einsum("mgk,gnk->mgn", xd.view(M, groups, K), w.view(groups, N // groups, K))
    return out.reshape(M, N).to(torch.bfloat16)
