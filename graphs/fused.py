"""Projections that read the same input, as one GEMM over their stacked weights.

A decode step of one token reads each weight once, so its time is the weights' bytes over
the bandwidth, plus a fixed cost per GEMM that small weights cannot hide (the layer's
``wkv``, ``weights_proj`` and the compressors' few-MB weights run far below the bandwidth
on their own). :func:`stack_rows` stores such weights as consecutive row blocks of one
tensor, and makes each module's weight a view of its block: the modules, their state-dict
names and in-place loading stay as they are, with no second copy of the weights.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from compile_ops.linear import fp8_linear


class StackedRows(NamedTuple):
    """Projections of one input stacked into one weight.

    ``weight`` / ``scale`` name the layer's buffers holding the stacked weight (``[sum of
    widths, in]``, bf16 or e4m3) and, for FP8, its block scales (``None`` for bf16);
    ``names[i]`` is the projection whose output is the ``widths[i]`` columns after the
    previous ones; ``fp32``: the product stays fp32 (bf16 weights only: a compressor's
    split weights need the fp32 sum), else it is bf16.
    """

    weight: str
    scale: Optional[str]
    names: tuple[str, ...]
    widths: tuple[int, ...]
    fp32: bool


def stack_rows(tensors: list[Tensor]) -> Tensor:
    """One contiguous tensor holding ``tensors`` (2-D, one dtype and width) as consecutive
    row blocks; each tensor becomes a view of its block (``tensor.data``), so a weight
    loaded or copied in place fills the stacked one."""
    stacked = torch.cat([t.detach() for t in tensors])
    start = 0
    for t in tensors:
        t.data = stacked[start:start + t.shape[0]]
        start += t.shape[0]
    return stacked


def mm_fp32(x: Tensor, weight: Tensor) -> Tensor:
    """``x [T, in] @ weight [out, in]^T`` as fp32 ``[T, out]`` with fp32 accumulation (bf16
    tensor cores on CUDA; CPU torch has no bf16 x bf16 -> fp32 product: the same sum in fp32)."""
    if x.is_cuda and x.dtype == torch.bfloat16:
        return torch.mm(x, weight.t(), out_dtype=torch.float32)
    return x.float() @ weight.float().t()


def project(module: torch.nn.Module, stacks: tuple[StackedRows, ...], x: Tensor) -> dict[str, Tensor]:
    """Each stacked projection of ``x [T, in]``: ``{name: [T, width]}``, column views of one
    GEMM per stack (fp32 for an ``fp32`` stack, else bf16)."""
    out = {}
    for s in stacks:
        weight = getattr(module, s.weight)
        if s.scale is not None:
            y = fp8_linear(x, weight, getattr(module, s.scale))
        elif s.fp32:
            y = mm_fp32(x, weight)
        else:
            y = x @ weight.t()
        out.update(zip(s.names, y.split(s.widths, dim=1)))
    return out
