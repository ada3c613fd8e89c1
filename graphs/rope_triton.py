"""The Triton kernel of :func:`graphs.rope.rope_heads_` (imported on CUDA only: the package
runs without Triton elsewhere)."""

from __future__ import annotations

from typing import Optional

import triton
import triton.language as tl
from torch import Tensor

from compile_ops._launch import launchable
from compile_ops._triton_quant import to_bf16

HEADS_PER_PROGRAM = 16  # of 64 turned dims each: 2 KB of a token's heads a program


@triton.jit
def _rope_heads_kernel(x, cos, sin, pos, H, S, s_xt, s_ct, INVERSE: tl.constexpr, D: tl.constexpr,
                       NOPE: tl.constexpr, HB: tl.constexpr, AT_POSITIONS: tl.constexpr):
    """Program ``(t, j)``: heads ``j * HB ..`` of token ``t`` in place, dims ``NOPE .. D - 1``
    (pair ``i``: dims ``NOPE + 2i``, ``+ 1``) turned by ``cos[r, i]``, ``sin[r, i]`` in fp32,
    as :func:`graphs.rope.apply_rope` does, then rounded to bf16; ``r`` is ``t``, or with
    ``AT_POSITIONS`` ``pos[t]`` clamped to the tables' ``S`` rows."""
    i_t, i_j = tl.program_id(0), tl.program_id(1)
    if AT_POSITIONS:
        r = tl.minimum(tl.maximum(tl.load(pos + i_t).to(tl.int64), 0), S - 1)
    else:
        r = i_t.to(tl.int64)
    o_h = i_j * HB + tl.arange(0, HB)
    o_d = NOPE + tl.arange(0, D - NOPE)
    m = (o_h < H)[:, None]
    row = x + i_t.to(tl.int64) * s_xt + o_h[:, None] * D
    v = tl.load(row + o_d[None, :], mask=m, other=0.0).to(tl.float32)
    w = tl.load(row + (o_d ^ 1)[None, :], mask=m, other=0.0).to(tl.float32)  # the pair's other value
    i_p = (o_d - NOPE) // 2
    c = tl.load(cos + r * s_ct + i_p)
    s = tl.load(sin + r * s_ct + i_p)
    # (even, odd) -> (even c - odd s, odd c + even s); the inverse turns by -s
    sign = tl.where((o_d % 2 == 0) != INVERSE, -1.0, 1.0)
    y = v * c[None, :] + (w * sign[None, :]) * s[None, :]
    tl.debug_barrier()  # every lane has read its pair's other value before any overwrites it
    # (rounded to nearest even by its bits: the interpreter's casts truncate)
    tl.store(row + o_d[None, :], to_bf16(y), mask=m)


def rope_heads_triton(x: Tensor, cos: Tensor, sin: Tensor, head_dim: int, inverse: bool = False,
                      positions: Optional[Tensor] = None) -> None:
    """:func:`graphs.rope.rope_heads_` as one Triton launch (CUDA tensors, or CPU ones in Triton's
    interpreter)."""
    T, H, P = x.shape[0], x.shape[1] // head_dim, cos.shape[1]
    if T:
        launchable(_rope_heads_kernel, x)[(T, triton.cdiv(H, HEADS_PER_PROGRAM))](
            x, cos, sin, x if positions is None else positions, H, cos.shape[0], x.stride(0), cos.stride(0),
            INVERSE=inverse, D=head_dim, NOPE=head_dim - 2 * P, HB=HEADS_PER_PROGRAM,
            AT_POSITIONS=positions is not None)
