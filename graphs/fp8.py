"""DeepSeek's FP8 checkpoints in the attention layer: block-scaled FP8 linears, a converter.

DeepSeek's V3 / V3.2 / V4 checkpoints store the attention projections as float8_e4m3fn
weights with one fp32 scale per 128 x 128 block, V4.1's with one ue8m0 scale per 32 x 32
block (``compile_ops.linear.quant``; a checkpoint's ``quantization_config.weight_block_size``
says which, :attr:`graphs.AttentionConfig.weight_block` holds it), named ``<linear>.scale``
in DeepSeek's inference code and ``<linear>.weight_scale_inv`` in Hugging Face
checkpoints. :class:`Fp8Linear` holds such a weight and runs ``dsv41::fp8_linear``
(activations quantized per token per block); it loads either naming. Which projections are FP8 follows DeepSeek's reference (:data:`FP8_LINEARS`):
``wq_a``, ``wq_b``, ``wkv``, ``wo_a``, ``wo_b`` and ``indexer.wq_b``; ``indexer.weights_proj``
stays bf16 and the compressors' ``wkv`` / ``wgate`` fp32, the norms and ``attn_sink`` fp32.

:func:`to_fp8_state_dict` turns a bf16 state dict into that format (for tests and users
without a checkpoint) with the same quantizer; :func:`dequantized_state_dict` goes back.

Example::

    >>> import torch
    >>> from graphs import CacheConfig, DSV41Attention, TINY
    >>> from graphs.fp8 import to_fp8_state_dict
    >>> from dataclasses import replace
    >>> cfg = replace(TINY, o_lora_rank=128)
    >>> bf16 = DSV41Attention(cfg, CacheConfig(2, 4, 32, 4), 2)
    >>> fp8 = DSV41Attention(cfg, CacheConfig(2, 4, 32, 4), 2, weights="fp8")
    >>> fp8.load_state_dict(to_fp8_state_dict(bf16.state_dict(), naming="hf"))
    <All keys matched successfully>
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from compile_ops.linear import BLOCK, dequantize_blocks, fp8_linear, layout_of_block, quantize_blocks

FP8_LINEARS = ("wq_a", "wq_b", "wkv", "wo_a", "wo_b", "indexer.wq_b")
"""The projections an FP8 checkpoint stores in FP8 (DeepSeek's reference; module paths)."""

SCALE_NAMES = {"deepseek": "scale", "hf": "weight_scale_inv"}
# The FP8 layer's outputs may differ from the bf16 layer with the dequantized weights by
# this much of the largest |y|: each of the five FP8 GEMMs on a token's path rounds its
# input to e4m3 per block (up to 2**-4 relative each; 2**-3 with power-of-two scales).
FP8_WEIGHTS_REL_TOL = 0.15


class Fp8Linear(nn.Module):
    """``y = x W^T`` with ``W`` block-scaled FP8: ``weight [out, in]`` float8_e4m3fn and
    ``scale [ceil(out/block), ceil(in/block)]`` (fp32 for ``block`` 128, float8_e8m0fnu for
    32; ``W = weight * scale``). ``forward(x [..., in])`` -> bf16 ``[..., out]`` through
    ``dsv41::fp8_linear``. ``load_state_dict`` also takes the scale under Hugging Face's
    name ``weight_scale_inv``."""

    def __init__(self, in_features: int, out_features: int, device=None, block: int = BLOCK) -> None:
        super().__init__()
        layout = layout_of_block(block)
        self.in_features, self.out_features, self.block = in_features, out_features, block
        self.weight = nn.Parameter(torch.zeros(out_features, in_features, device=device).to(torch.float8_e4m3fn),
                                   requires_grad=False)
        scale = torch.ones(-(-out_features // block), -(-in_features // block), device=device)
        self.scale = nn.Parameter(scale.to(layout.scale_dtype), requires_grad=False)
        self._register_load_state_dict_pre_hook(_rename_hf_scale)

    def forward(self, x: Tensor) -> Tensor:
        y = fp8_linear(x.reshape(-1, self.in_features), self.weight, self.scale)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 {self.block}x{self.block} blocks"


def _rename_hf_scale(state_dict, prefix, *args) -> None:
    hf = prefix + SCALE_NAMES["hf"]
    if hf in state_dict:
        state_dict[prefix + "scale"] = state_dict.pop(hf)


def _is_fp8_weight(key: str) -> bool:
    """Whether ``key`` (the layer's own key, or one under a model's prefix) is the weight of
    one of :data:`FP8_LINEARS` (the compressors' fp32 ``wkv`` is not)."""
    if key.endswith("compressor.wkv.weight"):
        return False
    return any(key == f"{name}.weight" or key.endswith(f".{name}.weight") for name in FP8_LINEARS)


def to_fp8_state_dict(state_dict: dict[str, Tensor], naming: str = "deepseek", block: int = BLOCK) -> dict[str, Tensor]:
    """A bf16 attention state dict with every :data:`FP8_LINEARS` weight quantized to
    ``block`` x ``block`` blocks (``compile_ops.linear.quantize_blocks``: 128 with fp32
    scales, 32 with ue8m0) and its scale added as ``<linear>.scale`` (``naming="deepseek"``)
    or ``<linear>.weight_scale_inv`` (``"hf"``)."""
    if naming not in SCALE_NAMES:
        raise ValueError(f"naming must be one of {sorted(SCALE_NAMES)}, got {naming!r}")
    out = {}
    for key, value in state_dict.items():
        if _is_fp8_weight(key):
            q, scale = quantize_blocks(value, block)
            out[key] = q
            out[key[: -len("weight")] + SCALE_NAMES[naming]] = scale
        else:
            out[key] = value
    return out


def dequantized_state_dict(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """The bf16 state dict of an FP8 one (either naming): each FP8 weight times its scale."""
    out = {}
    for key, value in state_dict.items():
        if key.endswith(tuple(SCALE_NAMES.values())):
            continue
        if value.dtype == torch.float8_e4m3fn:
            stem = key[: -len("weight")]
            scale = state_dict.get(stem + "scale", state_dict.get(stem + SCALE_NAMES["hf"]))
            value = dequantize_blocks(value, scale).to(torch.bfloat16)
        out[key] = value
    return out
