"""The Gluon kernels (``compile_ops/mla/gluon.py``, ``compile_ops/indexer/gluon.py``) built for sm_90 on the CPU.

CI has no GPU and Gluon has no interpreter, so without this test an edit that breaks the
kernel's Hopper build, makes it spill registers or outgrow the H200's shared memory would
first show up on the device. Triton ships ptxas and cuobjdump, so the whole build (PTX,
cubin, SASS) runs here, for every format and both column splits (``dsplit`` 1 and 2), with
the compile-time arguments and options of a real launch (:func:`compile_ops.mla.gluon.launch_options`). The build runs in a process
of its own: the tests' process runs Triton in its interpreter (``conftest.py``)."""

import concurrent.futures
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

# "window+compressed": a call of two formats (DeepSeek-V4.1's)
FORMATS = ["bf16", "fp8", "fp8_ds_mla", "fp8_dsv41", "fp4_dsv41", "fp8_dsv41+fp4_dsv41"]
BUILDS = [f"{kv_format}:{dsplit}" for kv_format in FORMATS for dsplit in (1, 2)]
# the indexer's scores kernel (compile_ops/indexer/gluon.py):
# "indexer:format:heads:restrict:page shift:groups:tokens" (V4.1's 32 index heads and V4's 64;
# candidate blocks or not; power-of-two pages or any; writing the top-k's group maxima or not;
# one token a program or a prefill step's blocks of them)
INDEXER_BUILDS = [f"indexer:{fmt}:{build}:{tokens}" for fmt in ("fp4", "fp8")
                  for build in ("32:0:6:0", "32:1:-1:1", "64:0:5:1", "64:1:6:0", "16:0:6:1") for tokens in (1, 4)]
# the warp-specialized prefill scores kernel (fp8 keys, four tokens of 32 heads a program on
# pages of 32 or more entries), "prefill:restrict:page shift:groups": the launches of the
# V4.1-Flash stack slice (python -m graphs.targets --only prefill: a ratio-2 layer's 32-entry
# pages, a ratio-1 layer's 64-entry pages, the layer inside the candidate source's blocks,
# each with the group maxima of rows past 8K entries), and without candidates, maxima or on
# larger pages
PREFILL_BUILDS = [f"prefill:{build}" for build in ("0:5:1", "0:6:1", "1:6:1", "1:5:0", "0:6:0", "0:7:1")]

# the weight-only FP8 GEMM (compile_ops/linear/gluon.py): every tile weight_only_tile gives,
# "linear:warpgroups:tokens:stages:partial" (K split into fp32 partials or not)
LINEAR_BUILDS = [f"linear:{wg}:{bt}:{stages}:{partial}" for wg, bt, stages in ((1, 16, 2), (1, 32, 2), (1, 64, 2), (2, 128, 3))
                 for partial in (0, 1)]

# the Gluon top-k levels (compile_ops.indexer.gluon._topk_level_kernel): every launch the plans
# of rows of 512 to 1M scores, k = 512 and 2048, run on it (those that keep id order and hold
# an entry a thread at least; a launch with a then-level runs the row's last level too),
# "topk:source:seg:k_pad:last:then_seg:warps"
TOPK_BUILDS = ["topk:0:512:512:1:0:4", "topk:0:2048:512:0:0:8", "topk:0:2048:512:0:2048:8", "topk:0:2048:512:1:0:8",
               "topk:0:2048:2048:1:0:8", "topk:0:8192:512:0:0:16", "topk:0:8192:512:1:0:16", "topk:0:8192:2048:0:0:16",
               "topk:0:8192:2048:0:8192:16", "topk:0:8192:2048:1:0:16", "topk:1:1024:512:1:0:4", "topk:1:2048:512:0:0:8",
               "topk:1:2048:512:0:1024:8", "topk:1:4096:512:1:0:8", "topk:1:4096:2048:1:0:8", "topk:1:8192:2048:0:0:16",
               "topk:1:8192:2048:0:4096:16", "topk:1:8192:2048:1:0:16", "topk:2:2048:512:0:2048:8",
               "topk:2:4096:512:0:0:8", "topk:2:8192:2048:0:0:16", "topk:2:8192:2048:0:8192:16"]

