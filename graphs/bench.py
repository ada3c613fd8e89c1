"""Measurement helpers for ``python -m graphs``: layer setups, timers, the per-batch table.

Three ways to run one decode step of ``b`` tokens are timed side by side:

* ``eager``: the layer in eager mode (``DecodeRunner(compile=False, cuda_graphs=False)``),
  wall clock per step including Python and launch overhead -- what an engine without
  graphs pays.
* ``compiled``: the Inductor-compiled step called directly, no graph.
* ``step``: :meth:`DecodeRunner.step` -- copy the step's inputs into the static buffers and
  replay the bucket's CUDA graph (wall clock); ``replay``: the graph replay alone (CUDA
  events); ``kernels``: the sum of the GPU times of the kernels one replay runs
  (``torch.profiler``), the floor a graph can reach.

:func:`agreement` is the job's verdict: the compiled decode against the eager one, token by
token, within :data:`REL_TOL`.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

import compile_ops
from compile_ops.indexer.cache import INDEX_DIM
from graphs.attention import DSV41Attention
from graphs.config import V41_FLASH, AttentionConfig, CacheConfig
from graphs.runner import DecodeRunner

# A compiled token's output may differ from the eager one's by this much of the eager
# decode's largest |y|: bf16 rounding in other fusions and summation orders.
REL_TOL = 2e-2
# The compiled and eager indexers score in bf16 through different kernels, so where two
# entries' scores nearly tie at the top-k boundary they may keep different ones. A token
# whose picks differ in at most this many entries is such a near-tie: its output (which
# attends other entries) is not compared. More is a failure.
MAX_TIE_SWAPS = 2


@dataclass(frozen=True)
class Agreement:
    """How a decode agrees with a reference decode of the same schedule, token by token.

    ``tokens``: tokens compared; ``tie_tokens``: tokens whose indexer top-k differ in at
    most :data:`MAX_TIE_SWAPS` entries (near-ties: outputs not compared);
    ``pick_mismatches``: tokens whose top-k differ in more; ``max_abs_diff`` /
    ``max_rel_diff``: the largest output difference over the other tokens, absolute and
    relative to the reference's largest ``|y|``.
    """

    tokens: int
    tie_tokens: int
    pick_mismatches: int
    max_abs_diff: float
    max_rel_diff: float

    @property
    def passed(self) -> bool:
        return self.pick_mismatches == 0 and self.max_rel_diff <= REL_TOL

    def verdict(self) -> str:
        ties = f", {self.tie_tokens} near-tie token(s) left out" if self.tie_tokens else ""
        picks = f", {self.pick_mismatches} token(s) with other top-k picks" if self.pick_mismatches else ""
        return (f"{'PASS' if self.passed else 'FAIL'}: {self.tokens} tokens, largest difference "
                f"{self.max_abs_diff:.3g} = {self.max_rel_diff:.2e} of max |y| (tolerance {REL_TOL:g}){ties}{picks}")


def agreement(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor],
              got_ids: Optional[Sequence[torch.Tensor]] = None,
              want_ids: Optional[Sequence[torch.Tensor]] = None) -> Agreement:
    """Compare per-request outputs ``got[r]`` with ``want[r]`` (``[n_r, dim]``), skipping
    near-ties of the top-k ids ``*_ids[r]`` (``[n_r, K]`` int32, ``-1`` padded; ``None``
    for a layer without indexer)."""
    scale = max((w.float().abs().max().item() for w in want if w.numel()), default=0.0) or 1.0
    tokens = ties = mismatches = 0
    diff = 0.0
    for r, (g, w) in enumerate(zip(got, want)):
        token_diff = (g.float() - w.float()).abs().amax(dim=-1) if g.numel() else g.new_zeros(0)
        swaps = torch.zeros(len(token_diff), dtype=torch.long)
        if got_ids is not None:
            for t, (a, b) in enumerate(zip(got_ids[r].tolist(), want_ids[r].tolist())):
                swaps[t] = max(len(set(a) - set(b)), len(set(b) - set(a)))
        tokens += len(token_diff)
        ties += int(((swaps > 0) & (swaps <= MAX_TIE_SWAPS)).sum())
        mismatches += int((swaps > MAX_TIE_SWAPS).sum())
        same = (swaps == 0).to(token_diff.device)
        if same.any():
            diff = max(diff, token_diff[same].max().item())
    return Agreement(tokens, ties, mismatches, diff, diff / scale)


def flash_cache(*, max_requests: int = 256, max_seq_len: int = 2048, page_size: int = 64,
                kv_format: str = "bf16") -> CacheConfig:
    """The serving geometry of :func:`flash_layer`."""
    return CacheConfig(max_requests=max_requests, max_tokens=max_requests, max_seq_len=max_seq_len,
                       page_size=page_size, kv_format=kv_format)


def flash_layer(ratio: int, device, *, cfg: AttentionConfig = V41_FLASH, max_requests: int = 256,
                max_seq_len: int = 2048, page_size: int = 64, kv_format: str = "bf16", seed: int = 0) -> DSV41Attention:
    """The V4.1-Flash layer the GPU tests and the benchmark share (identical shapes, so a
    second process finds Inductor's compiled graph in its on-disk cache)."""
    cache = flash_cache(max_requests=max_requests, max_seq_len=max_seq_len, page_size=page_size, kv_format=kv_format)
    return DSV41Attention(cfg, cache, ratio, device=device, seed=seed)


@torch.no_grad()
def fill_random(layer: DSV41Attention, seed: int = 0) -> None:
    """Fill bf16 caches and the index keys with random rows, so a step at a late position
    attends a full window and a top-k chosen among many real scores."""
    gen = torch.Generator(device=layer.swa_cache.device).manual_seed(seed)
    for name in ("swa_cache", "cmp_cache"):
        buf = layer.get_buffer(name)
        if buf is not None and buf.dtype == torch.bfloat16:
            buf.normal_(generator=gen)
    if layer.indexer is not None:  # quantized like real keys: random bytes would not be
        keys = layer.indexer.index_cache
        n = keys.shape[0] * keys.shape[1]
        compile_ops.write_index_keys(keys, torch.arange(n, device=keys.device),
                                     torch.randn(n, INDEX_DIM, device=keys.device, generator=gen), layer.indexer.index_format)


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


def kernel_time(fn: Callable[[], object], iters: int = 5, top: Optional[list] = None) -> float:
    """Sum of the GPU times of the kernels (and device memcpy/memset) ``fn`` runs, in
    microseconds per call, from ``torch.profiler``; 0 if the profiler saw none. ``top``,
    if given, receives the 8 costliest kernels as ``(name, us per call)``."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
    if top is not None:
        costly = sorted(kernels, key=lambda e: -e.self_device_time_total)[:8]
        top.extend((e.key[:80], round(e.self_device_time_total / iters, 1)) for e in costly)
    return sum(e.self_device_time_total for e in kernels) / iters


def decode_inputs(batch: int, position: int, dim: int, device, seed: int = 0):
    """A step of ``batch`` requests (rows ``0..batch-1``), all at ``position``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, dim, generator=gen).to(torch.bfloat16).to(device)
    positions = torch.full((batch,), position, dtype=torch.int32, device=device)
    rows = torch.arange(batch, dtype=torch.int32, device=device)
    return x, positions, rows


