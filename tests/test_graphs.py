"""CPU tests of the DeepSeek-V4.1 attention module and its decode-step runner (graphs/).

The layer is checked against the full-history oracle in ``graphs/naive.py`` (every
ratio, overlap and dense layers included), padding rows are shown to write nothing, the
compiled step is traced whole (zero graph breaks, a snapshot of its ``dsv41`` op
sequence) and the Inductor-compiled step matches the eager one over a multi-step decode
that crosses compressor-group and page boundaries.

Tolerances (max error over all outputs, relative to the largest output magnitude):
eager module vs fp32 oracle 2e-2 (bf16 activations, bf16 cache rows); compiled vs eager
2e-2 (Inductor fuses the fp32 math differently, so bf16 roundings of q / kv / entries may
differ by one ulp, which later steps read back from the caches).
"""

from __future__ import annotations

import copy

import expecttest
import pytest
import torch

from graphs import TINY, CacheConfig, DecodeRunner, DecodeStep, DSV41Attention, StepMetadata, compiled_call
from compile_ops.indexer.cache import read_index_keys
from graphs.naive import naive_index_scores, naive_outputs
from graphs.schedule import Schedule, hidden_states, run_schedule, staggered

PAGE = 4


def make_layer(ratio: int, *, max_seq_len: int = 32, seed: int = 0, swa_window=None) -> DSV41Attention:
    cache = CacheConfig(max_requests=4, max_tokens=4, max_seq_len=max_seq_len, page_size=PAGE, swa_window=swa_window)
    return DSV41Attention(TINY, cache, ratio, seed=seed)


def shuffled_meta(layer: DSV41Attention) -> StepMetadata:
    """Step buffers whose block tables hand out pages in a random order."""
    return StepMetadata.for_layer(layer, generator=torch.Generator().manual_seed(7))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


# (ratio, max_seq_len, steps): 24 steps cross 6 SWA pages, 12 ratio-2 groups (6 pages of 2
# entries) and exceed the top-k of 8; ratio 128 needs 130 steps to close one entry.
ORACLE_CASES = [
    pytest.param(0, 32, 24, id="swa-only"),
    pytest.param(1, 32, 24, id="ratio1"),
    pytest.param(2, 32, 24, id="ratio2"),
    pytest.param(4, 32, 24, id="ratio4-overlap"),
    pytest.param(128, 256, 131, id="ratio128-dense"),
]


@pytest.mark.parametrize("ratio, max_seq_len, steps", ORACLE_CASES)
def test_decode_matches_full_history_oracle(ratio, max_seq_len, steps):
    layer = make_layer(ratio, max_seq_len=max_seq_len)
    runner = DecodeRunner(layer, buckets=(1, 2, 4), compile=False, meta=shuffled_meta(layer))
    schedule = staggered(3, steps, stagger=5)
    xs = hidden_states(schedule, TINY.dim, seed=1)
    with torch.no_grad():
        outs, topk = run_schedule(runner.step, schedule, xs, watch=layer.topk_ids if ratio else None)
        for r, x in enumerate(xs):
            chosen = [[c for c in row if c >= 0] for row in topk[r].tolist()] if ratio else None
            ref = naive_outputs(layer, x, chosen)
            assert rel_err(outs[r], ref) < 2e-2, f"request {r}"
            if layer.indexer is None:
                continue
            # The top-k must be the K best entries by the oracle's scores, up to the rounding
            # of the index format: each score is off by at most `rounding` times its magnitude
            # (e4m3 q and keys, 2**-4 each, plus the bf16 rotation, 2**-8 each; bf16: the latter)
            scores = naive_index_scores(layer, x)
            bound = naive_index_scores(layer, x, magnitude=True) * (0.15 if layer.indexer.index_format == "fp8" else 2**-6)
            for p, ids in enumerate(chosen):
                existing = (p + 1) // ratio
                assert len(ids) == min(existing, layer.indexer.topk) and len(set(ids)) == len(ids)
                left_out = sorted(set(range(existing)) - set(ids))
                if left_out:
                    best_left_out = (scores[p, left_out] - bound[p, left_out]).max()
                    assert best_left_out <= (scores[p, ids] + bound[p, ids]).min(), (p, ids)


