"""DeepSeek-V4 checkpoints by their real names: a layer's attention weights and its config.

A checkpoint ships in one of two namings, and :func:`load_attention_weights` reads both:

* DeepSeek's own (``inference/model.py``): ``layers.{N}.attn.<name>``, where ``<name>`` is
  this package's parameter name (``wq_a.weight``, ``q_norm.weight``, ``attn_sink``,
  ``compressor.ape``, ``indexer.compressor.wkv.weight``, ..., FP8 scales ``<linear>.scale``);
* Hugging Face transformers' (``DeepseekV4Attention``): ``model.layers.{N}.self_attn.<hf>``,
  with the renames of transformers' ``conversion_mapping`` (:func:`hf_name`): ``wq_a ->
  q_a_proj``, ``q_norm -> q_a_norm``, ``wq_b -> q_b_proj``, ``wkv -> kv_proj``, ``wgate ->
  gate_proj``, ``wo_a -> o_a_proj``, ``wo_b -> o_b_proj``, a compressor's ``norm ->
  kv_norm`` and ``ape -> position_bias``, ``attn_sink -> sinks``, the indexer under the
  compressor (``indexer.compressor.* -> compressor.indexer.*``, ``indexer.wq_b ->
  compressor.indexer.q_b_proj``, ``indexer.weights_proj ->
  compressor.indexer.scorer.weights_proj``) and FP8 scales ``<linear>.weight_scale_inv``.

Loading is strict: every parameter of the layer must be there with its DCP=1 shape (the
config's), and every key under the layer's prefix must be one of the layer's; the error
names each missing, unexpected and misshapen key. A checkpoint is a mapping of names to
tensors, or a folder of ``*.safetensors`` files (read lazily: only the layer's keys).

Example::

    >>> import torch
    >>> from graphs import CacheConfig, DSV41Attention, TINY
    >>> from graphs.checkpoint import hf_name, load_attention_weights
    >>> src = DSV41Attention(TINY, CacheConfig(2, 4, 32, 4), 2, seed=1)
    >>> ckpt = {f"model.layers.3.self_attn.{hf_name(k)}": v for k, v in src.state_dict().items()}
    >>> dst = DSV41Attention(TINY, CacheConfig(2, 4, 32, 4), 2)
    >>> load_attention_weights(dst, ckpt, layer_id=3)
    'hf'
    >>> torch.equal(dst.wq_a.weight, src.wq_a.weight)
    True
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Mapping, Optional, Union

import torch
from torch import Tensor

NAMINGS = ("deepseek", "hf")
_HF_MODULES = {"wq_a": "q_a_proj", "q_norm": "q_a_norm", "wq_b": "q_b_proj", "wkv": "kv_proj", "wgate": "gate_proj",
               "wo_a": "o_a_proj", "wo_b": "o_b_proj"}
_HF_LEAVES = {"attn_sink": "sinks", "ape": "position_bias", "scale": "weight_scale_inv"}

Checkpoint = Union[Mapping[str, Tensor], str, os.PathLike]


def hf_name(name: str) -> str:
    """Hugging Face's name (under ``self_attn.``) of the layer parameter ``name``."""
    parts = name.split(".")
    if parts[0] == "indexer":  # HF nests the indexer in the compressor, its head weights in a scorer
        parts = ["compressor", "indexer"] + (["scorer"] if parts[1] == "weights_proj" else []) + \
                (parts[2:] if parts[1] == "compressor" else parts[1:])
    in_compressor = parts[0] == "compressor"
    out = []
    for i, p in enumerate(parts):
        last = i == len(parts) - 1
        if last and p in _HF_LEAVES:
            out.append(_HF_LEAVES[p])
        elif not last and p == "norm" and in_compressor:
            out.append("kv_norm")
        elif not last:
            out.append(_HF_MODULES.get(p, p))
        else:
            out.append(p)
    return ".".join(out)


def layer_prefix(layer_id: int, naming: str) -> str:
    """The key prefix of layer ``layer_id``'s attention in a checkpoint of ``naming``."""
    if naming not in NAMINGS:
        raise ValueError(f"naming must be one of {NAMINGS} (or 'auto'), got {naming!r}")
    return f"layers.{layer_id}.attn." if naming == "deepseek" else f"model.layers.{layer_id}.self_attn."


class _SafetensorsFolder(Mapping):
    """The tensors of a folder of ``*.safetensors`` files, by name, opened on access."""

    def __init__(self, folder: Path) -> None:
        from safetensors import safe_open

        self._open = safe_open
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {folder}")
        self._where: dict[str, Path] = {}
        for f in files:
            with safe_open(f, "pt") as handle:
                self._where.update(dict.fromkeys(handle.keys(), f))

    def __getitem__(self, key: str) -> Tensor:
        with self._open(self._where[key], "pt") as handle:
            return handle.get_tensor(key)

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def open_checkpoint(checkpoint: Checkpoint) -> Mapping[str, Tensor]:
    """A mapping of names to tensors: ``checkpoint`` itself, or the ``*.safetensors`` of a folder."""
    if isinstance(checkpoint, (str, os.PathLike)):
        folder = Path(checkpoint)
        if not folder.is_dir():
            raise FileNotFoundError(f"checkpoint folder {folder} does not exist")
        return _SafetensorsFolder(folder)
    if not isinstance(checkpoint, Mapping):
        raise TypeError(f"checkpoint must be a mapping of names to tensors or a folder, got {type(checkpoint).__name__}")
    return checkpoint


