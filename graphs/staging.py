"""The kernels that bring a step's inputs into a :class:`graphs.StepRunner`'s static
buffers on CUDA (imported on CUDA only, and by the CPU tests in Triton's interpreter): one
launch in front of the replay sets the step's integers and copies its hidden states into
the static input rows, where a copy and fills were launches of their own, each a few
microseconds after the one before on the device.

A one-token step's two integers (its position and request row) travel as the kernel's
arguments (:func:`stage_one_token`). A larger step's reach the device by a host-to-device
copy on a side stream into a device buffer of the runner's staging ring, issued while the
previous step's graph still runs (:func:`stage_step` then copies them on): on the step's
own stream such a copy waits for that graph to end, and its completion holds the next
kernel back several microseconds.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

ROW_BLOCK = 1024  # hidden-state values a program copies
INT_BLOCK = 1024  # columns of the step's integers a program copies


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
    copy = _convert_unless_kernel_copies(x, rows)
    dim = rows.shape[1]
    _one_token_kernel[(triton.cdiv(dim, ROW_BLOCK) if copy else 1,)](
        ints, ints.shape[1], position, row, x if copy else rows, rows, dim, COPY=copy, BLOCK=ROW_BLOCK)


@triton.jit(do_not_specialize=["size", "n"])
def _step_kernel(ints, staged, max_tokens, size, x, rows, n, dim, COPY: tl.constexpr, BLOCK: tl.constexpr,
                 INT_BLOCK: tl.constexpr):
    """Programs ``(r, 0)`` copy columns ``r * INT_BLOCK ..`` (below ``size``) of both rows
    of ``staged [2, max_tokens]`` into ``ints``; with ``COPY`` program ``(r, c)``, ``r < n``,
    copies values ``c * BLOCK ..`` of row ``r`` of ``x [n, dim]`` into ``rows``."""
    i_r = tl.program_id(0)
    i_c = tl.program_id(1)
    if i_c == 0:
        o = i_r * INT_BLOCK + tl.arange(0, INT_BLOCK)
        m = o < size
        tl.store(ints + o, tl.load(staged + o, mask=m), mask=m)
        tl.store(ints + max_tokens + o, tl.load(staged + max_tokens + o, mask=m), mask=m)
    if COPY:
        if i_r < n:
            o = i_c * BLOCK + tl.arange(0, BLOCK)
            m = o < dim
            at = i_r.to(tl.int64) * dim
            tl.store(rows + at + o, tl.load(x + at + o, mask=m), mask=m)


def _convert_unless_kernel_copies(x: Optional[Tensor], rows: Tensor) -> bool:
    """Whether the staging kernel is to copy ``x`` into ``rows`` (a bf16 contiguous ``x`` on
    their device); another ``x`` is copied (converted) into ``rows`` by torch here, and
    ``None`` (it is in ``rows`` already) needs no copy."""
    copy = x is not None and x.dtype == torch.bfloat16 and x.is_contiguous() and x.device == rows.device
    if x is not None and not copy:
        rows.copy_(x, non_blocking=True)
    return copy


def stage_step(ints: Tensor, staged: Tensor, size: int, x: Optional[Tensor], rows: Tensor) -> None:
    """Copy the first ``size`` columns (a step padded to its bucket) of both rows of the
    device block ``staged [2, max_tokens]`` into the metadata's integers ``ints`` (int32,
    the same shape), and the step's hidden states ``x [n, dim]`` into the static input
    rows ``rows [n, dim]`` (bf16), ``n <= size``, in one launch. ``x`` ``None``: they are in
    ``rows`` already; an ``x`` of another dtype, layout or device is copied by torch first."""
    n, dim = rows.shape
    if staged.shape != ints.shape or not n <= size <= ints.shape[1]:
        raise ValueError(f"stage_step takes a staged block shaped as ints {list(ints.shape)} and n <= size <= "
                         f"{ints.shape[1]}, got {list(staged.shape)}, n = {n}, size = {size}")
    copy = _convert_unless_kernel_copies(x, rows)
    grid = (max(n if copy else 0, triton.cdiv(size, INT_BLOCK)), triton.cdiv(dim, ROW_BLOCK) if copy else 1)
    _step_kernel[grid](ints, staged, ints.shape[1], size, x if copy else rows, rows, n, dim, COPY=copy,
                       BLOCK=ROW_BLOCK, INT_BLOCK=INT_BLOCK)
