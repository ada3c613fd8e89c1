"""The FP8 block formats of DeepSeek's checkpoints and activations (one quantizer, shared
by the op, the converter and the tests).

Two weight layouts, the two DeepSeek ships (``quantization_config.weight_block_size`` of a
checkpoint's ``config.json``; :data:`LAYOUTS`):

* ``128``: DeepSeek-V3 / V3.2 / V4. Weights ``[N, K]`` float8_e4m3fn with one **fp32**
  scale per 128 x 128 block, ``scale [ceil(N / 128), ceil(K / 128)]``; activations
  quantized per token per 128 values with fp32 scales.
* ``32``: DeepSeek-V4.1. One **ue8m0** scale (``torch.float8_e8m0fnu``: a power of two,
  one byte, ``2 ** (e - 127)``) per 32 x 32 block, ``scale [ceil(N / 32), ceil(K / 32)]``;
  activations per token per 32 values with power-of-two scales.

``w = weight * scale`` in both (DeepSeek names the scale ``<linear>.scale``, Hugging Face
``<linear>.weight_scale_inv``). A scale is ``amax / 448`` of its block (448: the largest
e4m3 value), rounded up to a power of two in the ue8m0 layout (as DeepSeek's
``fast_round_scale``: the next exponent unless the mantissa is zero), and ``1`` for an
all-zero block, so every value rounds to the nearest e4m3 of ``x / scale``: relative
error at most ``2**-4`` of the block's largest magnitude (``2**-3`` with power-of-two
scales, which are up to 2x larger).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

E4M3_MAX = 448.0


@dataclass(frozen=True)
class BlockLayout:
    """One FP8 weight layout: square blocks of ``block`` values, scales stored as
    ``scale_dtype`` (``float32``, or ``float8_e8m0fnu`` for power-of-two scales). A call of
    at most ``weight_only_tokens`` tokens is weight-only: its activations stay bf16 and the
    weight is dequantized in registers, which removes a launch and the activations'
    rounding; past it the activations are quantized per token per block."""

    block: int
    scale_dtype: torch.dtype
    weight_only_tokens: int

    @property
    def power_of_two(self) -> bool:
        return self.scale_dtype == torch.float8_e8m0fnu


# weight-only up to 64 tokens with 128-blocks (past them cuBLAS's blockwise GEMM takes
# over), up to 256 with 32-blocks, whose block-scaled GEMM (one 32-wide dot per scale
# block) is the slower one up to there (docs/ops.md has the figures)
LAYOUTS = {128: BlockLayout(128, torch.float32, 64), 32: BlockLayout(32, torch.float8_e8m0fnu, 256)}
"""The weight layouts by block size: ``128`` (V4, fp32 scales), ``32`` (V4.1, ue8m0)."""

BLOCK = 128
"""The default block (DeepSeek-V4's layout)."""

TILE_N = 128
"""Output columns per tile of the FP8 GEMMs; a group of a grouped projection holds whole tiles."""


def layout_of_block(block) -> BlockLayout:
    """The :data:`LAYOUTS` entry of ``block`` (an int, or a checkpoint's
    ``weight_block_size`` pair), or ``ValueError`` naming the two there are."""
    if isinstance(block, (list, tuple)):
        if len(block) != 2 or block[0] != block[1]:
            raise ValueError(f"weight_block_size must be square, [128, 128] or [32, 32], got {list(block)}")
        block = block[0]
    if isinstance(block, bool) or block not in LAYOUTS:
        raise ValueError(f"FP8 weight blocks must be 128 x 128 with fp32 scales (DeepSeek-V4) or 32 x 32 with ue8m0 "
                         f"scales (DeepSeek-V4.1), got block {block!r}")
    return LAYOUTS[block]


def layout_of_scale(scale: torch.Tensor) -> BlockLayout:
    """The layout a weight scale tensor is in, from its dtype (fp32: 128, float8_e8m0fnu: 32)."""
    for layout in LAYOUTS.values():
        if scale.dtype == layout.scale_dtype:
            return layout
    raise TypeError(f"weight_scale must be float32 (128 x 128 blocks) or float8_e8m0fnu (32 x 32 blocks), "
                    f"got {scale.dtype}")


def _scale(amax: torch.Tensor, power_of_two: bool) -> torch.Tensor:
    # divided by a tensor: CUDA torch multiplies by the reciprocal of a Python number, which
    # can round the scale differently from the CPU and the Triton quantizer
    s = amax / torch.full_like(amax, E4M3_MAX)
    if power_of_two:  # 2 ** ceil(log2(s)) from the bits: exponent + 1 unless the mantissa is 0
        bits = s.view(torch.int32)
        exponent = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
        s = (exponent << 23).view(torch.float32)
    return torch.where(amax > 0, s, torch.ones_like(amax))


def quantize_blocks(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` (any float) -> ``(float8_e4m3fn [N, K], scale [ceil(N/block),
    ceil(K/block)])`` in the layout of ``block`` (fp32 scales for 128, float8_e8m0fnu for 32)."""
    layout = layout_of_block(block)
    N, K = w.shape
    nb, kb = -(-N // block), -(-K // block)
    padded = torch.zeros(nb * block, kb * block, dtype=torch.float32, device=w.device)
    padded[:N, :K] = w.float()
    blocks = padded.view(nb, block, kb, block)
    scale = _scale(blocks.abs().amax(dim=(1, 3)), layout.power_of_two)
    q = (blocks / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(nb * block, kb * block)[:N, :K].contiguous(), scale.to(layout.scale_dtype)


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 ``[N, K]`` of a block-quantized weight (the block from ``scale``'s dtype)."""
    block = layout_of_scale(scale).block
    N, K = q.shape
    rows = scale.float().repeat_interleave(block, dim=0)[:N].repeat_interleave(block, dim=1)[:, :K]
    return q.float() * rows


def quantize_tokens(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> ``(float8_e4m3fn [M, K], fp32 scale [M, ceil(K/block)])``, per token
    per ``block`` values (power-of-two scales for the 32 layout)."""
    layout = layout_of_block(block)
    M, K = x.shape
    kb = -(-K // block)
    xf = x.float()
    if K % block:
        xf = torch.nn.functional.pad(xf, (0, kb * block - K))
    blocks = xf.view(M, kb, block)
    scale = _scale(blocks.abs().amax(dim=-1), layout.power_of_two)
    q = (blocks / scale.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(M, kb * block)[:, :K].contiguous(), scale
