"""GPU tests of the step's CUDA graphs (run on the device machine: ``pytest -m gpu``).

The layer is the benchmark's V4.1-Flash ratio-2 layer (``graphs.bench.flash_layer``: 256
request rows, 2048-token sequences, 64-token pages, steps up to 512 tokens), captured at
buckets 1..256, so steps of 257..512 tokens run as pieces of the 256 bucket. A mixed workload of 70 steps (prompts of 5 to 1000 tokens prefilled in chunks of
up to 256 while others decode one token or a token plus up to 3 drafts, rejected drafts
rewritten, request rows reused, up to 512 tokens per step) is replayed from the captured graphs and, on a deep
copy, run eagerly; the two are compared token by token.

Tolerance: per token, max |replay - eager| <= 3e-2 * max |eager| of that token's row
(bf16 activations and cache rows; Inductor's fused fp32 math rounds q / kv / entries to
bf16 differently by up to one ulp, and later steps read those rows back).
"""

from __future__ import annotations

import copy

import pytest
import torch

from graphs import DEFAULT_BUCKETS, TINY, CacheConfig, DSV41Attention, LayerStep, PageAllocator, StepMetadata, StepRunner
from graphs.bench import flash_layer
from graphs.naive import oracle_verdict
from graphs.schedule import hidden_states, mixed_workload, run_workload

pytestmark = pytest.mark.gpu

WORKLOAD = mixed_workload([300, 40, 700, 130, 64, 1000, 5, 260, 90, 17, 450], 64, chunk=256, max_tokens=512, rows=8,
                          arrive_every=1, drafts=3)
TOL = 3e-2
BUCKETS = tuple(b for b in DEFAULT_BUCKETS if b <= 256)


@pytest.fixture(scope="module")
def replayed():
    from torch._dynamo.utils import counters

    device = torch.device("cuda")
    layer = flash_layer(2, device)
    twin = StepRunner(copy.deepcopy(layer), compile=False, cuda_graphs=False)
    torch._dynamo.reset()
    counters.clear()
    runner = StepRunner(layer, BUCKETS)
    runner.capture()
    dynamo_graphs = counters["stats"]["unique_graphs"]
    breaks = sum(counters["graph_break"].values())
    xs = hidden_states(WORKLOAD, layer.cfg.dim, seed=3, device=device)
    with torch.no_grad():
        got, got_ids = run_workload(runner.step, WORKLOAD, xs, watch=layer.topk_ids, release=runner.release,
                                    sync_debug="error")
        want, want_ids = run_workload(twin.step, WORKLOAD, xs, watch=twin.layer.topk_ids, release=twin.release)
    return dict(runner=runner, twin=twin, xs=xs, got=got, want=want, got_ids=got_ids, want_ids=want_ids,
                dynamo_graphs=dynamo_graphs, breaks=breaks)


def test_the_workload_mixes_every_step_kind():
    kinds = WORKLOAD.kinds()
    assert len(WORKLOAD.steps) >= 64 and kinds["prefill"] and kinds["decode"] and kinds["draft"]
    sizes = [WORKLOAD.tokens(s) for s in range(len(WORKLOAD.steps))]
    assert max(sizes) == 512 and sum(size > BUCKETS[-1] for size in sizes) >= 4  # steps that run in pieces


def test_one_cuda_graph_per_bucket(replayed):
    runner = replayed["runner"]
    assert sorted(runner.graphs) == list(BUCKETS) and runner.captures == len(BUCKETS)
    assert replayed["breaks"] == 0
    assert replayed["dynamo_graphs"] == 1


def test_replayed_workload_equals_eager_and_the_oracle(replayed):
    """Both runs pass the full-history oracle (outputs given their own picks, picks within
    the index format's rounding of the oracle's scores); tokens whose replayed and eager
    picks are the same ids agree within TOL (where two near-tied entries swap, the
    outputs attend other rows and only the oracle can judge them)."""
    for run in ("got", "want"):
        verdict = oracle_verdict(replayed["runner"].layer if run == "got" else replayed["twin"].layer, replayed["xs"],
                                 replayed[run], replayed[f"{run}_ids"])
        print(f"{run}: {verdict.verdict()}")
        assert verdict.passed, verdict.verdict()
    worst, same, tokens = 0.0, 0, 0
    for got, want, a, b in zip(replayed["got"], replayed["want"], replayed["got_ids"], replayed["want_ids"]):
        assert got.shape == want.shape and torch.isfinite(got).all()
        alike = (a.sort(-1).values == b.sort(-1).values).all(-1)
        per_token = (got - want).abs().amax(-1) / want.abs().amax(-1)
        worst = max(worst, per_token[alike].max().item()) if alike.any() else worst
        same, tokens = same + int(alike.sum()), tokens + alike.numel()
    print(f"replay vs eager over {len(WORKLOAD.steps)} steps: {same}/{tokens} tokens pick the same ids, "
          f"worst per-token relative difference among them {worst:.2e}")
    assert same >= 0.95 * tokens and worst <= TOL


def test_one_token_steps_equal_eager(replayed):
    """A request of one token, then its next token (bucket 1: the step's integers and hidden
    states arrive by one kernel, ``graphs.staging``), bf16 and fp32 hidden states, against
    the eager twin; the second step reads the first's cache rows."""
    runner, twin = replayed["runner"], replayed["twin"]
    row = 7
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for r in (runner, twin):
            r.release(row)
        for position, dtype in ((0, torch.bfloat16), (1, torch.float32)):
            x = torch.randn(1, runner.layer.cfg.dim, generator=gen).to(dtype).cuda()
            got = runner.step(x, [position], [row]).clone()
            want = twin.step(x, [position], [row])
            assert runner.meta.ints[:, 0].tolist() == [position, row] and torch.equal(runner.input(1), x.bfloat16())
            assert ((got - want).abs().max() / want.abs().max()).item() <= TOL


