"""The FP8 block formats of DeepSeek's checkpoints and activations (one quantizer, shared
by the op, the converter and the tests).

* Weights ``[N, K]`` float8_e4m3fn with one fp32 scale per 128 x 128 block, ``scale
  [ceil(N / 128), ceil(K / 128)]``: ``w = weight * scale`` (DeepSeek names the scale
  ``<linear>.scale``, Hugging Face ``<linear>.weight_scale_inv``).
* Activations ``[M, K]`` quantized per token per 128 values (1 x 128), scale ``[M,
  ceil(K / 128)]`` fp32.

A scale is ``amax / 448`` of its block (448: the largest e4m3 value), ``1`` for an all-zero
block, so every value rounds to the nearest e4m3 of ``x / scale``: relative error at most
``2**-4`` of the block's largest magnitude.
"""

from __future__ import annotations

import torch

BLOCK = 128
E4M3_MAX = 448.0


def _scale(amax: torch.Tensor) -> torch.Tensor:
    # divided by a tensor: CUDA torch multiplies by the reciprocal of a Python number, which
    # can round the scale differently from the CPU and the Triton quantizer
    return torch.where(amax > 0, amax / torch.full_like(amax, E4M3_MAX), torch.ones_like(amax))


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` (any float) -> ``(float8_e4m3fn [N, K], fp32 scale [ceil(N/128), ceil(K/128)])``."""
    N, K = w.shape
    nb, kb = -(-N // BLOCK), -(-K // BLOCK)
    padded = torch.zeros(nb * BLOCK, kb * BLOCK, dtype=torch.float32, device=w.device)
    padded[:N, :K] = w.float()
    blocks = padded.view(nb, BLOCK, kb, BLOCK)
    scale = _scale(blocks.abs().amax(dim=(1, 3)))
    q = (blocks / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(nb * BLOCK, kb * BLOCK)[:N, :K].contiguous(), scale


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 ``[N, K]`` of a block-quantized weight."""
    N, K = q.shape
    rows = scale.repeat_interleave(BLOCK, dim=0)[:N].repeat_interleave(BLOCK, dim=1)[:, :K]
    return q.float() * rows


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> ``(float8_e4m3fn [M, K], fp32 scale [M, ceil(K/128)])``, per token per 128."""
    M, K = x.shape
    kb = -(-K // BLOCK)
    xf = x.float()
    if K % BLOCK:
        xf = torch.nn.functional.pad(xf, (0, kb * BLOCK - K))
    blocks = xf.view(M, kb, BLOCK)
    scale = _scale(blocks.abs().amax(dim=-1))
    q = (blocks / scale.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(M, kb * BLOCK)[:, :K].contiguous(), scale
