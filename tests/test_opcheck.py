"""torch.library.opcheck (schema, fake tensor, autograd registration, AOT dispatch) for every op."""

import math

import pytest
import torch
import torch.distributed as dist

import compile_ops
from compile_ops import write_kv
from compile_ops.formats import KV_FORMATS, new_cache

i32 = torch.int32
ALL_CHECKS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def opcheck(op, args):
    """opcheck with all default checks; test_schema is left out when an argument is float8,
    since its mutation check calls torch.allclose, which CPU float8 lacks (a torch limit).
    For those cases the caller's inputs are compared bytewise instead."""
    flat = [b for a in args for b in (a if isinstance(a, (list, tuple)) else [a])]  # lists of tensors too
    fp8 = [a for a in flat if isinstance(a, torch.Tensor) and a.dtype == torch.float8_e4m3fn]
    before = [a.view(torch.uint8).clone() for a in fp8]
    checks = ALL_CHECKS[1:] if fp8 else ALL_CHECKS
    result = torch.library.opcheck(op, args, test_utils=checks)
    assert all(v == "SUCCESS" for v in result.values()), result
    mutable = {a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    if not mutable:
        assert all(torch.equal(b, a.view(torch.uint8)) for b, a in zip(before, fp8))


def sparse_mla_args(kv_format, T=3, H=5, with_cmp=True, sink=True):
    cache = new_cache(kv_format, 2, 4, page_gap=3)
    write_kv(cache, torch.arange(8, dtype=i32), torch.randn(8, 512), kv_format)
    cmp = (cache, torch.randint(-1, 9, (T, 6), dtype=i32), torch.randint(0, 7, (T,), dtype=i32))
    return (
        torch.randn(T, H, 512).bfloat16(),
        cache,
        torch.randint(-1, 9, (T, 4), dtype=i32),
        torch.randint(0, 5, (T,), dtype=i32),
        *(cmp if with_cmp else (None, None, None)),
        torch.randn(H) if sink else None,
        0.06,
        kv_format,
        0.5,
    )


@pytest.mark.parametrize("kv_format", sorted(KV_FORMATS))
@pytest.mark.parametrize("with_cmp,sink", [(True, True), (False, False)], ids=["two-segments+sink", "swa-only"])
def test_sparse_mla(kv_format, with_cmp, sink):
    args = sparse_mla_args(kv_format, with_cmp=with_cmp, sink=sink)
    opcheck(torch.ops.dsv41.sparse_mla.default, args)
    out = torch.empty(3, 5, 512, dtype=torch.bfloat16)
    lse = torch.empty(3, 5)
    opcheck(torch.ops.dsv41.sparse_mla_out.default, (*args, out, lse))
    opcheck(torch.ops.dsv41.sparse_mla_out.default, (*args, out, lse, compile_ops.sparse_mla_workspace("cpu")))


def test_sparse_mla_of_two_cache_formats():
    """DeepSeek-V4.1's caches: fp8_dsv41 window rows, fp4_dsv41 compressed entries."""
    args = list(sparse_mla_args("fp8_dsv41"))
    entries = new_cache("fp4_dsv41", 2, 4)
    write_kv(entries, torch.arange(8, dtype=i32), torch.randn(8, 512), "fp4_dsv41")
    args[4] = entries
    opcheck(torch.ops.dsv41.sparse_mla.default, (*args, "fp4_dsv41"))
    out, lse = torch.empty(3, 5, 512, dtype=torch.bfloat16), torch.empty(3, 5)
    opcheck(torch.ops.dsv41.sparse_mla_out.default, (*args, out, lse, None, "fp4_dsv41"))


def slot_inputs():
    return (
        torch.randint(-1, 40, (4, 7), dtype=i32),
        torch.tensor([0, 1, 1, 0], dtype=i32),
        torch.randint(-1, 20, (2, 5), dtype=i32),
        8,
        torch.tensor([True, True, False, True]),
    )


def test_topk_to_slots():
    opcheck(torch.ops.dsv41.topk_to_slots.default, slot_inputs())


def test_dcp_topk_to_slots():
    opcheck(torch.ops.dsv41.dcp_topk_to_slots.default, (*slot_inputs(), 1, 2, 4))


def test_swa_indices():
    args = (torch.tensor([0, 5, -1, 30], dtype=i32), torch.tensor([0, 1, 1, 0], dtype=i32),
            torch.randint(0, 20, (2, 5), dtype=i32), 8, 6)
    opcheck(torch.ops.dsv41.swa_indices.default, args)


def test_lse_combine():
    lse = torch.randn(3, 4, 5)
    lse[0, 0, 0] = -math.inf
    opcheck(torch.ops.dsv41.lse_combine.default, (torch.randn(3, 4, 5, 16).bfloat16(), lse))


def test_write_kv():
    for kv_format in KV_FORMATS:
        cache = new_cache(kv_format, 2, 4)
        args = (cache, torch.tensor([3, -1, 7], dtype=i32), torch.randn(3, 512), kv_format, 0.5)
        opcheck(torch.ops.dsv41.write_kv.default, args)


@pytest.fixture
def world_of_one(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield dist.group.WORLD.group_name
    dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["ag_rs", "a2a"])
def test_dcp_combine(world_of_one, mode):
    args = (torch.randn(3, 4, 16).bfloat16(), torch.randn(3, 4), world_of_one, mode)
    opcheck(torch.ops.dsv41.dcp_combine.default, args)
    out, lse = compile_ops.dcp_combine(*args)
    assert torch.equal(out, args[0]) and torch.equal(lse, args[1])  # world 1: nothing to merge