def test_state_dict_uses_reference_names_and_loads():
    layer = make_layer(4)
    names = set(layer.state_dict())
    assert names == {
        "attn_sink", "wq_a.weight", "q_norm.weight", "wq_b.weight", "wkv.weight", "kv_norm.weight",
        "wo_a.weight", "wo_b.weight", "compressor.ape", "compressor.wkv.weight", "compressor.wgate.weight",
        "compressor.norm.weight", "indexer.wq_b.weight", "indexer.weights_proj.weight", "indexer.compressor.ape",
        "indexer.compressor.wkv.weight", "indexer.compressor.wgate.weight", "indexer.compressor.norm.weight",
    }
    assert layer.compressor.wkv.weight.shape == (2 * 512, TINY.dim)  # overlapping: two projections
    other = make_layer(4, seed=1)
    other.load_state_dict(layer.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(layer.state_dict().values(), other.state_dict().values()))
    assert "compressor.ape" not in make_layer(0).state_dict() and "indexer.wq_b.weight" not in make_layer(128, max_seq_len=256).state_dict()


def test_padding_rows_write_nothing():
    layer = make_layer(2)
    meta = shuffled_meta(layer)
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    with torch.no_grad():
        before = {k: v.clone() for k, v in layer.named_buffers()}
        meta.update(i32(5), i32(1), bucket=4)  # one valid token (closes group 2), three padding rows
        layer(torch.randn(4, TINY.dim, dtype=torch.bfloat16), meta.inputs(4))
    changed = {k for k, v in layer.named_buffers() if not torch.equal(v, before[k])}
    assert changed == {"swa_cache", "cmp_cache", "topk_ids", "compressor.kv_state", "compressor.score_state",
                       "indexer.index_cache", "indexer.compressor.kv_state", "indexer.compressor.score_state"}
    swa_rows = (layer.swa_cache != before["swa_cache"]).any(-1).flatten().nonzero().flatten().tolist()
    assert swa_rows == [meta.swa_slots[0].item()]
    cmp_rows = (layer.cmp_cache != before["cmp_cache"]).any(-1).flatten().nonzero().flatten().tolist()
    assert cmp_rows == [meta.cmp_slots[0].item()]
    slots = torch.arange(layer.cmp_cache.shape[0] * layer.cmp_cache.shape[1])  # the entry's index key, at its slot
    fmt = layer.indexer.index_format
    keys_changed = (read_index_keys(layer.indexer.index_cache, slots, fmt)
                    != read_index_keys(before["indexer.index_cache"], slots, fmt)).any(-1).nonzero().flatten().tolist()
    assert keys_changed == cmp_rows
    assert meta.swa_slots[1:].tolist() == [-1] * 3 and meta.cmp_slots[1:].tolist() == [-1] * 3
    for name in ("compressor.kv_state", "indexer.compressor.kv_state"):
        rows = (layer.get_buffer(name) != before[name]).flatten(1).any(1).nonzero().flatten().tolist()
        assert rows in ([1], [1, 4]), (name, rows)  # request row 1, and the spare row 4 padding writes to
    assert layer.topk_ids[1:].tolist() == [[-1] * layer.topk] * 3


def test_runner_pads_to_bucket_and_rejects_oversize():
    layer = make_layer(2)
    twin = copy.deepcopy(layer)
    runner = DecodeRunner(layer, buckets=(4,), compile=False)
    x = torch.randn(3, TINY.dim, dtype=torch.bfloat16)
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    with torch.no_grad():
        padded = runner.step(x, i32(0, 0, 0), i32(0, 1, 2))
        exact = twin(x, twin.step_inputs(i32(0, 0, 0), i32(0, 1, 2), i32(1, 1, 1), runner.meta.swa_block_table,
                                         runner.meta.cmp_block_table))
    assert rel_err(padded, exact) < 1e-2
    assert runner.meta.positions.tolist() == [0, 0, 0, -1]
    with pytest.raises(ValueError, match="1..4 tokens"):
        runner.step(torch.randn(5, TINY.dim, dtype=torch.bfloat16), i32(0, 0, 0, 0, 0), i32(0, 1, 2, 3, 0))


