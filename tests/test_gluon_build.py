"""The warp-specialized Gluon kernel (``compile_ops/mla/gluon.py``) built for sm_90 on the CPU.

CI has no GPU and Gluon has no interpreter, so without this test an edit that breaks the
kernel's Hopper build, makes it spill registers or outgrow the H200's shared memory would
first show up on the device. Triton ships ptxas and cuobjdump, so the whole build (PTX,
cubin, SASS) runs here, for every format and both column splits (``dsplit`` 1 and 2), with
the compile-time arguments and options of a real launch (:func:`compile_ops.mla.gluon.launch_options`). The build runs in a process
of its own: the tests' process runs Triton in its interpreter (``conftest.py``)."""

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


def build_report(build):
    """What the tests check of one ``"kv_format:dsplit"`` sm_90 build."""
    kv_format, dsplit = build.split(":")
    sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
    from sm90_build import full_sass

    compiled = build_sm90(kv_format, int(dsplit))
    sass = full_sass(compiled.asm["cubin"])
    return dict(
        shared=compiled.metadata.shared,
        spills=len(re.findall(r"\b(?:STL|LDL)(?:\.\w+)*\b", sass)),
        wgmma=sass.count("HGMMA"),
        setmaxnreg=sass.count("USETMAXREG"),
    )


@pytest.fixture(scope="module")
def reports():
    import triton

    from compile_ops.mla.ops import gluon_triton_unsupported

    refused = gluon_triton_unsupported(triton.__version__)
    if refused is not None:  # the backend refuses this Triton (tests/test_backends.py)
        pytest.skip(refused)
    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    run = subprocess.run([sys.executable, __file__, *BUILDS], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.splitlines()[-1])


@pytest.mark.parametrize("build", BUILDS)
def test_gluon_kernel_builds_for_sm90_without_spills(build, reports):
    report = reports[build]
    assert report["shared"] <= SM90_SHARED_BYTES, f"{report['shared']} bytes of shared memory"
    assert report["spills"] == 0, f"{report['spills']} local-memory (spill) instructions"
    assert report["wgmma"] > 0  # the products run as wgmma
    assert report["setmaxnreg"] >= 3  # the warpgroups' register split survived


if __name__ == "__main__":
    print(json.dumps({build: build_report(build) for build in sys.argv[1:]}))
