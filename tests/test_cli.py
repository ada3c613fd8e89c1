"""The command-line entry points: bad arguments end in an argparse error before any work,
``--help`` exits 0, and ``python -m graphs`` prints a verdict and exits non-zero on failure."""

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import graphs.__main__ as graphs_main
from compile_ops import selfcheck
from compile_ops.bench import __main__ as bench_main
from graphs.naive import REL_TOL, OracleVerdict

ROOT = Path(__file__).resolve().parent.parent


def exits(main, argv):
    """(exit status, seconds) of ``main(argv)`` (argparse exits through SystemExit)."""
    start = time.perf_counter()
    try:
        status = main(argv)
    except SystemExit as done:
        status = done.code
    return status, time.perf_counter() - start


@pytest.mark.parametrize("argv, says", [
    (["--kv-format", "fp9"], "invalid choice: 'fp9'"),
    (["--backend", "triton", "--device", "cpu"], "backend 'triton' cannot run sparse_mla on cpu"),
    (["--backend", "cudnn", "--device", "cpu"], "'auto' or one of"),
    (["--ratios", "3", "--device", "cpu"], "compress_ratio must be one of tiny's"),
    (["--decode", "0"], "--decode must be >= 1"),
    (["--device", "gpu"], "device"),
    (["--device", "cpu", "--dcp", "3"], "--dcp 3 must divide tiny's 4 heads and 2 output groups"),
], ids=["kv-format", "backend-off-device", "backend-unknown", "ratio", "decode", "device-name", "dcp"])
def test_graphs_rejects_bad_arguments_before_any_work(argv, says, capsys):
    status, seconds = exits(graphs_main.main, argv)
    assert status == 2 and seconds < 5
    assert says in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks a torch that cannot use CUDA")
@pytest.mark.parametrize("main, argv", [
    (graphs_main.main, ["--device", "cuda"]),
    (selfcheck.main, ["--device", "cuda", "--backend", "auto"]),
], ids=["graphs", "selfcheck"])
def test_cuda_without_cuda_is_an_argument_error(main, argv, capsys):
    status, _ = exits(main, argv)
    err = capsys.readouterr().err
    assert status == 2 and "error: no backend can run" in err and "this torch" in err and "Traceback" not in err


def test_graphs_ratio_128_runs_on_the_cpu(capsys):
    """The CPU layer is made long enough for every ratio it is asked for (ratio 128 once
    failed after minutes of other layers' work)."""
    status, _ = exits(graphs_main.main, ["--device", "cpu", "--ratios", "128", "--decode", "4", "--requests", "2"])
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert "compress_ratio=128" in printed and "PASS: every layer" in printed


