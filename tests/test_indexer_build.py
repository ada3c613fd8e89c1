"""The indexer's Triton kernels built for sm_90 on the CPU, as the GPU launches them.

CI has no GPU and the interpreter compiles nothing, so without this test an edit that
breaks a kernel's Hopper build, makes it spill registers or outgrow shared memory would
first show up on the device. Every top-k launch that :func:`compile_ops.indexer.triton.topk_plan`
makes for decode steps and prefill chunks (rows of 512 to 1M entries, V4.1's k = 512 and its
2048 candidate blocks) is built, with the scores kernel of both index formats and the
candidate kernels (``tests/scripts/sm90_build.py``, in a process of its own: the tests'
process runs Triton in its interpreter); the scores kernel also as a prefill step launches
it, several tokens a program.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

SM90_SHARED_BYTES = 232_448  # 227 KB: the most shared memory one block may opt into on sm_90
# Spills known today (Triton 3.7.1), the most allowed: a program selecting among 8192 entries
# holds more registers per thread than 16 warps have (its keys, ids and scores); a handful of
# values go to local memory.
KNOWN_SPILLS = {"topk-0-8192-512-last-ids": 2, "topk-0-8192-512-last-sorted": 2, "topk-0-8192-2048-last-sorted": 4,
                "topk-1-8192-2048-level-ids": 4}
# Triton 3.9 builds a few programs over 8192 entries with more, the others with fewer or none
if tuple(int(v) for v in triton.__version__.split(".")[:2]) >= (3, 9):
    KNOWN_SPILLS.update({"topk-0-8192-512-last-ids": 8, "topk-0-8192-512-last-sorted": 8,
                         "topk-0-8192-2048-last-ids": 2, "topk-1-8192-2048-last-sorted": 6,
                         "topk-1-8192-2048-level-ids": 12, "topk-2-8192-2048-then-8192-sorted": 4})


def topk_name(launch) -> str:
    """A top-k launch's build name: its source, segment, slots, whether it writes the result
    (``last``) or runs the last level after its own (``then-<seg>``), and its order."""
    role = "last" if launch.last else f"then-{launch.then_seg}" if launch.then_seg else "level"
    return f"topk-{launch.source}-{launch.seg}-{launch.k_pad}-{role}-{'sorted' if launch.sort else 'ids'}"


def builds() -> dict:
    """``{name: build}`` for ``tests/scripts/sm90_build.py``: V4.1-Flash's 32 index heads."""
    from compile_ops.indexer import triton as kernels

    mod = "compile_ops.indexer.triton"
    scores = dict(kernel=f"{mod}:_scores_kernel",
                  aligned=["s_qt", "s_qh", "s_wt", "s_page", "s_bt", "s_st", "s_at", "s_gt"],
                  types=dict(q="*bf16", w="*fp32", t2r="*i32", n_entries="*i32", cache="*u8", table="*i32",
                             allowed="*i8", scores="*fp32", n_out="*i32", tickets="*i32", gmax="*fp32",
                             g_counts="*i32"))
    topk = dict(kernel=f"{mod}:_segment_topk_kernel", aligned=["s_src", "s_ids", "s_cand", "s_out"],
                types=dict(src_vals="*fp32", src_ids="*i32", n="*i32", n_src="*i32", cand_vals="*fp32",
                           cand_ids="*i32", ids="*i32", vals="*fp32", bound="*i32", tickets="*i32"))
    out = {}
    # (a long row's scores write the top-k's group maxima too: the bulk-copied fp8 and the fp4 ones here;
    # a prefill step's programs take several tokens, as many as scores_tokens allows)
    for fmt, restrict, bulk in (("fp8", False, False), ("fp8", True, False), ("bf16", False, False),
                                ("fp8", False, True), ("fp8", True, True), ("fp4", False, False)):
        cache = "*bf16" if fmt == "bf16" else "*u8"
        keys = f"tensordesc<fp8e4nv[1, {kernels.BN}, 128]>" if bulk else cache
        for tokens in (1, kernels.FP4_QUERY_ROWS // 32 if fmt == "fp4" else kernels.SCORES_TOKENS):
            name = f"scores-{fmt}-{'restricted' if restrict else 'all'}{'-bulk' if bulk else ''}"
            out[name + (f"-{tokens}-tokens" if tokens > 1 else "")] = dict(
                scores, types={**scores["types"], "cache": cache, "keys": keys}, num_warps=4 * tokens,
                num_stages=kernels.SCORE_LAUNCH[bulk][1],
                constants=dict(HI=32, TB=tokens, FP8=fmt == "fp8", RESTRICT=restrict, BN=kernels.BN, ITERS=0,
                               UPCAST=False, TMA=bulk, FP4=fmt == "fp4", GROUPS=bulk or fmt == "fp4",
                               G=kernels.TOPK_GROUP))
    launches = {launch._replace(programs=0, cover=0) for T in (1, 64, 256, 4096)
                for L in (512, 8192, 1 << 15, 1 << 17, 1 << 20) for k in (512, 2048)
                for stage in kernels.topk_plan(T, L, k, sms=132) for launch in stage}
    for launch in sorted(launches):
        name = topk_name(launch)
        # (a selection of groups stores its bound where a program covers the row: an id-order one here)
        out[name] = dict(topk, num_warps=launch.warps,
                         constants=dict(SOURCE=launch.source, G=kernels.TOPK_GROUP, SEG=launch.seg, K_PAD=launch.k_pad,
                                        LAST=launch.last, SORTED=launch.sort, THEN_SEG=launch.then_seg,
                                        BOUND=launch.source != 2 and not launch.sort))
    out["group-max"] = dict(kernel=f"{mod}:_group_max_kernel", types=dict(
        scores="*fp32", n="*i32", gmax="*fp32", g_counts="*i32"),
        constants=dict(G=kernels.TOPK_GROUP, BLOCK=kernels.GROUP_MAX_BLOCK))
    out["candidate-mask"] = dict(kernel=f"{mod}:_candidate_mask_kernel", types=dict(
        cand="*i32", t2r="*i32", n_entries="*i32", allowed="*i8"),
        constants=dict(C_PAD=2048, CHUNK=kernels.MASK_CHUNK, ITERS=0))
    out["block-max"] = dict(kernel=f"{mod}:_block_max_kernel", types=dict(
        scores="*fp32", n="*i32", t2r="*i32", n_entries="*i32", out="*fp32", n_out="*i32"),
        constants=dict(BB=kernels.BLOCK_MAX_BLOCKS, BP=8, ITERS=0))
    return out


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    spec = tmp_path_factory.mktemp("sm90") / "spec.json"
    spec.write_text(json.dumps(builds()))
    root = Path(__file__).resolve().parent
    env = {**os.environ, "TRITON_INTERPRET": "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(root.parent), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, str(root / "scripts" / "sm90_build.py"), str(spec)], capture_output=True,
                         text=True, timeout=1200, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


def test_every_kernel_builds_without_new_spills(reports):
    """No register spills beyond :data:`KNOWN_SPILLS`, shared memory within an SM's."""
    for name, r in reports.items():
        assert r["spills"] <= KNOWN_SPILLS.get(name, 0), f"{name}: {r['spills']} local-memory (spill) instructions"
        assert r["shared"] <= SM90_SHARED_BYTES, f"{name}: {r['shared']} bytes of shared memory"


def test_scores_run_on_the_tensor_cores_with_streamed_keys(reports):
    """fp8 (or bf16 for bf16 keys) wgmma products, keys loaded row by row 16 bytes per lane
    (16 programs per SM keep the loads in flight), or by TMA bulk copies (pages of whole
    64-entry blocks); fp4 keys as e4m3 bytes (masks and shifts, no conversion instruction:
    ``F2F`` / ``F2FP`` would run at the conversion unit's rate); one token a program and a
    prefill step's blocks of tokens alike."""
    assert not [op for name in reports if name.startswith("scores-fp4") for op in reports[name]["ops"]
                if op.startswith("F2F")]
    for name in [name for name in reports if name.startswith("scores-")]:
        fmt, ops = name.removeprefix("scores-").removesuffix("-tokens").rstrip("-0123456789"), reports[name]["ops"]
        assert ("HGMMA" if fmt.startswith("bf16") else "QGMMA") in " ".join(ops), ops
        assert "UTMALDG" in " ".join(ops) if fmt.endswith("bulk") else any(op.startswith("LDG.E.128") for op in ops), ops


def test_the_build_covers_every_launch_of_the_plan(reports):
    """The top-k builds are the plan's launches: a decode row of 512 entries is one sorted
    program, one of 8K one launch; a 1M-entry row goes through its groups."""
    from compile_ops.indexer import triton as kernels

    decode = kernels.topk_plan(1, 512, 512, sms=132)
    assert [[(launch.source, launch.seg, launch.last) for launch in s] for s in decode] == [[(0, 512, True)]]
    # a decode row of 8K: four programs of 2048, the last of them to finish then selects the row's
    # 512 from their 2048 kept entries (no launch of its own)
    assert kernels.topk_plan(1, 8192, 512, sms=132, sort=False) == [[kernels.TopkLaunch(0, 2048, 4, 2048, 512, False,
                                                                                          False, then_seg=2048)]]
    # ... but a prefill chunk's launch of thousands of programs leaves the last level its own
    prefill = kernels.topk_plan(2048, 16384, 512, sms=132, sort=False)[1]
    assert [(launch.programs, launch.last, launch.then_seg) for launch in prefill] == [(2, False, 0), (1, True, 0)]
    grouped = kernels.topk_plan(64, 1 << 20, 512, sms=132)
    assert len(grouped) == 2 and grouped[1][0].source == 2 and grouped[1][0].seg <= kernels.TOPK_GATHER_SEGMENT
    assert all(topk_name(launch) in reports for stage in grouped for launch in stage)