def detect_naming(keys, layer_id: int) -> str:
    """``"deepseek"`` or ``"hf"``: the naming whose prefix of layer ``layer_id`` the keys have."""
    found = [n for n in NAMINGS if any(k.startswith(layer_prefix(layer_id, n)) for k in keys)]
    if len(found) != 1:
        raise ValueError(f"the checkpoint has {'no' if not found else 'both'} attention keys of layer {layer_id} "
                         f"({' / '.join(layer_prefix(layer_id, n) + '*' for n in NAMINGS)})")
    return found[0]


_FP8 = (torch.float8_e4m3fn, torch.float8_e8m0fnu)


def _dtype_fits(name: str, value: Tensor, p: Tensor) -> bool:
    """FP8 weights and scales load as they are (the scale's dtype is the block layout's);
    everything else is a float the copy converts."""
    if p.dtype in _FP8 or name.endswith(".scale"):
        return value.dtype == p.dtype
    return value.is_floating_point() and value.dtype not in _FP8


def load_attention_weights(layer, checkpoint: Checkpoint, layer_id: int, naming: str = "auto") -> str:
    """Load layer ``layer_id``'s attention weights of ``checkpoint`` into ``layer`` (a
    :class:`graphs.DSV41Attention`), strictly; returns the naming it read.

    Args:
        layer: the layer; its config fixes every shape (build it from the checkpoint's
            ``config.json``: :meth:`graphs.AttentionConfig.from_hf_config`, and with
            ``weights="fp8"`` for an FP8 checkpoint). Under DCP each rank takes its shard.
        checkpoint: names -> tensors (a state dict, ``safetensors.torch.load_file``'s
            result), or a folder of ``*.safetensors`` shards.
        layer_id: the layer's index in the model (``layers.{layer_id}.``).
        naming: ``"deepseek"``, ``"hf"`` or ``"auto"`` (from the keys).

    Raises ``ValueError`` naming every missing, unexpected or misshapen key, and a key whose
    dtype the layer cannot hold (an FP8 weight for a bf16 layer, a scale of the other block
    layout).
    """
    ckpt = open_checkpoint(checkpoint)
    if naming == "auto":
        naming = detect_naming(ckpt.keys(), layer_id)
    prefix = layer_prefix(layer_id, naming)
    ours = dict(layer.named_parameters())
    by_name = {prefix + (name if naming == "deepseek" else hf_name(name)): name for name in ours}
    present = [k for k in ckpt.keys() if k.startswith(prefix)]
    missing = sorted(k for k in by_name if k not in ckpt)
    unexpected = sorted(k for k in present if k not in by_name)
    state, wrong = {}, []
    for key, name in by_name.items():
        if key in missing:
            continue
        value, p = ckpt[key], ours[name]
        want = layer.full_shape(name, p)
        if tuple(value.shape) != want:
            wrong.append(f"{key}: shape {list(value.shape)}, the config gives {list(want)}")
        elif not _dtype_fits(name, value, p):
            wrong.append(f"{key}: dtype {value.dtype}, the layer holds {p.dtype}"
                         + (" (an FP8 checkpoint: build the layer with weights='fp8' and the checkpoint's "
                            "weight_block)" if value.dtype == torch.float8_e4m3fn else ""))
        else:
            state[name] = value
    if missing or unexpected or wrong:
        lines = [f"missing: {k}" for k in missing] + [f"unexpected: {k}" for k in unexpected] + wrong
        raise ValueError(f"layer {layer_id}'s attention weights ({naming} naming, prefix {prefix!r}) do not fit the "
                         f"layer ({layer.extra_repr()}):\n  " + "\n  ".join(lines))
    layer.load_state_dict(state, strict=True)
    return naming


def read_config(config: Union[Mapping, str, os.PathLike]) -> dict:
    """A checkpoint's ``config.json`` as a dict: ``config`` itself, a file, or a folder holding one."""
    if isinstance(config, Mapping):
        return dict(config)
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json at {path}")
    return json.loads(path.read_text())


def layer_ratios(config: Union[Mapping, str, os.PathLike]) -> list[int]:
    """Each layer's compress ratio from a ``config.json`` (``compress_ratios``, or
    transformers' ``layer_types`` with ``compress_rates``)."""
    c = read_config(config)
    if "compress_ratios" in c:
        return [int(r) for r in c["compress_ratios"]]
    if "layer_types" in c:
        rates = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128,
                 **(c.get("compress_rates") or {})}
        unknown = sorted(set(c["layer_types"]) - set(rates))
        if unknown:
            raise ValueError(f"config layer_types has types without a compress rate: {unknown}")
        return [0 if t == "sliding_attention" else int(rates[t]) for t in c["layer_types"]]
    raise ValueError("config.json has neither compress_ratios nor layer_types: which layer compresses is unknown")


def checkpoint_weights(config: Union[Mapping, str, os.PathLike]) -> str:
    """``"fp8"`` when the ``config.json`` declares FP8 weights (``quantization_config`` of
    ``quant_method`` ``"fp8"``, or DeepSeek's ``"dtype": "fp8"``), else ``"bf16"``."""
    c = read_config(config)
    quant: Optional[dict] = c.get("quantization_config")
    if quant is not None:
        if quant.get("quant_method", "fp8") != "fp8":
            raise ValueError(f"only FP8 checkpoints load, got quantization_config.quant_method "
                             f"{quant.get('quant_method')!r}")
        return "fp8"
    return "fp8" if c.get("dtype") == "fp8" else "bf16"
