"""GPU tests of the decode-step CUDA graphs (run on the device machine: ``pytest -m gpu``).

The layer is the benchmark's V4.1-Flash ratio-2 layer (``graphs.bench.flash_layer``: 256
request rows, 2048-token sequences, 64-token pages, buckets 1..256). Requests run 40
steps eagerly, then a 64-step loop is replayed from the captured graphs and, on a deep
copy, run eagerly; the two are compared token by token. The loop crosses ratio-2 groups
(every 2 steps), SWA pages (position 64) and compressed pages (entry 32 = position 65),
and its batch size moves between buckets (padding rows included).

Tolerance: per token, max |replay - eager| <= 3e-2 * max |eager| of that token's row
(bf16 activations and cache rows; Inductor's fused fp32 math rounds q / kv / entries to
bf16 differently by up to one ulp, and later steps read those rows back).
"""

from __future__ import annotations

import copy

import pytest
import torch

from graphs import DEFAULT_BUCKETS, TINY, CacheConfig, DecodeRunner, DecodeStep, DSV41Attention, StepMetadata
from graphs.bench import decode_inputs, flash_layer
from graphs.schedule import Schedule, hidden_states, run_schedule

pytestmark = pytest.mark.gpu

PREFIX = 40
LOOP = range(PREFIX, PREFIX + 64)
SCHEDULE = Schedule(starts=(0, 0, 10, 25, 40, 41, 60, 70, 90), lengths=(104, 80, 94, 60, 64, 50, 44, 34, 5))
TOL = 3e-2


@pytest.fixture(scope="module")
def replayed():
    from torch._dynamo.utils import counters

    device = torch.device("cuda")
    layer = flash_layer(2, device)
    torch._dynamo.reset()
    counters.clear()
    runner = DecodeRunner(layer)
    runner.capture()
    dynamo_graphs = counters["stats"]["unique_graphs"]
    breaks = sum(counters["graph_break"].values())
    xs = hidden_states(SCHEDULE, layer.cfg.dim, seed=3, device=device)
    with torch.no_grad():
        prefix = DecodeRunner(layer, compile=False, cuda_graphs=False, meta=runner.meta)
        run_schedule(prefix.step, SCHEDULE, xs, steps=range(PREFIX))
        twin = DecodeRunner(copy.deepcopy(layer), compile=False, cuda_graphs=False, meta=copy.deepcopy(runner.meta))
        got, _ = run_schedule(runner.step, SCHEDULE, xs, steps=LOOP, sync_debug="error")
        want, _ = run_schedule(twin.step, SCHEDULE, xs, steps=LOOP)
    return dict(runner=runner, twin=twin, got=got, want=want, dynamo_graphs=dynamo_graphs, breaks=breaks)


def test_one_cuda_graph_per_bucket(replayed):
    runner = replayed["runner"]
    assert sorted(runner.graphs) == list(DEFAULT_BUCKETS)
    assert runner.captures == len(DEFAULT_BUCKETS)
    assert replayed["breaks"] == 0
    assert replayed["dynamo_graphs"] <= 2  # 1 with backed_size_oblivious; bucket 1 may specialise on older torch


def test_replayed_loop_equals_eager_step_by_step(replayed):
    worst = 0.0
    for got, want in zip(replayed["got"], replayed["want"]):
        assert got.shape == want.shape and torch.isfinite(got).all()
        per_token = (got - want).abs().amax(-1) / want.abs().amax(-1)
        worst = max(worst, per_token.max().item())
    print(f"worst per-token relative difference replay vs eager over 64 steps: {worst:.2e}")
    assert worst <= TOL


def test_memory_constant_and_no_host_sync_over_1000_replays(replayed):
    runner = replayed["runner"]
    x, positions, rows = decode_inputs(5, 1000, runner.layer.cfg.dim, "cuda")
    with torch.no_grad():
        runner.step(x, positions, rows)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(1000):
                runner.step(x, positions, rows)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before


def test_reduce_overhead_mode_matches_eager():
    """``torch.compile(mode="reduce-overhead")`` of the step module (Inductor's CUDA-graph
    trees) on the tiny config: no skipped graphs, same outputs as eager."""
    from torch._dynamo.utils import counters

    cache = CacheConfig(max_requests=4, max_tokens=4, max_seq_len=64, page_size=4)
    layer = DSV41Attention(TINY, cache, 2, device="cuda")
    twin = copy.deepcopy(layer)
    meta, twin_meta = StepMetadata.for_layer(layer), StepMetadata.for_layer(twin)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(DecodeStep(layer, meta), mode="reduce-overhead", fullgraph=True)
    eager = DecodeStep(twin, twin_meta)
    static_x = torch.zeros(4, TINY.dim, dtype=torch.bfloat16, device="cuda")

    def step_with(module, m):
        def step(x, positions, rows):
            m.update(positions, rows, bucket=4)
            static_x[: x.shape[0]].copy_(x)
            return module(static_x)[: x.shape[0]].clone()
        return step

    schedule = Schedule(starts=(0, 1, 3, 6), lengths=(20, 12, 15, 14))
    xs = hidden_states(schedule, TINY.dim, seed=4, device="cuda")
    with torch.no_grad():
        got, _ = run_schedule(step_with(compiled, meta), schedule, xs)
        want, _ = run_schedule(step_with(eager, twin_meta), schedule, xs)
    assert sum(counters["inductor"].get(k, 0) for k in ("cudagraph_skips",)) == 0
    for g, w in zip(got, want):
        assert ((g - w).abs().max() / w.abs().max()).item() <= TOL
