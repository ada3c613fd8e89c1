"""The DeepSeek-V4 / V4.1 attention layer on the ``dsv41`` ops, and its step graphs.

* :class:`DSV41Attention` -- the layer (projections, RoPE, SWA cache write, compressor,
  indexer top-k, slot conversion, ``sparse_mla``, grouped output projection); ``forward``
  is one serving step of any mix of prefill chunks, decode and draft tokens, graph-safe.
* :class:`StepMetadata` / :class:`StepInputs` / :func:`step_inputs` -- step metadata in
  static buffers.
* :class:`Fp8Linear` (``graphs.fp8``) -- DeepSeek's block-scaled FP8 projections, loaded
  from either checkpoint naming (``DSV41Attention(..., weights="fp8")``).
* :func:`load_attention_weights` (``graphs.checkpoint``) and
  :meth:`DSV41Attention.from_checkpoint` -- a DeepSeek-V4 checkpoint's attention weights by
  their real names (DeepSeek's or Hugging Face's), strictly;
  :meth:`AttentionConfig.from_hf_config` -- the config from its ``config.json``.
* :class:`LayerPlan` (``graphs.plan``) -- which layer owns which shared compressed cache and
  top-k (DeepSeek-V4.1's kv / index / candidate sources), read from a ``config.json``;
  :data:`V41_FLASH_PLAN`.
* :class:`DSV41Stack` (``graphs.stack``) -- the plan's layers with the residual stream
  between them, each shared cache, index-key cache and top-k owned once; one step of all
  layers per ``forward``, one graph per bucket under :class:`StepRunner`.
* :class:`PageAllocator` / :class:`PagePool` -- host-side pages of the caches' pools, as an
  engine would own them; :class:`PageChanges` -- a step's block-table changes, host to
  device.
* :class:`LayerStep` / :class:`StepRunner` -- the step as one module; compile, capture one
  CUDA graph per token bucket, pad, replay; larger steps in pieces of the largest.
* Configs: :class:`AttentionConfig`, :class:`CacheConfig`, presets :data:`V41_FLASH`,
  :data:`V4_FLASH`, :data:`V4_PRO`, :data:`TINY`, :data:`TINY_V41` (TINY with DeepSeek-V4.1's
  layer kinds).

``python -m graphs`` runs the main job (see ``docs/graphs.md``).
"""

from graphs.attention import Compressor, DSV41Attention, Indexer, RMSNorm, Shared
from graphs.checkpoint import load_attention_weights
from graphs.fp8 import Fp8Linear
from graphs.config import (PRESETS, TINY, TINY_V41, V4_FLASH, V4_PRO, V41_CACHE_FORMATS, V41_FLASH, AttentionConfig,
                           CacheConfig)
from graphs.memory import buffer_bytes
from graphs.metadata import Geometry, PageChanges, StepInputs, StepMetadata, StepRows, step_inputs
from graphs.pages import PageAllocator, PagePool
from graphs.plan import V41_FLASH_PLAN, LayerPlan, LayerRole
from graphs.stack import DSV41Stack
from graphs.runner import DEFAULT_BUCKETS, LayerStep, StepRunner, compiled_call, mark_tokens_dynamic

__all__ = [
    "AttentionConfig",
    "CacheConfig",
    "Compressor",
    "DEFAULT_BUCKETS",
    "DSV41Attention",
    "DSV41Stack",
    "Fp8Linear",
    "Geometry",
    "Indexer",
    "LayerPlan",
    "LayerRole",
    "LayerStep",
    "PRESETS",
    "PageAllocator",
    "PageChanges",
    "PagePool",
    "RMSNorm",
    "Shared",
    "StepInputs",
    "StepMetadata",
    "StepRows",
    "StepRunner",
    "TINY",
    "TINY_V41",
    "V41_CACHE_FORMATS",
    "V41_FLASH",
    "V41_FLASH_PLAN",
    "V4_FLASH",
    "V4_PRO",
    "buffer_bytes",
    "compiled_call",
    "load_attention_weights",
    "mark_tokens_dynamic",
    "step_inputs",
]
