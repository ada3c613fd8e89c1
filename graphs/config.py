"""Configurations of the DeepSeek-V4 / V4.1 attention layer.

Two objects describe a layer:

* :class:`AttentionConfig` -- the model's dimensions (what a checkpoint fixes): hidden size,
  heads, LoRA ranks, window, indexer, RoPE, which compress ratios use an overlapping pool
  or no indexer.
* :class:`CacheConfig` -- the serving geometry (what an engine chooses): how many request
  rows and tokens a step may have, the longest sequence, page sizes and the KV format.

Presets: :data:`V41_FLASH`, :data:`V4_FLASH`, :data:`V4_PRO` and :data:`TINY` (a test
model small enough to compile on a CPU in seconds).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from compile_ops.formats import get_format
from compile_ops.indexer.cache import get_index_format
from compile_ops.linear import layout_of_block

HEAD_DIM = 512
ROPE_DIM = 64
_REQUIRED = object()
ARCHS = ("v4", "v4.1")


@dataclass(frozen=True)
class AttentionConfig:
    """Dimensions of one attention layer (names follow DeepSeek's reference ``ModelArgs``).

    ``compress_ratios`` lists the ratios the model's layers use (0 = SWA only). A layer of
    ratio ``r`` in ``overlap_ratios`` pools an overlapping window of ``2r`` tokens (V4's
    ratio 4); a ratio in ``dense_ratios`` attends every compressed entry, without indexer
    (V4's ratio 128).

    RoPE (:func:`graphs.rope.layer_inv_freq`): sliding-only layers turn by ``rope_theta``;
    compressed layers by ``compress_rope_theta`` with YaRN (``rope_factor``,
    ``original_seq_len``, ``beta_fast``, ``beta_slow``; ``original_seq_len = 0``: no YaRN).
    ``weight_block``: the block of an FP8 checkpoint's weights, 128 (fp32 scales, V4) or 32
    (ue8m0 scales, V4.1); used by layers built with ``weights="fp8"``.

    ``arch``: the layer kinds. ``"v4"``: DeepSeek-V4's (q normalised per head; compressors
    with a learned position bias ``ape``; an indexer with its own compressor and a Hadamard
    rotation). ``"v4.1"``: DeepSeek-V4.1's (no per-head q norm; no ``ape``; the ratio-1
    compressor without a gate, ``norm(wkv(x))`` per token; index keys ``k_norm(wk(latent))``
    of the compressor's latent before RoPE, no rotation). The layers that share another's
    cache or top-k, and the two-level candidates, need the stack (``graphs.plan``), which
    is not built yet.
    """

    name: str
    dim: int
    n_heads: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    window_size: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    compress_ratios: tuple[int, ...]
    overlap_ratios: tuple[int, ...] = ()
    dense_ratios: tuple[int, ...] = ()
    head_dim: int = HEAD_DIM
    rope_head_dim: int = ROPE_DIM
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_factor: float = 16.0
    original_seq_len: int = 65536
    beta_fast: int = 32
    beta_slow: int = 1
    weight_block: int = 128
    arch: str = "v4"

    def __post_init__(self) -> None:
        if self.head_dim != HEAD_DIM or self.rope_head_dim != ROPE_DIM:
            raise ValueError(
                f"head_dim / rope_head_dim must be {HEAD_DIM} / {ROPE_DIM} (the dsv41 ops' layout), "
                f"got {self.head_dim} / {self.rope_head_dim}"
            )
        if self.n_heads % self.o_groups:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by o_groups ({self.o_groups})")
        layout_of_block(self.weight_block)
        if self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {ARCHS}, got {self.arch!r}")
        if self.index_head_dim < self.rope_head_dim:
            raise ValueError(
                f"index_head_dim ({self.index_head_dim}) must be >= rope_head_dim ({self.rope_head_dim})"
            )

    @classmethod
    def from_hf_config(cls, config, name: Optional[str] = None) -> "AttentionConfig":
        """The attention dimensions of a DeepSeek-V4 / V4.1 checkpoint's ``config.json`` (a
        dict, the file, or its folder), in either spelling: Hugging Face's
        (``hidden_size``, ``num_attention_heads``, ``sliding_window``, ``rms_norm_eps``,
        ``rope_scaling`` / ``rope_parameters`` with ``factor``,
        ``original_max_position_embeddings``, ``beta_fast``, ``beta_slow``, ...) or
        DeepSeek's ``inference/config.json`` (``dim``, ``n_heads``, ``window_size``,
        ``norm_eps``, ``rope_factor``, ``original_seq_len``, ...). The ratios come from
        ``compress_ratios`` (or ``layer_types``; :func:`graphs.checkpoint.layer_ratios`); as
        in DeepSeek's reference, ratio 4 pools overlapping windows and ratio 128 has no
        indexer. ``quantization_config.weight_block_size`` gives :attr:`weight_block`
        (``[128, 128]`` or ``[32, 32]``; others are refused). Missing keys are named in
        the ``ValueError``."""
        from graphs.checkpoint import layer_ratios, read_config

        c = read_config(config)
        missing = []

        def get(*keys, default=_REQUIRED):
            for k in keys:
                if c.get(k) is not None:
                    return c[k]
            if default is _REQUIRED:
                missing.append(" / ".join(keys))
                return None
            return default

        rope = get("rope_parameters", "rope_scaling", default=None) or {}
        if isinstance(rope.get("compress"), dict):  # transformers' nested {"main", "compress"}
            rope = rope["compress"]
        yarn = rope.get("rope_type", rope.get("type")) == "yarn" or "rope_factor" in c
        head_dim = get("head_dim", default=HEAD_DIM)
        rope_dim = get("qk_rope_head_dim", "rope_head_dim", default=None)
        if rope_dim is None:
            partial = c.get("partial_rotary_factor")
            rope_dim = int(head_dim * partial) if partial else ROPE_DIM
        block = (c.get("quantization_config") or {}).get("weight_block_size", [128, 128])
        fields = dict(
            dim=get("hidden_size", "dim"), n_heads=get("num_attention_heads", "n_heads"),
            q_lora_rank=get("q_lora_rank"), o_lora_rank=get("o_lora_rank"), o_groups=get("o_groups"),
            window_size=get("sliding_window", "window_size"), index_n_heads=get("index_n_heads"),
            index_head_dim=get("index_head_dim"), index_topk=get("index_topk"),
            head_dim=head_dim, rope_head_dim=rope_dim, norm_eps=float(get("rms_norm_eps", "norm_eps")),
            rope_theta=float(get("rope_theta", default=10000.0)),
            compress_rope_theta=float(get("compress_rope_theta", default=160000.0)),
        )
        if missing:
            raise ValueError(f"config.json lacks {', '.join(missing)}")
        if yarn:
            fields.update(rope_factor=float(rope.get("factor", c.get("rope_factor"))),
                          original_seq_len=int(rope.get("original_max_position_embeddings", c.get("original_seq_len"))),
                          beta_fast=int(rope.get("beta_fast", c.get("beta_fast", 32))),
                          beta_slow=int(rope.get("beta_slow", c.get("beta_slow", 1))))
        else:
            fields.update(original_seq_len=0)
        ratios = tuple(sorted(set(layer_ratios(c)) | {0}))
        v41 = any(c.get(k) is not None for k in ("kv_source_layer_ids", "kv_source_layers"))
        fields.update(arch="v4.1" if v41 else "v4")
        return cls(name=name or c.get("_name_or_path") or c.get("model_type") or "checkpoint",
                   compress_ratios=ratios, overlap_ratios=tuple(r for r in ratios if r == 4),
                   dense_ratios=tuple(r for r in ratios if r == 128),
                   weight_block=layout_of_block(block).block, **fields)

    @property
    def v41(self) -> bool:
        """DeepSeek-V4.1's layer kinds (``arch == "v4.1"``)."""
        return self.arch == "v4.1"

    def check_ratio(self, ratio: int) -> int:
        if ratio not in self.compress_ratios:
            raise ValueError(f"compress_ratio must be one of {self.name}'s {self.compress_ratios}, got {ratio}")
        return ratio

    def has_indexer(self, ratio: int) -> bool:
        return ratio > 0 and ratio not in self.dense_ratios

    def overlaps(self, ratio: int) -> bool:
        return ratio in self.overlap_ratios