SM90_SHARED_BYTES = 232_448  # 227 KB: the most shared memory one block may opt into on sm_90
POINTER_TYPES = {
    "q": "*bf16", "out": "*bf16", "lse": "*fp32", "part_o": "*fp32", "part_lse": "*fp32", "sink": "*fp32",
    "swa_idx": "*i32", "swa_len": "*i32", "cmp_idx": "*i32", "cmp_len": "*i32",
}
# as Triton specializes a launch with contiguous index tensors and 16-byte aligned strides
ONES = ("s_swa_n", "s_cmp_n")
ALIGNED = ("s_qt", "s_qh", "swa_stride", "cmp_stride")


def build_sm90(kv_format, dsplit):
    """:func:`gluon._sparse_mla_ws_kernel` compiled for sm_90 as a launch on ``kv_format``
    caches (``"window+compressed"``: two formats) with power-of-two pages and ``dsplit``
    programs per head block would compile it."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from compile_ops.formats import get_format
    from compile_ops.mla import gluon

    kv_format, _, cmp_format = kv_format.partition("+")
    fmt = get_format(kv_format)
    options = gluon.launch_options(fmt, page_shift=True, dsplit=dsplit, cmp_fmt=get_format(cmp_format or kv_format))
    num_warps, maxnreg = options.pop("num_warps"), options.pop("maxnreg")
    kernel = gluon._sparse_mla_ws_kernel
    names = list(inspect.signature(kernel.fn).parameters)
    signature, constants = {}, {}
    for i, name in enumerate(names):
        if name in options or name in ONES:
            signature[name] = "constexpr"
            constants[(i,)] = options.get(name, 1)
        elif name in ("swa_kv", "cmp_kv"):
            signature[name] = mangle_type(torch.empty(0, dtype=get_format(kv_format).dtype))
        else:
            signature[name] = POINTER_TYPES.get(name, "fp32" if name in ("qk_scale", "kv_scale") else "i32")
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names)
               if signature[name].startswith("*") or name in ALIGNED}
    source = GluonASTSource(kernel, signature, constants, aligned)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, maxnreg=maxnreg))


def build_indexer_sm90(index_format: str, heads: int, restrict: bool, page_shift: int, groups: bool, tokens: int):
    """:func:`compile_ops.indexer.gluon._scores_kernel` compiled for sm_90 as
    :func:`compile_ops.indexer.gluon.launch_scores_gluon` launches it for ``heads`` index heads
    over ``index_format`` keys (``groups``: writing the top-k's group maxima too), ``tokens``
    tokens a program."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from compile_ops.indexer import gluon
    from compile_ops.indexer.triton import BN, TOPK_GROUP

    kernel = gluon._scores_kernel
    names = list(inspect.signature(kernel.fn).parameters)
    types = dict(q="*bf16", w="*fp32", t2r="*i32", n_entries="*i32", cache="*u8", table="*i32", allowed="*i8",
                 scores="*fp32", n_out="*i32", tickets="*i32", gmax="*fp32", g_counts="*i32")
    options = dict(HI=max(16, heads), TB=tokens, RESTRICT=restrict, BN=BN, PAGE_SHIFT=page_shift, STAGES=gluon.STAGES,
                   FP4=index_format == "fp4", GROUPS=groups, G=TOPK_GROUP)
    signature = {n: "constexpr" if n in options else types.get(n, "i32") for n in names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
               if signature[n].startswith("*")
               or n in ("s_qt", "s_qh", "s_wt", "s_page", "s_bt", "s_st", "s_at", "s_gt")}
    source = GluonASTSource(kernel, signature, {(names.index(k),): v for k, v in options.items()}, aligned)
    maxnreg = gluon.max_registers(tokens, index_format == "fp4")
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=maxnreg))