def test_memory_constant_and_no_host_sync_over_1000_replays(replayed):
    """1000 decode steps of 5 requests (positions 0..999: pages given and recycled on the
    host, the graph of bucket 8 replayed)."""
    runner = replayed["runner"]
    x = torch.randn(5, runner.layer.cfg.dim, device="cuda").to(torch.bfloat16)
    rows = torch.arange(5, dtype=torch.int32)
    with torch.no_grad():
        runner.step(x, torch.zeros(5, dtype=torch.int32), rows)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for p in range(1, 1001):
                runner.step(x, torch.full((5,), p, dtype=torch.int32), rows)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
    assert runner.pages.pages_held()[0] <= 5 * runner.layer.cache_cfg.swa_pages_between_steps(runner.layer.cfg.window_size)


def test_reduce_overhead_mode_matches_eager():
    """``torch.compile(mode="reduce-overhead")`` of the step module (Inductor's CUDA-graph
    trees) on the tiny config: no skipped graphs, same outputs as eager."""
    from torch._dynamo.utils import counters

    cache = CacheConfig(max_requests=4, max_tokens=8, max_seq_len=64, page_size=4)
    layer = DSV41Attention(TINY, cache, 2, device="cuda")
    twin = copy.deepcopy(layer)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(LayerStep(layer, StepMetadata.for_layer(layer)), mode="reduce-overhead", fullgraph=True)
    eager = LayerStep(twin, StepMetadata.for_layer(twin))
    static_x = torch.zeros(8, TINY.dim, dtype=torch.bfloat16, device="cuda")

    def step_with(module):
        pages = PageAllocator.for_layer(module.layer if isinstance(module, LayerStep) else layer)

        def step(x, positions, rows):
            meta = module.meta if isinstance(module, LayerStep) else compiled._orig_mod.meta
            pages.plan(positions, rows)
            meta.apply_pages(pages.take_changes())
            meta.update(positions, rows, bucket=8)
            static_x[: x.shape[0]].copy_(x)
            out = module(static_x)[: x.shape[0]].clone()
            pages.trim()
            return out
        return step

    workload = mixed_workload([9, 3, 14, 6], 10, chunk=4, max_tokens=8, rows=4, drafts=2)
    xs = hidden_states(workload, TINY.dim, seed=4, device="cuda")
    with torch.no_grad():
        got, _ = run_workload(step_with(compiled), workload, xs)
        want, _ = run_workload(step_with(eager), workload, xs)
    assert sum(counters["inductor"].get(k, 0) for k in ("cudagraph_skips",)) == 0
    for g, w in zip(got, want):
        assert ((g - w).abs().max() / w.abs().max()).item() <= TOL


# Kernels one batch-1 decode replay of this layer (its own compressor and indexer) may
# launch: the step's launch budget, so that a change that adds launches fails here
DECODE_KERNELS = 25


def test_decode_replay_launches_within_its_budget(replayed):
    """A batch-1 decode step at 1K tokens, replayed, runs at most ``DECODE_KERNELS`` kernels,
    on two streams (the cache writes beside the q projection)."""
    from graphs.bench import grow_rows, profile_kernels

    runner = replayed["runner"]
    grow_rows(runner, [0], 1024)
    x = torch.randn(1, runner.layer.cfg.dim, device="cuda").to(torch.bfloat16)
    runner.step(x, torch.tensor([1024], dtype=torch.int32), torch.tensor([0], dtype=torch.int32))
    profile = profile_kernels(runner.graphs[runner.bucket_for(1)].replay)
    launches = profile.count
    print(f"batch-1 decode replay: {launches} kernels on {profile.streams} streams")
    assert launches <= DECODE_KERNELS, f"a batch-1 decode replay runs {launches} kernels, over {DECODE_KERNELS}"
    assert profile.streams == 2, "the cache writes run on their own stream, beside the q projection"


def test_v41_cache_formats_replay_passes_the_oracle():
    """DeepSeek-V4.1's own cache formats (fp8 window, fp4 compressed entries and index keys;
    ``sparse_mla`` reads both caches in one call): the workload replayed from the captured
    graphs, with no host sync, passes the oracle that rounds each cache to its format; one
    Dynamo graph, no break."""
    from torch._dynamo.utils import counters

    from graphs import V41_CACHE_FORMATS

    layer = flash_layer(2, torch.device("cuda"), **V41_CACHE_FORMATS)
    torch._dynamo.reset()
    counters.clear()
    runner = StepRunner(layer, BUCKETS)
    runner.capture()
    assert sum(counters["graph_break"].values()) == 0 and counters["stats"]["unique_graphs"] == 1
    xs = hidden_states(WORKLOAD, layer.cfg.dim, seed=3, device=layer.swa_cache.device)
    with torch.no_grad():
        got, ids = run_workload(runner.step, WORKLOAD, xs, watch=layer.topk_ids, release=runner.release,
                                sync_debug="error")
    verdict = oracle_verdict(layer, xs, got, ids)
    print(verdict.verdict())
    assert verdict.passed, verdict.verdict()
