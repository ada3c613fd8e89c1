"""Projections that read the same input, as one GEMM over their stacked weights.

A decode step of one token reads each weight once, so its time is the weights' bytes over
the bandwidth, plus a fixed cost per GEMM that small weights cannot hide (the layer's
``wkv``, ``weights_proj`` and the compressors' few-MB weights run far below the bandwidth
on their own). :func:`stack_rows` stores such weights as consecutive row blocks of one
tensor, and makes each module's weight a view of its block: the modules, their state-dict
names and in-place loading stay as they are, with no second copy of the weights.

:func:`project_beside` runs such a GEMM on a side stream of the device while the current
stream goes on with work that neither reads its output nor writes its input (the layer's
cache writes beside its ``q`` GEMM); :func:`join_beside` makes the current stream wait for
it. A GEMM of a few tokens leaves most SMs idle, and small kernels fill them.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from compile_ops.linear import bf16_linear, fp8_linear
from graphs.rope import _check_heads, rope_heads_


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
    """``x [T, in] @ weight [out, in]^T`` as fp32 ``[T, out]`` with fp32 accumulation
    (:func:`compile_ops.bf16_linear` on CUDA: a GEMV at one token, else cuBLAS's bf16 tensor
    cores; CPU torch has no bf16 x bf16 -> fp32 product: the same sum in fp32)."""
    if x.is_cuda and x.dtype == torch.bfloat16:
        return bf16_linear(x, weight, torch.float32)
    return x.float() @ weight.float().t()


def mm_bf16(x: Tensor, weight: Tensor) -> Tensor:
    """``x [T, in] @ weight [out, in]^T`` as bf16 ``[T, out]`` (:func:`compile_ops.bf16_linear`
    on CUDA: a GEMV at one token)."""
    return bf16_linear(x, weight) if x.is_cuda else x @ weight.t()


def _weights(module: torch.nn.Module, s: StackedRows) -> tuple[Tensor, Optional[Tensor]]:
    return getattr(module, s.weight), None if s.scale is None else getattr(module, s.scale)


def columns(stacks: tuple[StackedRows, ...], ys: list[Tensor]) -> dict[str, Tensor]:
    """``{name: [T, width]}``: each stack's projections as column views of its product ``ys[i]``."""
    out = {}
    for s, y in zip(stacks, ys):
        out.update(zip(s.names, y.split(s.widths, dim=1)))
    return out


def project(module: torch.nn.Module, stacks: tuple[StackedRows, ...], x: Tensor) -> dict[str, Tensor]:
    """Each stacked projection of ``x [T, in]``: ``{name: [T, width]}``, column views of one
    GEMM per stack (fp32 for an ``fp32`` stack, else bf16). Several stacks (an FP8 layer's
    bf16 and FP8 weights of ``x``) run side by side (``graphs::mm_side_by_side``): a decode
    step's GEMVs of a few MB each leave most of the bandwidth idle on their own."""
    weights = [_weights(module, s) for s in stacks]
    if len(stacks) == 1:
        return columns(stacks, [_stack_product(x, *weights[0], stacks[0].fp32)])
    ys = torch.ops.graphs.mm_side_by_side(x, [w for w, _ in weights], [s for _, s in weights],
                                          [s.fp32 for s in stacks])
    return columns(stacks, ys)


def _stack_product(x: Tensor, weight: Tensor, scale: Optional[Tensor], fp32: bool) -> Tensor:
    if scale is not None:
        return fp8_linear(x, weight, scale)
    return mm_fp32(x, weight) if fp32 else mm_bf16(x, weight)


class TurnedHeads(NamedTuple):
    """Heads of a projection that :func:`project_beside` turns after its GEMM: ``name``, the
    first projection of its stack, whose output is heads of ``head_dim`` (bf16, a power of
    two) with their last ``2P`` dims turned by the rows ``positions [T]`` (int32 / int64,
    ``-1`` for padding) of the tables ``cos, sin [S, P]`` fp32
    (:func:`graphs.rope.rope_heads_`). The side stream reads the tables and positions after
    the current stream has gone on: pass the module's tables and the step's input positions,
    never tensors computed in the step (a compiler may hand those buffers to later work)."""

    name: str
    cos: Tensor
    sin: Tensor
    positions: Tensor
    head_dim: int


def project_beside(module: torch.nn.Module, stacks: tuple[StackedRows, ...], x: Tensor,
                   turn: Optional[TurnedHeads] = None) -> list[Tensor]:
    """Each stack's bf16 product with ``x [T, in]`` (``[T, sum of widths]``), computed on
    the device's side stream (:func:`side_stream`) while the current stream goes on: read
    them after :func:`join_beside` (then :func:`columns`). ``turn``: the heads of one
    projection turned in place there too, after its GEMM."""
    names = [s.names[0] for s in stacks]
    if turn is not None and turn.name not in names:
        raise ValueError(f"turn.name must be the first projection of a stack ({names}), got {turn.name!r}")
    ys = []
    for s in stacks:
        if turn is not None and s.names[0] == turn.name:
            ys.append(torch.ops.graphs.mm_beside(x, *_weights(module, s), turn.cos, turn.sin, turn.positions,
                                                 s.widths[0], turn.head_dim))
        else:
            ys.append(torch.ops.graphs.mm_beside(x, *_weights(module, s)))
    return ys


def join_beside(ys: list[Tensor]) -> None:
    """The current stream waits for the side stream's work so far: ``ys``
    (:func:`project_beside`'s products) may be read after this."""
    for y in ys:
        torch.ops.graphs.join_beside(y)


