"""A stack of DeepSeek-V4 / V4.1 attention layers, sharing what the layer plan says they share.

:class:`DSV41Stack` builds the layers of a :class:`graphs.LayerPlan` (all of them, or a
slice that keeps every layer a chosen layer reads from) with the residual stream between
them, and runs one serving step of every layer in one ``forward``:

* each **kv source** owns its compressed cache and index keys, each **index source** its
  top-k buffer, the **candidate source** its candidate blocks; they are buffers of the
  stack's modules, each held once, and every later layer reads the most recent source's
  (:class:`graphs.Shared`) inside the same graph: nothing lives in a Python-side singleton;
* the step's inputs are derived once per geometry (one per compress ratio: its slot
  mapping, rows, entry counts; the SWA slots and indices once for all) by
  :meth:`graphs.StepMetadata.all_inputs`, and every layer of that ratio reads them: a
  layer's ``forward`` only computes;
* the layers of one ratio address their caches through one compressed block table (each
  kv source holds its own pages of the same page ids): one page plan per step.

The residual stream is a stand-in for the model around attention: block ``l`` computes
``h = h + attn_l(attn_norm_l(h))`` in fp32, then ``h = h + ffn_l(h)`` where ``ffn_l`` is
a module you pass (default none: DeepSeek's MoE and its multi-stream hyper-connections,
mHC, are not part of this package). The attention inputs therefore change from layer to
layer, as they do in the model, so each layer's compressor, indexer and projections see
their own inputs.

Example::

    >>> import torch
    >>> from graphs import CacheConfig, DSV41Stack, StepRunner, TINY_V41, LayerPlan
    >>> plan = LayerPlan.from_lists([0, 2, 2, 1, 1, 1], kv_sources=[1, 3], index_sources=[1, 3, 5],
    ...                             candidate_source=3, candidate_topk_blocks=2, candidate_block_size=2)
    >>> stack = DSV41Stack(TINY_V41, CacheConfig(2, 8, 32, 4), plan)
    >>> runner = StepRunner(stack, buckets=(1, 2, 4, 8), compile=False)
    >>> i32 = lambda *v: torch.tensor(v, dtype=torch.int32)
    >>> runner.step(torch.randn(5, TINY_V41.dim, dtype=torch.bfloat16), i32(0, 1, 2, 3, 0), i32(0, 0, 0, 0, 1)).shape
    torch.Size([5, 64])
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from graphs.attention import DSV41Attention, RMSNorm, Shared
from graphs.config import AttentionConfig, CacheConfig
from graphs.metadata import Geometry, StepInputs
from graphs.plan import LayerPlan


class Block(nn.Module):
    """One layer of the stack: ``h + attn(attn_norm(h))``, then ``+ ffn(h)`` (fp32 ``h``)."""

    def __init__(self, attn: DSV41Attention, ffn: Optional[nn.Module]) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(attn.cfg.dim, attn.cfg.norm_eps, attn.device)
        self.attn = attn
        self.ffn = ffn

    def forward(self, h: Tensor, inp: StepInputs, shared: Optional[Shared]) -> Tensor:
        h = h + self.attn(self.attn_norm(h).to(torch.bfloat16), inp, shared).float()
        return h if self.ffn is None else h + self.ffn(h)


class DSV41Stack(nn.Module):
    """The attention layers of ``plan`` with the residual stream between them; ``forward``
    is one serving step of all of them.

    Args:
        cfg: model dimensions (``cfg.arch`` ``"v4.1"`` for DeepSeek-V4.1's layer kinds).
        cache: serving geometry, the same for every layer.
        plan: which layer owns and reads which shared artifact (:class:`graphs.LayerPlan`).
        layer_ids: the layers to build (default: all of the plan's); every layer a chosen
            one reads from (its kv, index and candidate sources) must be chosen too.
        device, dcp_group, weights: as :class:`graphs.DSV41Attention`.
        seed: layer ``l``'s weights are drawn from ``seed + l``.
        ffn: ``{layer_id: module}`` applied to the residual after that layer's attention
            (the stand-in for the model's MoE; default none).
        record_inputs: keep each block's fp32 residual input of the last step, and the
            last block's output, in ``layer_inputs [(layers + 1) * max_tokens, dim]`` (one copy
            per layer per step; :meth:`recorded_inputs` is its token-major view), so an
            oracle can check every layer on its own inputs
            (:func:`graphs.naive.stack_verdict`'s ``inputs``).

    Attributes:
        blocks: the :class:`Block` of each chosen layer, in order; ``layers`` maps a layer
            id to its :class:`graphs.DSV41Attention`.
    """

    def __init__(self, cfg: AttentionConfig, cache: CacheConfig, plan: LayerPlan,
                 layer_ids: Optional[Sequence[int]] = None, device=None, seed: int = 0,
                 dcp_group: Optional[str] = None, weights: str = "bf16",
                 ffn: Optional[dict[int, nn.Module]] = None, record_inputs: bool = False) -> None:
        super().__init__()
        ids = list(range(len(plan.layers))) if layer_ids is None else sorted(set(int(i) for i in layer_ids))
        self.cfg, self.cache_cfg, self.plan, self.layer_ids = cfg, cache, plan, ids
        bad = [i for i in ids if not 0 <= i < len(plan.layers)]
        if bad or not ids:
            raise ValueError(f"layer_ids must be a non-empty subset of 0..{len(plan.layers) - 1}, got {layer_ids}")
        missing = sorted({(i, s) for i in ids for s in self.sources(i) if s not in ids})
        if missing:
            raise ValueError("a slice of the plan must keep the layers it reads from: "
                             + ", ".join(f"layer {i} reads layer {s}" for i, s in missing))
        ffn = ffn or {}
        self.blocks = nn.ModuleList(
            Block(DSV41Attention(cfg, cache, plan.layers[i].ratio, device, seed + i, dcp_group, weights,
                                 plan=plan, layer_id=i), ffn.get(i))
            for i in ids)
        self.layers = {i: b.attn for i, b in zip(ids, self.blocks)}
        inputs = None
        if record_inputs:  # each block's residual input of the last step, for the oracle's per-layer check
            # layer-major rows, written by index_copy_ into the whole buffer: a copy_ into a
            # slice of it makes Inductor clone the buffer for every write
            inputs = torch.zeros((len(ids) + 1) * cache.max_tokens, cfg.dim, dtype=torch.float32, device=device)
        self.register_buffer("layer_inputs", inputs, persistent=False)

    def recorded_inputs(self) -> Tensor:
        """``[max_tokens, layers + 1, dim]`` view of ``layer_inputs`` (for
        :func:`graphs.schedule.run_workload`'s ``watch``)."""
        if self.layer_inputs is None:
            raise ValueError("build the stack with record_inputs=True to record its layers' inputs")
        return self.layer_inputs.view(len(self.blocks) + 1, self.cache_cfg.max_tokens, -1).transpose(0, 1)

    def step_rows(self) -> list[Tensor]:
        """Every layer's :meth:`graphs.DSV41Attention.step_rows`, and the recorded inputs
        (:meth:`recorded_inputs`) when kept: token-major buffers a step fills row by row."""
        rows = [b for block in self.blocks for b in block.attn.step_rows()]
        return rows + ([self.recorded_inputs()] if self.layer_inputs is not None else [])

    def sources(self, layer_id: int) -> set[int]:
        """The other layers whose caches, ids or candidates layer ``layer_id`` reads."""
        role = self.plan.layers[layer_id]
        out = {role.kv_source, role.index_source} - {None, layer_id}
        if self.plan.uses_candidates(layer_id):
            out.add(self.plan.candidate_source)
        return out

    @classmethod
    def from_checkpoint(cls, folder, cache: CacheConfig, layer_ids: Optional[Sequence[int]] = None, device=None,
                        dcp_group: Optional[str] = None) -> "DSV41Stack":
        """The stack of a checkpoint folder (``config.json`` and ``*.safetensors``): config
        and plan from the config, each layer's attention weights and ``attn_norm`` loaded
        strictly by layer (:func:`graphs.checkpoint.load_attention_weights`)."""
        from graphs.checkpoint import (checkpoint_weights, detect_naming, layer_prefix, load_attention_weights,
                                       open_checkpoint, read_config)

        config = read_config(folder)
        stack = cls(AttentionConfig.from_hf_config(config), cache, LayerPlan.from_config(config), layer_ids, device,
                    dcp_group=dcp_group, weights=checkpoint_weights(config))
        tensors = open_checkpoint(folder)
        for i, block in zip(stack.layer_ids, stack.blocks):
            naming = load_attention_weights(block.attn, tensors, i)
            key = (f"layers.{i}.attn_norm.weight" if naming == "deepseek"
                   else f"model.layers.{i}.input_layernorm.weight")
            if key not in tensors:
                raise KeyError(f"the checkpoint has no {key} (layer {i}'s attention norm; {layer_prefix(i, naming)}* "
                               f"loaded)")
            with torch.no_grad():
                block.attn_norm.weight.copy_(tensors[key].float())
        return stack

    @property
    def device(self) -> torch.device:
        return self.blocks[0].attn.device

    def geometries(self) -> list[Geometry]:
        """One :class:`graphs.metadata.Geometry` per compress ratio of the stack's layers."""
        window, rank = self.cfg.window_size, self.blocks[0].attn.dcp_rank
        ratios = sorted({b.attn.compress_ratio for b in self.blocks})
        return [Geometry.of(window, self.cache_cfg, r, rank) for r in ratios]

    def shared(self, layer: DSV41Attention, T: int) -> Optional[Shared]:
        """What ``layer`` reads from the stack's other layers this step (``None``: nothing)."""
        if not layer.reads_shared:
            return None
        role = layer.role
        src, idx = self.layers[role.kv_source], self.layers[role.index_source] if role.index_source is not None else None
        keys = src.indexer.index_cache if src.indexer is not None else None
        topk = idx.topk_ids[:T] if idx is not None and idx is not layer else None
        candidates = self.layers[self.plan.candidate_source].candidate_ids[:T] if layer.uses_candidates else None
        return Shared(src.cmp_cache, keys, topk, candidates)

    def forward(self, x: Tensor, inputs: dict[int, StepInputs]) -> Tensor:
        """One step of ``T`` tokens through every layer: ``x [T, dim]`` bf16 (the first
        layer's residual input) -> ``[T, dim]`` bf16; ``inputs[ratio]`` the step's inputs of
        each geometry (:meth:`graphs.StepMetadata.all_inputs`)."""
        T = x.shape[0]
        h = x.float()
        rows = torch.arange(T, device=x.device) if self.layer_inputs is not None else None
        for i, block in enumerate(self.blocks):
            layer = block.attn
            if rows is not None:
                self.layer_inputs.index_copy_(0, rows + i * self.cache_cfg.max_tokens, h)
            h = block(h, inputs[layer.compress_ratio], self.shared(layer, T))
        if rows is not None:
            self.layer_inputs.index_copy_(0, rows + len(self.blocks) * self.cache_cfg.max_tokens, h)
        return h.to(x.dtype)

    @torch.no_grad()
    def reset_cache(self) -> None:
        """Zero every layer's caches, compressor state, index keys, top-k and candidates."""
        for block in self.blocks:
            block.attn.reset_cache()

    def extra_repr(self) -> str:
        kinds = {i: ("kv+index source" if r.compresses and r.indexes else "kv source" if r.compresses else
                     "index source" if r.indexes else "reader" if r.ratio else "SWA only")
                 for i, r in ((i, self.plan.layers[i]) for i in self.layer_ids)}
        return f"{self.cfg.name}, layers={self.layer_ids}, kinds={kinds}"
