"""The DeepSeek-V4 / V4.1 attention layer on the ``dsv41`` ops, one serving step per call.

A step is any mix of prefill chunks, decode tokens and draft (multi-token) tokens. Shape
legend: ``T`` tokens of the step, ``H`` query heads, ``R`` request
rows, ``L`` compressed entries one request can hold (``max_seq_len // ratio``), ``K``
top-k columns, ``D = 512`` head width (448 NoPE + 64 RoPE dims).

Parameter names follow DeepSeek's reference ``inference/model.py`` (``wq_a``, ``q_norm``,
``wq_b``, ``wkv``, ``kv_norm``, ``wo_a``, ``wo_b``, ``attn_sink``, ``compressor.{ape,
wkv, wgate, norm}``, ``indexer.{wq_b, weights_proj, compressor.*}``), so the attention
part of such a checkpoint's state dict loads with ``load_state_dict``. Caches, compressor
state, index keys and the top-k buffer are non-persistent buffers.

The step is graph-safe: every shape comes from ``x.shape[0]`` and the config, padding
tokens (``is_valid == False``) write nothing that a valid token reads (cache writes go to
slot ``-1``, state writes go to the spare request row ``R``), and nothing syncs with the
host.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
from torch import Tensor, nn

import compile_ops  # noqa: F401  (registers torch.ops.dsv41)
from compile_ops import backends
from compile_ops._checks import check_device, check_tensor
from compile_ops.formats import HEAD_DIM, new_cache
from compile_ops.indexer.cache import INDEX_DIM, new_index_cache
from compile_ops.indexer.ops import check_index_write
from compile_ops.kv.ops import check_kv_write
from compile_ops.dcp import all_gather_heads
from compile_ops.linear import quantize_blocks
from compile_ops.linear.quant import TILE_N
from graphs.config import AttentionConfig, CacheConfig
from graphs.fp8 import Fp8Linear
from graphs.fused import (StackedRows, TurnedHeads, columns, join_beside, mm_bf16, project, project_beside,
                          side_stream, stack_rows)
from graphs.metadata import Geometry, StepInputs, StepRows, derive, step_inputs
from graphs.plan import LayerPlan, LayerRole
from graphs.rope import apply_rope_last, layer_inv_freq, rope_heads_, rope_tables


def _dcp_rank(cfg: AttentionConfig, cache: CacheConfig, ratio: int, dcp_group: Optional[str]):
    """``(group name or None, rank, world)`` of a layer; checks the group against the cache
    geometry and the heads and output groups against the world size."""
    N = cache.dcp_world
    if dcp_group is None:
        if N > 1:
            raise ValueError(f"cache.dcp_world is {N}: pass dcp_group, the c10d name of the DCP group")
        return None, 0, 1
    from compile_ops._groups import group_rank, group_size

    if group_size(dcp_group) != N:
        raise ValueError(f"dcp_group {dcp_group!r} has {group_size(dcp_group)} ranks but cache.dcp_world is {N}")
    if cfg.n_heads % N or cfg.o_groups % N:
        raise ValueError(f"a DCP group of {N} ranks must divide the heads ({cfg.n_heads}) and the output groups "
                         f"({cfg.o_groups}): each rank holds H / N heads and G / N groups")
    if N == 1:
        return None, 0, 1
    _check_same_config(dcp_group, cfg, cache, ratio)
    return dcp_group, group_rank(dcp_group), N


def _check_same_config(dcp_group: str, cfg: AttentionConfig, cache: CacheConfig, ratio: int) -> None:
    """One small collective at construction: every rank of the group must build the same
    layer (model dims and serving geometry); a mismatch raises on every rank, naming it."""
    import dataclasses

    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = _resolve_process_group(dcp_group)
    mine = {"compress_ratio": ratio, **{f"cfg.{k}": v for k, v in dataclasses.asdict(cfg).items()},
            **{f"cache.{k}": v for k, v in dataclasses.asdict(cache).items()}}
    every: list = [None] * group.size()
    dist.all_gather_object(every, mine, group=group)
    for rank, theirs in enumerate(every):
        differ = sorted(k for k in mine if theirs.get(k) != every[0].get(k))
        if differ:
            raise ValueError(f"DCP rank {rank} was built with another layer than rank 0: "
                             + ", ".join(f"{k} = {theirs.get(k)!r} vs {every[0].get(k)!r}" for k in differ))


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim in fp32, returned in ``x``'s dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


class RMSNorm(nn.Module):
    """:func:`rms_norm` with a learned fp32 ``weight [dim]``."""

    def __init__(self, dim: int, eps: float, device=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32, device=device))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


def turned_rows(values: Tensor, weight: Tensor, eps: float, cos: Tensor, sin: Tensor) -> Tensor:
    """``values [N, W]`` as bf16, RMS-normalised (:func:`rms_norm`), the last ``2P`` dims of
    each row turned by its ``cos, sin [N, P]`` (:func:`graphs.rope.apply_rope_last`): a
    layer's window kv and DeepSeek-V4.1's index keys before they are stored."""
    return apply_rope_last(rms_norm(values.to(torch.bfloat16), weight, eps), 2 * cos.shape[1], cos, sin)


@torch.library.custom_op("graphs::write_turned", mutates_args=("cache",))
def write_turned(cache: Tensor, slots: Tensor, values: Tensor, fmt: str, kv_scale: float, weight: Tensor, eps: float,
                 cos: Tensor, sin: Tensor) -> None:
    """Store :func:`turned_rows` of ``values`` at ``slots`` of ``cache``: ``dsv41::write_kv``
    (``values [N, 512]``, ``fmt`` a KV format, ``kv_scale``) or ``dsv41::write_index_keys``
    (``values [N, 128]``, ``fmt`` an index format; ``kv_scale`` unused) of those rows, the
    same bytes up to the fp32 rounding of the norm's sum. ``values``: any float dtype, rows
    of any stride (a column slice of a projection's output); ``weight [W]`` fp32; ``cos,
    sin [N, P]`` fp32. Where the stores' ``"kv"`` backend is Triton (CUDA), one launch
    normalises, turns, quantizes and stores each row
    (:func:`compile_ops.kv.triton.write_rows_triton`), where the unfused rows take a norm
    kernel, a RoPE kernel and the store; elsewhere :func:`turned_rows`, then that backend's
    store."""
    layout = _check_turned(cache, slots, values, fmt, kv_scale, weight, eps, cos, sin)
    if cache.shape[0] * cache.shape[1] == 0 or slots.shape[0] == 0:
        return
    # the store both dsv41 stores call: the Triton one normalises and turns in its program
    backend, ops = backends.resolve("kv", cache.device)
    if backend == "triton":
        ops["write_kv"](cache, slots, values, layout, kv_scale, turn=(weight, eps, cos, sin))
    else:
        ops["write_kv"](cache, slots, turned_rows(values, weight, eps, cos, sin), layout, kv_scale)


@write_turned.register_fake
def _(cache, slots, values, fmt, kv_scale, weight, eps, cos, sin):
    _check_turned(cache, slots, values, fmt, kv_scale, weight, eps, cos, sin)


def _check_turned(cache, slots, values, fmt, kv_scale, weight, eps, cos, sin):
    """:func:`write_turned`'s checks: the store's own (``dsv41::write_kv`` or
    ``write_index_keys``, by ``values``' width), then the norm's and the rotation's.
    Returns the cache's format."""
    check_tensor("values", values, (torch.bfloat16, torch.float16, torch.float32), 2, cache.device)
    width = values.shape[1]
    if width not in (HEAD_DIM, INDEX_DIM):
        raise ValueError(f"values must be KV rows [N, {HEAD_DIM}] or index keys [N, {INDEX_DIM}], got {list(values.shape)}")
    layout = (check_index_write(cache, slots, values, fmt) if width == INDEX_DIM
              else check_kv_write(cache, slots, values, fmt, kv_scale))
    if not float(eps) >= 0.0:  # (a negative eps can make the mean square's root NaN)
        raise ValueError(f"eps must be a float >= 0, got {eps}")
    check_tensor("weight", weight, torch.float32, 1, cache.device)
    if weight.shape[0] != width or weight.stride(0) != 1:
        raise ValueError(f"weight must be [{width}] (values' width) with unit stride, got {list(weight.shape)} "
                         f"stride {weight.stride()}")
    for name, t in (("cos", cos), ("sin", sin)):
        check_tensor(name, t, torch.float32, 2, cache.device)
        if t.shape[0] != values.shape[0] or not 0 < 2 * t.shape[1] <= width or t.stride(1) != 1:
            raise ValueError(f"{name} must be [N, P] with N = {values.shape[0]} rows, 0 < 2P <= {width} and unit "
                             f"column stride, got {list(t.shape)} stride {t.stride()}")
    if cos.stride() != sin.stride():
        raise ValueError(f"cos and sin must have the same strides, got {cos.stride()} and {sin.stride()}")
    return layout


Stats = tuple[Tensor, Tensor, Tensor]


def _merge(a: Stats, b: Stats) -> Stats:
    """Online-softmax merge of two softmax-pooling stats ``(max, sum of exp(score - max),
    sum of exp(score - max) * kv)``, each ``[..., width]``, per dim; a max of ``-inf`` is
    an empty stat."""
    m = torch.maximum(a[0], b[0])
    base = torch.where(m == float("-inf"), 0.0, m)
    ea, eb = torch.exp(a[0] - base), torch.exp(b[0] - base)
    return m, a[1] * ea + b[1] * eb, a[2] * ea + b[2] * eb


def _where(cond: Tensor, a: Stats, b: Stats) -> Stats:
    return tuple(torch.where(cond.unsqueeze(-1), x, y) for x, y in zip(a, b))


class Compressor(nn.Module):
    """Softmax-gated pooling of ``ratio`` consecutive tokens into one compressed entry.

    Each token projects to ``kv = wkv(x)`` and gate logits ``wgate(x) + ape[pos % ratio]``
    (fp32, per dim; DeepSeek-V4.1's compressors have no ``ape``, and its ratio-1 one no
    ``wgate``: an entry is then ``norm(wkv(x))`` of one token). When token ``pos`` closes its
    group (``(pos + 1) % ratio == 0``) the entry is ``sum_i softmax_i(gate) * kv_i`` over the
    group, RMS-normalised (the *latent*, :meth:`latent`), with RoPE at the group's first
    position (:meth:`forward`). An *overlapping* compressor (V4's ratio 4) projects twice
    as wide: the first half of each token's projection joins the *next* group's pool, the
    second half its own, so an entry pools ``2 * ratio`` tokens (the first group has no
    predecessor).

    A step may hold many tokens of a request (consecutive positions, contiguous in the
    step): a segmented scan over the step's tokens gives every token the softmax stats
    (running max, sum of weights, weighted sum) of its group up to itself, so a chunk
    closes any number of groups at once. Groups that span steps continue from ``state``,
    ``[3, R + 1, P, width]`` fp32: each request row's prefix stats at its last ``P``
    positions, in a ring by ``pos % P`` (row ``R`` absorbs padding tokens), ``P =
    CacheConfig.compressor_ring`` (overlapping: the previous group's first halves too). A
    step that rewrites rejected positions reads only prefixes of positions before it,
    which hold accepted tokens, so its entries equal those of a run that never saw the
    rejected ones (up to fp32 rounding: a chunk merges in another order than single steps).
    """

    def __init__(self, cfg: AttentionConfig, ratio: int, head_dim: int, overlap: bool, cache: CacheConfig,
                 device=None, position_bias: bool = True, gate: bool = True) -> None:
        super().__init__()
        self.ratio, self.head_dim, self.overlap = ratio, head_dim, overlap
        self.rope_dim = cfg.rope_head_dim
        self.width = width = (2 if overlap else 1) * head_dim
        if position_bias:
            self.ape = nn.Parameter(torch.zeros(ratio, width, dtype=torch.float32, device=device))
        else:
            self.register_parameter("ape", None)
        self.wkv = nn.Linear(cfg.dim, width, bias=False, dtype=torch.float32, device=device)
        self.wgate = nn.Linear(cfg.dim, width, bias=False, dtype=torch.float32, device=device) if gate else None
        # [wkv; wgate] as bf16 high parts over bf16 low parts: bf16 tokens times both parts
        # with fp32 accumulation is the fp32 product to 2**-16 of each weight, on bf16 tensor
        # cores instead of fp32 ones (the high parts alone for bf16-valued weights); derived
        # from the weights (split_weights, which the layer calls at load)
        rows = 2 * (2 if gate else 1) * width
        self.register_buffer("split", torch.zeros(rows, cfg.dim, dtype=torch.bfloat16, device=device),
                             persistent=False)
        self.norm = RMSNorm(head_dim, cfg.norm_eps, device)
        self.ring = cache.compressor_ring(ratio, overlap)
        self.register_buffer("state", torch.zeros(3, cache.max_requests + 1, self.ring, width, device=device),
                             persistent=False)

    @torch.no_grad()
    def split_weights(self) -> None:
        """Refresh ``split`` from ``wkv`` and ``wgate`` (the layer's ``load_state_dict``,
        ``reset_parameters`` and ``refresh_splits`` do). Weights that are bf16 values
        (DeepSeek's checkpoints hold the compressors' in bf16) have no low parts: ``split``
        is then the high parts alone, and the step reads half the bytes."""
        w = torch.cat([self.wkv.weight] + ([self.wgate.weight] if self.wgate is not None else []))
        high = w.to(torch.bfloat16)
        low = (w - high.float()).to(torch.bfloat16)
        split = torch.cat([high, low]) if low.any() else high
        if split.shape == self.split.shape:
            self.split.copy_(split)
        else:  # the other layout: a new buffer, which the layer stacks again
            self.split = split

    def gates(self, parts: Tensor) -> tuple[Tensor, Tensor]:
        """``(wkv(x), wgate(x))``, each ``[T, width]`` fp32, from ``parts = x @ split^T``
        (``[T, split rows]`` fp32: the layer computes it in its stacked x projection; gate
        logits of zero without ``wgate``)."""
        n = self.width
        if parts.shape[1] == n * (2 if self.wgate is not None else 1):
            both = parts  # high parts alone: the weights are bf16 values
        else:
            half = parts.shape[1] // 2
            both = parts[:, :half] + parts[:, half:]
        kv = both[:, :n]
        return kv, (both[:, n:] if self.wgate is not None else torch.zeros_like(kv))

    def forward(self, parts: Tensor, rows: StepRows, cos_table: Tensor, sin_table: Tensor, dtype: torch.dtype):
        """One step of ``parts = x @ split^T`` (:meth:`gates`). Returns ``(entry [T,
        head_dim]`` in ``dtype``, ``closing [T]`` bool): ``entry[t]`` is meaningful where
        ``closing[t]``; the entry is the :meth:`latent` with RoPE at its group's first position."""
        latent, closing = self.latent(parts, rows, dtype)
        group_start = rows.pos - rows.pos % self.ratio
        return apply_rope_last(latent, self.rope_dim, cos_table[group_start], sin_table[group_start]), closing

    def latent(self, parts: Tensor, rows: StepRows, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``(latent [T, head_dim]`` in ``dtype``, before RoPE, ``closing [T]`` bool) of one
        step of ``parts = x @ split^T`` (:meth:`gates`; the compressor state is updated)."""
        r, d, P, T = self.ratio, self.head_dim, self.ring, parts.shape[0]
        pos, row, valid, first, last = rows.pos, rows.row, rows.valid, rows.first, rows.last
        kv, score = self.gates(parts)
        if self.ape is not None:
            score = score + self.ape[pos % r]
        stats: Stats = (score, torch.ones_like(score), kv)  # each [T, width]: one token's softmax stats
        t = torch.arange(T, device=parts.device)
        group_start = pos - pos % r
        # the step's tokens of one group are contiguous: the scan merges t with t - k, k = 1, 2, 4, ...
        seg_start = t - (pos - torch.maximum(group_start, first))
        k = 1
        while k < r:
            earlier = (t - k).clamp(min=0)
            stats = _where(t - k >= seg_start, _merge(tuple(s[earlier] for s in stats), stats), stats)
            k *= 2
        if P:
            carried = valid & (group_start < first)  # the group began in an earlier step
            slot = (first - 1) % P
            stats = _where(carried, _merge(tuple(s[row, slot] for s in self.state), stats), stats)
        closing = valid & ((pos + 1) % r == 0)
        if self.overlap:
            # the previous group's first halves: the prefix at its closing position pos - r
            prev_pos = pos - r
            earlier, slot = (t - r).clamp(min=0), prev_pos % P
            prev = _where(prev_pos >= first, tuple(s[earlier, :d] for s in stats),
                          tuple(s[row, slot, :d] for s in self.state))
            empty = (torch.full_like(prev[0], float("-inf")), torch.zeros_like(prev[1]), torch.zeros_like(prev[2]))
            pooled = _merge(_where(prev_pos < 0, empty, prev), tuple(s[:, d:] for s in stats))
        else:
            pooled = stats
        if P:
            keep = valid & (pos > last - P)  # the last P positions of each request
            at = (torch.where(keep, row, self.state.shape[1] - 1), pos % P)
            # one scatter into the whole buffer: Inductor writes it in place (one scatter per
            # view of a stat makes it copy the whole state back every step)
            kind = torch.arange(3, device=parts.device).unsqueeze(1)
            self.state.index_put_((kind, at[0].unsqueeze(0), at[1].unsqueeze(0)), torch.stack(stats))
        return self.norm((pooled[2] / pooled[1]).to(dtype)), closing


def hadamard(n: int, device=None) -> Tensor:
    """The ``n x n`` orthonormal Hadamard matrix (Sylvester's construction, ``n`` a power of 2)."""
    h = torch.ones(1, 1, device=device)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h * n**-0.5


class Indexer(nn.Module):
    """Top-k selection of compressed entries: ``score[t, c] = sum_h w_h(x_t) relu(<q_th, k_c>)``.

    Index queries ``wq_b(qr) -> [T, Hi, 128]`` (RoPE on the last 64 dims), head weights
    ``weights_proj(x) / sqrt(Di * Hi)``. Index keys: DeepSeek-V4's come from the indexer's
    own :class:`Compressor`, and queries and keys are rotated by a 128 x 128 Hadamard matrix
    (orthogonal: exact scores are unchanged; it spreads outliers before quantization);
    DeepSeek-V4.1's are ``k_norm(wk(latent))`` of the layer compressor's latent before RoPE,
    then RoPE at the group's first position, with no rotation (``cfg.arch``). The
    keys live in ``index_cache``, a paged index-key cache in ``cache.index_format`` addressed
    by the compressed cache's block table and written at its slots; the ids come from
    ``dsv41::indexer_topk`` over each token's ``n_entries`` closed entries (``-1`` padded),
    so the cost follows the entries a request has, not the cache's capacity, in ascending
    id order (position order, as DeepSeek-V4.1's reference attends them; attention takes
    any order, so nothing sorts them by score).
    """

    def __init__(self, cfg: AttentionConfig, cache: CacheConfig, ratio: int, device=None,
                 dcp_group: Optional[str] = None, linear=None, owns_keys: bool = True,
                 candidates: tuple[int, int] = (0, 0)) -> None:
        super().__init__()
        self.dcp_group, self.interleave = dcp_group, cache.dcp_interleave
        linear = linear or (lambda i, o: nn.Linear(i, o, bias=False, dtype=torch.bfloat16, device=device))
        if cfg.index_head_dim != INDEX_DIM:
            raise ValueError(f"the indexer ops take {INDEX_DIM}-wide keys, got index_head_dim {cfg.index_head_dim}")
        self.ratio = ratio
        self.n_heads, self.head_dim, self.rope_dim = cfg.index_n_heads, cfg.index_head_dim, cfg.rope_head_dim
        self.topk = min(cfg.index_topk, cache.max_entries(ratio))
        self.index_format = cache.index_format
        self.n_blocks, self.block = candidates
        self.wq_b = linear(cfg.q_lora_rank, self.n_heads * self.head_dim)
        self.weights_proj = nn.Linear(cfg.dim, self.n_heads, bias=False, dtype=torch.bfloat16, device=device)
        self.compressor = self.wk = self.k_norm = None
        if cfg.v41:  # keys from the layer compressor's latent, on the kv source only
            if owns_keys:
                self.wk = nn.Linear(cfg.head_dim, self.head_dim, bias=False, dtype=torch.bfloat16, device=device)
                self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps, device)
            self.register_buffer("rotation", None, persistent=False)
        else:
            if not owns_keys:
                raise ValueError("a DeepSeek-V4 indexer owns its keys (its own compressor)")
            self.compressor = Compressor(cfg, ratio, self.head_dim, cfg.overlaps(ratio), cache, device)
            self.register_buffer("rotation", hadamard(self.head_dim, device).to(torch.bfloat16), persistent=False)
        keys = None
        if owns_keys:
            keys = new_index_cache(cache.index_format, cache.cmp_num_pages(ratio), cache.block_size(ratio), device=device)
        self.register_buffer("index_cache", keys, persistent=False)

    def write_keys(self, parts: Optional[Tensor], rows: "StepRows", cos_table: Tensor, sin_table: Tensor,
                   inp: StepInputs, latent: Tensor) -> None:
        """Write this step's closed entries' index keys into ``index_cache`` (kv sources only):
        V4's from its own compressor's ``parts`` (:meth:`Compressor.gates`), V4.1's from the
        layer compressor's ``latent``."""
        # written where the compressed entry of the same group is (inp.cmp_slots, -1 if none)
        if self.compressor is not None:
            key, _ = self.compressor(parts, rows, cos_table, sin_table, torch.bfloat16)
            torch.ops.dsv41.write_index_keys(self.index_cache, inp.cmp_slots, key @ self.rotation, self.index_format)
            return
        group_start = rows.pos - rows.pos % self.ratio
        # (a one-token GEMV on CUDA: cuBLAS's small GEMM launch costs more than it reads)
        write_turned(self.index_cache, inp.cmp_slots, mm_bf16(latent, self.wk.weight), self.index_format, 1.0,
                     self.k_norm.weight, self.k_norm.eps, cos_table[group_start], sin_table[group_start])

    def forward(self, q: Tensor, head_weights: Tensor, rows: "StepRows", cos, sin, inp: StepInputs,
                index_cache: Tensor, candidates: Optional[Tensor] = None) -> tuple[Tensor, Optional[Tensor]]:
        """``(ids [T, K], blocks)`` of the index queries ``q = wq_b(qr)`` ``[T, Hi * Di]`` and
        the head weights' logits ``weights_proj(x)`` ``[T, Hi]`` (both bf16, from the layer's
        stacked projections): top-k request-local entry ids (``-1`` padded), each token
        over its own ``rows.n_entries`` of ``index_cache`` (the kv source's keys), inside
        ``candidates`` blocks when given; ``blocks [T, n_blocks]`` this layer's candidate
        blocks when it is the candidate source (``None`` otherwise)."""
        T = q.shape[0]
        # (fp32 before the view: a view of a column slice would specialise T == 1)
        q = apply_rope_last(q.float().view(T, self.n_heads, self.head_dim), self.rope_dim, cos, sin).to(torch.bfloat16)
        if self.rotation is not None:
            q = q @ self.rotation
        q = q.contiguous()
        weights = head_weights.float() * (self.head_dim * self.n_heads) ** -0.5
        call = (q, weights, index_cache, inp.cmp_block_table, inp.token_to_req, rows.n_entries, self.topk)
        dsv41 = torch.ops.dsv41
        # under DCP: this rank's keys, every rank gets the same global ids
        dcp = () if self.dcp_group is None else (self.dcp_group, self.interleave)
        if self.n_blocks:  # the candidate source: its top-k and the blocks from one scoring
            topk_and_blocks = dsv41.dcp_indexer_topk_and_candidates if dcp else dsv41.indexer_topk_and_candidates
            return topk_and_blocks(*call, self.n_blocks, self.block, self.index_format, *dcp, order="id")
        topk = dsv41.dcp_indexer_topk if dcp else dsv41.indexer_topk
        return topk(*call, self.index_format, *dcp, candidates, self.block or 1, order="id"), None


def _unshare_stacked(layer: "DSV41Attention", state_dict, prefix: str, local_metadata) -> None:
    """``state_dict()`` holds copies of the stacked weights, not views of one tensor: a
    saved state dict then holds each weight on its own (safetensors refuses shared memory)."""
    for stacks in layer.stacks.values():
        for s in stacks:
            for name in s.names:
                for key in (f"{prefix}{name}.weight", f"{prefix}{name}.scale"):
                    if key in state_dict:
                        state_dict[key] = state_dict[key].clone()


class Shared(NamedTuple):
    """What a DeepSeek-V4.1 layer reads from the layers it shares with (``graphs.plan``),
    this step: ``cmp_cache`` and ``index_cache``, its kv source's compressed cache and index
    keys (addressed by the same ``cmp_block_table``); ``topk [T, K]`` int32, its index
    source's ids of this step; ``candidates [T, C]`` int32, the candidate source's blocks of
    this step (for the index sources after it). ``None`` where the layer owns the part."""

    cmp_cache: Optional[Tensor] = None
    index_cache: Optional[Tensor] = None
    topk: Optional[Tensor] = None
    candidates: Optional[Tensor] = None


class DSV41Attention(nn.Module):
    """DeepSeek-V4 / V4.1 sparse-MLA attention layer; ``forward`` is one serving step.

    Args:
        cfg: model dimensions and layer kinds (:data:`graphs.V41_FLASH`, :data:`graphs.TINY`,
            :data:`graphs.TINY_V41`, ...; ``cfg.arch`` ``"v4"`` or ``"v4.1"``).
        cache: serving geometry (request rows, longest sequence, pages, kv_format).
        compress_ratio: 0 (SWA only) or one of ``cfg.compress_ratios``.
        device: where parameters, caches and state live.
        seed: weights are random-initialised from this seed (no downloads).

    Buffers: ``swa_cache`` (paged by position) and ``cmp_cache`` (paged by compressed
    entry), both ``[pages, page_size, row_width]`` in ``cache.kv_format``;
    ``compressor.state`` and ``indexer.compressor.state``; ``indexer.index_cache``; ``topk_ids [max_tokens, K]``
    (the last step's request-local compressed ids); ``rope_cos`` / ``rope_sin``.

    Example::

        >>> import torch
        >>> from graphs import CacheConfig, DSV41Attention, StepMetadata, TINY
        >>> layer = DSV41Attention(TINY, CacheConfig(4, 4, 32, 4), compress_ratio=2)
        >>> meta = StepMetadata.for_layer(layer)
        >>> meta.update(torch.tensor([0, 0], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), bucket=2)
        2
        >>> y = layer(torch.randn(2, TINY.dim, dtype=torch.bfloat16), meta.inputs(2))
        >>> y.shape
        torch.Size([2, 64])
    """

    def __init__(self, cfg: AttentionConfig, cache: CacheConfig, compress_ratio: int, device=None, seed: int = 0,
                 dcp_group: Optional[str] = None, weights: str = "bf16", *, plan: Optional[LayerPlan] = None,
                 layer_id: int = 0) -> None:
        super().__init__()
        device = check_device("device", device)
        self.cfg, self.cache_cfg = cfg, cache
        self.compress_ratio = ratio = cache.check_ratio(cfg.check_ratio(compress_ratio)) if compress_ratio else 0
        self.plan, self.layer_id = plan, layer_id
        self.role = role = self._role(plan, layer_id, ratio)
        H, D, G, bf16 = cfg.n_heads, cfg.head_dim, cfg.o_groups, torch.bfloat16
        self.n_heads, self.head_dim, self.rope_dim = H, D, cfg.rope_head_dim
        self.softmax_scale = D ** -0.5
        self.kv_format, self.kv_scale = cache.kv_format, float(cache.kv_scale)
        self.cmp_kv_format = cache.compressed_format
        self.dcp_group, self.dcp_rank, N = _dcp_rank(cfg, cache, ratio, dcp_group)
        self.local_heads, self.local_groups = H // N, G // N
        # (dim, rows per rank) of the parameters sharded over the DCP group: q heads, wo_a's
        # output groups, wo_b's input groups; everything else is replicated
        self.shards = {"wq_b.weight": (0, H // N * D), "wo_a.weight": (0, G // N * cfg.o_lora_rank),
                       "wo_b.weight": (1, G // N * cfg.o_lora_rank)} if N > 1 else {}
        if weights not in ("bf16", "fp8"):
            raise ValueError(f"weights must be 'bf16' or 'fp8' (DeepSeek's block-scaled FP8, blocks of "
                             f"cfg.weight_block), got {weights!r}")
        self.weights = weights
        if weights == "fp8":
            B = cfg.weight_block
            if cfg.o_lora_rank % TILE_N or any(size % B for _, size in self.shards.values()):
                raise ValueError(f"FP8 weights need o_lora_rank ({cfg.o_lora_rank}) to be a multiple of {TILE_N} (the "
                                 f"grouped GEMM's tile) and every DCP shard of the projections a multiple of the "
                                 f"{B}-row scale blocks")
            self.shards.update({k[: -len("weight")] + "scale": (d, n // B) for k, (d, n) in self.shards.items()})

        def linear(i: int, o: int) -> nn.Module:
            if weights == "fp8":
                return Fp8Linear(i, o, device, cfg.weight_block)
            return nn.Linear(i, o, bias=False, dtype=bf16, device=device)

        self.attn_sink = nn.Parameter(torch.zeros(H, dtype=torch.float32, device=device))  # all heads: rank 0 attends them
        self.wq_a = linear(cfg.dim, cfg.q_lora_rank)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps, device)
        self.wq_b = linear(cfg.q_lora_rank, H // N * D)
        self.wkv = linear(cfg.dim, D)
        self.kv_norm = RMSNorm(D, cfg.norm_eps, device)
        self.wo_a = linear(H * D // G, G // N * cfg.o_lora_rank)
        self.wo_b = linear(G // N * cfg.o_lora_rank, cfg.dim)
        self.compressor = Compressor(cfg, ratio, D, cfg.overlaps(ratio), cache, device, position_bias=not cfg.v41,
                                     gate=not (cfg.v41 and ratio == 1)) if role.compresses else None
        # (blocks this layer picks as the candidate source, entries per candidate block)
        candidates = (0, 0)
        if plan is not None and plan.candidate_source is not None:
            candidates = (plan.candidate_topk_blocks if plan.candidate_source == layer_id else 0,
                          plan.candidate_block_size)
        self.uses_candidates = plan is not None and plan.uses_candidates(layer_id)
        self.candidate_block = plan.candidate_block_size if self.uses_candidates else 0
        self.indexer = Indexer(cfg, cache, ratio, device, self.dcp_group, linear, owns_keys=role.compresses,
                               candidates=candidates) if role.indexes else None
        self._register_load_state_dict_pre_hook(self._shard_full_weights)

        cos, sin = rope_tables(layer_inv_freq(cfg, ratio), cache.max_seq_len)
        self.register_buffer("rope_cos", cos.to(device), persistent=False)
        self.register_buffer("rope_sin", sin.to(device), persistent=False)
        self.register_buffer(
            "swa_cache", new_cache(cache.kv_format, cache.swa_num_pages(cfg.window_size), cache.page_size, device=device),
            persistent=False
        )
        side_stream(self.device)  # made here, outside any compiled step
        cmp_cache = None
        if role.compresses:
            cmp_cache = new_cache(cache.compressed_format, cache.cmp_num_pages(ratio), cache.block_size(ratio),
                                  device=device)
        self.register_buffer("cmp_cache", cmp_cache, persistent=False)
        self.topk = (min(cfg.index_topk, cache.max_entries(ratio)) if cfg.has_indexer(ratio)
                     else cache.max_entries(ratio)) if ratio else 0
        # the ids (and candidate blocks) a step picked, kept for the layers that read them
        owns_ids = ratio and (role.indexes or role.index_source is None)
        self.register_buffer(
            "topk_ids", torch.full((cache.max_tokens, self.topk), -1, dtype=torch.int32, device=device)
            if owns_ids else None, persistent=False
        )
        self.register_buffer(
            "candidate_ids", torch.full((cache.max_tokens, candidates[0]), -1, dtype=torch.int32, device=device)
            if candidates[0] else None, persistent=False
        )
        self.stacks: dict[str, tuple[StackedRows, ...]] = {}  # none until _stack_projections
        self.reset_parameters(seed)
        self.requires_grad_(False)  # inference only: caches are written in place every step
        self._stack_projections()
        self.register_load_state_dict_post_hook(lambda module, keys: module.refresh_splits())
        self.register_state_dict_post_hook(_unshare_stacked)

    def _projections(self) -> dict[str, list[tuple[str, nn.Module, Tensor]]]:
        """The projections of each input: ``x`` (``wq_a``, ``wkv``, the compressors' split
        weights, ``indexer.weights_proj``) and ``q`` (of ``qr``: ``wq_b``, ``indexer.wq_b``),
        as ``(name, module, weight)``."""
        x = [("wq_a", self.wq_a, self.wq_a.weight), ("wkv", self.wkv, self.wkv.weight)]
        q = [("wq_b", self.wq_b, self.wq_b.weight)]
        for name, c in (("compressor", self.compressor), ("indexer.compressor", getattr(self.indexer, "compressor", None))):
            if c is not None:
                x.append((name, c, c.split))
        if self.indexer is not None:
            x.append(("indexer.weights_proj", self.indexer.weights_proj, self.indexer.weights_proj.weight))
            q.append(("indexer.wq_b", self.indexer.wq_b, self.indexer.wq_b.weight))
        return {"x": x, "q": q}

    @torch.no_grad()
    def refresh_splits(self) -> None:
        """Derive what the step reads from the loaded weights: each compressor's ``split``
        (:meth:`Compressor.split_weights`), and the stacked projections where a weight is no
        longer a view of its stack. ``load_state_dict`` and ``reset_parameters`` call it;
        call it after changing weights in place (before capturing graphs: a compressor's
        ``split`` may change size)."""
        for m in self.modules():
            if isinstance(m, Compressor):
                m.split_weights()
        self._stack_projections(if_split=True)

    @torch.no_grad()
    def _stack_projections(self, if_split: bool = False) -> None:
        """Stack each input's projections into one weight per storage kind (``graphs.fused``:
        the modules' weights become views of it); ``if_split``: only where a weight is no
        longer a view (``load_state_dict(assign=True)`` replaced it)."""
        if if_split and all(getattr(self, s.weight).untyped_storage().data_ptr() == w.untyped_storage().data_ptr()
                            for side, stacks in self.stacks.items() for s in stacks
                            for name, _, w in self._projections()[side] if name in s.names):
            return
        self.stacks = {}
        for side, members in self._projections().items():
            fp8 = [m for m in members if isinstance(m[1], Fp8Linear)]
            bf16 = [m for m in members if not isinstance(m[1], Fp8Linear)]
            # FP8 weights stack only where every block of rows has its own scale row
            aligned = all(m.out_features % m.block == 0 for _, m, _ in fp8[:-1])
            groups = [bf16] + ([fp8] if aligned else [[m] for m in fp8])
            stacks = []
            for i, group in enumerate(g for g in groups if g):
                weight = f"{side}_proj_{i}"
                # plain attributes, not buffers: they are the parameters' memory, moved by _apply
                setattr(self, weight, stack_rows([w for _, _, w in group]))
                scale = None
                if isinstance(group[0][1], Fp8Linear):
                    scale = weight + "_scale"
                    setattr(self, scale, stack_rows([m.scale for _, m, _ in group]))
                stacks.append(StackedRows(weight, scale, tuple(n for n, _, _ in group),
                                          tuple(w.shape[0] for _, _, w in group),
                                          any(isinstance(m, Compressor) for _, m, _ in group)))
            self.stacks[side] = tuple(stacks)

    def _apply(self, fn, recurse: bool = True):
        # .to() / .cuda() move each weight on its own: stack them again on the new device
        super()._apply(fn, recurse)
        self._stack_projections()
        side_stream(self.device)
        return self

    def _role(self, plan: Optional[LayerPlan], layer_id: int, ratio: int) -> LayerRole:
        """Layer ``layer_id``'s role in ``plan`` (checked against ``ratio``); without a plan
        the layer owns its compressed cache and top-k."""
        if plan is None:
            return LayerRole(layer_id, ratio, layer_id if ratio else None,
                             layer_id if self.cfg.has_indexer(ratio) else None)
        if not 0 <= layer_id < len(plan.layers):
            raise ValueError(f"layer_id must be in 0..{len(plan.layers) - 1} (the plan's layers), got {layer_id}")
        role = plan.layers[layer_id]
        if role.ratio != ratio:
            raise ValueError(f"layer {layer_id} has ratio {role.ratio} in the plan, but compress_ratio is {ratio}")
        return role

    @property
    def reads_shared(self) -> bool:
        """Whether ``forward`` needs :class:`Shared` parts: another layer's compressed cache
        or top-k (a DeepSeek-V4.1 reader, or an index source after the candidate source)."""
        r = self.role
        return bool(r.ratio) and (not r.compresses or (r.index_source not in (None, r.layer_id)) or self.uses_candidates)

    @classmethod
    def from_checkpoint(cls, folder, layer_id: int, cache: CacheConfig, device=None,
                        dcp_group: Optional[str] = None) -> "DSV41Attention":
        """Layer ``layer_id`` of a DeepSeek-V4 checkpoint folder (its ``config.json`` and
        ``*.safetensors``, in DeepSeek's or Hugging Face's naming): the config by
        :meth:`AttentionConfig.from_hf_config`, the layer's compress ratio from the
        config's plan (:class:`graphs.plan.LayerPlan`; a layer that reads another's cache or
        top-k takes them as :class:`Shared`, as :class:`graphs.DSV41Stack` passes them), FP8 weights when the config declares them, and the weights loaded
        strictly by :func:`graphs.checkpoint.load_attention_weights`."""
        from graphs.checkpoint import checkpoint_weights, load_attention_weights, read_config
        from graphs.plan import LayerPlan

        config = read_config(folder)
        plan = LayerPlan.from_config(config)
        if not 0 <= layer_id < len(plan.layers):
            raise ValueError(f"layer_id must be in 0..{len(plan.layers) - 1} (the config's compress_ratios), got {layer_id}")
        layer = cls(AttentionConfig.from_hf_config(config), cache, plan.layers[layer_id].ratio, device=device,
                    dcp_group=dcp_group, weights=checkpoint_weights(config), plan=plan, layer_id=layer_id)
        load_attention_weights(layer, folder, layer_id)
        return layer

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """Random weights: linear ``N(0, 1/in)`` (the compressors' fp32 ``wkv`` / ``wgate``
        rounded to bf16 values, as DeepSeek's checkpoints hold them), norms ``1 + N(0,
        0.1^2)``, ``ape`` and ``attn_sink`` ``N(0, 0.5^2)``; drawn on the CPU so every device
        gets the same, and drawn at their full (DCP=1) shapes, so every rank holds its shard
        of one layer."""
        gen = torch.Generator().manual_seed(seed)
        for name, p in sorted(self.named_parameters()):
            if name.endswith(".scale"):  # set with its FP8 weight below
                continue
            shape = self.full_shape(name, p)
            if name.endswith("norm.weight"):
                value = 1 + 0.1 * torch.randn(shape, generator=gen)
            elif name.endswith("ape") or name == "attn_sink":
                value = 0.5 * torch.randn(shape, generator=gen)
            else:
                value = torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
                if name.split(".")[-2] in ("wkv", "wgate") and "compressor" in name:
                    value = value.to(torch.bfloat16).float()
            value = self.shard(name, value)
            if p.dtype == torch.float8_e4m3fn:  # the bf16 layer of this seed, quantized
                q, scale = quantize_blocks(value.to(torch.bfloat16), self.cfg.weight_block)
                p.copy_(q)
                self.get_parameter(name[: -len("weight")] + "scale").copy_(scale)
            else:
                p.copy_(value)
        self.refresh_splits()

    def full_shape(self, name: str, p: Tensor) -> tuple[int, ...]:
        """The DCP=1 shape of parameter ``name`` (``p`` its local shard)."""
        if name not in self.shards:
            return tuple(p.shape)
        dim, _ = self.shards[name]
        return tuple(n * (self.cache_cfg.dcp_world if d == dim else 1) for d, n in enumerate(p.shape))

    def shard(self, name: str, full: Tensor) -> Tensor:
        """This rank's slice of the full (DCP=1) value of parameter ``name``."""
        if name not in self.shards:
            return full
        dim, size = self.shards[name]
        return full.narrow(dim, self.dcp_rank * size, size)

    def _shard_full_weights(self, state_dict, prefix, *args) -> None:
        """``load_state_dict`` of a full state dict on a DCP rank: slice the sharded
        parameters to this rank (a local shard of the right shape loads as it is)."""
        for name in self.shards:
            value = state_dict.get(prefix + name)
            if value is not None and tuple(value.shape) == self.full_shape(name, self.get_parameter(name)):
                state_dict[prefix + name] = self.shard(name, value)

    @torch.no_grad()
    def reset_cache(self) -> None:
        """Zero caches, compressor state and index keys; the top-k and candidate buffers to
        ``-1`` (buffers derived from the weights, the RoPE tables and scratch stay)."""
        for name, buf in self.named_buffers():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("swa_cache", "cmp_cache", "state", "index_cache"):
                buf.zero_()
            elif leaf in ("topk_ids", "candidate_ids"):
                buf.fill_(-1)

    @property
    def device(self) -> torch.device:
        return self.swa_cache.device

    def step_rows(self) -> list[Tensor]:
        """The buffers whose first ``T`` rows hold what a ``T``-token step picked, token by
        token, after it (``topk_ids``, ``candidate_ids``; those the layer has)."""
        return [b for b in (self.topk_ids, self.candidate_ids) if b is not None]

    def geometries(self) -> list[Geometry]:
        """This layer's one :class:`graphs.metadata.Geometry` (for :class:`StepMetadata`)."""
        return [Geometry.of(self.cfg.window_size, self.cache_cfg, self.compress_ratio, self.dcp_rank)]

    def step_inputs(self, positions, token_to_req, swa_block_table, cmp_block_table) -> StepInputs:
        """:func:`graphs.step_inputs` with this layer's page sizes, ratio and DCP shard."""
        c = self.cache_cfg
        return step_inputs(positions, token_to_req, swa_block_table, cmp_block_table, c.page_size,
                           c.block_size(self.compress_ratio), self.compress_ratio, self.dcp_rank, c.dcp_world,
                           c.dcp_interleave)

    def _check_shared(self, shared: Optional[Shared]) -> Shared:
        shared = Shared() if shared is None else shared
        r, missing = self.role, []
        if not r.compresses and shared.cmp_cache is None:
            missing.append(f"cmp_cache (layer {r.kv_source}'s)")
        if self.indexer is not None and self.indexer.index_cache is None and shared.index_cache is None:
            missing.append(f"index_cache (layer {r.kv_source}'s)")
        if self.indexer is None and r.index_source is not None and shared.topk is None:
            missing.append(f"topk (layer {r.index_source}'s ids of this step)")
        if self.uses_candidates and shared.candidates is None:
            missing.append(f"candidates (layer {self.plan.candidate_source}'s blocks of this step)")
        if missing:
            raise ValueError(f"layer {r.layer_id} reads what other layers own: pass Shared({', '.join(missing)}), "
                             f"or run it in a DSV41Stack")
        return shared

    def _write_caches(self, xs: dict[str, Tensor], inp: StepInputs, cos: Tensor, sin: Tensor,
                      dtype: torch.dtype) -> None:
        """Write the step's window kv, and with its own compressor its closed compressed
        entries and their index keys, from the ``x`` stack's projections ``xs``."""
        rows, rd = inp.rows, self.rope_dim
        write_turned(self.swa_cache, inp.swa_slots, xs["wkv"], self.kv_format, self.kv_scale, self.kv_norm.weight,
                     self.kv_norm.eps, cos, sin)
        if self.compressor is None:
            return
        latent, _ = self.compressor.latent(xs["compressor"], rows, dtype)
        group_start = rows.pos - rows.pos % self.compress_ratio
        entry = apply_rope_last(latent, rd, self.rope_cos[group_start], self.rope_sin[group_start])
        torch.ops.dsv41.write_kv(self.cmp_cache, inp.cmp_slots, entry, self.cmp_kv_format, self.kv_scale)
        if self.indexer is not None and self.indexer.index_cache is not None:
            self.indexer.write_keys(xs.get("indexer.compressor"), rows, self.rope_cos, self.rope_sin, inp, latent)

    def forward(self, x: Tensor, inp: StepInputs, shared: Optional[Shared] = None) -> Tensor:
        """One step of ``T`` tokens: ``x [T, dim]`` bf16 -> ``[T, dim]`` bf16 (rows of
        padding tokens hold garbage). A layer that reads other layers' caches or ids
        (:attr:`reads_shared`) takes them as ``shared`` (:class:`Shared`); ``inp`` then
        addresses its kv source's compressed cache (the same ``cmp_block_table``).

        Any mix of prefill chunks, decode tokens and draft tokens: each request's tokens
        are contiguous in the step at consecutive positions (``inp`` says which), and each
        token is causal on its own (its window ends at its position, it sees the entries
        closed at or before it). The step writes its kv, closed compressed entries and
        index keys before attending, so a token sees itself and the earlier tokens of its
        chunk.
        """
        T, D, rd = x.shape[0], self.head_dim, self.rope_dim
        cache = self.cache_cfg
        if inp.rows is None:  # not derived by the step's metadata: derive them here
            inp = derive(inp, self.geometries()[0])
        rows = inp.rows
        valid, pos = rows.valid, rows.pos
        cos, sin = self.rope_cos[pos], self.rope_sin[pos]

        xs = project(self, self.stacks["x"], x)
        qr = self.q_norm(xs["wq_a"].to(x.dtype))
        # The q GEMM runs on the side stream while this one writes the caches: neither reads
        # what the other writes, and the GEMM leaves SMs free for the writes' small kernels.
        # V4.1 does not normalise q's heads: they are turned in place in the GEMM's output,
        # after it on the side stream.
        turn = TurnedHeads("wq_b", self.rope_cos, self.rope_sin, inp.positions, D) if self.cfg.v41 else None
        q_stacks = project_beside(self, self.stacks["q"], qr, turn)
        self._write_caches(xs, inp, cos, sin, x.dtype)
        join_beside(q_stacks)
        qs = columns(self.stacks["q"], q_stacks)
        if self.cfg.v41:
            q = qs["wq_b"]
            # (the heads where they lie; a view of the column slice would specialise T == 1)
            q = q.as_strided((T, self.local_heads, D), (q.stride(0), D, 1))
        else:  # V4 normalises each head of q (no weight)
            # (fp32 before the view: a view of a column slice would specialise T == 1)
            q = qs["wq_b"].to(x.dtype).float().view(T, self.local_heads, D)
            q = q * torch.rsqrt(q.square().mean(-1, keepdim=True) + self.cfg.norm_eps)
            q = apply_rope_last(q, rd, cos, sin).to(x.dtype)
        swa_idx, swa_lens = inp.swa_idx, inp.swa_lens

        cmp_idx: Optional[Tensor] = None
        cmp_lens: Optional[Tensor] = None
        cmp_cache = self.cmp_cache
        if self.compress_ratio:
            shared = self._check_shared(shared)
            index_cache = self.indexer.index_cache if self.indexer is not None else None
            if self.compressor is None:
                cmp_cache = shared.cmp_cache
            if self.indexer is not None:
                if index_cache is None:
                    index_cache = shared.index_cache
                topk, blocks = self.indexer(qs["indexer.wq_b"].to(x.dtype), xs["indexer.weights_proj"].to(x.dtype),
                                            rows, cos, sin, inp, index_cache, shared.candidates)
                if blocks is not None:
                    self.candidate_ids[:T].copy_(blocks)
            elif self.role.index_source is None:  # dense: every closed entry
                ids = torch.arange(self.topk, device=x.device, dtype=torch.int32)
                topk = torch.where(ids < rows.n_entries.unsqueeze(1), ids, -1)
            else:
                topk = shared.topk
            if self.topk_ids is not None:  # (the slot conversion reads the op's own output, not this copy)
                self.topk_ids[:T].copy_(topk)
            if self.dcp_group is None:
                cmp_idx, cmp_lens = torch.ops.dsv41.topk_to_slots(
                    topk, inp.token_to_req, inp.cmp_block_table, cache.block_size(self.compress_ratio), valid
                )
            else:  # the global ids this rank holds, as its local slots
                cmp_idx, cmp_lens = torch.ops.dsv41.dcp_topk_to_slots(
                    topk, inp.token_to_req, inp.cmp_block_table, cache.block_size(self.compress_ratio), valid,
                    self.dcp_rank, cache.dcp_world, cache.dcp_interleave,
                )

        sink: Optional[Tensor] = self.attn_sink
        if self.dcp_group is not None:
            # every rank attends all heads over its shard; rank 0 alone adds the window and
            # the sink, so each is counted once when dcp_combine merges the partials
            q = all_gather_heads(q, self.dcp_group, cache.dcp_world)
            if self.dcp_rank:
                swa_lens, sink = torch.zeros_like(swa_lens), None
        o = q.new_empty(q.shape)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        torch.ops.dsv41.sparse_mla_out(
            q, self.swa_cache, swa_idx, swa_lens, cmp_cache, cmp_idx, cmp_lens, sink,
            self.softmax_scale, self.kv_format, self.kv_scale, o, lse, None, self.cmp_kv_format,
        )
        if self.dcp_group is not None:
            o, _ = torch.ops.dsv41.dcp_combine(o, lse, self.dcp_group, "ag_rs")  # this rank's heads
        groups, lora = self.local_groups, self.cfg.o_lora_rank
        rope_heads_(o.view(T, -1), cos, sin, D, inverse=True)
        if isinstance(self.wo_a, Fp8Linear):  # the grouped FP8 GEMM: group g's heads times its rows of wo_a
            flat = torch.ops.dsv41.fp8_linear(o.view(T, -1), self.wo_a.weight, self.wo_a.scale, groups)
        else:
            wo_a = self.wo_a.weight.view(groups, lora, -1)
            # One GEMM per group, batched over groups, each group's output transposed:
            # [G, o_lora, H*D/G] @ [G, H*D/G, T] -> [G, o_lora, T], which is [T, G * o_lora]
            # column-major, read by wo_b as it lies (no copy back to token-major). (A matmul
            # broadcasting wo_a over tokens would copy the 67 MB weight once per token.)
            flat = torch.bmm(wo_a, o.view(T, groups, -1).permute(1, 2, 0)).view(groups * lora, T).t()
        y = self.wo_b(flat) if isinstance(self.wo_b, Fp8Linear) else mm_bf16(flat, self.wo_b.weight)
        if self.dcp_group is not None:  # each rank's output groups: the sum is the layer's output
            c10d = torch.ops._c10d_functional
            y = c10d.wait_tensor(c10d.all_reduce(y, "sum", self.dcp_group))
        return y

    def extra_repr(self) -> str:
        c = self.cache_cfg
        return (f"{self.cfg.name}, compress_ratio={self.compress_ratio}, kv_format={c.kv_format!r}, "
                f"requests={c.max_requests}, max_seq_len={c.max_seq_len}, page_size={c.page_size}")
