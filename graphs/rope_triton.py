"""The Triton kernel of :func:`graphs.rope.rope_heads` (imported on CUDA only: the package
runs without Triton elsewhere)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from compile_ops._launch import launchable
from compile_ops._triton_quant import to_bf16

HEADS_PER_PROGRAM = 4


@triton.jit
def _rope_heads_kernel(x, cos, sin, out, H, s_xt, s_ct, INVERSE: tl.constexpr, D: tl.constexpr, NOPE: tl.constexpr,
                       HB: tl.constexpr):
    """Program ``(t, j)``: heads ``j * HB ..`` of token ``t``, each ``D`` values rounded to
    bf16; pair ``i`` of the last ``D - NOPE`` (dims ``NOPE + 2i``, ``+ 1``) turned by
    ``cos[t, i]``, ``sin[t, i]`` in fp32, as :func:`graphs.rope.apply_rope` does."""
    i_t, i_j = tl.program_id(0), tl.program_id(1)
    o_h = i_j * HB + tl.arange(0, HB)
    o_d = tl.arange(0, D)
    m = (o_h < H)[:, None] & (o_d < D)[None, :]
    row = x + i_t.to(tl.int64) * s_xt + o_h[:, None] * D
    # (rounded to nearest even by its bits: the interpreter's casts truncate)
    v = to_bf16(tl.load(row + o_d[None, :], mask=m, other=0.0).to(tl.float32)).to(tl.float32)
    rot = o_d >= NOPE
    # the pair's other value, and the pair's angle
    w = to_bf16(tl.load(row + (o_d ^ 1)[None, :], mask=m & rot[None, :], other=0.0).to(tl.float32)).to(tl.float32)
    i_p = tl.where(rot, (o_d - NOPE) // 2, 0)
    c = tl.load(cos + i_t.to(tl.int64) * s_ct + i_p, mask=rot, other=1.0)
    s = tl.load(sin + i_t.to(tl.int64) * s_ct + i_p, mask=rot, other=0.0)
    # (even, odd) -> (even c - odd s, odd c + even s); the inverse turns by -s
    sign = tl.where((o_d % 2 == 0) != INVERSE, -1.0, 1.0)
    y = v * c[None, :] + (w * sign[None, :]) * s[None, :]
    y = tl.where(rot[None, :], y, v)
    tl.store(out + i_t.to(tl.int64) * H * D + o_h[:, None] * D + o_d[None, :], to_bf16(y), mask=m)


def rope_heads_triton(x: Tensor, cos: Tensor, sin: Tensor, head_dim: int, inverse: bool = False) -> Tensor:
    """:func:`rope_heads` as one Triton launch (CUDA tensors, or CPU ones in Triton's interpreter)."""
    T, width = x.shape
    H, P = width // head_dim, cos.shape[1]
    out = torch.empty(T, H, head_dim, dtype=torch.bfloat16, device=x.device)
    if T:
        launchable(_rope_heads_kernel, x)[(T, triton.cdiv(H, HEADS_PER_PROGRAM))](
            x, cos, sin, out, H, x.stride(0), cos.stride(0), INVERSE=inverse, D=head_dim, NOPE=head_dim - 2 * P,
            HB=HEADS_PER_PROGRAM)
    return out