@torch.no_grad()
def time_batches(runner: DecodeRunner, eager: DecodeRunner, batches, position: int, *, iters: int = 20,
                 replay_iters: int = 100, profile_batches=(), deadline: Optional[float] = None) -> list[dict]:
    """One row per batch size: microseconds of eager / compiled / step / replay / kernels."""
    device = runner.layer.swa_cache.device
    cuda = device.type == "cuda"
    rows = []
    for b in batches:
        if deadline is not None and time.perf_counter() > deadline:
            break
        x, positions, req = decode_inputs(b, position, runner.layer.cfg.dim, device)
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
                row["top_kernels"] = []
                row["kernels_us"] = kernel_time(runner.graphs[bucket].replay, top=row["top_kernels"])
                row["kernels_from"] = "graph replay"
                if not row["kernels_us"]:  # the profiler saw no kernels inside the graph
                    row["top_kernels"] = []
                    row["kernels_us"] = kernel_time(compiled_step, top=row["top_kernels"])
                    row["kernels_from"] = "compiled step without graph"
        rows.append(row)
    return rows


def eager_twin(layer: DSV41Attention, buckets) -> DecodeRunner:
    """An eager runner over a deep copy of ``layer`` (same weights and state)."""
    return DecodeRunner(copy.deepcopy(layer), buckets=buckets, compile=False, cuda_graphs=False)


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
        ax.set_xlabel("batch (tokens per decode step)")
        ax.set_ylabel("microseconds per step")
        ax.set_title(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
