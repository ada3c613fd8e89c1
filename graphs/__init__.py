"""The DeepSeek-V4 / V4.1 attention layer on the ``dsv41`` ops, and its decode-step graphs.

* :class:`DSV41Attention` -- the layer (projections, RoPE, SWA cache write, compressor,
  indexer top-k, slot conversion, ``sparse_mla``, grouped output projection); ``forward``
  is one decode step, graph-safe.
* :class:`StepMetadata` / :class:`StepInputs` / :func:`step_inputs` -- step metadata in
  static buffers.
* :class:`DecodeStep` / :class:`DecodeRunner` -- the step as one module; compile, capture
  one CUDA graph per batch-size bucket, pad, replay.
* Configs: :class:`AttentionConfig`, :class:`CacheConfig`, presets :data:`V41_FLASH`,
  :data:`V4_FLASH`, :data:`V4_PRO`, :data:`TINY`.

``python -m graphs`` runs the demo / benchmark (see ``docs/graphs.md``).
"""

from graphs.attention import Compressor, DSV41Attention, Indexer, RMSNorm
from graphs.config import PRESETS, TINY, V4_FLASH, V4_PRO, V41_FLASH, AttentionConfig, CacheConfig
from graphs.memory import buffer_bytes
from graphs.metadata import StepInputs, StepMetadata, default_block_tables, step_inputs
from graphs.runner import DEFAULT_BUCKETS, DecodeRunner, DecodeStep, compiled_call, mark_tokens_dynamic

__all__ = [
    "AttentionConfig",
    "CacheConfig",
    "Compressor",
    "DEFAULT_BUCKETS",
    "DSV41Attention",
    "DecodeRunner",
    "DecodeStep",
    "Indexer",
    "PRESETS",
    "RMSNorm",
    "StepInputs",
    "StepMetadata",
    "TINY",
    "V41_FLASH",
    "V4_FLASH",
    "V4_PRO",
    "buffer_bytes",
    "compiled_call",
    "default_block_tables",
    "mark_tokens_dynamic",
    "step_inputs",
]