@dataclass(frozen=True)
class CacheConfig:
    """Serving geometry of one layer's caches, pools and step buffers.

    Args:
        max_requests: request rows ``R`` (rows of the block tables and of the compressor
            state).
        max_tokens: largest step in tokens (prefill chunks, decode and draft tokens of all
            its requests together); sizes the step buffers.
        max_seq_len: longest sequence; sizes the block tables' columns and the RoPE tables.
        page_size: tokens per page of the SWA cache.
        cmp_block_size: compressed entries per page of the compressed and index-key caches
            (``None``: ``max(1, page_size // ratio)``, i.e. a page covers ``page_size``
            tokens).
        kv_format: format of the KV caches (``compile_ops.formats``): the window's, and the
            compressed one's unless ``cmp_kv_format`` says otherwise.
        kv_scale: per-tensor scale of the ``"fp8"`` format.
        index_format: format of the indexer's paged index-key cache, ``"fp8"`` (132 B per
            entry, e4m3 products), ``"fp4"`` (68 B, DeepSeek-V4.1's) or ``"bf16"``
            (``compile_ops.indexer.cache``).
        cmp_kv_format: format of the compressed cache when it is not ``kv_format``
            (DeepSeek-V4.1: ``"fp4_dsv41"`` entries beside an ``"fp8_dsv41"`` window, which
            ``sparse_mla``'s kernels read in one call); ``None``: the same.
        max_rewind: how far a step may go back into positions its request already wrote
            (rejected draft tokens): a step of a request may start at any position from
            ``high + 1 - max_rewind`` to ``length``, where ``high`` is the highest position
            the request has written and ``length`` its accepted tokens. Sizes the
            compressor's state ring and the SWA pages a request keeps.
        swa_pages: pages of the SWA pool (``None``: :meth:`default_swa_pages`, enough for
            every request row to hold its window and the largest step to add its tokens).
        cmp_pages: pages of the compressed pool, shared by the index-key cache (``None``:
            every request row at ``max_seq_len``). Size it to the tokens the engine holds
            at once; :class:`graphs.PageAllocator` raises when it runs out. Under DCP it is
            this rank's pool.
        dcp_world: ranks of the decode-context-parallel group the compressed and index
            caches are sharded over (1: no DCP).
        dcp_interleave: the shard interleave ``I``: global entry ``c`` lives on rank
            ``(c // I) % dcp_world`` as local entry ``(c // (dcp_world * I)) * I + c % I``.
    """

    max_requests: int
    max_tokens: int
    max_seq_len: int
    page_size: int
    cmp_block_size: int | None = None
    kv_format: str = "bf16"
    kv_scale: float = 1.0
    index_format: str = "fp8"
    max_rewind: int = 4
    swa_pages: int | None = None
    cmp_pages: int | None = None
    dcp_world: int = 1
    dcp_interleave: int = 1
    cmp_kv_format: str | None = None

    def __post_init__(self) -> None:
        for name in ("max_requests", "max_tokens", "max_seq_len", "page_size"):
            _check_int(name, getattr(self, name), 1)
        _check_int("max_rewind", self.max_rewind, 0)
        _check_int("dcp_world", self.dcp_world, 1)
        _check_int("dcp_interleave", self.dcp_interleave, 1)
        for name in ("cmp_block_size", "swa_pages", "cmp_pages"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 1)
        get_format(self.kv_format)
        get_format(self.compressed_format)
        get_index_format(self.index_format)

    @property
    def compressed_format(self) -> str:
        """The compressed cache's format: ``cmp_kv_format``, else ``kv_format``."""
        return self.cmp_kv_format or self.kv_format

    def block_size(self, ratio: int) -> int:
        """Compressed entries per page for compress ratio ``ratio``."""
        if self.cmp_block_size is not None:
            return self.cmp_block_size
        return max(1, self.page_size // max(ratio, 1))

    def max_entries(self, ratio: int) -> int:
        """Compressed entries one request can hold (``0`` for SWA-only layers)."""
        return self.max_seq_len // ratio if ratio else 0

    def local_entries(self, n: int, rank: int) -> int:
        """How many of global entries ``0 .. n - 1`` DCP rank ``rank`` holds."""
        span = self.dcp_world * self.dcp_interleave
        return (n // span) * self.dcp_interleave + min(max(n % span - rank * self.dcp_interleave, 0), self.dcp_interleave)

    def check_ratio(self, ratio: int) -> int:
        """``ratio`` if a layer of that compress ratio fits this geometry (at least one
        compressed entry per request), else ``ValueError``."""
        if ratio and self.max_entries(ratio) < 1:
            raise ValueError(f"max_seq_len ({self.max_seq_len}) must be >= compress_ratio ({ratio})")
        return ratio

    def compressor_ring(self, ratio: int, overlap: bool) -> int:
        """Positions per request row of a compressor's state ring: a step reads the prefix
        stats of the position before it (overlapping: of the ``ratio`` positions before it)
        after rewinding up to ``max_rewind``, so ``max_rewind + 1`` (overlapping: ``ratio +
        max_rewind``); ``0`` for ratio 1 without overlap, whose entries are single tokens."""
        if ratio <= 1 and not overlap:
            return 0
        return (ratio if overlap else 1) + self.max_rewind

    def swa_table_columns(self) -> int:
        """Columns of an SWA block-table row: one per page of ``max_seq_len`` positions."""
        return -(-self.max_seq_len // self.page_size)

    def swa_keep(self, window: int) -> int:
        """Positions below its highest written one that a request's SWA pages must keep
        between steps: what the window of a next step reads when it starts ``max_rewind``
        positions back, ``max(0, window - 2 + max_rewind)``."""
        return max(0, window - 2 + self.max_rewind)

    def swa_pages_between_steps(self, window: int) -> int:
        """SWA pages a request holds between its steps: ``ceil(swa_keep / page_size) + 1``
        (at most ``swa_table_columns``)."""
        return min(self.swa_table_columns(), -(-self.swa_keep(window) // self.page_size) + 1)

    def default_swa_pages(self, window: int) -> int:
        """SWA pool for every row between steps plus the largest step's new pages:
        ``R * swa_pages_between_steps + ceil(max_tokens / page_size) + min(R, max_tokens)``."""
        step = -(-self.max_tokens // self.page_size) + min(self.max_requests, self.max_tokens)
        return self.max_requests * self.swa_pages_between_steps(window) + step

    def swa_num_pages(self, window: int) -> int:
        return self.swa_pages if self.swa_pages is not None else self.default_swa_pages(window)

    def cmp_pages_per_request(self, ratio: int) -> int:
        """Compressed pages a request at ``max_seq_len`` holds on a rank (its block-table
        columns; rank 0's count, the largest, on every rank so all ranks have one shape)."""
        return -(-self.local_entries(self.max_entries(ratio), 0) // self.block_size(ratio)) if ratio else 0

    def cmp_num_pages(self, ratio: int) -> int:
        if not ratio:
            return 0
        return self.cmp_pages if self.cmp_pages is not None else self.max_requests * self.cmp_pages_per_request(ratio)


def _check_int(name: str, value, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an int >= {least}, got {value!r}")


# DeepSeek-V4.1-Flash's attention (its config.json; DeepSeek-V4.1's layer kinds)
V41_FLASH = AttentionConfig(
    name="V4.1-Flash", dim=5120, n_heads=64, q_lora_rank=1280, o_lora_rank=1024, o_groups=8,
    window_size=128, index_n_heads=32, index_head_dim=128, index_topk=512, compress_ratios=(0, 1, 2),
    overlap_ratios=(), dense_ratios=(), weight_block=32, arch="v4.1", norm_eps=1e-20,
)
V4_FLASH = AttentionConfig(
    name="V4-Flash", dim=4096, n_heads=64, q_lora_rank=1024, o_lora_rank=1024, o_groups=8,
    window_size=128, index_n_heads=64, index_head_dim=128, index_topk=512,
    compress_ratios=(0, 4, 128), overlap_ratios=(4,), dense_ratios=(128,),
)
# V4-Pro: 128 heads and top-k 1024 per the design; hidden 7168, q_lora 1536 and 16 output
# groups are assumptions (the V3-size trunk), adjust to the checkpoint's config.json.
V4_PRO = replace(V4_FLASH, name="V4-Pro", dim=7168, n_heads=128, q_lora_rank=1536, o_groups=16, index_topk=1024)
TINY = AttentionConfig(
    name="tiny", dim=64, n_heads=4, q_lora_rank=32, o_lora_rank=32, o_groups=2,
    window_size=8, index_n_heads=2, index_head_dim=128, index_topk=8,
    compress_ratios=(0, 1, 2, 4, 128), overlap_ratios=(4,), dense_ratios=(128,),
)
# TINY with DeepSeek-V4.1's layer kinds (ratios 1 and 2, eps 1e-20): what the CPU tests
# and `python -m graphs --preset tiny-v4.1` check V4.1's kinds with
TINY_V41 = replace(TINY, name="tiny-v4.1", arch="v4.1", compress_ratios=(0, 1, 2), overlap_ratios=(), dense_ratios=(),
                   norm_eps=1e-20)
PRESETS = {c.name: c for c in (V41_FLASH, V4_FLASH, V4_PRO, TINY, TINY_V41)}
# DeepSeek-V4.1's own cache formats (its inference code's fake-quantization): the window in
# fp8, compressed entries and index keys in fp4; CacheConfig(..., **V41_CACHE_FORMATS)
V41_CACHE_FORMATS = {"kv_format": "fp8_dsv41", "cmp_kv_format": "fp4_dsv41", "index_format": "fp4"}
