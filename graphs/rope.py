"""Interleaved (GPT-J) rotary embedding with DeepSeek's YaRN frequency table.

Dims ``2i`` and ``2i + 1`` of the rotated slice form pair ``i`` and turn by angle
``position * freq[i]``. Tables are plain ``cos`` / ``sin`` buffers ``[max_seq_len, rope/2]``
(no complex numbers, so Inductor fuses the rotation), looked up by position; padding
tokens (position ``-1``) read row 0 and their results are never used.

:func:`rope_heads_` is the rotation of the attention heads' last dims in place as one op
(``graphs::rope_heads_``, a Triton kernel on CUDA, :mod:`graphs.rope_triton`): Inductor
tunes its own fused kernel of the same rotation once, at the size-1 trace of a
dynamic-token step, and that choice for one token then serves every step size.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor


def yarn_inv_freq(dim: int, original_seq_len: int, base: float, factor: float, beta_fast: int,
                  beta_slow: int) -> torch.Tensor:
    """Inverse frequencies ``[dim // 2]`` fp32 of base ``base``, YaRN-interpolated whenever
    ``original_seq_len > 0`` (DeepSeek-V4's ``precompute_freqs_cis``: V4 applies YaRN
    regardless of the context a cache is sized for, unlike V3, which applied it only past
    ``original_seq_len``); pair ``i`` keeps ``base ** (-2i / dim)`` below the ramp, is
    divided by ``factor`` above it."""
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if original_seq_len > 0:
        def correction_dim(rotations: float) -> float:
            return dim * math.log(original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(correction_dim(beta_fast)), 0)
        high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0, 1)
        inv = inv / factor * ramp + inv * (1 - ramp)
    return inv.float()


def layer_inv_freq(cfg, compress_ratio: int) -> torch.Tensor:
    """The RoPE frequencies of a layer (DeepSeek-V4's rule): a compressed layer (``ratio >
    0``: its q, kv, compressor and indexer alike) uses ``cfg.compress_rope_theta`` with
    YaRN (``cfg.rope_factor``, ``cfg.original_seq_len``, ``cfg.beta_fast`` /
    ``beta_slow``); a sliding-only layer uses plain ``cfg.rope_theta``. ``cfg`` is a
    :class:`graphs.AttentionConfig`."""
    if compress_ratio:
        return yarn_inv_freq(cfg.rope_head_dim, cfg.original_seq_len, cfg.compress_rope_theta, cfg.rope_factor,
                             cfg.beta_fast, cfg.beta_slow)
    return yarn_inv_freq(cfg.rope_head_dim, 0, cfg.rope_theta, 1.0, 0, 0)


def rope_tables(inv_freq: torch.Tensor, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``[max_seq_len, len(inv_freq)]`` fp32."""
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq.double())
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate ``x [T, ..., 2P]`` by per-token tables ``cos, sin [T, P]``; fp32 math, ``x``'s dtype out.

    ``inverse=True`` turns the other way (undoes the rotation).
    """
    shape = x.shape
    pairs = x.float().reshape(shape[0], -1, shape[-1] // 2, 2)
    c = cos.view(shape[0], 1, -1, 1)
    s = sin.view(shape[0], 1, -1, 1)
    # (even, odd) -> (even c - odd s, odd c + even s): one elementwise expression over the
    # pairs and their swapped copy (-odd, even), no stack of halves
    swapped = torch.cat([-pairs[..., 1:], pairs[..., :1]], dim=-1)
    out = pairs * c + swapped * (-s if inverse else s)
    return out.reshape(shape).to(x.dtype)


def apply_rope_last(x: Tensor, rope_dim: int, cos: Tensor, sin: Tensor, inverse: bool = False) -> Tensor:
    """``x`` with :func:`apply_rope` on its last ``rope_dim`` dims."""
    nope = x.shape[-1] - rope_dim
    return torch.cat([x[..., :nope], apply_rope(x[..., nope:], cos, sin, inverse)], dim=-1)


@torch.library.custom_op("graphs::rope_heads_", mutates_args=("x",))
def rope_heads_(x: Tensor, cos: Tensor, sin: Tensor, head_dim: int, inverse: bool = False,
                positions: Optional[Tensor] = None) -> None:
    """The last ``2P`` dims of each head of ``x [T, H * head_dim]`` (bf16, rows of any stride,
    unit column stride; ``2P`` a power of two) turned in place by ``cos, sin [T, P]`` fp32
    in fp32 (``inverse``: the other way), back to bf16: ``apply_rope_last`` of
    ``x.float().view(T, H, head_dim)``, rounded to bf16. The other dims are not read or
    written, so the op moves ``2P / head_dim`` of the bytes a rotated copy of the heads
    would (V4.1's q and attention output: 64 of 512 dims).

    ``positions [T]`` int32 / int64: ``cos, sin`` are tables ``[S, P]`` and token ``t``
    turns by their row ``positions[t]``, clamped to ``0 .. S - 1`` (padding's ``-1`` reads
    row 0), looked up inside the op's kernel."""
    rope = _check_heads(x, cos, sin, head_dim, positions)
    if x.is_cuda:
        from graphs.rope_triton import rope_heads_triton

        rope_heads_triton(x, cos.contiguous(), sin.contiguous(), head_dim, inverse, positions)
        return
    if positions is not None:
        rows = positions.long().clamp(0, cos.shape[0] - 1)
        cos, sin = cos[rows], sin[rows]
    heads = x.view(x.shape[0], -1, head_dim)[..., head_dim - rope:]  # (a view of x: written in place)
    heads.copy_(apply_rope(heads.float(), cos, sin, inverse))


@rope_heads_.register_fake
def _(x, cos, sin, head_dim, inverse=False, positions=None):
    _check_heads(x, cos, sin, head_dim, positions)


def _check_heads(x: Tensor, cos: Tensor, sin: Tensor, head_dim: int, positions: Optional[Tensor] = None) -> int:
    """:func:`rope_heads_`'s checks; returns ``2P``, the turned dims of a head."""
    if x.dim() != 2 or x.dtype != torch.bfloat16 or x.stride(1) != 1:
        raise ValueError(f"x must be [T, H * head_dim] bf16 with unit column stride, got {x.dtype} "
                         f"{list(x.shape)} stride {x.stride()}")
    if x.shape[1] % head_dim or head_dim & (head_dim - 1):
        raise ValueError(f"x's width {x.shape[1]} must be whole heads of a power-of-two head_dim, got {head_dim}")
    if positions is not None and (positions.shape != (x.shape[0],) or positions.dtype not in (torch.int32, torch.int64)
                                  or positions.device != x.device):
        raise ValueError(f"positions must be [T] int32 or int64 with T = {x.shape[0]} on x's device {x.device}, "
                         f"got {positions.dtype} {list(positions.shape)} on {positions.device}")
    if cos.shape != sin.shape or cos.dim() != 2 or 2 * cos.shape[1] > head_dim \
            or (cos.shape[0] != x.shape[0] if positions is None else not cos.shape[0]):
        want = "[T, P] with T = " + str(x.shape[0]) if positions is None else "tables [S, P] with S >= 1"
        raise ValueError(f"cos and sin must be {want} and 2P <= head_dim = {head_dim}, got "
                         f"{list(cos.shape)} and {list(sin.shape)}")
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError(f"cos and sin must be fp32, got {cos.dtype} and {sin.dtype}")
    if cos.device != x.device or sin.device != x.device:
        raise ValueError(f"cos and sin must be on x's device {x.device}, got {cos.device} and {sin.device}")
    rope = 2 * cos.shape[1]
    if rope & (rope - 1):
        raise ValueError(f"the turned dims 2P must be a power of two, got {rope}")
    return rope
