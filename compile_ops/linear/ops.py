"""``dsv41::fp8_linear``: schema, validation, fake, dispatch to the ``"linear"`` backends.

A backend quantizes the activations per token per 128 values as
:func:`compile_ops.linear.quant.quantize_tokens` does (on CUDA a one-launch Triton
quantizer, equal bit for bit) and multiplies them by the weight with fp32 accumulation.
"""

from __future__ import annotations

import torch
from torch import Tensor

from compile_ops import backends
from compile_ops._checks import check_tensor
from compile_ops.linear.quant import BLOCK, dequantize_blocks, quantize_blocks, quantize_tokens
from compile_ops.linear.reference import fp8_linear_reference


def _check(x, weight, weight_scale, groups):
    check_tensor("x", x, (torch.bfloat16, torch.float32), 2)
    check_tensor("weight", weight, torch.float8_e4m3fn, 2, x.device)
    check_tensor("weight_scale", weight_scale, torch.float32, 2, x.device)
    N, K = weight.shape
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ValueError(f"groups must be an int >= 1, got {groups!r}")
    if groups > 1 and (N % (groups * BLOCK) or K % BLOCK):
        raise ValueError(f"with groups={groups}, weight [{N}, {K}] must hold whole {BLOCK}-blocks per group: "
                         f"N / groups and K multiples of {BLOCK}")
    if x.shape[1] != groups * K:
        raise ValueError(f"x must be [M, groups * K] with K = weight.shape[1] = {K}, groups = {groups}, "
                         f"got {list(x.shape)}")
    want = (-(-N // BLOCK), -(-K // BLOCK))
    if tuple(weight_scale.shape) != want:
        raise ValueError(f"weight_scale must be [ceil(N/{BLOCK}), ceil(K/{BLOCK})] = {list(want)} for weight "
                         f"[{N}, {K}], got {list(weight_scale.shape)}")


@torch.library.custom_op("dsv41::fp8_linear", mutates_args=())
def fp8_linear(x: Tensor, weight: Tensor, weight_scale: Tensor, groups: int = 1) -> Tensor:
    _check(x, weight, weight_scale, groups)
    if x.shape[0] == 0:
        return x.new_empty(0, weight.shape[0], dtype=torch.bfloat16)
    args = (x, weight, weight_scale, groups)
    return backends.implementation("linear", "fp8_linear", x.device, args=args)(*args)


@fp8_linear.register_fake
def _(x, weight, weight_scale, groups=1):
    _check(x, weight, weight_scale, groups)
    return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.bfloat16)


fp8_linear.__doc__ = """``x @ W^T`` of a block-scaled FP8 weight, bf16 ``[M, N]`` out.

With ``groups = G > 1`` it is a grouped projection: ``x [M, G * K]``, ``weight [N, K]``
holds ``G`` stacked ``[N / G, K]`` weights, and output columns ``g * N / G ..`` are
``x[:, g * K : (g + 1) * K] @ W_g^T`` (the attention layer's ``wo_a``; ``N / G`` and ``K``
whole 128-blocks).

``x [M, K]`` bf16 (or fp32) is quantized per token per 128 values to e4m3 with fp32
scales (``quantize_tokens``); ``weight [N, K]`` float8_e4m3fn with ``weight_scale
[ceil(N/128), ceil(K/128)]`` fp32 (DeepSeek's 128 x 128 blocks, ``w = weight * scale``).
Products accumulate in fp32. Shapes follow the inputs only; no host sync. Backends, in
``auto`` order: ``scaled_mm`` (cuBLAS's blockwise FP8 GEMM through
``torch.nn.functional.scaled_mm``, on Hopper with a torch that has it, for calls of one
group, at least 128 tokens and 2**19 outputs), ``triton`` (a block-scaled FP8 GEMM that splits K over the
SMs for decode batches; any CUDA GPU), and the dequantizing plain-torch ``reference``.

Example::

    >>> import torch
    >>> from compile_ops.linear import fp8_linear, quantize_blocks
    >>> w, s = quantize_blocks(torch.eye(4, 256))
    >>> fp8_linear(torch.ones(1, 256).bfloat16(), w, s).tolist()
    [[1.0, 1.0, 1.0, 1.0]]
"""


backends.register_backend("linear", "scaled_mm", backends.imported("compile_ops.linear.scaled_mm", "available"),
                          {"fp8_linear": backends.imported("compile_ops.linear.scaled_mm", "fp8_linear_scaled_mm")},
                          limits=backends.imported("compile_ops.linear.scaled_mm", "limits"))
backends.register_backend("linear", "triton", backends.cuda_with_triton,
                          {"fp8_linear": backends.imported("compile_ops.linear.triton", "fp8_linear_triton")})
backends.register_backend("linear", "reference", backends.any_device, {"fp8_linear": fp8_linear_reference})

__all__ = ["BLOCK", "dequantize_blocks", "fp8_linear", "quantize_blocks", "quantize_tokens"]