def _dynamo_graphs(ratio: int, max_seq_len: int = 32):
    """FX graphs Dynamo hands to the backend for one compiled decode step of ``ratio``."""
    layer = make_layer(ratio, max_seq_len=max_seq_len)
    step = DecodeStep(layer, StepMetadata.for_layer(layer))
    captured = []

    def backend(gm, example_inputs):
        captured.append(gm)
        return gm

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with torch.no_grad():
        compiled_call(torch.compile(step, fullgraph=True, backend=backend), torch.randn(4, TINY.dim, dtype=torch.bfloat16))
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    return captured, breaks


def dsv41_ops(gm) -> str:
    return "\n".join(str(n.target) for n in gm.graph.nodes if n.op == "call_function" and str(n.target).startswith("dsv41."))


class TestDecodeStepGraph(expecttest.TestCase):
    """The whole step is one Dynamo graph; its custom-op sequence is pinned by snapshot."""

    def test_swa_only_step(self):
        graphs, breaks = _dynamo_graphs(0)
        self.assertEqual((len(graphs), breaks), (1, 0))
        self.assertExpectedInline(dsv41_ops(graphs[0]), """\
dsv41.write_kv
dsv41.swa_indices
dsv41.sparse_mla_out""")

    def test_indexed_step(self):
        graphs, breaks = _dynamo_graphs(2)
        self.assertEqual((len(graphs), breaks), (1, 0))
        self.assertExpectedInline(dsv41_ops(graphs[0]), """\
dsv41.write_kv
dsv41.swa_indices
dsv41.write_kv
dsv41.write_index_keys
dsv41.indexer_topk
dsv41.topk_to_slots
dsv41.sparse_mla_out""")

    def test_overlap_and_dense_steps_have_no_breaks(self):
        for ratio, max_seq_len in ((4, 32), (128, 256)):
            graphs, breaks = _dynamo_graphs(ratio, max_seq_len)
            self.assertEqual((len(graphs), breaks), (1, 0), f"ratio {ratio}")
            indexer = ["dsv41.write_index_keys", "dsv41.indexer_topk"] if ratio == 4 else []  # 128: dense, no indexer
            self.assertEqual(dsv41_ops(graphs[0]).split(), ["dsv41.write_kv", "dsv41.swa_indices", "dsv41.write_kv", *indexer,
                                                            "dsv41.topk_to_slots", "dsv41.sparse_mla_out"])


def test_compiled_step_matches_eager_over_multistep_decode():
    """Inductor-compiled runner vs eager runner, same weights, same schedule: 20 steps with
    batch sizes 1..4 (buckets 1, 2, 4, padding rows included) crossing ratio-2 groups,
    compressed and SWA pages. One compile serves every bucket."""
    layer = make_layer(2)
    eager_layer = copy.deepcopy(layer)
    compiled = DecodeRunner(layer, buckets=(1, 2, 4), meta=shuffled_meta(layer))
    eager = DecodeRunner(eager_layer, buckets=(1, 2, 4), compile=False, meta=shuffled_meta(eager_layer))
    schedule = Schedule(starts=(0, 2, 5, 9), lengths=(20, 14, 8, 11))
    xs = hidden_states(schedule, TINY.dim, seed=2)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with torch.no_grad():
        got, topk = run_schedule(compiled.step, schedule, xs, watch=layer.topk_ids)
        want, want_topk = run_schedule(eager.step, schedule, xs, watch=eager_layer.topk_ids)
        assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
        assert all(torch.equal(a, b) for a, b in zip(topk, want_topk))  # one indexer op: the same ids
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
        for r in range(len(xs)):
            assert rel_err(got[r], want[r]) < 2e-2, f"request {r}"
            chosen = [[c for c in row if c >= 0] for row in topk[r].tolist()]  # the indexer's picks
            assert rel_err(got[r], naive_outputs(layer, xs[r], chosen)) < 2e-2, f"request {r} vs oracle"
    rows = slice(0, layer.cache_cfg.max_requests)  # the spare state row absorbs padding writes
    for name, part in (("swa_cache", slice(None)), ("cmp_cache", slice(None)), ("compressor.kv_state", rows),
                       ("indexer.compressor.kv_state", rows)):
        assert rel_err(layer.get_buffer(name)[part], eager_layer.get_buffer(name)[part]) < 2e-2, name


