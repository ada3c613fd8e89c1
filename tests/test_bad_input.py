"""Bad calls raise ValueError/TypeError naming the argument and what was expected."""

import pytest
import torch

import compile_ops
from compile_ops.formats import new_cache
from compile_ops.indexer.cache import new_index_cache
from graphs import TINY, CacheConfig, DSV41Attention, PageAllocator, PageChanges, StepMetadata, StepRunner

pytestmark = pytest.mark.quick  # the quick subset: python -m pytest -m quick

i32 = torch.int32


def mla_args(**change):
    args = dict(
        q=torch.randn(3, 4, 512).bfloat16(),
        swa_cache=new_cache("bf16", 2, 4),
        swa_indices=torch.zeros(3, 5, dtype=i32),
        swa_lens=torch.zeros(3, dtype=i32),
        cmp_cache=new_cache("bf16", 2, 4),
        cmp_indices=torch.zeros(3, 6, dtype=i32),
        cmp_lens=torch.zeros(3, dtype=i32),
        sink=torch.zeros(4),
        sm_scale=0.1,
        kv_format="bf16",
        kv_scale=1.0,
    )
    args.update(change)
    return args


def slot_args(**change):
    args = dict(
        topk=torch.zeros(3, 8, dtype=i32),
        token_to_req=torch.zeros(3, dtype=i32),
        block_table=torch.zeros(2, 4, dtype=i32),
        block_size=16,
        is_valid=torch.ones(3, dtype=torch.bool),
    )
    args.update(change)
    return args


def swa_args(**change):
    args = dict(
        positions=torch.zeros(3, dtype=i32),
        token_to_req=torch.zeros(3, dtype=i32),
        block_table=torch.zeros(2, 4, dtype=i32),
        page_size=16,
        window=8,
    )
    args.update(change)
    return args


META = torch.device("meta")
NO_CUDA = not torch.cuda.is_available()


def runner_call(method: str):
    """``StepRunner(tiny layer).<method>(**kwargs)``: the serving entry points' checks."""
    def call(**kwargs):
        runner = StepRunner(DSV41Attention(TINY, CacheConfig(4, 8, 32, 4), 2), (2, 4), compile=False)
        return getattr(runner, method)(**kwargs)
    return call


def metadata_update(**kwargs):
    return StepMetadata.for_layer(DSV41Attention(TINY, CacheConfig(4, 8, 32, 4), 0)).update(**kwargs)


def metadata_apply_pages(**kwargs):
    return StepMetadata.for_layer(DSV41Attention(TINY, CacheConfig(4, 8, 32, 4), 2)).apply_pages(**kwargs)


def page_changes(index, pages, ratio=2):
    """:class:`PageChanges` in the block-table layout of ``metadata_apply_pages``' layer (of ``ratio``)."""
    tables = PageAllocator(CacheConfig(4, 8, 32, 4), ratio, TINY.window_size).tables
    return PageChanges(torch.tensor(index), torch.tensor(pages, dtype=i32), tables)


def x(*shape):
    return torch.randn(*shape).bfloat16()

