"""CPU tests of ``lowering``: Inductor's code around the ops, reinplacing, export, AOTInductor.

On the CPU the ops run their reference kernels and stay extern calls in Inductor's code
(the Triton inlining is proven on the GPU by ``tests/scripts/gpu_lowering_check.py``). What is
checked here: the compiled decode step calls the ops on the caches and step buffers
themselves (no clone / copy around them), ``sparse_mla_out`` and ``write_kv`` are
re-inplaced (``possibly_missed_reinplacing_opportunities == 0``), the decision of what is
inlined, and ``torch.export`` + AOTInductor of the step against eager.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing import FileCheck

import compile_ops
import lowering
from compile_ops.formats import new_cache
from compile_ops.mla.ops import sparse_mla
from compile_ops.slots.ops import swa_indices
from graphs import TINY, CacheConfig, DSV41Attention, LayerStep
from helpers import grown_meta
from lowering.aoti import EngineStep, export_step, package_step, remaining_custom_ops
from lowering.inductor import inline_triton, inlines

RATIO = 2
I32 = torch.int32


def tiny_layer() -> DSV41Attention:
    return DSV41Attention(TINY, CacheConfig(4, 4, 32, 4), compress_ratio=RATIO)


def test_install_is_idempotent():
    names = lowering.install()
    assert names == lowering.install()
    assert {"dsv41::sparse_mla", "dsv41::sparse_mla_out", "dsv41::topk_to_slots", "dsv41::swa_indices"} <= set(names)


def test_inline_decision(monkeypatch):
    """Inlined only on CUDA with the Triton backend and inlining on (fake CUDA tensors, in a
    process that answers as if it had a GPU)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with FakeTensorMode():
        q = torch.empty(2, 4, 512, dtype=torch.bfloat16, device="cuda")
        ints = torch.empty(2, dtype=I32, device="cuda")
    args = (q, None, None, None, None, None, None, None, 0.1)
    with compile_ops.use_backends(sparse_mla="triton"):
        assert inlines(sparse_mla, *args)
        with inline_triton(False):
            assert not inlines(sparse_mla, *args)
        # two cache formats (V4.1's fp4 entries beside an fp8 window): the tl kernel reads both
        assert inlines(sparse_mla, *args, "fp8_dsv41", 1.0, "fp4_dsv41")
    with compile_ops.use_backends(sparse_mla="reference"):
        assert not inlines(sparse_mla, *args)
    assert inlines(swa_indices, ints, ints, ints, 4, 8)
    assert not inlines(sparse_mla, torch.empty(2, 4, 512, dtype=torch.bfloat16), *args[1:])
    with FakeTensorMode():
        cache = torch.empty(2, 4, 528, dtype=torch.uint8, device="cuda")
        kv = torch.empty(2, 512, dtype=torch.bfloat16, device="cuda")
    assert inlines(compile_ops.write_kv, cache, ints, kv, "fp8_dsv41")
    with inline_triton(False):
        assert not inlines(compile_ops.write_kv, cache, ints, kv, "fp8_dsv41")
    with compile_ops.use_backends(kv="reference"):
        assert not inlines(compile_ops.write_kv, cache, ints, kv, "fp8_dsv41")
    assert not inlines(compile_ops.write_kv, new_cache("fp8_dsv41", num_pages=2, page_size=4), ints.cpu(), kv.cpu(), "fp8_dsv41")


def test_compiled_decode_step_calls_ops_in_place():
    """The ops are called on the caches and the step's own buffers, and the compressor's
    state is scattered into in place: no clone, no copy of a buffer back into itself."""
    torch._dynamo.reset()
    counters.clear()
    layer = tiny_layer()
    meta = grown_meta(layer, 2, 1)
    meta.update(torch.tensor([0, 0], dtype=I32), torch.tensor([0, 1], dtype=I32), bucket=2)
    twin = copy.deepcopy(layer)
    x = torch.randn(2, TINY.dim, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch.no_grad():
        got, (code,) = run_and_get_code(torch.compile(LayerStep(layer, meta), fullgraph=True), x)
        want = LayerStep(twin, copy.deepcopy(meta))(x)
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)
    assert counters["inductor"]["possibly_missed_reinplacing_opportunities"] == 0
    # the SWA write (normalised and turned in its store), the compressed write, top-k ->
    # slots, attention, in order (the window, a pure op, may be scheduled anywhere before
    # attention); the stores get the cache buffer itself (a graph input), not a copy of it
    FileCheck().check("torch.ops.dsv41.swa_indices.default(").check("torch.ops.dsv41.sparse_mla_out").run(code)
    (FileCheck()
     .check_regex(r"torch\.ops\.graphs\.write_turned\.default\(arg\d+_1,")
     .check_regex(r"torch\.ops\.dsv41\.write_kv\.default\(arg\d+_1,")
     .check("torch.ops.dsv41.topk_to_slots.default(")
     .check_regex(r"torch\.ops\.dsv41\.sparse_mla_out\.default\(buf\d+, arg\d+_1,")
     .run(code))
    FileCheck().check_not("clone").check_not(".copy_(").check_not("aten.contiguous").run(code)
    # a kernel of aten.copy_ (not _to_copy) would write a whole mutated buffer every step
    assert not re.findall(r"\w*(?<!_to)_copy__\w*", code)