def build_prefill_sm90(restrict: bool, page_shift: int, groups: bool):
    """:func:`compile_ops.indexer.gluon._prefill_scores_kernel` compiled for sm_90 as
    :func:`compile_ops.indexer.gluon.launch_scores_gluon` launches it (32 heads, four tokens a
    program) over an fp8 index cache of ``2 ** page_shift``-entry pages (its TMA descriptors,
    :func:`compile_ops.indexer.gluon.prefill_descriptors`)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from compile_ops.indexer import gluon
    from compile_ops.indexer.cache import new_index_cache
    from compile_ops.indexer.triton import BN, TOPK_GROUP

    kernel = gluon._prefill_scores_kernel
    names = list(inspect.signature(kernel.fn).parameters)
    keys, scales = gluon.prefill_descriptors(new_index_cache("fp8", 2, 1 << page_shift))
    types = dict(q="*bf16", w="*fp32", t2r="*i32", n_entries="*i32", table="*i32", allowed="*i8", scores="*fp32",
                 n_out="*i32", tickets="*i32", gmax="*fp32", g_counts="*i32", keys=mangle_type(keys),
                 scales=mangle_type(scales))
    options = dict(HI=32, TB=gluon.GLUON_TOKENS, RESTRICT=restrict, BN=BN, PAGE_SHIFT=page_shift, GROUPS=groups,
                   G=TOPK_GROUP)
    signature = {n: "constexpr" if n in options else types.get(n, "i32") for n in names}
    strides = ("s_qt", "s_qh", "s_wt", "s_page", "s_bt", "s_st", "s_at", "s_gt")
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
               if signature[n].startswith("*") or n in strides}
    source = GluonASTSource(kernel, signature, {(names.index(k),): v for k, v in options.items()}, aligned)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4, maxnreg=gluon.PREFILL_REGISTERS))


def build_topk_sm90(source: int, seg: int, k_pad: int, last: bool, then_seg: int, warps: int):
    """:func:`compile_ops.indexer.gluon._topk_level_kernel` compiled for sm_90 as
    ``compile_ops.indexer.triton._launch`` launches one level (a selection of groups, source
    0 of a grouped row, stores its bound)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from compile_ops.indexer import gluon
    from compile_ops.indexer.triton import TOPK_GROUP

    kernel = gluon._topk_level_kernel
    names = list(inspect.signature(kernel.fn).parameters)
    types = dict(src_vals="*fp32", src_ids="*i32", n="*i32", n_src="*i32", cand_vals="*fp32", cand_ids="*i32",
                 ids="*i32", vals="*fp32", bound="*i32", tickets="*i32")
    options = dict(SOURCE=source, G=TOPK_GROUP, SEG=seg, K_PAD=k_pad, LAST=last, BOUND=source == 0, THEN_SEG=then_seg,
                   W=warps)
    signature = {n: "constexpr" if n in options else types.get(n, "i32") for n in names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
               if signature[n].startswith("*") or n in ("s_src", "s_ids", "s_cand", "s_out")}
    source = GluonASTSource(kernel, signature, {(names.index(k),): v for k, v in options.items()}, aligned)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))


