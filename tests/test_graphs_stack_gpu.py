"""GPU tests of a DeepSeek-V4.1 stack's CUDA graphs (run on the device machine: ``pytest -m gpu``).

The stack is the CPU tests' 8-layer plan of every role (``tests/test_graphs_stack.py``)
at V4.1-Flash's attention dims scaled down to fit a quick test (``dim`` 1024, 16 heads,
fp8_dsv41 caches), compiled whole (``fullgraph=True``) and captured as one CUDA graph per
token bucket. A mixed workload (prefill chunks, decode, drafts with rejections, reused
rows) is served from the graphs with ``torch.cuda.set_sync_debug_mode("error")`` and held
to the layer-by-layer oracle (``graphs.naive.stack_verdict``: every layer on its recorded
inputs within 4e-2 of its max |y| with fp8 caches, given the stack's own picks); then 1000 replays leave ``memory_allocated`` where
it was.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from graphs import V41_FLASH, CacheConfig, DSV41Stack, LayerPlan, StepRunner
from graphs.naive import stack_verdict
from graphs.schedule import hidden_states, mixed_workload, run_workload

pytestmark = pytest.mark.gpu

CFG = replace(V41_FLASH, name="v4.1-small", dim=1024, n_heads=16, q_lora_rank=256, o_groups=2, o_lora_rank=256,
              index_n_heads=8, index_topk=64, weight_block=32)
PLAN = LayerPlan.from_lists([0, 2, 2, 2, 1, 1, 1, 1], kv_sources=[1, 4], index_sources=[1, 4, 6],
                            candidate_source=4, candidate_topk_blocks=16, candidate_block_size=8)
CACHE = CacheConfig(8, 256, 1024, 64, kv_format="fp8_dsv41", max_rewind=3)
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
INDEX_LAYERS = (1, 4, 6)
WORKLOAD = mixed_workload([300, 40, 500, 130, 5, 260], 24, chunk=128, max_tokens=256, rows=4, arrive_every=1,
                          drafts=3)


@pytest.fixture(scope="module")
def served():
    from torch._dynamo.utils import counters

    stack = DSV41Stack(CFG, CACHE, PLAN, device="cuda", record_inputs=True)
    torch._dynamo.reset()
    counters.clear()
    runner = StepRunner(stack, BUCKETS)
    runner.capture()
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    xs = hidden_states(WORKLOAD, CFG.dim, seed=3, device="cuda")
    watch = {l: stack.layers[l].topk_ids for l in INDEX_LAYERS}
    watch["candidates"] = stack.layers[4].candidate_ids
    watch["inputs"] = stack.recorded_inputs()
    with torch.no_grad():
        outs, seen = run_workload(runner.step, WORKLOAD, xs, watch=watch, release=runner.release, sync_debug="error")
    return dict(stack=stack, runner=runner, xs=xs, outs=outs, seen=seen, graphs=graphs, breaks=breaks)


def test_one_dynamo_graph_and_one_cuda_graph_per_bucket(served):
    runner = served["runner"]
    assert (served["graphs"], served["breaks"]) == (1, 0)
    assert sorted(runner.graphs) == list(BUCKETS) and runner.captures == len(BUCKETS)


def test_the_replayed_stack_equals_the_oracle(served):
    seen = served["seen"]
    verdict = stack_verdict(served["stack"], served["xs"], served["outs"], {l: seen[l] for l in INDEX_LAYERS},
                            seen["candidates"], seen["inputs"])
    print(verdict.verdict())
    assert verdict.passed, verdict.verdict()


def test_a_thousand_replays_keep_memory_constant(served):
    runner = served["runner"]
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for bucket in (1, 64, 256):
        for _ in range(1000 // 3 + 1):
            runner.graphs[bucket].replay()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
