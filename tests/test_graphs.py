"""CPU tests of the DeepSeek-V4.1 attention layer, its page allocator and its step runner.

The layer is checked against the full-history oracle in ``graphs/naive.py`` for every
ratio (overlapping 4 and dense 128 included) over decode, chunked prefill, mixed steps and
multi-token steps whose rejected drafts are rewritten; padding rows are shown to write
nothing; the compiled step is traced whole (zero graph breaks for every step kind, a
snapshot of its ``dsv41`` op sequence) and the Inductor-compiled step matches the eager
one over a mixed workload.

Tolerances (max error over all outputs, relative to the largest output magnitude): layer
vs fp32 oracle 2e-2 (bf16 activations, bf16 cache rows); chunked vs token-by-token and
compiled vs eager 2e-2 (GEMMs of other shapes and Inductor's fusions round bf16
activations differently, by an ulp, and later steps read those rows back).
"""

from __future__ import annotations

import copy
import random

import expecttest
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compile_ops.formats import read_kv
from compile_ops.indexer.cache import read_index_keys
from graphs import TINY, TINY_V41, CacheConfig, DSV41Attention, PageAllocator, StepMetadata, StepRunner
from graphs.bench import pick_matched
from graphs.fused import project
from graphs.naive import oracle_verdict
from graphs.schedule import Workload, hidden_states, mixed_workload, run_workload, staggered
from helpers import examples

PAGE = 4
I32 = torch.int32


def i32(*v):
    return torch.tensor(v, dtype=I32)


def make_layer(ratio: int, *, max_seq_len: int = 32, max_tokens: int = 4, seed: int = 0, **cache) -> DSV41Attention:
    cfg = CacheConfig(max_requests=4, max_tokens=max_tokens, max_seq_len=max_seq_len, page_size=PAGE, **cache)
    return DSV41Attention(TINY, cfg, ratio, seed=seed)


def make_runner(layer: DSV41Attention, buckets=(1, 2, 4), **kw) -> StepRunner:
    """An eager runner whose allocator hands pages out in a random order."""
    pages = PageAllocator.for_layer(layer, generator=torch.Generator().manual_seed(7))
    return StepRunner(layer, buckets, pages=pages, compile=kw.pop("compile", False), **kw)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def check_against_oracle(layer: DSV41Attention, xs, outs, topk) -> None:
    """Each request's outputs equal the oracle's given the layer's picks, and the picks are
    the oracle's top-k up to the rounding of the index format."""
    verdict = oracle_verdict(layer, xs, outs, topk)
    assert verdict.passed, verdict.verdict()


# (ratio, max_seq_len, steps): 24 steps cross 6 SWA pages, 12 ratio-2 groups (6 pages of 2
# entries) and exceed the top-k of 8; ratio 128 needs 130 steps to close one entry.
RATIOS = [
    pytest.param(0, 32, 24, id="swa-only"),
    pytest.param(1, 32, 24, id="ratio1"),
    pytest.param(2, 32, 24, id="ratio2"),
    pytest.param(4, 32, 24, id="ratio4-overlap"),
    pytest.param(128, 256, 131, id="ratio128-dense"),
]


@pytest.mark.quick
@pytest.mark.parametrize("ratio, max_seq_len, steps", RATIOS)
def test_decode_matches_full_history_oracle(ratio, max_seq_len, steps):
    layer = make_layer(ratio, max_seq_len=max_seq_len)
    runner = make_runner(layer)
    workload = staggered(3, steps, stagger=5)
    xs = hidden_states(workload, TINY.dim, seed=1)
    with torch.no_grad():
        outs, topk = run_workload(runner.step, workload, xs, watch=layer.topk_ids if ratio else None)
    check_against_oracle(layer, xs, outs, topk)


@pytest.mark.parametrize("ratio", [2, 4])
def test_decode_with_fp32_compressor_weights_matches_the_oracle(ratio):
    """Compressor weights off the bf16 grid (run as high and low parts) against the oracle,
    which multiplies the fp32 weights."""
    layer = make_layer(ratio, max_seq_len=32)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "compressor.w" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 1e-3)
    layer.refresh_splits()
    assert layer.compressor.split.shape[0] == 4 * layer.compressor.width
    runner = make_runner(layer)
    workload = staggered(3, 24, stagger=5)
    xs = hidden_states(workload, TINY.dim, seed=1)
    with torch.no_grad():
        outs, topk = run_workload(runner.step, workload, xs, watch=layer.topk_ids)
    check_against_oracle(layer, xs, outs, topk)


def prompt_then_decode(prompt: int, decode: int, chunk: int) -> Workload:
    return mixed_workload([prompt], decode, chunk=chunk, max_tokens=64, rows=1)


@pytest.mark.quick
@pytest.mark.parametrize("ratio, max_seq_len, steps", RATIOS)
def test_chunked_prefill_equals_token_by_token_and_the_oracle(ratio, max_seq_len, steps):
    """A prompt fed in chunks of 1, 3, 7 and 64 tokens, then decoded: every chunking gives
    the token-by-token outputs and the oracle's (chunks close many groups at once, groups
    span chunks, ratio 4's overlap reaches into the previous chunk)."""
    prompt, decode = steps - 6, 6
    results = {}
    for chunk in (1, 3, 7, 64):
        layer = make_layer(ratio, max_seq_len=max_seq_len, max_tokens=64)
        runner = make_runner(layer, buckets=(1, 4, 16))
        workload = prompt_then_decode(prompt, decode, chunk)
        assert max(workload.tokens(s) for s in range(len(workload.steps))) == min(chunk, prompt)
        xs = hidden_states(workload, TINY.dim, seed=3)
        with torch.no_grad():
            outs, topk = run_workload(runner.step, workload, xs, watch=layer.topk_ids if ratio else None)
        results[chunk] = outs[0]
        if chunk in (1, 64):
            check_against_oracle(layer, xs, outs, topk)
    for chunk in (3, 7, 64):
        assert rel_err(results[chunk], results[1]) < 2e-2, f"chunk {chunk}"