# (id, op, kwargs, exception, words the message must contain)
CASES = [
    ("q-float32", compile_ops.sparse_mla, mla_args(q=torch.randn(3, 4, 512)), TypeError, ["q", "bfloat16", "float32"]),
    ("q-2d", compile_ops.sparse_mla, mla_args(q=torch.randn(3, 512).bfloat16()), ValueError, ["q", "3 dims"]),
    ("q-head-dim-576", compile_ops.sparse_mla, mla_args(q=torch.randn(3, 4, 576).bfloat16()), ValueError, ["q", "512", "576"]),
    ("swa_indices-T-mismatch", compile_ops.sparse_mla, mla_args(swa_indices=torch.zeros(2, 5, dtype=i32)), ValueError, ["swa_indices", "T", "(3)"]),
    ("swa_indices-int64", compile_ops.sparse_mla, mla_args(swa_indices=torch.zeros(3, 5, dtype=torch.int64)), TypeError, ["swa_indices", "int32", "int64"]),
    ("swa_lens-2d", compile_ops.sparse_mla, mla_args(swa_lens=torch.zeros(3, 1, dtype=i32)), ValueError, ["swa_lens", "1 dims"]),
    ("sink-H-mismatch", compile_ops.sparse_mla, mla_args(sink=torch.zeros(5)), ValueError, ["sink", "H", "(4)"]),
    ("sink-bf16", compile_ops.sparse_mla, mla_args(sink=torch.zeros(4).bfloat16()), TypeError, ["sink", "float32"]),
    ("unknown-kv_format", compile_ops.sparse_mla, mla_args(kv_format="fp4"), ValueError, ["kv_format", "fp4", "fp8_dsv41"]),
    ("cache-width-vs-format", compile_ops.sparse_mla, mla_args(kv_format="fp8_ds_mla", swa_cache=new_cache("fp8_dsv41", 2, 4)), ValueError, ["swa_cache", "584", "528"]),
    ("cache-dtype-vs-format", compile_ops.sparse_mla, mla_args(kv_format="fp8"), TypeError, ["swa_cache", "float8_e4m3fn", "bfloat16"]),
    ("cache-not-page-contiguous", compile_ops.sparse_mla, mla_args(swa_cache=new_cache("bf16", 2, 8)[:, ::2]), ValueError, ["swa_cache", "contiguous within each page"]),
    ("cmp-half-given", compile_ops.sparse_mla, mla_args(cmp_cache=None), ValueError, ["cmp_cache", "together"]),
    ("cache-on-other-device", compile_ops.sparse_mla, mla_args(cmp_cache=new_cache("bf16", 2, 4, device=META)), ValueError, ["cmp_cache", "cpu", "meta"]),
    ("kv_scale-zero", compile_ops.sparse_mla, mla_args(kv_scale=0.0), ValueError, ["kv_scale", "positive"]),
    ("sm_scale-negative", compile_ops.sparse_mla, mla_args(sm_scale=-0.1), ValueError, ["sm_scale", "positive", "-0.1"]),
    ("sm_scale-nan", compile_ops.sparse_mla, mla_args(sm_scale=float("nan")), ValueError, ["sm_scale", "positive", "nan"]),
    # a non-tensor argument of the wrong Python type is rejected by the dispatcher's schema check
    ("sm_scale-str", compile_ops.sparse_mla, mla_args(sm_scale="0.1"), RuntimeError, ["sm_scale", "float", "str"]),
    ("topk-int64", compile_ops.topk_to_slots, slot_args(topk=torch.zeros(3, 8, dtype=torch.int64)), TypeError, ["topk", "int32", "int64"]),
    ("block_size-zero", compile_ops.topk_to_slots, slot_args(block_size=0), ValueError, ["block_size", ">= 1", "0"]),
    ("is_valid-int", compile_ops.topk_to_slots, slot_args(is_valid=torch.ones(3, dtype=i32)), TypeError, ["is_valid", "bool"]),
    ("token_to_req-T-mismatch", compile_ops.topk_to_slots, slot_args(token_to_req=torch.zeros(4, dtype=i32)), ValueError, ["token_to_req", "T", "(3)"]),
    ("block_table-1d", compile_ops.topk_to_slots, slot_args(block_table=torch.zeros(4, dtype=i32)), ValueError, ["block_table", "2 dims"]),
    ("dcp-rank-out-of-world", compile_ops.dcp_topk_to_slots, {**slot_args(), "rank": 2, "world": 2, "interleave": 1}, ValueError, ["rank", "[0, 2)"]),
    ("dcp-interleave-zero", compile_ops.dcp_topk_to_slots, {**slot_args(), "rank": 0, "world": 2, "interleave": 0}, ValueError, ["interleave", ">= 1"]),
    ("window-negative", compile_ops.swa_indices, swa_args(window=-3), ValueError, ["window", ">= 1", "-3"]),
    ("page_size-negative", compile_ops.swa_indices, swa_args(page_size=-16), ValueError, ["page_size", ">= 1", "-16"]),
    ("positions-float", compile_ops.swa_indices, swa_args(positions=torch.zeros(3)), TypeError, ["positions", "int32"]),
    ("lse_combine-shape-mismatch", compile_ops.lse_combine, dict(partial_out=torch.zeros(2, 3, 4, 8), partial_lse=torch.zeros(2, 3, 5)), ValueError, ["partial_lse", "[2, 3, 4]"]),
    ("lse_combine-int-out", compile_ops.lse_combine, dict(partial_out=torch.zeros(2, 3, 4, 8, dtype=i32), partial_lse=torch.zeros(2, 3, 4)), TypeError, ["partial_out", "int32"]),
    ("dcp_combine-no-group", compile_ops.dcp_combine, dict(out=torch.zeros(3, 4, 8), lse=torch.zeros(3, 4), group_name="nope"), ValueError, ["group_name", "nope"]),
    # the serving entry points (graphs): every one names the argument and the expected value
    ("apply_pages-tuple", metadata_apply_pages, dict(changes=(torch.zeros(1, dtype=torch.int64),) * 3), TypeError, ["PageChanges", "take_changes", "tuple"]),
    ("apply_pages-int32-index", metadata_apply_pages, dict(changes=page_changes([0], [1])._replace(index=torch.zeros(1, dtype=i32))), ValueError, ["host", "int64", "take_changes"]),
    ("apply_pages-other-layout", metadata_apply_pages, dict(changes=page_changes([0], [1], ratio=4)), ValueError, ["laid out", "for_layer"]),
    ("apply_pages-index-past-tables", metadata_apply_pages, dict(changes=page_changes([0, 10**6], [1, 2])), ValueError, ["1000000", "outside"]),
    ("apply_pages-negative-index", metadata_apply_pages, dict(changes=page_changes([-1], [1])), ValueError, ["-1", "outside"]),
    ("step-x-hidden-size", runner_call("step"), dict(x=x(2, 65), positions=[0, 1], token_to_req=[0, 0]), ValueError, ["x", "dim = 64", "(2, 65)"]),
    ("step-x-1d", runner_call("step"), dict(x=x(64), positions=[0], token_to_req=[0]), ValueError, ["x", "[n, dim = 64]", "(64,)"]),
    ("step-positions-float", runner_call("step"), dict(x=x(2, 64), positions=torch.tensor([0.0, 1.5]), token_to_req=[0, 0]), TypeError, ["positions", "integer", "float32"]),
    ("step-positions-float-list", runner_call("step"), dict(x=x(2, 64), positions=[0, 1.5], token_to_req=[0, 0]), TypeError, ["positions", "ints", "float"]),
    ("step-positions-count", runner_call("step"), dict(x=x(2, 64), positions=[0], token_to_req=[0]), ValueError, ["positions", "[n] = [2]"]),
    ("release-row-out-of-range", runner_call("release"), dict(row=9), ValueError, ["row", "0..3", "9"]),
    ("metadata-positions-float", metadata_update, dict(positions=torch.tensor([0.0, 1.5]), token_to_req=torch.zeros(2, dtype=i32)), TypeError, ["positions", "integer", "float32"]),
    pytest.param("layer-on-cuda-without-cuda", DSV41Attention, dict(cfg=TINY, cache=CacheConfig(4, 8, 32, 4), compress_ratio=2, device="cuda"), ValueError, ["device='cuda'", "no CUDA GPU"], marks=pytest.mark.skipif(not NO_CUDA, reason="a CUDA GPU is visible")),
    pytest.param("new_cache-on-cuda-without-cuda", new_cache, dict(kv_format="bf16", num_pages=2, page_size=4, device="cuda"), ValueError, ["device='cuda'", "no CUDA GPU"], marks=pytest.mark.skipif(not NO_CUDA, reason="a CUDA GPU is visible")),
    ("new_index_cache-unknown-device", new_index_cache, dict(index_format="fp8", num_pages=2, page_size=4, device="tpu"), ValueError, ["device", "'tpu'"]),
]


@pytest.mark.parametrize("name,op,kwargs,error,words", CASES,
                         ids=[c.values[0] if hasattr(c, "values") else c[0] for c in CASES])
def test_bad_call_raises_a_clear_error(name, op, kwargs, error, words):
    with pytest.raises(error) as info:
        op(**kwargs)
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} missing from: {message}"


def test_sparse_mla_out_checks_caller_buffers():
    args = mla_args()
    with pytest.raises(ValueError, match=r"out must be a contiguous \[T, H, 512\]"):
        compile_ops.sparse_mla_out(**args, out=torch.empty(3, 5, 512, dtype=torch.bfloat16), lse=torch.empty(3, 4))
    with pytest.raises(TypeError, match="lse must have dtype torch.float32"):
        compile_ops.sparse_mla_out(**args, out=torch.empty(3, 4, 512, dtype=torch.bfloat16), lse=torch.empty(3, 4).double())


def test_out_of_range_slots_are_not_an_error():
    args = mla_args(swa_indices=torch.tensor([[10**6, -5, 7, 8, 2**31 - 1]] * 3, dtype=i32), swa_lens=torch.full((3,), 5, dtype=i32))
    out, lse = compile_ops.sparse_mla(**args)
    assert torch.isfinite(lse).all()
