"""``dsv41::fp8_linear``: schema, validation, fake, dispatch to the ``"linear"`` backends;
``dsv41::bf16_linear``, its bf16 counterpart (a GEMV at one token on CUDA, no backend choice).

A backend quantizes the activations of a call of more than its layout's
``weight_only_tokens`` tokens (:class:`compile_ops.linear.BlockLayout`) per token per
block of the weight's layout (128 values with fp32 scales, or 32 with power-of-two
scales) as :func:`compile_ops.linear.quant.quantize_tokens` does (on CUDA a
one-launch Triton quantizer, equal bit for bit), takes a smaller call's activations in
bf16, and multiplies them by the weight with fp32 accumulation.
"""

from __future__ import annotations

import torch
from torch import Tensor

from compile_ops import backends
from compile_ops._checks import check_tensor
from compile_ops.linear.quant import (BLOCK, LAYOUTS, TILE_N, BlockLayout, dequantize_blocks,
                                      layout_of_block, layout_of_scale, quantize_blocks, quantize_tokens)
from compile_ops.linear.reference import fp8_linear_reference


def _check(x, weight, weight_scale, groups):
    check_tensor("x", x, (torch.bfloat16, torch.float32), 2)
    check_tensor("weight", weight, torch.float8_e4m3fn, 2, x.device)
    check_tensor("weight_scale", weight_scale, [layout.scale_dtype for layout in LAYOUTS.values()], 2, x.device)
    B = layout_of_scale(weight_scale).block
    N, K = weight.shape
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ValueError(f"groups must be an int >= 1, got {groups!r}")
    if groups > 1 and (N % (groups * TILE_N) or K % B):
        raise ValueError(f"with groups={groups}, weight [{N}, {K}] must hold whole blocks per group: N / groups a "
                         f"multiple of {TILE_N} and K of {B}")
    if x.shape[1] != groups * K:
        raise ValueError(f"x must be [M, groups * K] with K = weight.shape[1] = {K}, groups = {groups}, "
                         f"got {list(x.shape)}")
    want = (-(-N // B), -(-K // B))
    if tuple(weight_scale.shape) != want:
        raise ValueError(f"weight_scale ({weight_scale.dtype}: {B} x {B} blocks) must be [ceil(N/{B}), ceil(K/{B})] "
                         f"= {list(want)} for weight [{N}, {K}], got {list(weight_scale.shape)}")


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

``x [M, K]`` bf16 (or fp32) is quantized per token per block to e4m3 when ``M`` is more
than the layout's ``weight_only_tokens`` (64 with 128-blocks, 256 with 32-blocks); a
smaller call is weight-only: ``x`` in bf16 times the weight dequantized in registers (one
launch fewer, no activation rounding). ``weight [N, K]``
float8_e4m3fn with ``weight_scale`` in one of DeepSeek's two layouts, told apart by its
dtype (``compile_ops.linear.LAYOUTS``): fp32 ``[ceil(N/128), ceil(K/128)]`` (V4's 128 x
128 blocks, activations per 128 values with fp32 scales) or float8_e8m0fnu ``[ceil(N/32),
ceil(K/32)]`` (V4.1's 32 x 32 blocks, activations per 32 values with power-of-two
scales); ``w = weight * scale``. Any other scale dtype or shape is refused. Products
accumulate in fp32. Shapes follow the inputs only; no host sync. Backends, in ``auto``
order: ``scaled_mm`` (cuBLAS's blockwise FP8 GEMM through
``torch.nn.functional.scaled_mm``, on Hopper with a torch that has it, for 128-block
calls of one group, at least 128 tokens and 2**19 outputs), ``gluon`` (Hopper: a
weight-only GEMM of 32-blocks for 2 to 256 tokens with the widened weights as the tensor
cores' register operand, the ``triton`` kernels for every other call), ``triton`` (a block-scaled
FP8 GEMM that splits K over the SMs for decode batches, weight-only up to the layout's
``weight_only_tokens``, a GEMV on the CUDA cores at ``M = 1``; past them with 32-blocks
both operands exactly in bf16 on cuBLAS; any CUDA GPU, both layouts), and
the dequantizing plain-torch ``reference``.

Example::

    >>> import torch
    >>> from compile_ops.linear import fp8_linear, quantize_blocks
    >>> w, s = quantize_blocks(torch.eye(4, 256))
    >>> fp8_linear(torch.ones(1, 256).bfloat16(), w, s).tolist()
    [[1.0, 1.0, 1.0, 1.0]]
"""


def _check_bf16(x, weight, out_dtype):
    check_tensor("x", x, torch.bfloat16, 2)
    check_tensor("weight", weight, torch.bfloat16, 2, x.device)
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype}")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"x must be [M, K] with K = weight.shape[1] = {weight.shape[1]}, got {list(x.shape)}")


@torch.library.custom_op("dsv41::bf16_linear", mutates_args=())
def bf16_linear(x: Tensor, weight: Tensor, out_dtype: torch.dtype = torch.bfloat16) -> Tensor:
    _check_bf16(x, weight, out_dtype)
    if x.shape[0] == 1 and backends.cuda_with_triton(x.device, None) is None:
        from compile_ops.linear.triton import bf16_gemv_triton

        return bf16_gemv_triton(x, weight if weight.stride(1) == 1 else weight.contiguous(), out_dtype)
    if x.is_cuda:
        return torch.mm(x, weight.t(), out_dtype=out_dtype)
    return (x.float() @ weight.float().t()).to(out_dtype)


@bf16_linear.register_fake
def _(x, weight, out_dtype=torch.bfloat16):
    _check_bf16(x, weight, out_dtype)
    return x.new_empty(x.shape[0], weight.shape[0], dtype=out_dtype)


bf16_linear.__doc__ = """``x @ weight^T`` of bf16 operands with fp32 accumulation, ``[M, N]`` in
``out_dtype`` (bf16, or fp32 for a product that must keep its fp32 sum).

``x [M, K]`` bf16 (any strides), ``weight [N, K]`` bf16. On a CUDA GPU a one-token call
(``M = 1``, a decode step's projection) is a GEMV on the CUDA cores (Triton, tiles of
eight weight rows): cuBLAS's GEMMs of one token read their weight below the bandwidth
(``docs/performance-decode.md``); any other call is cuBLAS's GEMM (``torch.mm``). Off CUDA
the product is computed in fp32. Shapes follow the inputs only; no host sync.

Example::

    >>> import torch
    >>> from compile_ops.linear import bf16_linear
    >>> bf16_linear(torch.ones(1, 4).bfloat16(), torch.eye(3, 4).bfloat16(), torch.float32).tolist()
    [[1.0, 1.0, 1.0]]
"""


backends.register_backend("linear", "scaled_mm", backends.imported("compile_ops.linear.scaled_mm", "available"),
                          {"fp8_linear": backends.imported("compile_ops.linear.scaled_mm", "fp8_linear_scaled_mm")},
                          limits=backends.imported("compile_ops.linear.scaled_mm", "limits"))


def _gluon_unavailable(device, kv_format):
    return backends.hopper_with_gluon(device)


# before triton: its weight-only GEMM of 2-256 tokens beats the portable kernel's
# (docs/ops.md); it runs the triton kernels for every other call
backends.register_backend("linear", "gluon", _gluon_unavailable,
                          {"fp8_linear": backends.imported("compile_ops.linear.gluon", "fp8_linear_gluon")})
backends.register_backend("linear", "triton", backends.cuda_with_triton,
                          {"fp8_linear": backends.imported("compile_ops.linear.triton", "fp8_linear_triton")})
backends.register_backend("linear", "reference", backends.any_device, {"fp8_linear": fp8_linear_reference})

__all__ = ["BLOCK", "LAYOUTS", "BlockLayout", "bf16_linear", "dequantize_blocks", "fp8_linear", "layout_of_block",
           "layout_of_scale", "quantize_blocks", "quantize_tokens"]
