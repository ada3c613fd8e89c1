"""Measurement helpers for ``python -m graphs``: layer setups, timers, floors, tables.

Decode steps of ``b`` tokens are timed four ways side by side:

* ``eager``: the layer in eager mode (``StepRunner(compile=False, cuda_graphs=False)``),
  wall clock per step including Python and launch overhead -- what an engine without
  graphs pays.
* ``compiled``: the Inductor-compiled step called directly, no graph.
* ``step``: :meth:`StepRunner.step` -- plan pages on the host, copy the step's inputs into
  the static buffers and replay the bucket's CUDA graph (wall clock); ``replay``: the graph
  replay alone (CUDA events); ``kernels``: the sum of the GPU times of the kernels one
  replay runs (``torch.profiler``), the floor a graph can reach.

Larger steps (prefill chunks past the largest bucket) run as pieces of the largest bucket:
:func:`time_large_steps` splits a step's cost into host time (until the call returns, the
work enqueued) and wall time. Floors: :func:`decode_floor_us` (bytes read
once at the copy bandwidth) and :func:`step_flops` (the matrix work at the bf16 rate).
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch

import compile_ops
from compile_ops.bench import BF16_FLOPS_PER_S, COPY_BYTES_PER_S
from compile_ops.formats import get_format
from compile_ops.indexer.cache import INDEX_DIM, get_index_format
from graphs.attention import Compressor, DSV41Attention
from graphs.config import V41_FLASH, AttentionConfig, CacheConfig
from graphs.runner import StepRunner



def flash_cache(*, max_requests: int = 256, max_seq_len: int = 2048, page_size: int = 64, kv_format: str = "bf16",
                max_tokens: int = 512, **pools) -> CacheConfig:
    """The serving geometry of :func:`flash_layer`."""
    return CacheConfig(max_requests=max_requests, max_tokens=max_tokens, max_seq_len=max_seq_len,
                       page_size=page_size, kv_format=kv_format, **pools)


def flash_layer(ratio: int, device, *, cfg: AttentionConfig = V41_FLASH, seed: int = 0, weights: str = "bf16",
                **cache) -> DSV41Attention:
    """The V4.1-Flash layer the GPU tests and the benchmark share (identical shapes, so a
    second process finds Inductor's compiled graph in its on-disk cache)."""
    return DSV41Attention(cfg, flash_cache(**cache), ratio, device=device, seed=seed, weights=weights)


@torch.no_grad()
def fill_random(layer: DSV41Attention, seed: int = 0) -> None:
    """Fill bf16 caches and the index keys with random rows, so a step at a late position
    attends a full window and a top-k chosen among many real scores."""
    gen = torch.Generator(device=layer.swa_cache.device).manual_seed(seed)
    for buf in (layer.swa_cache, layer.cmp_cache):
        if buf is not None and buf.dtype == torch.bfloat16:
            buf.normal_(generator=gen)
    if layer.indexer is not None and layer.indexer.index_cache is not None:  # quantized like real keys
        keys = layer.indexer.index_cache
        n = keys.shape[0] * keys.shape[1]
        for start in range(0, n, 1 << 20):
            slots = torch.arange(start, min(n, start + (1 << 20)), device=keys.device)
            compile_ops.write_index_keys(keys, slots, torch.randn(slots.numel(), INDEX_DIM, device=keys.device,
                                                                  generator=gen), layer.indexer.index_format)


def grow_rows(runner: StepRunner, rows, length: int) -> None:
    """Give request rows ``rows`` the pages of ``length`` tokens (released first), as if
    steps had written them, and copy the tables in."""
    for r in rows:
        runner.release(r)
        runner.pages.grow(r, length)
    runner.meta.apply_pages(runner.pages.take_changes())


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_host(fn: Callable[[], object], device, iters: int, warmup: int = 2) -> float:
    """Wall-clock microseconds per call (device synchronised before and after)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / iters * 1e6


def time_replay(graph: "torch.cuda.CUDAGraph", iters: int) -> float:
    """Microseconds per replay, by CUDA events around ``iters`` back-to-back replays."""
    graph.replay()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / iters * 1e3


def decode_replay_at(runner: StepRunner, batch: int, position: int, iters: int, reps: int = 1) -> float:
    """Microseconds per replay of ``runner``'s bucket for ``batch`` requests (rows ``0 ..
    batch - 1``, their pages grown to ``position`` tokens by :func:`grow_rows`) each decoding
    one token at ``position``: the best of ``reps`` loops of ``iters`` (:func:`time_replay`)."""
    grow_rows(runner, range(batch), position)
    bucket = runner.bucket_for(batch)
    runner.meta.update(torch.full((batch,), position, dtype=torch.int32), torch.arange(batch, dtype=torch.int32),
                       bucket=bucket)
    return min(time_replay(runner.graphs[bucket], iters) for _ in range(reps))


class KernelProfile(NamedTuple):
    """What ``torch.profiler`` saw of one call (kernels and device memcpy / memset)."""

    us: float  # summed GPU microseconds per call (0: the profiler saw none)
    count: int  # kernels per call
    top: list  # the 8 costliest as (name, us per call)
    names: frozenset  # every kernel's name
    ops: dict  # GPU microseconds per call of the kernels each dsv41 op ran, by op name (none inside a graph)
    streams: int  # CUDA streams its kernels ran on


def profile_kernels(fn: Callable[[], object], iters: int = 5) -> KernelProfile:
    """The kernels ``fn`` runs per call (a CUDA graph's replay: the kernels inside it)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
    costly = sorted(kernels, key=lambda e: -e.self_device_time_total)[:8]
    ops: dict[str, float] = {}
    streams = set()
    for e in prof.events():  # an op's device time holds the kernels of the ops it calls
        if e.name.startswith("dsv41::") and e.device_type == DeviceType.CPU:
            ops[e.name] = ops.get(e.name, 0.0) + e.device_time_total / iters
        elif e.device_type == DeviceType.CUDA:
            streams.add(e.device_resource_id)
    return KernelProfile(sum(e.self_device_time_total for e in kernels) / iters,
                         round(sum(e.count for e in kernels) / iters),
                         [(e.key[:80], round(e.self_device_time_total / iters, 1)) for e in costly],
                         frozenset(e.key for e in kernels), ops, len(streams))


def time_page_planning(batches=(1, 64, 256), steps: int = 192, context: int = 1024, *, stagger: bool = False,
                       reps: int = 3) -> list[dict]:
    """Host microseconds per decode step of the page work of :meth:`StepRunner.step`
    (``plan``, ``take_changes``, ``apply_pages`` to a host :class:`StepMetadata` through a
    staging buffer, ``trim``) for ``b`` requests decoding from ``context`` tokens, in the
    V4.1-Flash serving geometry of :func:`flash_layer` (256 rows, 139264-token sequences,
    64-token pages, ratio 2): the best of ``reps`` runs of ``steps`` steps.
    ``stagger``: row ``r`` starts at ``context + 7r mod 64``, so some rows take or give
    back pages every step (without it every row crosses a page in the same step)."""
    from graphs.metadata import Geometry, StepMetadata
    from graphs.pages import PageAllocator
    from graphs.runner import PAGE_STAGING_WORDS

    cache = flash_cache(max_requests=256, max_seq_len=139264, kv_format="fp8_dsv41")
    meta = StepMetadata(1, [Geometry.of(V41_FLASH.window_size, cache, 2)], "cpu")
    staging = torch.empty(PAGE_STAGING_WORDS, dtype=torch.int32)
    rows = []
    for b in batches:
        req = torch.arange(b, dtype=torch.int32)
        start = torch.tensor([context + (7 * r % 64 if stagger else 0) for r in range(b)], dtype=torch.int32)
        best = float("inf")
        for _ in range(reps):
            pages = PageAllocator(cache, 2, V41_FLASH.window_size)
            for r in range(b):
                pages.grow(r, int(start[r]))
            meta.apply_pages(pages.take_changes())
            steps_pos = [start + i for i in range(steps)]
            began = time.perf_counter()
            for pos in steps_pos:
                pages.plan(pos, req)
                meta.apply_pages(pages.take_changes(), staging=staging)
                pages.trim()
            best = min(best, (time.perf_counter() - began) / steps * 1e6)
        rows.append({"batch": b, "stagger": stagger, "host_us": round(best, 1)})
    return rows


@torch.no_grad()
def time_step_overhead(runner: StepRunner, batch: int, position: int, *, steps: int = 300, reps: int = 3,
                       warmup: int = 50, in_place: bool = False, stagger: bool = False) -> dict:
    """``StepRunner.step`` wall time against the bucket's replay alone, in microseconds per
    step: ``batch`` request rows decoding from ``position``, ``steps`` back-to-back steps
    (after ``warmup`` steps) against ``steps`` back-to-back replays (the captured graph,
    or the compiled / eager step where none is captured), ``reps`` times interleaved, the
    best of each; then ``steps`` more steps each after a synchronize, timed up to the
    return of ``step`` (the host's own time: above the replay, the host sets the pace), the
    median, the best of the ``reps``. ``in_place``: the hidden states are
    :meth:`StepRunner.input` itself (no copy); ``stagger``: row ``r`` starts at ``position +
    7 r mod page_size``, so some row takes or gives back a page every step. Every row of
    the runner is released first. Returns ``{"step_us", "replay_us", "ratio", "host_us"}``."""
    layer, device = runner.layer, runner.x.device
    page = layer.cache_cfg.page_size
    size = runner.bucket_for(batch)
    replay = runner.graphs[size].replay if size in runner.graphs else (lambda: runner.run(size))
    x = torch.randn(batch, layer.cfg.dim, generator=torch.Generator().manual_seed(batch)).to(torch.bfloat16).to(device)
    if in_place:
        x = runner.input(batch).copy_(x)
    req = torch.arange(batch, dtype=torch.int32)
    start = torch.tensor([position + ((r * 7) % page if stagger else 0) for r in range(batch)], dtype=torch.int32)
    best = {"step_us": float("inf"), "replay_us": float("inf"), "host_us": float("inf")}
    for _ in range(reps):
        for r in range(layer.cache_cfg.max_requests):
            runner.release(r)
        for r in range(batch):
            runner.pages.grow(r, int(start[r]))
        runner.meta.apply_pages(runner.pages.take_changes())
        for i in range(warmup):
            runner.step(x, start + i, req)
        positions = [start + warmup + i for i in range(steps)]
        _sync(device)
        begin = time.perf_counter()
        for p in positions:
            runner.step(x, p, req)
        _sync(device)
        best["step_us"] = min(best["step_us"], (time.perf_counter() - begin) / steps * 1e6)
        best["replay_us"] = min(best["replay_us"], time_host(replay, device, steps, warmup=0))
        host = []
        for i in range(steps):
            _sync(device)
            begin = time.perf_counter()
            runner.step(x, start + warmup + steps + i, req)
            host.append(time.perf_counter() - begin)
        _sync(device)
        best["host_us"] = min(best["host_us"], statistics.median(host) * 1e6)
    return {**{k: round(v, 1) for k, v in best.items()}, "ratio": round(best["step_us"] / best["replay_us"], 3)}


@torch.no_grad()
def time_batches(runner: StepRunner, eager: StepRunner, batches, position: int, *, iters: int = 20,
                 replay_iters: int = 100, profile_batches=(), deadline: Optional[float] = None) -> list[dict]:
    """One row per batch size ``b`` (rows ``0..b-1`` decoding at ``position``):
    microseconds of eager / compiled / step / replay / kernels."""
    device = runner.layer.swa_cache.device
    cuda = device.type == "cuda"
    rows = []
    for b in batches:
        if deadline is not None and time.perf_counter() > deadline:
            break
        for r in (runner, eager):
            grow_rows(r, range(b), position)
        gen = torch.Generator().manual_seed(b)
        x = torch.randn(b, runner.layer.cfg.dim, generator=gen).to(torch.bfloat16).to(device)
        positions, req = torch.full((b,), position, dtype=torch.int32), torch.arange(b, dtype=torch.int32)
        bucket = runner.bucket_for(b)
        row = {"batch": b, "bucket": bucket}
        row["eager_us"] = time_host(lambda: eager.step(x, positions, req), device, max(5, iters // 2))

        def compiled_step():
            runner.meta.update(positions, req, bucket=bucket)
            runner.x[:b].copy_(x)
            return runner.run(bucket)

        row["compiled_us"] = time_host(compiled_step, device, iters)
        if cuda:
            row["step_us"] = time_host(lambda: runner.step(x, positions, req), device, replay_iters)
            row["replay_us"] = time_replay(runner.graphs[bucket], replay_iters)
            if b in profile_batches:
                prof = profile_kernels(runner.graphs[bucket].replay)
                row["kernels_from"] = "graph replay"
                if not prof.us:  # the profiler saw no kernels inside the graph
                    prof = profile_kernels(compiled_step)
                    row["kernels_from"] = "compiled step without graph"
                row.update(kernels_us=prof.us, kernels_per_step=prof.count, top_kernels=prof.top)
        rows.append(row)
    return rows


def weight_bytes(layer: DSV41Attention) -> int:
    """Bytes of the layer's parameters (what it holds; :func:`read_weight_bytes`: what a
    step reads)."""
    return sum(p.numel() * p.element_size() for p in layer.parameters())


def read_weight_bytes(layer: DSV41Attention) -> int:
    """Bytes of the weights a step reads: the parameters, with each compressor's fp32
    ``wkv`` / ``wgate`` counted as the bf16 ``split`` the step multiplies (half their bytes
    for bf16-valued weights, the same bytes as high and low parts)."""
    compressors = [m for m in layer.modules() if isinstance(m, Compressor)]
    held = {id(linear.weight) for c in compressors for linear in (c.wkv, c.wgate) if linear is not None}
    return (sum(p.numel() * p.element_size() for p in layer.parameters() if id(p) not in held)
            + sum(c.split.numel() * c.split.element_size() for c in compressors))


def decode_floor_us(layer: DSV41Attention, batch: int, context: int) -> dict:
    """The byte floor of a decode step of ``batch`` requests at ``context`` tokens: the
    weights, each request's index keys and attention rows (window + top-k) read once at
    the copy bandwidth."""
    c, r = layer.cache_cfg, layer.compress_ratio
    entries = context // r if r else 0
    keys = batch * entries * get_index_format(c.index_format).bytes_per_token if layer.indexer is not None else 0
    attended = batch * (layer.cfg.window_size * get_format(c.kv_format).bytes_per_token
                        + min(layer.topk, entries) * get_format(c.compressed_format).bytes_per_token)
    parts = {"weights": read_weight_bytes(layer), "index_keys": keys, "attention_rows": attended}
    return {"bytes": parts, "floor_us": sum(parts.values()) / COPY_BYTES_PER_S * 1e6}


def step_flops(layer: DSV41Attention, tokens: int, n_entries_sum: int) -> float:
    """Matrix FLOPs of a step of ``tokens`` tokens whose indexer scores ``n_entries_sum``
    entries in all: ``2 * in * out`` per token per linear, attention ``4 * H * 512`` per
    attended row (window + top-k), the indexer ``2 * Hi * 128`` per scored entry."""
    linear = sum(p.numel() for n, p in layer.named_parameters() if n.endswith(".weight") and p.dim() == 2)
    attended = layer.cfg.window_size + layer.topk
    flops = 2 * linear * tokens + 4 * layer.n_heads * layer.head_dim * attended * tokens
    if layer.indexer is not None:
        flops += 2 * layer.indexer.n_heads * layer.indexer.head_dim * n_entries_sum
    return float(flops)


def prefill_flops(model, prompt: int) -> float:
    """:func:`step_flops` of a ``prompt``-token prefill summed over ``model``'s layers (a
    :class:`graphs.DSV41Attention` or a :class:`graphs.DSV41Stack`): the token at position
    ``p`` scores the ``(p + 1) // ratio`` entries before it, or at most its candidate
    blocks' entries in a layer that scores inside the candidate source's blocks."""
    layers = [model] if isinstance(model, DSV41Attention) else [block.attn for block in model.blocks]
    total = 0.0
    for layer in layers:
        entries = 0
        if layer.indexer is not None:
            r = layer.compress_ratio
            per_token = torch.arange(1, prompt + 1) // r
            if layer.uses_candidates:
                per_token = per_token.clamp(max=layer.plan.candidate_topk_blocks * layer.candidate_block // r)
            entries = int(per_token.sum())
        total += step_flops(layer, prompt, entries)
    return total


@torch.no_grad()
def time_prefill(runner: StepRunner, prompt: int, chunk: int, row: int = 0) -> dict:
    """A ``prompt``-token prefill of request row ``row`` in chunks of ``chunk`` tokens (a
    chunk past the largest bucket runs in pieces): wall time, tokens/s, the share of the
    bf16 matrix rate its FLOPs (:func:`prefill_flops`) reach, and the last chunk's kernels
    (run again compiled, without a graph, so the profiler sees each op): their GPU time,
    the costliest, and the share of it inside the ``dsv41`` indexer ops."""
    layer, device = runner.layer, runner.layer.device
    gen = torch.Generator().manual_seed(prompt)
    x = torch.randn(chunk, layer.cfg.dim, generator=gen).to(torch.bfloat16).to(device)

    def run():
        runner.release(row)
        for p in range(0, prompt, chunk):
            n = min(chunk, prompt - p)
            runner.step(x[:n], torch.arange(p, p + n, dtype=torch.int32), torch.full((n,), row, dtype=torch.int32))

    run()  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    run()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    # the metadata still holds the last chunk: running it again rewrites what it wrote
    last = runner.bucket_for(prompt - (prompt - 1) // chunk * chunk)
    prof = profile_kernels(lambda: runner.run(last), iters=2)
    indexer_us = sum(us for name, us in prof.ops.items() if "indexer" in name)
    flops = prefill_flops(layer, prompt)
    runner.release(row)
    return {"prompt": prompt, "chunk": chunk, "ms": round(seconds * 1e3, 2), "tokens_per_s": round(prompt / seconds),
            "tflops": round(flops / seconds / 1e12, 1), "pct_of_bf16_rate": round(100 * flops / seconds / BF16_FLOPS_PER_S, 1),
            "chunk_kernels_us": round(prof.us, 1), "chunk_indexer_us": round(indexer_us, 1),
            "chunk_top_kernels": prof.top}


@torch.no_grad()
def time_large_steps(runner: StepRunner, sizes, iters: int = 5) -> list[dict]:
    """Steps of ``n`` tokens (one request's prefill chunk at position 0, request row 0
    released before each), each from an idle GPU: the host's microseconds until the call
    returns (its work all enqueued) and the wall microseconds until the GPU is done, the
    medians of ``iters``. Past the largest bucket a step runs in ``pieces`` graph replays."""
    layer, device = runner.layer, runner.layer.device
    out = []
    for n in sizes:
        x = torch.randn(n, layer.cfg.dim, device=device).to(torch.bfloat16)
        positions, rows = torch.arange(n, dtype=torch.int32), torch.zeros(n, dtype=torch.int32)
        host, wall = [], []
        for i in range(iters + 1):  # the first: warm-up
            runner.release(0)
            torch.cuda.synchronize()
            start = time.perf_counter()
            runner.step(x, positions, rows)
            enqueued = time.perf_counter()
            torch.cuda.synchronize()
            if i:
                host.append(enqueued - start)
                wall.append(time.perf_counter() - start)
        largest = runner.buckets[-1]
        out.append({"tokens": n, "pieces": -(-n // largest), "host_us": round(statistics.median(host) * 1e6, 1),
                    "wall_us": round(statistics.median(wall) * 1e6, 1)})
    runner.release(0)
    return out


@torch.no_grad()
def capacity_replays(cfg: AttentionConfig, ratio: int, device, *, batch: int = 64, context: int = 1024,
                     capacities=(4096, 1 << 20), iters: int = 200) -> list[dict]:
    """Decode replay of ``batch`` requests at ``context`` tokens in layers whose
    ``max_seq_len`` is each of ``capacities`` (fp8 caches, pools for every row at
    ``max_seq_len``): cost must follow the content, not the capacity. The steps
    are eager-captured graphs (no compile: the comparison is of one kernel set)."""
    out = []
    for cap in capacities:
        cache = CacheConfig(batch, batch, cap, 64, kv_format="fp8_dsv41")  # pools: every row at max_seq_len
        layer = DSV41Attention(cfg, cache, ratio, device=device)
        runner = StepRunner(layer, (batch,), compile=False)
        runner.capture(warmup=1)
        grow_rows(runner, range(batch), context)
        runner.meta.update(torch.full((batch,), context, dtype=torch.int32), torch.arange(batch, dtype=torch.int32),
                           bucket=batch)
        out.append({"max_seq_len": cap, "replay_us": round(time_replay(runner.graphs[batch], iters), 1)})
        del runner, layer
        torch.cuda.empty_cache()
    return out


@dataclass(frozen=True)
class PickMatched:
    """Two runs of one workload compared where they pick the same top-k ids: ``worst`` is
    the largest output difference over those tokens relative to the reference's largest
    ``|y|``, ``share`` the fraction of tokens that pick the same ids (``1`` without an
    indexer); passes at ``worst <= tolerance`` and ``share >= min_share``."""

    tokens: int
    worst: float
    share: float
    tolerance: float
    min_share: float

    @property
    def passed(self) -> bool:
        return self.worst <= self.tolerance and self.share >= self.min_share

    def verdict(self, what: str) -> str:
        return (f"{'PASS' if self.passed else 'FAIL'}: {what}: {self.tokens} tokens, {100 * self.share:.1f} % pick the "
                f"same ids (at least {100 * self.min_share:.0f} %), largest difference among them {self.worst:.2e} of "
                f"max |y| (tolerance {self.tolerance:g})")


def pick_matched(got, want, got_ids=None, want_ids=None, *, tolerance: float, min_share: float) -> PickMatched:
    """:class:`PickMatched` of per-request outputs ``[n_q, dim]`` and top-k ids ``[n_q, K]``
    (``None``: compare every token). A token whose near-tied scores pick another entry in
    one run attends other rows, which no output tolerance covers."""
    scale = max(w.float().abs().max().item() for w in want if w.numel())
    worst, same, tokens = 0.0, 0, 0
    for q, (g, w) in enumerate(zip(got, want)):
        if got_ids is None:
            alike = torch.ones(g.shape[0], dtype=torch.bool, device=g.device)
        else:
            alike = (got_ids[q].sort(-1).values == want_ids[q].sort(-1).values).all(-1)
        if alike.any():
            worst = max(worst, (g.float() - w.float())[alike].abs().max().item() / scale)
        same, tokens = same + int(alike.sum()), tokens + alike.numel()
    return PickMatched(tokens, worst, same / max(tokens, 1), tolerance, min_share)


def eager_twin(layer: DSV41Attention, buckets) -> StepRunner:
    """An eager runner over a deep copy of ``layer`` (same weights and state)."""
    return StepRunner(copy.deepcopy(layer), buckets=buckets, compile=False, cuda_graphs=False)


def plot(results: dict, path: str, title: str) -> None:
    """Step time per batch size, one panel per layer ratio (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.5), squeeze=False)
    for ax, (label, rows) in zip(axes[0], results.items()):
        batches = [r["batch"] for r in rows]
        for key, name in (("eager_us", "eager"), ("compiled_us", "compiled, no graph"),
                          ("step_us", "graph step (copy-in + replay)"), ("replay_us", "graph replay")):
            if all(key in r for r in rows):
                ax.plot(batches, [r[key] for r in rows], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch (requests, one token each)")
        ax.set_ylabel("microseconds per step")
        ax.set_title(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