@pytest.mark.parametrize("ratio", [0, 1, 2, 4, 128])
@pytest.mark.parametrize("kv_format,index_format", [("bf16", "fp8"), ("fp8_dsv41", "bf16")])
def test_buffer_bytes_formula_equals_the_layers_buffers(ratio, kv_format, index_format):
    """``graphs.buffer_bytes`` (the documented memory formula) predicts every byte the layer
    allocates for buffers, per group and in total."""
    from graphs import buffer_bytes

    cache = CacheConfig(4, 4, 256, PAGE, kv_format=kv_format, index_format=index_format)
    layer = DSV41Attention(TINY, cache, ratio)
    got = {name: b.numel() * b.element_size() for name, b in layer.named_buffers()}
    want = buffer_bytes(TINY, cache, ratio)
    assert want["total"] == sum(got.values())
    assert want["swa_cache"] == got["swa_cache"]
    if ratio:
        assert want["cmp_cache"] == got["cmp_cache"]
        assert want["index_cache"] == got.get("indexer.index_cache", 0)


@pytest.mark.parametrize("ratio", [0, 2])
def test_swa_ring_holds_the_window_only(ratio):
    """``CacheConfig(swa_window=W)``: each request row cycles through the pages its window
    spans, so the SWA cache is ``R * (ceil((W - 1) / page) + 1) + 1`` pages instead of every
    page of ``max_seq_len``; a 40-step decode (the ring wraps 3 times) gives exactly the
    outputs of the full-length cache (same values, other pages) and matches the oracle."""
    ring_layer = make_layer(ratio, max_seq_len=64, swa_window=TINY.window_size)
    full_layer = make_layer(ratio, max_seq_len=64)
    ring = -(-(TINY.window_size - 1) // PAGE) + 1
    assert ring_layer.swa_cache.shape[0] == 4 * ring + 1 < full_layer.swa_cache.shape[0] == 4 * (64 // PAGE) + 1
    schedule = staggered(3, 40, stagger=5)
    xs = hidden_states(schedule, TINY.dim, seed=4)
    results = []
    for layer in (ring_layer, full_layer):
        runner = DecodeRunner(layer, buckets=(1, 2, 4), compile=False, meta=shuffled_meta(layer))
        with torch.no_grad():
            results.append(run_schedule(runner.step, schedule, xs, watch=layer.topk_ids if ratio else None))
    assert ring_layer.swa_cache.shape[0] < full_layer.swa_cache.shape[0]
    (ring_out, topk), (full_out, _) = results
    for r, x in enumerate(xs):
        assert torch.equal(ring_out[r], full_out[r]), f"request {r}"
        chosen = [[c for c in row if c >= 0] for row in topk[r].tolist()] if ratio else None
        assert rel_err(ring_out[r], naive_outputs(ring_layer, x, chosen)) < 2e-2, f"request {r} vs oracle"


def test_swa_window_below_the_layers_window_is_refused():
    with pytest.raises(ValueError, match="must be >= the layer's window_size"):
        make_layer(2, swa_window=TINY.window_size - 1)
