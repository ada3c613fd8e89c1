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