# (outside the modules: a module holding a stream could not be deep-copied)
_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> Optional[torch.cuda.Stream]:
    """The stream that runs :func:`project_beside`'s GEMMs on CUDA ``device`` (one per
    device); ``None`` off CUDA, where they run in order on the current stream."""
    if device.type != "cuda":
        return None
    index = torch.cuda.current_device() if device.index is None else device.index
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(index)
    return _SIDE_STREAMS[index]


@torch.library.custom_op("graphs::mm_beside", mutates_args=())
def mm_beside(x: Tensor, weight: Tensor, scale: Optional[Tensor], cos: Optional[Tensor] = None,
              sin: Optional[Tensor] = None, positions: Optional[Tensor] = None, turned: int = 0,
              head_dim: int = 0) -> Tensor:
    """``x [T, in] @ weight [out, in]^T`` -> bf16 ``[T, out]`` (``scale``: an e4m3 weight's
    block scales, :func:`compile_ops.linear.fp8_linear`), on :func:`side_stream` after the
    work queued so far on the current stream; read it after ``graphs::join_beside``.
    ``turned > 0``: its first ``turned`` columns are heads of ``head_dim``, turned in place
    after the GEMM by the rows ``positions [T]`` of the tables ``cos, sin [S, P]``
    (:func:`graphs.rope.rope_heads_`), on the side stream too (the turn then leaves the path
    of the work beside it). The side stream reads ``x`` (held for it from the allocator)
    and the turn's tables and positions after the op returns: those must not be buffers a
    compiler may reuse within the step (:class:`TurnedHeads`)."""
    _check_turned(weight, cos, sin, positions, turned)
    side = side_stream(x.device)
    if side is None:
        return _turned_product(x, weight, scale, cos, sin, positions, turned, head_dim)
    main = torch.cuda.current_stream(x.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        y = _turned_product(x, weight, scale, cos, sin, positions, turned, head_dim)
    # neither block is handed out again while the other stream may still use it
    x.record_stream(side)
    y.record_stream(main)
    return y


def _product(x: Tensor, weight: Tensor, scale: Optional[Tensor]) -> Tensor:
    # bf16: cuBLAS's GEMM even at one token, not bf16_linear's GEMV, whose programs fill
    # every SM: the small kernels queued beside it would wait for them
    return x @ weight.t() if scale is None else fp8_linear(x, weight, scale)


def _turned_product(x: Tensor, weight: Tensor, scale: Optional[Tensor], cos: Optional[Tensor],
                    sin: Optional[Tensor], positions: Optional[Tensor], turned: int, head_dim: int) -> Tensor:
    y = _product(x, weight, scale)
    if turned:
        rope_heads_(y[:, :turned], cos, sin, head_dim, positions=positions)
    return y


def _check_turned(weight: Tensor, cos: Optional[Tensor], sin: Optional[Tensor], positions: Optional[Tensor],
                  turned: int) -> None:
    if turned < 0 or turned > weight.shape[0]:
        raise ValueError(f"turned must be 0 .. weight's {weight.shape[0]} rows, got {turned}")
    if turned and (cos is None or sin is None or positions is None):
        raise ValueError("turned columns need the tables cos and sin and the positions")


@mm_beside.register_fake
def _(x, weight, scale, cos=None, sin=None, positions=None, turned=0, head_dim=0):
    _check_turned(weight, cos, sin, positions, turned)
    y = x.new_empty(x.shape[0], weight.shape[0], dtype=torch.bfloat16)
    if turned:  # the turn's own checks, as the op's rope_heads_ makes them
        _check_heads(y[:, :turned], cos, sin, head_dim, positions)
    return y


@torch.library.custom_op("graphs::mm_side_by_side", mutates_args=())
def mm_side_by_side(x: Tensor, weights: list[Tensor], scales: list[Optional[Tensor]],
                    fp32: list[bool]) -> list[Tensor]:
    """Each ``x [T, in] @ weights[i] [out_i, in]^T`` -> ``[T, out_i]`` (fp32 where ``fp32[i]``,
    a bf16 weight only; else bf16; ``scales[i]``: an e4m3 weight's block scales): the last
    on the current stream, the others on :func:`side_stream` beside it; the current stream
    waits for them before the op returns. Inside one op, so that the compiler cannot queue
    the last product before the others' launch."""
    side = side_stream(x.device)
    if side is None:
        return [_stack_product(x, w, s, f) for w, s, f in zip(weights, scales, fp32)]
    main = torch.cuda.current_stream(x.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        ys = [_stack_product(x, w, s, f) for w, s, f in zip(weights[:-1], scales[:-1], fp32[:-1])]
    ys.append(_stack_product(x, weights[-1], scales[-1], fp32[-1]))
    main.wait_stream(side)
    # neither block is handed out again while the other stream may still use it
    x.record_stream(side)
    for y in ys[:-1]:
        y.record_stream(main)
    return ys


@mm_side_by_side.register_fake
def _(x, weights, scales, fp32):
    return [x.new_empty(x.shape[0], w.shape[0], dtype=torch.float32 if f else torch.bfloat16)
            for w, f in zip(weights, fp32)]


@torch.library.custom_op("graphs::join_beside", mutates_args=("y",))
def _join_beside(y: Tensor) -> None:
    # (``y`` counts as written here, so that its readers come after the wait)
    side = side_stream(y.device)
    if side is not None:
        torch.cuda.current_stream(y.device).wait_stream(side)


@_join_beside.register_fake
def _(y):
    return None