def _attention_inputs():
    gen = torch.Generator().manual_seed(1)
    cache = new_cache("bf16", num_pages=4, page_size=4)
    kv = torch.randn(3, 512, generator=gen)
    slots = torch.tensor([1, 6, -1], dtype=I32)
    q = torch.randn(3, 4, 512, generator=gen).to(torch.bfloat16)
    idx = torch.tensor([[1, 6, 2], [6, -1, -1], [0, 1, 6]], dtype=I32)
    lens = torch.tensor([2, 1, 3], dtype=I32)
    sink = torch.randn(4, generator=gen)
    return cache, slots, kv, q, idx, lens, sink


def _write_then_attend(cache, slots, kv, q, idx, lens, sink, out, lse):
    compile_ops.write_kv(cache, slots, kv, "bf16")
    compile_ops.sparse_mla_out(q, cache, idx, lens, None, None, None, sink, 0.05, "bf16", 1.0, out, lse)
    return out.float().sum()


def test_out_ops_reinplaced():
    """``write_kv`` (cache) and ``sparse_mla_out`` (out, lse) write caller-owned buffers in place."""
    torch._dynamo.reset()
    counters.clear()
    args = _attention_inputs()
    out, lse = torch.empty(3, 4, 512, dtype=torch.bfloat16), torch.empty(3, 4)
    eager = copy.deepcopy((*args, out, lse))
    _write_then_attend(*eager)
    _, (code,) = run_and_get_code(torch.compile(_write_then_attend, fullgraph=True), *args, out, lse)
    assert counters["inductor"]["possibly_missed_reinplacing_opportunities"] == 0
    for name, got, want in (("cache", args[0], eager[0]), ("out", out, eager[-2]), ("lse", lse, eager[-1])):
        torch.testing.assert_close(got, want, msg=name)
    (FileCheck()
     .check_regex(r"torch\.ops\.dsv41\.write_kv\.default\(arg0_1,")
     .check_regex(r"torch\.ops\.dsv41\.sparse_mla_out\.default\(arg\d+_1, arg0_1,")
     .check("'bf16', 1.0, arg7_1, arg8_1")  # out and lse: the caller's buffers
     .run(code))
    FileCheck().check_not("clone").check_not(".copy_(").run(code)


def test_export_step_reference_ops():
    """On the CPU every op stays a call (reference kernels); ``T`` is dynamic in [1, max_tokens]."""
    program = export_step(tiny_layer())
    assert remaining_custom_ops(program) == [
        "dsv41.indexer_topk.default", "dsv41.sparse_mla_out.default", "dsv41.swa_indices.default",
        "dsv41.topk_to_slots.default", "dsv41.write_index_keys.default", "dsv41.write_kv.default",
    ]
    (T,) = [s for s in program.range_constraints.values()]
    assert (T.lower, T.upper) == (1, 4)


def test_aoti_package_decodes_like_eager(tmp_path):
    """The ``.pt2`` (reference ops through the proxy executor) runs 6 steps of 1-4 tokens
    like the eager layer; its caches and state live in the package and persist."""
    layer = tiny_layer()
    meta = grown_meta(layer, 4, 6)
    eager, fresh = EngineStep(copy.deepcopy(layer)), copy.deepcopy(layer)
    model = torch._inductor.aoti_load_package(package_step(layer, str(tmp_path / "step.pt2"), meta=meta))
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for step, T in enumerate((2, 3, 4, 1, 3, 4)):
            x = torch.randn(T, TINY.dim, generator=gen).to(torch.bfloat16)
            pos = torch.full((T,), step, dtype=I32)
            args = (x, pos, torch.arange(T, dtype=I32), meta.swa_block_table, meta.cmp_block_table)
            got, want = model(*args), eager(*args)
            err = (got.float() - want.float()).abs().max().item()
            assert err <= 2e-2 * want.float().abs().max().item(), f"step {step} (T={T}): max error {err}"
        # the comparison means something: without the earlier steps' caches the output differs
        stateless = EngineStep(fresh)(*args)
        assert (stateless.float() - want.float()).abs().max() > 0.1


@pytest.mark.gpu
@pytest.mark.parametrize("kv_format", ["bf16", "fp8", "fp8_ds_mla", "fp8_dsv41"])
def test_write_kv_compiles_into_inductor_code_on_cuda(kv_format):
    """On CUDA ``write_kv`` is traced (torch quantizer + Triton row store), so Inductor's code
    calls no ``dsv41`` op and copies no cache; the bytes equal eager's (``-1`` rows write
    nothing)."""
    torch._dynamo.reset()
    counters.clear()
    cache = new_cache(kv_format, num_pages=8, page_size=64, device="cuda")
    cache.view(torch.uint8).copy_(torch.randint(0, 256, cache.view(torch.uint8).shape, dtype=torch.uint8))
    want = cache.clone()
    slots = torch.tensor([3, -1, 130, 511, 64, -1, 200], dtype=I32, device="cuda")
    kv = torch.randn(7, 512, device="cuda").to(torch.bfloat16)
    compile_ops.write_kv(want, slots, kv, kv_format)
    _, (code,) = run_and_get_code(torch.compile(compile_ops.write_kv, fullgraph=True), cache, slots, kv, kv_format)
    FileCheck().check_not("torch.ops.dsv41").check_not("clone").run(code)
    assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8))
    assert counters["inductor"]["possibly_missed_reinplacing_opportunities"] == 0