def final_caches(layer: DSV41Attention, pages: PageAllocator, rows: list[int]) -> dict[str, torch.Tensor]:
    """What later steps of ``rows`` can read, by position (not by page): the SWA rows of the
    last window, the compressed entries and index keys, the compressor rings' prefixes."""
    out = {}
    c, ratio = layer.cache_cfg, layer.compress_ratio
    for r in rows:
        n = pages.length[r]
        pos = torch.arange(max(0, n - TINY.window_size), n)
        slots = pages.swa_table[r, pos // PAGE].long() * PAGE + pos % PAGE
        out[f"swa {r}"] = read_kv(layer.swa_cache, slots, c.kv_format)
        if ratio:
            e = torch.arange(n // ratio)
            bs = c.block_size(ratio)
            slots = pages.cmp_table[r, e // bs].long() * bs + e % bs
            out[f"cmp {r}"] = read_kv(layer.cmp_cache, slots, c.kv_format)
            ring = layer.compressor.ring
            if ring:
                held = torch.arange(max(0, n - ring), n) % ring
                out[f"state {r}"] = layer.compressor.state[:, r, held]
            if layer.indexer is not None:
                out[f"keys {r}"] = read_index_keys(layer.indexer.index_cache, slots, layer.indexer.index_format)
    return out


@pytest.mark.parametrize("ratio, max_seq_len, steps", RATIOS)
def test_mixed_steps_with_rejected_drafts_equal_a_run_without_them(ratio, max_seq_len, steps):
    """Prompts of different lengths prefilled in chunks of 5 while others decode 1 token
    plus up to 3 drafts, in the same steps (<= 12 tokens); rejected drafts are rewritten by
    the next step. Outputs match the oracle, and the caches and compressor state that later
    steps read equal a token-by-token run that never saw the rejected tokens."""
    prompts = [steps - 10, 3, 11, 6]
    mixed = mixed_workload(prompts, 10, chunk=5, max_tokens=12, rows=4, arrive_every=2, drafts=3)
    kinds = mixed.kinds()
    assert kinds["draft"] and kinds["prefill"] and any(
        len({c.kind for c in step}) > 1 for step in mixed.steps)  # prefill and decode share steps
    assert any(c.accepted < c.n for step in mixed.steps for c in step)
    plain = mixed_workload(prompts, 10, chunk=1, max_tokens=4, rows=4)
    xs = hidden_states(mixed, TINY.dim, seed=5)
    caches, outputs = [], []
    for workload in (mixed, plain):
        layer = make_layer(ratio, max_seq_len=max_seq_len, max_tokens=12, max_rewind=3)
        runner = make_runner(layer, buckets=(1, 4, 8, 16) if workload is mixed else (1, 2, 4))
        with torch.no_grad():
            outs, topk = run_workload(runner.step, workload, xs, watch=layer.topk_ids if ratio else None)
        if workload is mixed:
            check_against_oracle(layer, xs, outs, topk)
        outputs.append(outs)
        caches.append(final_caches(layer, runner.pages, list(range(4))))
    for q in range(len(prompts)):
        assert rel_err(outputs[0][q], outputs[1][q]) < 2e-2, f"request {q}"
    assert caches[0].keys() == caches[1].keys()
    for name in caches[0]:
        a, b = caches[0][name], caches[1][name]
        assert a.shape == b.shape and (not a.numel() or rel_err(a, b) < 2e-2), name


def test_a_rewind_past_max_rewind_and_bad_layouts_are_refused():
    layer = make_layer(2, max_tokens=8, max_rewind=2)
    runner = make_runner(layer, buckets=(8,))
    x = lambda n: torch.randn(n, TINY.dim, dtype=torch.bfloat16)  # noqa: E731
    with torch.no_grad():
        runner.step(x(6), i32(0, 1, 2, 3, 4, 5), i32(0, 0, 0, 0, 0, 0))
        runner.step(x(2), i32(4, 5), i32(0, 0))  # rewinds 2: allowed
        with pytest.raises(ValueError, match="rewind at most max_rewind=2"):
            runner.step(x(1), i32(3), i32(0))
        with pytest.raises(ValueError, match="cannot start at position 7"):
            runner.step(x(1), i32(7), i32(0))
        with pytest.raises(ValueError, match="consecutive positions"):
            runner.step(x(2), i32(0, 2), i32(1, 1))
        with pytest.raises(ValueError, match="contiguous"):
            runner.step(x(3), i32(6, 0, 7), i32(0, 1, 0))
        with pytest.raises(ValueError, match="outside"):
            runner.step(x(1), i32(0), i32(4))
        with pytest.raises(ValueError, match="1..8 tokens"):
            runner.step(x(9), torch.arange(9, dtype=I32), torch.zeros(9, dtype=I32))
        with pytest.raises(ValueError, match=r"positions and token_to_req must be \[n\] = \[2\]"):
            runner.step(x(2), i32(6, 7), i32(0))
        with pytest.raises(TypeError, match="integer tensor"):
            runner.step(x(1), torch.tensor([6.0]), i32(0))
        with pytest.raises(TypeError, match="must be ints"):
            runner.step(x(1), [True], [0])
        assert runner.pages.length[:2] == [6, 0]  # refused steps change nothing
        runner.release(0)
        runner.step(x(1), i32(0), i32(0))  # a released row starts over


def test_swa_pages_follow_the_window_and_a_small_pool_suffices():
    """Between steps a request holds at most ``swa_pages_between_steps`` SWA pages whatever
    its length; with the default pool (every row's window plus one step) a 40-step decode of
    4 requests (the window moves across 10 pages) matches the oracle, and an exhausted pool
    raises a clear error."""
    layer = make_layer(2, max_seq_len=64)
    cache = layer.cache_cfg
    per_row = cache.swa_pages_between_steps(TINY.window_size)
    assert layer.swa_cache.shape[0] == cache.default_swa_pages(TINY.window_size) < 4 * (64 // PAGE)
    runner = make_runner(layer)
    workload = staggered(4, 40, stagger=3)
    xs = hidden_states(workload, TINY.dim, seed=4)
    held = []
    step = runner.step

    def watched_step(x, positions, rows):
        out = step(x, positions, rows)
        held.append(max(int((runner.pages.swa_table[r] >= 0).sum()) for r in range(4)))
        return out

    with torch.no_grad():
        outs, topk = run_workload(watched_step, workload, xs, watch=layer.topk_ids)
    assert max(held) == per_row
    check_against_oracle(layer, xs, outs, topk)
    small = make_layer(2, max_seq_len=64, swa_pages=1)
    runner = make_runner(small)
    with torch.no_grad(), pytest.raises(RuntimeError, match="swa pool's .* pages are all in use"):
        runner.step(torch.randn(2, TINY.dim, dtype=torch.bfloat16), i32(0, 0), i32(0, 1))


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


def test_update_padded_copies_a_staged_block():
    """``update_padded(staged)``: the ``[2, max_tokens]`` block arrives as staged; a block
    of another shape or dtype is refused."""
    meta = StepMetadata.for_layer(make_layer(2))
    M = meta.max_tokens
    staged = torch.stack([torch.arange(M, dtype=torch.int32), torch.arange(M, dtype=torch.int32) % 3])
    meta.update_padded(staged)
    assert torch.equal(meta.ints, staged)
    for bad in (staged[:, :2].contiguous(), staged.long(), staged[:1]):
        with pytest.raises(ValueError, match="staged must be int32"):
            meta.update_padded(bad)


def test_a_one_token_steps_inputs_arrive_in_one_kernel():
    """``graphs.staging.stage_one_token`` (Triton's interpreter on the CPU): column 0 of the
    integers becomes the step's position and request row as ``update`` sets them, the
    hidden states land in the input rows (bf16 ones by the kernel, others converted first,
    none when they are there already), and nothing else changes."""
    stage_one_token = pytest.importorskip("graphs.staging").stage_one_token
    meta = StepMetadata.for_layer(make_layer(2))
    dim = 2500  # three programs of the copy, the last one partial
    rows = torch.randn(4, dim).bfloat16()
    before = rows.clone()
    meta.update(i32(9, 10, 11), i32(2, 0, 1))
    x = torch.randn(1, dim)
    for given, want in ((x.bfloat16(), x.bfloat16()), (x, x.bfloat16()), (None, before[:1])):
        rows.copy_(before)
        stage_one_token(meta.ints, 77, 3, given, rows[:1])
        assert meta.ints[:, :3].tolist() == [[77, 10, 11], [3, 0, 1]]
        assert torch.equal(rows[:1], want) and torch.equal(rows[1:], before[1:])
    want = StepMetadata.for_layer(make_layer(2))
    want.update(i32(77), i32(3), bucket=1)
    assert torch.equal(meta.ints[:, :1], want.ints[:, :1])


def test_a_larger_steps_inputs_arrive_in_one_kernel():
    """``graphs.staging.stage_step`` (Triton's interpreter on the CPU): the first ``size``
    columns of the staged block become the metadata's integers as ``update_padded`` sets
    them (columns past ``size`` left alone), the ``n`` rows of hidden states land in the
    input rows (bf16 ones by the kernel, others converted first, none when they are there
    already), across several programs of integers and of each row."""
    stage_step = pytest.importorskip("graphs.staging").stage_step
    meta = StepMetadata.for_layer(make_layer(2))
    max_tokens = meta.ints.shape[1]
    dim = 2500  # three programs a row, the last one partial
    rows = torch.randn(max_tokens, dim).bfloat16()
    before_rows, before_ints = rows.clone(), torch.randint(-5, 50, meta.ints.shape, dtype=I32)
    for n, size in ((3, 4), (2, 2), (max_tokens - 1, max_tokens)):
        staged = torch.randint(-1, 100, meta.ints.shape, dtype=I32)
        x = torch.randn(n, dim)
        for given, want in ((x.bfloat16(), x.bfloat16()), (x, x.bfloat16()), (None, before_rows[:n])):
            rows.copy_(before_rows)
            meta.ints.copy_(before_ints)
            stage_step(meta.ints, staged, size, given, rows[:n])
            assert torch.equal(meta.ints[:, :size], staged[:, :size])
            assert torch.equal(meta.ints[:, size:], before_ints[:, size:])
            assert torch.equal(rows[:n], want) and torch.equal(rows[n:], before_rows[n:])


def test_many_columns_of_integers_take_several_programs(monkeypatch):
    """A step wider than one program's columns of integers (``INT_BLOCK``, made small here)
    is copied whole, by as many programs as it needs, with no hidden states to copy; a
    staged block of another shape, or a size past the metadata's columns or below the
    rows', is refused (the kernel would write out of bounds)."""
    staging = pytest.importorskip("graphs.staging")
    monkeypatch.setattr(staging, "INT_BLOCK", 4)
    meta = StepMetadata.for_layer(make_layer(2, max_tokens=16))
    staged = torch.randint(-1, 100, meta.ints.shape, dtype=I32)
    rows = torch.zeros(3, 8).bfloat16()
    staging.stage_step(meta.ints, staged, 11, None, rows)
    assert torch.equal(meta.ints[:, :11], staged[:, :11]) and not rows.any()
    for bad in ((staged[:, :8], 4), (staged, 17), (staged, 2)):  # another block; size past the columns or below n
        with pytest.raises(ValueError, match="stage_step takes"):
            staging.stage_step(meta.ints, *bad, None, rows)


def test_the_staging_kernels_build_for_sm90(tmp_path):
    """``graphs.staging``'s kernels built for sm_90 on the CPU (``tests/scripts/sm90_build.py``,
    a process of its own: this one runs Triton's interpreter), with and without the copy:
    16-byte loads and stores of the hidden states, no spills."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    types = dict(ints="*i32", x="*bf16", rows="*bf16")
    spec = {f"one-copy-{copy}": dict(kernel="graphs.staging:_one_token_kernel", types=types, aligned=["dim"],
                                     constants=dict(COPY=copy, BLOCK=1024)) for copy in (True, False)}
    spec.update({f"step-copy-{copy}": dict(kernel="graphs.staging:_step_kernel", types={**types, "staged": "*i32"},
                                           aligned=["dim", "max_tokens"],
                                           constants=dict(COPY=copy, BLOCK=1024, INT_BLOCK=1024))
                 for copy in (True, False)})
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    root = Path(__file__).resolve().parent
    env = {**os.environ, "TRITON_INTERPRET": "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(root.parent), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, str(root / "scripts" / "sm90_build.py"), str(tmp_path / "spec.json")],
                         capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    reports = json.loads(run.stdout.splitlines()[-1])
    for name, r in reports.items():
        assert r["spills"] == 0, (name, r)
    for kernel in ("one", "step"):
        ops = reports[f"{kernel}-copy-True"]["ops"]
        assert "LDG.E.128" in ops and "STG.E.128" in ops, (kernel, ops)
    assert not any(op.startswith("LDG") for op in reports["one-copy-False"]["ops"])


def test_padding_rows_write_nothing():
    layer = make_layer(2)
    meta = StepMetadata.for_layer(layer)
    pages = PageAllocator.for_layer(layer, generator=torch.Generator().manual_seed(7))
    pages.grow(1, 5)
    pages.plan(i32(5), i32(1))
    meta.apply_pages(pages.take_changes())
    with torch.no_grad():
        before = {k: v.clone() for k, v in layer.named_buffers()}
        meta.update(i32(5), i32(1), bucket=4)  # one valid token (closes group 2), three padding rows
        layer(torch.randn(4, TINY.dim, dtype=torch.bfloat16), meta.inputs(4))
    changed = {k for k, v in layer.named_buffers() if not torch.equal(v, before[k])}
    assert changed == {"swa_cache", "cmp_cache", "topk_ids", "compressor.state", "indexer.index_cache",
                       "indexer.compressor.state"}
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
    assert meta.valid.tolist() == [True, False, False, False]  # what the slot conversion read
    for name in ("compressor.state", "indexer.compressor.state"):
        rows = (layer.get_buffer(name) != before[name]).transpose(0, 1).flatten(1).any(1).nonzero().flatten().tolist()
        assert rows in ([1], [1, 4]), (name, rows)  # request row 1, and the spare row 4 padding writes to
    assert layer.topk_ids[1:].tolist() == [[-1] * layer.topk] * 3


def test_runner_pads_to_bucket_and_runs_larger_steps_in_pieces():
    layer = make_layer(2, max_tokens=12)
    twin = copy.deepcopy(layer)
    runner = make_runner(layer, buckets=(4,))
    x = torch.randn(3, TINY.dim, dtype=torch.bfloat16)
    with torch.no_grad():
        padded = runner.step(x, i32(0, 0, 0), i32(0, 1, 2))
        assert runner.meta.positions[:4].tolist() == [0, 0, 0, -1]
        exact = twin(x, twin.step_inputs(i32(0, 0, 0), i32(0, 1, 2), runner.meta.swa_block_table,
                                         runner.meta.cmp_block_table))
        assert rel_err(padded, exact) < 1e-2
        assert runner.bucket_for(6) == 4  # past the largest bucket: pieces of it
    with pytest.raises(ValueError, match="host"):
        runner.step(x, i32(0, 0, 0).to("meta"), i32(0, 1, 2))


def test_steps_past_the_largest_bucket_equal_one_step_of_their_size():
    """A 10-token step (a prefill chunk, two decodes, a second prefill) through buckets of 4
    runs as pieces of 4, 4 and 2 tokens; it equals the same step through one bucket of 16,
    each token's top-k picks, caches and states included, and a bad token in its last
    piece changes nothing."""
    pieces, whole = make_layer(2, max_tokens=16), make_layer(2, max_tokens=16)
    by_pieces, by_whole = make_runner(pieces, buckets=(1, 2, 4)), make_runner(whole, buckets=(16,))
    gen = torch.Generator().manual_seed(3)
    steps = [(i32(*range(5), 0, 0, 0), i32(0, 0, 0, 0, 0, 1, 2, 3)),
             (i32(*range(5, 11), 1, 1, *range(3)), i32(*[0] * 6, 1, 2, 3, 3, 3))]
    with torch.no_grad():
        for positions, rows in steps:
            x = torch.randn(len(positions), TINY.dim, generator=gen).to(torch.bfloat16)
            y = by_pieces.step(x, positions, rows)
            assert y.shape == (len(positions), TINY.dim)
            assert rel_err(y, by_whole.step(x, positions, rows)) < 1e-2
            assert torch.equal(pieces.topk_ids[:len(positions)], whole.topk_ids[:len(positions)])  # each token's picks
        before = {k: v.clone() for k, v in pieces.state_dict().items()}
        for k, v in whole.state_dict().items():
            assert rel_err(before[k], v) < 1e-2 if v.is_floating_point() else torch.equal(before[k], v), k
        bad = i32(11, 12, 13, 14, 15, 16, 17, 18, 19, 25)  # the last token skips positions
        with pytest.raises(ValueError):
            by_pieces.step(torch.zeros(10, TINY.dim, dtype=torch.bfloat16), bad, i32(*[0] * 10))
        for k, v in pieces.state_dict().items():
            assert torch.equal(before[k], v), k


class _Recorder:
    """A ``torch.compile`` backend that keeps the FX graphs Dynamo hands it."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm


def _dynamo_graphs(ratio: int, max_seq_len: int = 32, workload: Workload | None = None):
    """FX graphs Dynamo produces while a compiled runner serves ``workload`` (default: one
    4-token step of fresh requests), and the graph-break count."""
    layer = make_layer(ratio, max_seq_len=max_seq_len, max_tokens=16, max_rewind=3)
    recorder = _Recorder()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    runner = StepRunner(layer, (1, 2, 4, 8, 16), compile=True, backend=recorder, cuda_graphs=False)
    workload = workload or staggered(4, 1, stagger=0)
    with torch.no_grad():
        run_workload(runner.step, workload, hidden_states(workload, TINY.dim), release=runner.release)
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    return recorder.graphs, breaks


def custom_ops(gm) -> str:
    """The graph's calls of the package's ops (``dsv41`` and the layer's ``graphs`` ops), in order."""
    return "\n".join(str(n.target).removesuffix(".default") for n in gm.graph.nodes
                     if n.op == "call_function" and str(n.target).startswith(("dsv41.", "graphs.")))


class TestStepGraph(expecttest.TestCase):
    """The whole step is one Dynamo graph for every step kind; its op sequence is pinned."""

    def test_swa_only_step(self):
        graphs, breaks = _dynamo_graphs(0)
        self.assertEqual((len(graphs), breaks), (1, 0))
        self.assertExpectedInline(custom_ops(graphs[0]), """\
dsv41.swa_indices
graphs.mm_beside
graphs.write_turned
graphs.join_beside
dsv41.sparse_mla_out
graphs.rope_heads_""")

    def test_every_step_kind_runs_one_indexed_graph(self):
        """Prefill chunks, decode, drafts with rewinds and mixed steps, buckets 1..16 and an
        unpadded 12-token step: one graph, no break."""
        workload = mixed_workload([13, 2, 9], 6, chunk=6, max_tokens=12, rows=3, drafts=2)
        assert {c.kind for step in workload.steps for c in step} == {"prefill", "decode", "draft"}
        graphs, breaks = _dynamo_graphs(2, workload=workload)
        self.assertEqual((len(graphs), breaks), (1, 0))
        self.assertExpectedInline(custom_ops(graphs[0]), """\
dsv41.swa_indices
graphs.mm_beside
graphs.write_turned
dsv41.write_kv
dsv41.write_index_keys
graphs.join_beside
dsv41.indexer_topk
dsv41.topk_to_slots
dsv41.sparse_mla_out
graphs.rope_heads_""")

    def test_overlap_and_dense_steps_have_no_breaks(self):
        for ratio, max_seq_len in ((4, 32), (128, 256)):
            graphs, breaks = _dynamo_graphs(ratio, max_seq_len)
            self.assertEqual((len(graphs), breaks), (1, 0), f"ratio {ratio}")
            # 128: dense, no indexer
            keys, topk = (["dsv41.write_index_keys"], ["dsv41.indexer_topk"]) if ratio == 4 else ([], [])
            self.assertEqual(custom_ops(graphs[0]).split(),
                             ["dsv41.swa_indices", "graphs.mm_beside", "graphs.write_turned", "dsv41.write_kv", *keys,
                              "graphs.join_beside", *topk, "dsv41.topk_to_slots", "dsv41.sparse_mla_out",
                              "graphs.rope_heads_"])


def test_compiled_step_matches_eager_over_a_mixed_workload():
    """Inductor-compiled runner vs eager runner, same weights, same mixed workload (chunked
    prefill, decode, drafts; buckets 1..8 with padding and unpadded 12-token steps). One
    compile serves every step. Inductor keeps a fused kernel's intermediates in fp32 (the
    stacked projection's bf16 rounding of ``wq_a(x)`` before ``q_norm``), so a near-tied
    index score may pick another entry: tokens that pick the same ids must agree."""
    layer = make_layer(2, max_tokens=12, max_rewind=3)
    eager_layer = copy.deepcopy(layer)
    compiled = make_runner(layer, buckets=(1, 2, 4, 8), compile=True)
    eager = make_runner(eager_layer, buckets=(1, 2, 4, 8))
    workload = mixed_workload([15, 4, 9, 20], 8, chunk=7, max_tokens=12, rows=4, arrive_every=2, drafts=3)
    xs = hidden_states(workload, TINY.dim, seed=2)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with torch.no_grad():
        got, topk = run_workload(compiled.step, workload, xs, watch=layer.topk_ids, release=compiled.release)
        want, want_topk = run_workload(eager.step, workload, xs, watch=eager_layer.topk_ids, release=eager.release)
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    agree = pick_matched(got, want, topk, want_topk, tolerance=2e-2, min_share=0.8)
    assert agree.passed, agree.verdict("compiled vs eager")
    check_against_oracle(layer, xs, got, topk)


@pytest.mark.parametrize("cfg, ratio", [(TINY, r) for r in (0, 1, 2, 4, 128)] + [(TINY_V41, r) for r in (1, 2)],
                         ids=[f"v4-{r}" for r in (0, 1, 2, 4, 128)] + ["v41-1", "v41-2"])
@pytest.mark.parametrize("kv_format,index_format", [("bf16", "fp8"), ("fp8_dsv41", "bf16")])
def test_buffer_bytes_formula_equals_the_layers_buffers(cfg, ratio, kv_format, index_format):
    """``graphs.buffer_bytes`` (the documented memory formula) predicts every byte the layer
    allocates for buffers, per group and in total (V4.1's indexer: no compressor, no rotation)."""
    from graphs import buffer_bytes

    cache = CacheConfig(4, 4, 256, PAGE, kv_format=kv_format, index_format=index_format, cmp_pages=7)
    layer = DSV41Attention(cfg, cache, ratio)
    got = {name: b.numel() * b.element_size() for name, b in layer.named_buffers()}
    want = buffer_bytes(cfg, cache, ratio)
    assert want["total"] == sum(got.values())
    for name, p in layer.named_parameters():  # fp32 compressor weights: high and low parts
        if "compressor.w" in name:
            p.add_(1e-5)
    layer.refresh_splits()
    split = sum(b.numel() * b.element_size() for name, b in layer.named_buffers() if name.endswith("split"))
    assert split == buffer_bytes(cfg, cache, ratio, bf16_compressors=False)["compressor_split"] == (
        2 * want["compressor_split"])
    assert want["swa_cache"] == got["swa_cache"]
    if ratio:
        assert want["cmp_cache"] == got["cmp_cache"] == 7 * cache.block_size(ratio) * got["cmp_cache"] // (
            layer.cmp_cache.shape[0] * layer.cmp_cache.shape[1])
        assert want["index_cache"] == got.get("indexer.index_cache", 0)
        assert want["compressor_split"] == got["compressor.split"] + got.get("indexer.compressor.split", 0)


@pytest.mark.parametrize("ratio", [2, 4])
def test_compressor_projection_is_the_fp32_product_and_follows_loaded_weights(ratio):
    """The compressors run ``wkv`` / ``wgate`` (fp32 weights) in bf16: bf16 values as they
    are, other fp32 values as bf16 high and low parts (twice the rows); either way equal to
    the fp32 product within 2**-14 of its largest value through the layer's stacked x
    projection, refreshed by ``load_state_dict`` in both directions."""
    layer = DSV41Attention(TINY, CacheConfig(4, 4, 64, PAGE), ratio)
    other = DSV41Attention(TINY, CacheConfig(4, 4, 64, PAGE), ratio, seed=9)
    fp32 = DSV41Attention(TINY, CacheConfig(4, 4, 64, PAGE), ratio, seed=9)
    gen = torch.Generator().manual_seed(1)
    for name, p in fp32.named_parameters():
        if "compressor.w" in name:
            p.add_(torch.randn(p.shape, generator=gen) * 1e-5)  # off the bf16 grid
    fp32.refresh_splits()
    x = torch.randn(5, TINY.dim, generator=torch.Generator().manual_seed(0)).bfloat16()
    for source, parts_per_weight in ((layer, 1), (fp32, 2), (other, 1)):
        layer.load_state_dict(source.state_dict())
        for comp in (layer.compressor, layer.indexer.compressor):
            assert comp.split.shape[0] == parts_per_weight * 2 * comp.width
        parts = project(layer, layer.stacks["x"], x)
        for name, comp, want_from in (("compressor", layer.compressor, source.compressor),
                                      ("indexer.compressor", layer.indexer.compressor, source.indexer.compressor)):
            kv, gate = comp.gates(parts[name])
            for got, w in ((kv, want_from.wkv.weight), (gate, want_from.wgate.weight)):
                want = x.double() @ w.double().t()
                assert (got.double() - want).abs().max() <= 2**-14 * want.abs().max()


@settings(deadline=None, max_examples=examples(0.5))
@given(ratio=st.sampled_from([0, 2, 4]), world=st.sampled_from([1, 2]), seed=st.integers(0, 2**16),
       steps=st.integers(1, 30))
def test_pages_held_follow_each_rows_positions(ratio, world, seed, steps):
    """Random steps of several rows (decode, drafts with rewinds, prefill chunks, releases),
    each trimmed: every row holds exactly the SWA pages of positions ``high - swa_keep ..
    high`` and the compressed pages of its first ``high + 1`` positions' entries (this
    rank's share), each page once, and the pools' free pages are the rest."""
    gen = random.Random(seed)
    cache = CacheConfig(3, 16, 96, 4, dcp_world=world)
    window = TINY.window_size
    pages = PageAllocator(cache, ratio, window, rank=world - 1, generator=torch.Generator().manual_seed(seed))
    ps, keep = cache.page_size, cache.swa_keep(window)
    for _ in range(steps):
        if gen.random() < 0.1:
            pages.release(gen.randrange(3))
            continue
        pos, req = [], []
        for r in gen.sample(range(3), gen.randint(1, 3)):
            start = max(pages.high[r] + 1 - gen.choice([0, 0, 1, cache.max_rewind]), 0)
            start = min(start, pages.length[r])
            n = min(gen.choice([1, 1, 3, 9]), cache.max_seq_len - start)
            if n > 0:
                pos += range(start, start + n)
                req += [r] * n
        if pos:
            pages.plan(torch.tensor(pos, dtype=I32), torch.tensor(req, dtype=I32))
            pages.trim()
    swa, held = pages.swa_table, []
    cmp = pages.cmp_table
    for r, high in enumerate(pages.high):
        want = set(range(max(0, high - keep) // ps, high // ps + 1)) if high >= 0 else set()
        assert set((swa[r] >= 0).nonzero().flatten().tolist()) == want, r
        if ratio:
            entries = cache.local_entries((high + 1) // ratio, world - 1)
            assert (cmp[r] >= 0).nonzero().flatten().tolist() == list(range(-(-entries // cache.block_size(ratio)))), r
    for table, pool in ((swa, pages.swa_pool), (cmp, None)):
        used = table[table >= 0].tolist()
        assert len(used) == len(set(used))
        if pool is not None:
            assert len(used) + pool.num_free == pool.num_pages
    assert pages.pages_held() == (int((swa >= 0).sum()), int((cmp >= 0).sum()))


@settings(deadline=None, max_examples=examples(0.5))
@given(ratio=st.sampled_from([0, 2, 4, (2, 4)]), world=st.sampled_from([1, 2]), seed=st.integers(0, 2**16),
       steps=st.integers(1, 40))
def test_few_token_and_settled_steps_plan_as_the_array_path_does(ratio, world, seed, steps):
    """Steps of at most ``FEW_TOKENS`` tokens are planned on Python ints, and rows whose
    run ends before their next page change skip the page search: random steps, bad ones
    included (rows out of range, gaps, a request in two runs, rewinds past ``max_rewind``,
    starts past a row's length, a pool run dry), give the same error, the same pages in
    the same table entries, the same changes and the same lengths on Python ints, on
    arrays, on the two mixed as by default, and on arrays with every row searched."""
    from unittest import mock

    import graphs.pages

    gen = random.Random(seed)
    cache = CacheConfig(3, 9, 64, 4, dcp_world=world)
    twins = [PageAllocator(cache, ratio, TINY.window_size, rank=world - 1, generator=torch.Generator().manual_seed(seed))
             for _ in range(4)]
    for _ in range(steps):
        if gen.random() < 0.1:
            row = gen.randrange(3)
            for pages in twins:
                pages.release(row)
            continue
        pos, req = [], []
        for r in gen.sample(range(3), gen.randint(1, 3)):
            start = max(twins[0].high[r] + 1 - gen.choice([0, 0, 1, cache.max_rewind, cache.max_rewind + 1]), 0)
            start = min(start, twins[0].length[r] + gen.choice([0, 0, 0, 1]))
            n = gen.choice([1, 1, 2, 5, 9])
            pos += range(start, start + n)
            req += [r] * n
        if gen.random() < 0.15 and len(pos) > 1:  # a gap, a row out of range or a split request
            i = gen.randrange(len(pos))
            pos[i], req[i] = gen.choice([(pos[i] + 1, req[i]), (pos[i], 3), (pos[i], req[0])])
        outcomes = []
        # Python ints throughout, arrays throughout, the default (the rows that move a page
        # on Python ints), and arrays searching every row (none settled)
        for pages, few in zip(twins, (len(pos), 0, graphs.pages.FEW_TOKENS, 0)):
            if pages is twins[3]:
                pages._settled_to[:] = 0
            with mock.patch.object(graphs.pages, "FEW_TOKENS", few):
                try:
                    pages.plan(list(pos), torch.tensor(req, dtype=I32))
                    error = None
                except (ValueError, RuntimeError) as e:
                    error = (type(e), str(e))
            pages.trim()
            changes = pages.take_changes()
            changes = None if changes is None else (changes.index.tolist(), changes.pages.tolist())
            outcomes.append((error, changes, pages.swa_table.tolist(), [pages.cmp_table_of(r).tolist() for r in pages.ratios],
                             pages.length, pages.high, pages.pages_held()))
        assert outcomes[0] == outcomes[1] == outcomes[2] == outcomes[3], (pos, req)


def test_hidden_states_written_into_input_rows_step_as_a_copied_input():
    """``StepRunner.input(n)``: the same tensor for the same ``n``; hidden states written
    there and passed to ``step`` give what the same values passed as their own tensor give
    (a prefill chunk, then decode steps); ``n`` outside ``1..max_tokens`` is refused."""
    runners = [make_runner(make_layer(2, max_tokens=4)) for _ in range(2)]
    gen = torch.Generator().manual_seed(0)
    for pos in ([0, 1, 2], [3], [4], [5]):
        x = torch.randn(len(pos), TINY.dim, generator=gen).bfloat16()
        rows = runners[1].input(len(pos))
        assert rows is runners[1].input(len(pos)) and rows.shape == x.shape
        rows.copy_(x)
        outs = [r.step(h, pos, [0] * len(pos)).clone() for r, h in zip(runners, (x, rows))]
        assert torch.equal(outs[0], outs[1])
    for n in (0, 5):
        with pytest.raises(ValueError, match="1..4 tokens"):
            runners[0].input(n)


@settings(deadline=None, max_examples=examples(0.3))
@given(seed=st.integers(0, 2**16), steps=st.integers(1, 12))
def test_applied_page_changes_make_the_tables_the_allocators(seed, steps):
    """``apply_pages`` of a stack's changes (the SWA table and one compressed table per
    ratio, all in one store, packed in one copy): after every step and release the
    metadata's tables equal the allocator's host tables, whether the changes are packed
    into a staging buffer they fit in (which then holds them) or one too small (left
    alone: they go in a new buffer)."""
    from graphs import DSV41Stack, LayerPlan

    gen = random.Random(seed)
    staging = torch.full((gen.choice([4, 64]),), -7, dtype=I32)
    stack = DSV41Stack(TINY_V41, CacheConfig(4, 16, 64, PAGE), LayerPlan.from_lists([0, 2, 1], kv_sources=[1, 2], index_sources=[1, 2]))
    pages = PageAllocator.for_layer(stack, generator=torch.Generator().manual_seed(seed))
    meta = StepMetadata.for_layer(stack)
    for _ in range(steps):
        if gen.random() < 0.2:
            pages.release(gen.randrange(4))
        else:
            r = gen.randrange(4)
            n = min(gen.choice([1, 3, 9, 16]), 64 - pages.length[r])
            if n:
                pages.plan(list(range(pages.length[r], pages.length[r] + n)), [r] * n)
                pages.trim()
        changes = pages.take_changes()
        words = 0 if changes is None else 3 * changes.index.numel()
        staging.fill_(-7)
        meta.apply_pages(changes, staging=staging)
        assert bool((staging == -7).all()) == (words == 0 or words > staging.numel())
        assert torch.equal(meta.swa_block_table, pages.swa_table)
        for ratio in pages.ratios:
            assert torch.equal(meta.cmp_table_of(ratio), pages.cmp_table_of(ratio))


def test_array_steps_check_every_run():
    """A step of more than ``FEW_TOKENS`` tokens is checked on arrays, whether every run
    continues its row (a decode step) or some rewind: a run past ``max_seq_len``, a rewind
    past ``max_rewind`` and a start past a row's length are refused, naming the row, and
    change nothing; the same rows then step."""
    import graphs.pages

    R = graphs.pages.FEW_TOKENS + 4
    pages = PageAllocator(CacheConfig(R, R, 64, 4, max_rewind=2, swa_pages=16 * R), 2, TINY.window_size)
    for r in range(R):
        pages.grow(r, 64 if r == 0 else 60)  # row 0 is full
    state = lambda: (pages.swa_table.tolist(), pages.cmp_table.tolist(), pages.length, pages.high,  # noqa: E731
                     pages.pages_held())
    before = state()
    with pytest.raises(ValueError, match="request 0: positions 64..64 outside"):  # every run continues
        pages.plan(torch.tensor(pages.length, dtype=I32), torch.arange(R, dtype=I32))
    assert state() == before
    rows = torch.arange(1, R, dtype=I32)
    at = lambda *shift: torch.tensor([60 + s for s in shift], dtype=I32)  # noqa: E731
    pages.plan(at(*[0] * (R - 1)), rows)
    pages.plan(at(*[1] * (R - 2), 0), rows)  # the last row rewinds one
    before = state()
    for shift, match in ((-2, "rewind at most max_rewind=2"), (3, "cannot start at position 63")):
        with pytest.raises(ValueError, match=f"request {R - 1} .*{match}"):
            pages.plan(at(*[2] * (R - 2), shift), rows)
        assert state() == before
    pages.plan(at(*[2] * (R - 2), 1), rows)
    assert pages.length == [64] + [63] * (R - 2) + [62]


def test_a_step_the_pools_cannot_serve_changes_nothing():
    """A step that needs more pages than a pool holds is refused whole: ``RuntimeError``
    naming the pool, every table, length and free page as before; a smaller step then
    plans as usual."""
    layer = make_layer(2, max_seq_len=64, max_tokens=16, swa_pages=3)
    pages = PageAllocator.for_layer(layer)
    pages.plan(torch.arange(8, dtype=I32), torch.zeros(8, dtype=I32))
    before = (pages.swa_table, pages.cmp_table, pages.length, pages.high, pages.pages_held())
    pos, req = torch.cat([torch.arange(8, 16), torch.arange(16)]).to(I32), torch.tensor([0] * 8 + [1] * 16, dtype=I32)
    with pytest.raises(RuntimeError, match="swa pool's 3 pages are all in use"):
        pages.plan(pos, req)
    after = (pages.swa_table, pages.cmp_table, pages.length, pages.high, pages.pages_held())
    assert all(torch.equal(a, b) for a, b in zip(before[:2], after[:2])) and before[2:] == after[2:]
    pages.plan(torch.arange(8, 12, dtype=I32), torch.zeros(4, dtype=I32))
    assert pages.length[:2] == [12, 0]


def test_page_changes_name_each_table_entry_once():
    """A row released and reused before the tables are copied: each (row, column) appears
    once, with its last page (a device index_put_ of duplicates would pick either)."""
    layer = make_layer(2, max_seq_len=64, max_tokens=16)
    pages = PageAllocator.for_layer(layer, generator=torch.Generator().manual_seed(3))
    pages.plan(torch.arange(12, dtype=I32), torch.zeros(12, dtype=I32))
    pages.take_changes()
    pages.release(0)
    pages.plan(torch.arange(5, dtype=I32), torch.zeros(5, dtype=I32))
    meta = StepMetadata.for_layer(layer)
    index, new, _ = pages.take_changes()
    assert len(set(index.tolist())) == len(index)
    meta.block_tables.index_put_((index,), new)
    for table, mirror in ((meta.swa_block_table, pages.swa_table), (meta.cmp_block_table, pages.cmp_table)):
        assert torch.equal(table[0], mirror[0])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 7), st.integers(0, 1000), st.integers(1, 5)), max_size=6, unique_by=lambda r: r[0]),
       st.integers(0, 3))
def test_step_rows_give_each_token_its_requests_first_and_last_position(runs, padding):
    """A step's requests (contiguous tokens at consecutive positions, in any row order) and
    padding: every valid token gets its request's lowest and highest position in the
    step, padding its clamped position 0."""
    from graphs.metadata import StepInputs, step_rows

    pos = [p + i for _, p, n in runs for i in range(n)] + [-1] * padding
    req = [r for r, _, n in runs for _ in range(n)] + [0] * padding
    positions, token_to_req = torch.tensor(pos, dtype=torch.int32), torch.tensor(req, dtype=torch.int32)
    inp = StepInputs(positions, token_to_req, positions >= 0, *([None] * 4))
    rows = step_rows(inp, max_requests=8, ratio=2)
    want_first = [p for _, p, n in runs for _ in range(n)] + [0] * padding
    want_last = [p + n - 1 for _, p, n in runs for _ in range(n)] + [0] * padding
    assert rows.first.tolist() == want_first and rows.last.tolist() == want_last
    assert rows.row.tolist() == [r for r, _, n in runs for _ in range(n)] + [8] * padding
