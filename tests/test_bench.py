"""The sparse-MLA benchmark end to end on the CPU (wall clock, the reference backend)."""

import csv

import pytest

from compile_ops.bench import sparse_mla as bench


def test_sparse_mla_bench_writes_table_csv_and_plot(tmp_path, capsys):
    out = tmp_path / "bench"
    rc = bench.main(["--device", "cpu", "--T", "1,2", "--shapes", "8:64", "--formats", "bf16,fp8_dsv41",
                     "--backends", "reference,flashmla", "--ref-T", "", "--pool", "1024", "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "backend flashmla: timed as 'op [flashmla backend]'" in printed
    rows = list(csv.DictReader(open(out / "sparse_mla.csv")))
    assert {(r["T"], r["impl"], r["kv_format"]) for r in rows} == {
        (t, "reference", f) for t in ("1", "2") for f in ("bf16", "fp8_dsv41")}
    assert all(float(r["us"]) > 0 and float(r["kv_gbps"]) > 0 for r in rows)
    table = (out / "sparse_mla.md").read_text().splitlines()
    assert "reference bf16 us / TF/s / %roof" in table[0] and "reference fp8_dsv41 us / TF/s / %roof" in table[0]
    assert [line.split("|")[3].strip() for line in table[2:]] == ["1", "2"]
    assert all(line.split("|")[4].strip() for line in table[2:])  # a time in every row
    pytest.importorskip("matplotlib")
    assert (out / "sparse_mla.png").stat().st_size > 0


@pytest.mark.parametrize("stagger", [False, True])
def test_step_overhead_runs_real_decode_steps_and_times_both(stagger):
    """``graphs.bench.time_step_overhead``: every row of the batch decodes ``warmup + 2
    steps`` tokens per repetition from its start (``position``, or staggered within a page:
    ``steps`` back to back, ``steps`` with the host timed alone), rows past the batch hold
    nothing, and the three figures and the ratio come back."""
    from graphs import TINY, CacheConfig, DSV41Attention, StepRunner
    from graphs.bench import time_step_overhead

    runner = StepRunner(DSV41Attention(TINY, CacheConfig(6, 4, 64, 4), compress_ratio=2), (1, 4), compile=False)
    got = time_step_overhead(runner, 3, 20, steps=2, reps=2, warmup=1, in_place=stagger, stagger=stagger)
    assert got["step_us"] > 0 and got["replay_us"] > 0 and got["ratio"] == pytest.approx(got["step_us"] / got["replay_us"], rel=1e-2)
    assert got["host_us"] > 0
    assert runner.pages.length == [20 + (7 * r % 4 if stagger else 0) + 5 for r in range(3)] + [0] * 3


def test_the_decode_floor_counts_the_compressor_weights_the_step_reads():
    """``read_weight_bytes`` (the weights of the decode floor): the parameters, with the
    compressors' fp32 ``wkv`` / ``wgate`` counted as the bf16 they are read in, half their
    bytes when they hold bf16 values, all of them when they do not (high and low parts)."""
    import torch

    from graphs import TINY, CacheConfig, DSV41Attention
    from graphs.bench import decode_floor_us, read_weight_bytes, weight_bytes

    layer = DSV41Attention(TINY, CacheConfig(2, 4, 64, 4), compress_ratio=4)
    compressor_bytes = sum(p.numel() * 4 for n, p in layer.named_parameters() if "compressor.w" in n)
    assert compressor_bytes > 0
    assert read_weight_bytes(layer) == weight_bytes(layer) - compressor_bytes // 2
    assert decode_floor_us(layer, 1, 16)["bytes"]["weights"] == read_weight_bytes(layer)
    with torch.no_grad():
        for n, p in layer.named_parameters():
            if "compressor.w" in n:
                p.add_(1e-4)
    layer.refresh_splits()
    assert read_weight_bytes(layer) == weight_bytes(layer)


def test_prefill_flops_sum_each_layers_scored_entries():
    """``prefill_flops`` of a stack is the sum of its layers' ``step_flops``, each index
    layer scoring ``(p + 1) // ratio`` entries at position ``p``, a layer that scores inside
    the candidate source's blocks at most their entries; readers score none."""
    from graphs import TINY_V41, CacheConfig, DSV41Stack
    from graphs.bench import prefill_flops, step_flops
    from graphs.stack_job import TINY_PLAN

    stack = DSV41Stack(TINY_V41, CacheConfig(2, 16, 64, 4), TINY_PLAN)
    prompt, want = 40, 0.0
    plan = TINY_PLAN
    for block in stack.blocks:
        layer = block.attn
        entries = 0
        if layer.indexer is not None:
            cap = plan.candidate_topk_blocks * plan.candidate_block_size // layer.compress_ratio
            entries = sum(min((p + 1) // layer.compress_ratio, cap if layer.uses_candidates else p + 1)
                          for p in range(prompt))
        assert prefill_flops(layer, prompt) == step_flops(layer, prompt, entries)
        want += step_flops(layer, prompt, entries)
    assert [b.attn.uses_candidates for b in stack.blocks if b.attn.indexer is not None] == [False, False, True]
    assert prefill_flops(stack, prompt) == want