def test_graphs_serves_under_dcp_against_dcp1():
    """``python -m graphs --dcp 2`` (2 gloo processes) checks the DCP layer against DCP=1."""
    run = subprocess.run([sys.executable, "-m", "graphs", "--device", "cpu", "--dcp", "2", "--interleave", "4",
                          "--ratios", "2", "--decode", "3", "--requests", "3"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "ratio 2: PASS" in run.stdout and "0 token(s) with other top-k ids, 0 graph breaks" in run.stdout
    assert "PASS: every layer (DCP=2 against DCP=1)" in run.stdout
    assert "caches per rank" in run.stdout and "x\n" in run.stdout


def test_graphs_checks_fp8_weights_against_the_dequantized_bf16_layer(capsys):
    status, _ = exits(graphs_main.main, ["--device", "cpu", "--weights", "fp8", "--ratios", "2", "--decode", "3",
                                         "--requests", "3"])
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert "PASS: fp8 weights vs the dequantized bf16 layer" in printed and "PASS: every layer" in printed


def test_graphs_help_states_the_defaults_it_runs(capsys):
    status, _ = exits(graphs_main.main, ["--help"])
    assert status == 0
    assert "(default: 1 2)" in capsys.readouterr().out
    assert graphs_main.DEFAULT_RATIOS == (1, 2)


def test_graphs_stack_defaults_to_deepseek_v41_cache_formats():
    """``--stack`` serves DeepSeek-V4.1's own formats unless told otherwise; the single
    layer keeps its defaults (bf16 on the CPU, fp8 index keys)."""
    args = graphs_main.parse_args(["--device", "cpu", "--stack"])
    assert (args.kv_format, args.cmp_kv_format, args.index_format) == ("fp8_dsv41", "fp4_dsv41", "fp4")
    args = graphs_main.parse_args(["--device", "cpu", "--stack", "--index-format", "fp8", "--kv-format", "bf16"])
    assert (args.kv_format, args.cmp_kv_format, args.index_format) == ("bf16", "fp4_dsv41", "fp8")
    args = graphs_main.parse_args(["--device", "cpu"])
    assert (args.kv_format, args.cmp_kv_format, args.index_format) == ("bf16", None, "fp8")


@pytest.mark.parametrize("argv, status, says", [
    (["--help"], 0, "{sparse-mla,slots,dcp,indexer,linear}"),
    ([], 2, "required: benchmark"),
    (["nope"], 2, "invalid choice: 'nope'"),
    (["slots", "--help"], 0, "--tokens"),
    (["linear", "--tokens", "1,x"], 2, "expected comma-separated integers"),
], ids=["help", "none", "unknown", "benchmark-help", "bad-tokens"])
def test_bench_dispatcher(argv, status, says, capsys):
    assert exits(bench_main.main, argv)[0] == status
    out = capsys.readouterr()
    assert says in out.out + out.err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
@pytest.mark.parametrize("argv", [["linear", "--tokens", "1"], ["sparse-mla"], ["indexer"], ["slots"]],
                         ids=["linear", "sparse-mla", "indexer", "slots"])
def test_gpu_benchmarks_refuse_without_cuda(argv, capsys):
    assert bench_main.main(argv) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().out


@pytest.mark.parametrize("main, argv", [
    (graphs_main.main, ["--help"]), (selfcheck.main, ["--help"]), (bench_main.main, ["linear", "--help"]),
    (bench_main.main, ["sparse-mla", "--help"]), (bench_main.main, ["indexer", "--help"]),
], ids=["graphs", "selfcheck", "bench-linear", "bench-sparse-mla", "bench-indexer"])
def test_help_is_plain_text(main, argv, capsys):
    """``--help`` prints the module docstring's paragraph without reST markup."""
    assert exits(main, argv)[0] == 0
    out = capsys.readouterr().out
    assert "``" not in out and ":func:" not in out and len(out) > 200


def test_selfcheck_has_a_row_for_every_op(capsys):
    """``python -m compile_ops`` checks every public op against its oracle (gloo rows included)."""
    import compile_ops

    assert selfcheck.main([]) == 0
    out = capsys.readouterr().out
    ops = {line.split()[0].split("[")[0] for line in out.splitlines()[2:] if line and not line[0].isspace()
           and "ops match" not in line}
    public = {n for n in compile_ops.__all__ if hasattr(torch.ops.dsv41, n)}
    assert public <= ops, f"no row for {sorted(public - ops)}"


def test_backend_applies_to_every_family():
    """``--backend reference`` runs every family on the reference (fp8_linear and the combine
    included); a backend only some families have leaves the others on ``auto``."""
    import dataclasses

    import compile_ops

    families = {f.name for f in dataclasses.fields(compile_ops.BackendConfig)}
    assert set(graphs_main.OP_FAMILIES) == families
    assert graphs_main.backend_choice("reference", "fp8") == dict.fromkeys(families, "reference")
    gluon = graphs_main.backend_choice("gluon", "bf16")  # the indexer's Gluon kernel reads fp4 / fp8 keys
    assert gluon["sparse_mla"] == gluon["linear"] == "gluon"
    assert {gluon[f] for f in families - {"sparse_mla", "linear"}} == {"auto"}
    for index_format in ("fp4", "fp8"):
        gluon = graphs_main.backend_choice("gluon", index_format)
        assert gluon["sparse_mla"] == gluon["indexer"] == gluon["linear"] == "gluon"
        assert {gluon[f] for f in families - {"sparse_mla", "indexer", "linear"}} == {"auto"}


def test_oracle_verdict_fails_on_outputs_or_picks():
    assert OracleVerdict(10, REL_TOL / 2, 0).passed
    assert not OracleVerdict(10, 2 * REL_TOL, 0).passed
    bad_picks = OracleVerdict(10, 0.0, 1)
    assert not bad_picks.passed and bad_picks.verdict().startswith("FAIL") and "1 token(s)" in bad_picks.verdict()


def test_graphs_exits_1_when_a_layer_fails(monkeypatch, capsys):
    honest = graphs_main.oracle_verdict

    def strict(*args):  # as if one token had picked entries the oracle rules out
        result = honest(*args)
        return OracleVerdict(result.tokens, result.max_rel_diff, 1, result.tolerance)

    monkeypatch.setattr(graphs_main, "oracle_verdict", strict)
    status, _ = exits(graphs_main.main, ["--device", "cpu", "--ratios", "2", "--decode", "4", "--requests", "2"])
    printed = capsys.readouterr().out
    assert status == 1 and "FAIL: ratio 2" in printed


def test_readme_example_runs():
    """The README's Python block, as a user would paste it."""
    text = (ROOT / "README.md").read_text()
    block = text.split("```python\n", 1)[1].split("```", 1)[0]
    run = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() in ("reference", "gluon", "triton", "flashinfer", "flashmla")


def test_targets_table_sets_each_figure_beside_its_floor_and_limit():
    from graphs.targets import Target, table

    text = table([Target("batch-1 replay", 116.4, 100.0, floor=33.2, note="29 kernels"),
                  Target("64 x 64K / bytes floor", 1.39, 1.4, unit="x", note="179.0 us against 128.8 us"),
                  Target("kernels per replay", 29, 60, unit="kernels"),
                  Target("FP8 prefill / FP8 floor", 3.1, None, unit="x")])
    assert "| batch-1 replay <= 100 us | 116.4 us (29 kernels) | 33.2 us (3.51x) | no |" in text
    assert "| 64 x 64K / bytes floor <= 1.4x | 1.39x (179.0 us against 128.8 us) | - | yes |" in text
    assert "| kernels per replay <= 60 kernels | 29 kernels | - | yes |" in text
    assert "| FP8 prefill / FP8 floor | 3.10x | - | - |" in text  # reported, no target set


@pytest.mark.parametrize("argv, status, says", [
    (["--only", "decode,chunks"], 2, "sections are decode, long, indexer, stack, fp4, prefill"),
    (["--only", ","], 2, "sections are"),
] + ([] if torch.cuda.is_available() else [(["--only", "indexer"], 1, "it needs a CUDA GPU")]))
def test_targets_refuses_unknown_sections_and_a_machine_without_cuda(argv, status, says, capsys):
    from graphs.targets import main

    got, seconds = exits(main, argv)
    printed = capsys.readouterr()
    assert got == status and seconds < 5 and says in printed.out + printed.err
