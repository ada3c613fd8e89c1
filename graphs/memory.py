"""The layer's buffer memory as a formula of its configuration, without allocating it.

:func:`buffer_bytes` gives the bytes of every buffer of ``DSV41Attention(cfg, cache, ratio)``
(caches, compressor state, step scratch; not the weights), from the same geometry the layer
sizes them with. ``tests/test_graphs.py`` checks it against the buffers of real layers.
"""

from __future__ import annotations

from compile_ops.formats import get_format
from compile_ops.indexer.cache import INDEX_DIM, get_index_format
from typing import Optional, Sequence

from graphs.config import AttentionConfig, CacheConfig
from graphs.plan import LayerPlan, LayerRole

FP32 = 4


def _compressor_state(cfg: AttentionConfig, cache: CacheConfig, ratio: int, head_dim: int) -> int:
    """``state``: ``(R + 1) * P * 3 * width`` fp32, ``P = max_rewind + 1`` (overlapping:
    ``ratio + max_rewind``, ``width = 2 * head_dim``; ratio 1: no state)."""
    overlap = cfg.overlaps(ratio)
    ring = cache.compressor_ring(ratio, overlap)
    return (cache.max_requests + 1) * ring * 3 * (2 if overlap else 1) * head_dim * FP32


def _compressor_split(cfg: AttentionConfig, ratio: int, head_dim: int, bf16_compressors: bool) -> int:
    """``split``: ``wkv`` and ``wgate`` in bf16, ``2 * width * dim`` bf16, as high and low
    parts for fp32 weights twice that (V4.1's ratio 1 has no ``wgate``: half)."""
    projections = 1 if cfg.v41 and ratio == 1 else 2
    parts = 1 if bf16_compressors else 2
    return parts * projections * (2 if cfg.overlaps(ratio) else 1) * head_dim * cfg.dim * 2


def buffer_bytes(cfg: AttentionConfig, cache: CacheConfig, ratio: int,
                 role: Optional[LayerRole] = None, candidate_blocks: int = 0,
                 bf16_compressors: bool = True) -> dict[str, int]:
    """Bytes of each buffer group of the layer; ``role``: its place in a
    :class:`graphs.LayerPlan` (default: it owns its cache and top-k), where only a kv source holds the compressed and index-key caches and the
    compressor, only an index source (or a dense layer) the top-k buffer, and the candidate
    source ``candidate_blocks`` more int32 per step token; ``bf16_compressors``: the
    compressors' weights are bf16 values (DeepSeek's checkpoints, ``reset_parameters``),
    else fp32 ones.

    * ``swa_cache``: ``swa_pages * page_size * bytes_per_token(kv_format)``, the pool
      (default ``CacheConfig.default_swa_pages``: every row's window plus one step)
    * ``cmp_cache``: ``cmp_pages * block_size * bytes_per_token(compressed_format)``
    * ``index_cache``: ``cmp_pages * block_size * (132 fp8 | 68 fp4 | 256 bf16)``
    * ``compressor_state``: the compressors' ``(R + 1)``-row fp32 state rings (main and indexer)
    * ``compressor_split``: the compressors' projections in bf16 (fp32 weights: as bf16
      high and low parts, twice the bytes)
    * ``step_scratch``: ``topk_ids [max_tokens, K]`` int32, the RoPE tables
      ``2 * max_seq_len * rope_dim / 2`` fp32, the Hadamard matrix,
      ``candidate_ids [max_tokens, candidate_blocks]`` int32 (``sparse_mla``'s split-K partials
      are no buffer of the layer: its calls share the per-device default workspace)
    """
    compresses = bool(ratio) and (role is None or role.compresses)
    owns_ids = bool(ratio) and (role is None or role.indexes or role.index_source is None)
    kv = get_format(cache.kv_format).bytes_per_token
    out = {"swa_cache": cache.swa_num_pages(cfg.window_size) * cache.page_size * kv, "cmp_cache": 0, "index_cache": 0,
           "compressor_state": 0, "compressor_split": 0}
    topk = 0
    if compresses:
        entries = cache.cmp_num_pages(ratio) * cache.block_size(ratio)
        out["cmp_cache"] = entries * get_format(cache.compressed_format).bytes_per_token
        out["compressor_state"] = _compressor_state(cfg, cache, ratio, cfg.head_dim)
        out["compressor_split"] = _compressor_split(cfg, ratio, cfg.head_dim, bf16_compressors)
        if cfg.has_indexer(ratio):
            out["index_cache"] = entries * get_index_format(cache.index_format).bytes_per_token
            if not cfg.v41:  # V4's indexer has a compressor of its own; V4.1's reads the latent
                out["compressor_state"] += _compressor_state(cfg, cache, ratio, INDEX_DIM)
                out["compressor_split"] += _compressor_split(cfg, ratio, INDEX_DIM, bf16_compressors)
    if owns_ids:
        topk = min(cfg.index_topk, cache.max_entries(ratio)) if cfg.has_indexer(ratio) else cache.max_entries(ratio)
    rotation = INDEX_DIM * INDEX_DIM * 2 if compresses and cfg.has_indexer(ratio) and not cfg.v41 else 0
    rope = 2 * cache.max_seq_len * (cfg.rope_head_dim // 2) * FP32
    out["step_scratch"] = cache.max_tokens * (topk + candidate_blocks) * 4 + rope + rotation
    out["total"] = sum(out.values())
    return out


def stack_buffer_bytes(cfg: AttentionConfig, cache: CacheConfig, plan: LayerPlan,
                       layer_ids: Optional[Sequence[int]] = None, record_inputs: bool = False) -> dict[str, int]:
    """Bytes of each buffer group of ``DSV41Stack(cfg, cache, plan, layer_ids)``, summed over
    its layers (:func:`buffer_bytes` of each by its role: a shared cache counted once, at its
    source), and ``per_layer``: each layer's total; ``record_inputs``: plus the recorded
    inputs, ``(layers + 1) * max_tokens * dim`` fp32 (``layer_inputs``)."""
    ids = range(len(plan.layers)) if layer_ids is None else sorted(set(layer_ids))
    out: dict = {}
    per_layer = {}
    for i in ids:
        role = plan.layers[i]
        blocks = plan.candidate_topk_blocks if plan.candidate_source == i else 0
        layer = buffer_bytes(cfg, cache, role.ratio, role, blocks)
        for k, v in layer.items():
            out[k] = out.get(k, 0) + v
        per_layer[i] = layer["total"]
    out["layer_inputs"] = (len(ids) + 1) * cache.max_tokens * cfg.dim * FP32 if record_inputs else 0
    out["total"] += out["layer_inputs"]
    out["per_layer"] = per_layer
    return out