def build_linear_sm90(warpgroups: int, tokens: int, stages: int, partial: bool):
    """:func:`compile_ops.linear.gluon._weight_only_kernel` compiled for sm_90 as
    :func:`compile_ops.linear.gluon.fp8_linear_gluon` launches it."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from compile_ops.linear import gluon

    kernel = gluon._weight_only_kernel
    names = list(inspect.signature(kernel.fn).parameters)
    types = dict(x="*bf16", w="*u8", w_s="*u8", c="*fp32" if partial else "*bf16")
    options = dict(WG=warpgroups, BT=tokens, BK=gluon.BK, STAGES=stages, PARTIAL=partial)
    signature = {n: "constexpr" if n in options else types.get(n, "i32") for n in names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
               if signature[n].startswith("*") or n in ("K", "stride_xm", "stride_wn", "stride_cm")}
    source = GluonASTSource(kernel, signature, {(names.index(k),): v for k, v in options.items()}, aligned)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4 * warpgroups))


def loop_barriers(sass: str) -> list[int]:
    """The ``BAR.SYNC`` count of each loop of a kernel's SASS (a backward branch's span;
    an instruction is 16 bytes)."""
    lines = sass.splitlines()
    counts = []
    for i, line in enumerate(lines):
        m = re.search(r"BRA (?:!?U?P\d, )?0x([0-9a-f]+)", line)
        if m and int(m.group(1), 16) // 16 < i:
            counts.append(sum("BAR.SYNC" in lines[j] for j in range(int(m.group(1), 16) // 16, i + 1)))
    return counts


def waits_before_memory(ptx: str) -> bool:
    """Whether a kernel's PTX waits for the stream's previous kernel (``griddepcontrol.wait``,
    a programmatic dependent launch) before its first global load, store, atomic or copy."""
    wait = ptx.find("griddepcontrol.wait")
    first = re.search(r"\b(?:ld|st|atom|red)\.global|\bcp\.async\.", ptx)
    return wait >= 0 and (first is None or wait < first.start())


def build_report(build):
    """What the tests check of one ``"kv_format:dsplit"`` (or ``INDEXER_BUILDS``) sm_90 build."""
    sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
    from sm90_build import full_sass

    if build.startswith("topk:"):
        _, source, seg, k_pad, last, then_seg, warps = build.split(":")
        compiled = build_topk_sm90(int(source), int(seg), int(k_pad), last == "1", int(then_seg), int(warps))
        sass = full_sass(compiled.asm["cubin"])
        return dict(spills=len(re.findall(r"\b(?:STL|LDL)(?:\.\w+)*\b", sass)), loops=loop_barriers(sass),
                    redux=sass.count("REDUX"), waits=waits_before_memory(compiled.asm["ptx"]))
    if build.startswith("linear:"):
        _, warpgroups, tokens, stages, partial = build.split(":")
        compiled = build_linear_sm90(int(warpgroups), int(tokens), int(stages), partial == "1")
        sass = full_sass(compiled.asm["cubin"])
        return dict(shared=compiled.metadata.shared, spills=len(re.findall(r"\b(?:STL|LDL)(?:\.\w+)*\b", sass)),
                    wgmma=sass.count("HGMMA"), pair_loads=sass.count("LDS.U16"), stores=len(re.findall(r"(?<![A-Z])STS", sass)),
                    copies=sass.count("LDGSTS.E.BYPASS.128"), scale_products=sass.count("HMUL2.BF16"))
    if build.startswith("prefill:"):
        _, restrict, page_shift, groups = build.split(":")
        compiled = build_prefill_sm90(restrict == "1", int(page_shift), groups == "1")
        sass = full_sass(compiled.asm["cubin"])
        return dict(shared=compiled.metadata.shared, spills=len(re.findall(r"\b(?:STL|LDL)(?:\.\w+)*\b", sass)),
                    wgmma=sass.count("QGMMA"), shapes=sorted(set(re.findall(r"QGMMA\.(\w+)", sass))),
                    bulk=sass.count("UTMALDG"), copies=sass.count("LDGSTS"), setmaxnreg=sass.count("USETMAXREG"),
                    waits=waits_before_memory(compiled.asm["ptx"]),
                    overlapped=bool(re.search(r"wgmma\.wait_group\.sync\.aligned\s+1;", compiled.asm["ptx"])))
    if build.startswith("indexer:"):
        _, index_format, heads, restrict, page_shift, groups, tokens = build.split(":")
        compiled = build_indexer_sm90(index_format, int(heads), restrict == "1", int(page_shift), groups == "1",
                                      int(tokens))
        sass = full_sass(compiled.asm["cubin"])
        return dict(shared=compiled.metadata.shared, spills=len(re.findall(r"\b(?:STL|LDL)(?:\.\w+)*\b", sass)),
                    wgmma=sass.count("QGMMA"), copies=sass.count("LDGSTS.E.BYPASS.128"),
                    shapes=sorted(set(re.findall(r"QGMMA\.(\w+)", sass))),
                    waits=waits_before_memory(compiled.asm["ptx"]),
                    overlapped=bool(re.search(r"wgmma\.wait_group\.sync\.aligned\s+1;", compiled.asm["ptx"])))
    kv_format, dsplit = build.split(":")
    compiled = build_sm90(kv_format, int(dsplit))
    sass = full_sass(compiled.asm["cubin"])
    return dict(
        shared=compiled.metadata.shared,
        spills=len(re.findall(r"\b(?:STL|LDL)(?:\.\w+)*\b", sass)),
        wgmma=sass.count("HGMMA"),
        setmaxnreg=sass.count("USETMAXREG"),
        waits=waits_before_memory(compiled.asm["ptx"]),
    )


@pytest.fixture(scope="module")
def reports():
    import triton

    from compile_ops.backends import gluon_triton_unsupported

    refused = gluon_triton_unsupported(triton.__version__)
    if refused is not None:  # the backend refuses this Triton (tests/test_backends.py)
        pytest.skip(refused)
    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    run = subprocess.run([sys.executable, __file__, *BUILDS, *INDEXER_BUILDS, *PREFILL_BUILDS, *TOPK_BUILDS, *LINEAR_BUILDS],
                         env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.splitlines()[-1])


@pytest.mark.parametrize("build", BUILDS)
def test_gluon_kernel_builds_for_sm90_without_spills(build, reports):
    report = reports[build]
    assert report["shared"] <= SM90_SHARED_BYTES, f"{report['shared']} bytes of shared memory"
    assert report["spills"] == 0, f"{report['spills']} local-memory (spill) instructions"
    assert report["wgmma"] > 0  # the products run as wgmma
    assert report["setmaxnreg"] >= 3  # the warpgroups' register split survived
    assert report["waits"], "a programmatic dependent launch reads memory before griddepcontrol.wait"


@pytest.mark.parametrize("build", INDEXER_BUILDS)
def test_indexer_scores_build_for_sm90_without_spills(build, reports):
    """The scores kernel: no spills at 16 to 64 heads, its keys copied 16 bytes a
    ``cp.async`` (a wider or narrower row layout would split them), four 32-deep e4m3
    ``wgmma`` a block (fp4: one per 32 values, each under its own scales; fp8: one
    128-deep product from shared memory, of a pair of tokens' queries where one token's
    heads are fewer than 64, the second pair's product in flight while the first's scores
    are summed); launched as a programmatic dependent, it touches no global memory before
    it has waited for the kernel before it."""
    report = reports[build]
    assert report["shared"] <= SM90_SHARED_BYTES, f"{report['shared']} bytes of shared memory"
    assert report["spills"] == 0, f"{report['spills']} local-memory (spill) instructions"
    assert report["copies"] >= 2 and report["wgmma"] >= 4, report
    assert report["waits"], "a programmatic dependent launch reads memory before griddepcontrol.wait"
    _, index_format, heads, _, _, _, tokens = build.split(":")
    if index_format == "fp8":  # a pair of tokens' queries are one product's columns where one's are under 64
        pairs = tokens != "1" and int(heads) < 64
        width = max(16, int(heads)) * (2 if pairs else 1)
        assert report["shapes"] == [f"64x{width}x32"], report
        assert report["overlapped"] == (pairs and int(tokens) > 2), report


@pytest.mark.parametrize("build", TOPK_BUILDS)
def test_topk_levels_build_for_sm90_with_one_barrier_a_search_step(build, reports):
    """The Gluon top-k level: no spills, its search loop (two steps an iteration) two
    barriers, one a step (``tl.sum``'s block reduction takes three a step), and no global
    memory touched before it has waited for the kernel before it (a programmatic dependent
    launch)."""
    report = reports[build]
    assert report["spills"] == 0, f"{report['spills']} local-memory (spill) instructions"
    assert report["redux"] >= 2 and 2 in report["loops"], report  # the counts within a warp: REDUX
    assert all(count <= 2 for count in report["loops"]), report
    assert report["waits"], "a programmatic dependent launch reads memory before griddepcontrol.wait"


@pytest.mark.parametrize("build", PREFILL_BUILDS)
def test_prefill_scores_build_for_sm90_without_spills(build, reports):
    """The warp-specialized prefill scores kernel: no spills in any partition under the
    launch's register split (three warpgroups, each of its partitions setting its own
    registers), its keys copied by TMA (no ``cp.async``), two 64-column products a key block
    (a pair of 32-head tokens each), the second in flight while the first's scores are
    summed; launched as a programmatic dependent, no partition touches global memory before
    it has waited for the kernel before it."""
    report = reports[build]
    assert report["shared"] <= SM90_SHARED_BYTES, f"{report['shared']} bytes of shared memory"
    assert report["spills"] == 0, f"{report['spills']} local-memory (spill) instructions"
    assert report["shapes"] == ["64x64x32"] and report["wgmma"] >= 8, report
    assert report["bulk"] >= 2 and report["copies"] == 0, report
    assert report["setmaxnreg"] >= 3 and report["overlapped"], report
    assert report["waits"], "a programmatic dependent launch reads memory before griddepcontrol.wait"


@pytest.mark.parametrize("build", LINEAR_BUILDS)
def test_weight_only_gemm_builds_for_sm90_without_spills(build, reports):
    """The weight-only GEMM: no spills; a K step of 128 is eight 16-deep bf16 ``wgmma``
    whose register operand comes from 2-byte loads of the weight bytes (no store of the
    widened weights to shared memory) and one bf16 multiply a pair by its block's scale."""
    report = reports[build]
    assert report["shared"] <= SM90_SHARED_BYTES, f"{report['shared']} bytes of shared memory"
    assert report["spills"] == 0, f"{report['spills']} local-memory (spill) instructions"
    assert report["wgmma"] == 8 and report["pair_loads"] == 32 and report["scale_products"] == 32, report
    assert report["stores"] == 0 and report["copies"] > 0, report


if __name__ == "__main__":
    with concurrent.futures.ProcessPoolExecutor(os.cpu_count()) as pool:  # one build per core
        print(json.dumps(dict(zip(sys.argv[1:], pool.map(build_report, sys.argv[1:])))))
