"""The kernel that brings a one-token step's inputs into a :class:`graphs.StepRunner`'s
static buffers on CUDA (imported on CUDA only, and by the CPU tests in Triton's
interpreter).

The step's two integers (its position and request row) travel as the kernel's arguments
and the same launch copies its hidden states into the static input rows: one kernel in
front of the replay where two fills and a copy kernel were three launches, each a few
microseconds after the one before on the device, and no host-to-device copy, whose
completion holds the next kernel back several microseconds.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

ROW_BLOCK = 1024  # hidden-state values a program copies


@triton.jit(do_not_specialize=["position", "row"])
def _one_token_kernel(ints, max_tokens, position, row, x, rows, dim, COPY: tl.constexpr, BLOCK: tl.constexpr):
    """Program 0 sets column 0 of ``ints [2, max_tokens]`` to ``(position, row)``; with
    ``COPY`` program ``p`` copies values ``p * BLOCK ..`` of ``x [dim]`` into ``rows``."""
    i_p = tl.program_id(0)
    if i_p == 0:
        tl.store(ints, position)
        tl.store(ints + max_tokens, row)
    if COPY:
        o = i_p * BLOCK + tl.arange(0, BLOCK)
        m = o < dim
        tl.store(rows + o, tl.load(x + o, mask=m), mask=m)


def stage_one_token(ints: Tensor, position: int, row: int, x: Optional[Tensor], rows: Tensor) -> None:
    """Set column 0 of the metadata's integers ``ints [2, max_tokens]`` (int32) to the step's
    ``position`` and request ``row``, and copy its hidden states ``x [1, dim]`` into the
    static input rows ``rows [1, dim]`` (bf16), in one launch. ``x`` ``None``: they are in
    ``rows`` already; an ``x`` of another dtype, layout or device is copied by torch first."""
    copy = x is not None and x.dtype == torch.bfloat16 and x.is_contiguous() and x.device == rows.device
    if x is not None and not copy:
        rows.copy_(x, non_blocking=True)
    dim = rows.shape[1]
    _one_token_kernel[(triton.cdiv(dim, ROW_BLOCK) if copy else 1,)](
        ints, ints.shape[1], position, row, x if copy else rows, rows, dim, COPY=copy, BLOCK=ROW_BLOCK)
