"""CPU tests of the FlashInfer backend's argument translation (``compile_ops.mla.flashinfer``).

No SM100/SM120 GPU is available here, so FlashInfer's kernels are **not** run or verified by
these tests. The end-to-end checks evaluate the translated keyword arguments with a small
plain-torch *interpretation of FlashInfer's documented semantics* (the docstrings of
``trtllm_batch_decode_sparse_mla_dsv4`` / ``_sparse_mla_sm120_paged_attention`` and the
reference functions of FlashInfer's own tests, flashinfer 0.6.18 @ fb28d72) and compare with
``sparse_mla_reference``. That checks our translation against FlashInfer's contract; it is
not a mock of the kernel and says nothing about the kernels' own correctness.
"""

import math

import pytest
import torch

from compile_ops import write_kv
from compile_ops.formats import new_cache, read_kv
from compile_ops.mla import flashinfer as fi
from compile_ops.mla.inputs import SparseMLAArgs
from compile_ops.mla.reference import sparse_mla_reference

LOG2E = 1.0 / math.log(2.0)


def test_predicate_cpu_and_capabilities():
    assert "CUDA" in fi.flashinfer_unavailable(torch.device("cpu"), "bf16")
    assert "SM90" in fi.unavailable_reason("cuda", (9, 0), "fp8_ds_mla", None)
    assert fi.unavailable_reason("cuda", (10, 0), "bf16", None) is None
    assert fi.unavailable_reason("cuda", (10, 3), "fp8", None) is None
    assert fi.unavailable_reason("cuda", (12, 0), "fp8_ds_mla", None) is None
    assert "fp8_ds_mla" in fi.unavailable_reason("cuda", (10, 0), "fp8_ds_mla", None)
    assert "bf16" in fi.unavailable_reason("cuda", (12, 1), "bf16", None)
    assert fi.unavailable_reason("cuda", (10, 0), "fp8_dsv41", None) is not None
    assert fi.unavailable_reason("cuda", (10, 0), "bf16", "flashinfer is not importable") == "flashinfer is not importable"


@pytest.mark.parametrize(
    "H, expected",
    [(1, [(0, 1, 8)]), (8, [(0, 8, 8)]), (9, [(0, 9, 16)]), (64, [(0, 64, 64)]), (100, [(0, 100, 128)]),
     (200, [(0, 128, 128), (128, 200, 128)])],
    ids=lambda v: str(v),
)
def test_head_chunks(H, expected):
    assert fi.head_chunks(H) == expected


def test_pad_heads_zero_queries_and_neutral_sinks():
    q = torch.randn(3, 5, 512).bfloat16()
    sink = torch.tensor([0.5, float("-inf"), -2.0, 1.0, 0.0])
    qp, sp = fi.pad_heads(q, sink, 8)
    assert qp.shape == (3, 8, 512) and torch.equal(qp[:, :5], q) and not qp[:, 5:].any()
    neg = torch.tensor(fi.NEG_SINK).item()  # as fp32
    assert sp.dtype == torch.float32 and sp.tolist() == [0.5, neg, -2.0, 1.0, 0.0] + [neg] * 3
    assert fi.pad_heads(q, None, 8)[1] is None


def test_mask_segment_awkward_rows():
    idx = torch.tensor(
        [[3, -1, 7, 99, 2], [1, 2, 3, 4, 5], [4, 4, 5, -7, 8], [0, 1, 2, 3, 4], [6, 6, 6, 6, 6]], dtype=torch.int32
    )
    lens = torch.tensor([5, 0, 9, -3, 2], dtype=torch.int32)
    seg = fi.mask_segment(idx, lens, cache_slots=8, width=8)
    assert seg.indices.tolist() == [
        [3, -1, 7, -1, 2, -1, -1, -1],  # hole kept as -1, slot 99 out of range
        [-1] * 8,  # lens 0
        [4, 4, 5, -1, -1, -1, -1, -1],  # duplicates kept, -7 and 8 (out of range) dropped
        [-1] * 8,  # negative lens
        [6, 6, -1, -1, -1, -1, -1, -1],
    ]
    assert seg.lens.tolist() == [5, 0, 5, 0, 2]
    assert fi.empty_rows(seg).tolist() == [False, True, False, True, False]
    with pytest.raises(ValueError):
        fi.mask_segment(idx, lens, 8, width=4)


def test_sm100_combined_table():
    swa = fi.mask_segment(torch.tensor([[0, 1, 2], [5, -1, 7]], dtype=torch.int32), torch.tensor([2, 3], dtype=torch.int32), 8)
    cmp = fi.mask_segment(torch.tensor([[3, 4, 5, 6, 7, 1], [1, 1, 2, 9, 0, 0]], dtype=torch.int32),
                          torch.tensor([6, 4], dtype=torch.int32), 8)
    args = fi.sm100_args(swa, cmp)
    assert args.sparse_indices.shape == (2, 128 + 8) and args.sparse_indices.dtype == torch.int32
    assert args.sparse_indices[0, :3].tolist() == [0, 1, -1] and (args.sparse_indices[:, 3:128] == -1).all()
    assert args.sparse_indices[1, :3].tolist() == [5, -1, 7]
    assert args.sparse_indices[0, 128:].tolist() == [3, 4, 5, 6, 7, 1, -1, -1]
    assert args.sparse_indices[1, 128:].tolist() == [1, 1, 2, -1, -1, -1, -1, -1]
    assert args.sparse_topk_lens.tolist() == [134, 132]  # counts the 128 SWA columns
    assert args.seq_lens.tolist() == [2, 3]
    no_cmp = fi.sm100_args(swa, None)  # K = 0: the SWA columns alone
    assert no_cmp.sparse_indices.shape == (2, 128) and no_cmp.sparse_topk_lens.tolist() == [128, 128]
    wide = fi.mask_segment(torch.zeros(1, 129, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 8)
    with pytest.raises(ValueError, match="at most 128"):
        fi.sm100_args(wide, None)


def test_flat_rows_with_padded_pages():
    cache = new_cache("bf16", num_pages=3, page_size=4, page_gap=2 * 512)
    write_kv(cache, torch.arange(12), torch.randn(12, 512), "bf16")
    rows, span = fi.flat_rows(cache, "swa_cache")
    assert span == 6 and rows.shape == (2 * 6 + 4, 1, 512)
    slots = torch.tensor([[5, -1, 11]], dtype=torch.int32)
    r = fi.slots_to_rows(slots, 4, span)
    assert r.tolist() == [[7, -1, 15]]
    assert torch.equal(rows[7, 0], cache[1, 1]) and torch.equal(rows[15, 0], cache[2, 3])
    with pytest.raises(ValueError, match="multiple"):
        fi.flat_rows(new_cache("bf16", 2, 4, page_gap=3), "swa_cache")


@pytest.mark.parametrize("W, expected", [(1, 128), (128, 128), (129, 192), (300, 512), (1024, 1024)])
def test_sm120_swa_width(W, expected):
    assert fi.sm120_swa_width(W) == expected


def test_sm120_swa_width_too_wide():
    with pytest.raises(ValueError):
        fi.sm120_swa_width(1025)


@pytest.mark.parametrize("sink_kind", ["none", "neg_inf", "finite"])
def test_lse_from_sm120(sink_kind):
    kernel = torch.tensor([[3.0, -1e30], [float("nan"), 2.0], [-1e30, -1e30]])
    empty = torch.tensor([False, False, True])
    sink = {"none": None, "neg_inf": torch.full((2,), float("-inf")), "finite": torch.tensor([0.5, -1.0])}[sink_kind]
    got = fi.lse_from_sm120(kernel, empty, sink)
    fill = [float("-inf")] * 2 if sink is None else (sink * LOG2E).tolist()
    assert got.tolist() == [[3.0, fill[1]], [fill[0], 2.0], fill]
    assert not got.isnan().any()


# ------------------------------------------------------------------ end to end, interpreted


def _interpret_sm100(kw):
    """FlashInfer's documented SM100 semantics (tests/attention/test_trtllm_gen_sparse_mla_dsv4.py)."""
    q = kw["query"][:, 0].float()
    table, topk_lens, seq_lens = kw["sparse_indices"], kw["sparse_topk_lens"], kw["seq_lens"]
    swa, cmp = kw["swa_kv_cache"][:, 0].float(), kw["compressed_kv_cache"][:, 0].float()
    cols = torch.arange(table.shape[1])
    is_swa = cols < 128
    pool_rows = torch.where(is_swa, swa.shape[0], cmp.shape[0])
    safe = table.clamp_min(0).long()
    keys = torch.where(is_swa.view(1, -1, 1), swa[safe.clamp_max(swa.shape[0] - 1)], cmp[safe.clamp_max(cmp.shape[0] - 1)])
    valid = (table >= 0) & (table < pool_rows) & (cols < topk_lens.unsqueeze(1))
    valid &= ~is_swa | (cols < seq_lens.clamp(max=128).unsqueeze(1))  # SWA window from seq_lens
    bmm1 = kw["bmm1_scale"] if isinstance(kw["bmm1_scale"], float) else kw["bmm1_scale"].item()
    s = torch.einsum("thd,tnd->thn", q, keys) * bmm1
    s = s.masked_fill(~valid.unsqueeze(1), float("-inf"))
    lse = s.logsumexp(-1)
    out = torch.einsum("thn,tnd->thd", torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0), keys) * kw["bmm2_scale"]
    if kw["sinks"] is not None:
        out = out * torch.sigmoid(lse - kw["sinks"]).nan_to_num(0.0).unsqueeze(-1)
    kw["out"].copy_(torch.where(torch.isfinite(lse).unsqueeze(-1), out, 0.0).unsqueeze(1))


def _interpret_sm120(kw):
    """FlashInfer's documented SM120 semantics (``_ref_sparse_attn`` in test_sparse_mla_sm120.py):
    ``-1`` and columns ``>= lengths`` skipped, LSE base 2 with the sink folded in, ``-1e30``
    for an empty row without sink."""
    q = kw["query"][:, 0].float()
    keys, valid = [], []
    for i, seg in enumerate(kw["sparse_mla_segments"]):
        cache = kw["kv_cache"] if i == 0 else seg.kv_cache
        cols = torch.arange(seg.indices.shape[1])
        keys.append(read_kv(cache, seg.indices, "fp8_ds_mla"))
        valid.append((seg.indices >= 0) & (cols < seg.lengths.unsqueeze(1)))
    keys, valid = torch.cat(keys, 1), torch.cat(valid, 1)
    s = torch.einsum("thd,tnd->thn", q, keys) * kw["sm_scale"]
    s = s.masked_fill(~valid.unsqueeze(1), float("-inf"))
    lse_e = s.logsumexp(-1)
    out = torch.einsum("thn,tnd->thd", torch.exp(s - lse_e.unsqueeze(-1)).nan_to_num(0.0), keys)
    lse2 = lse_e * LOG2E
    if kw["sinks"] is not None:
        out = out * torch.sigmoid(lse_e - kw["sinks"]).unsqueeze(-1)
        lse2 = torch.logaddexp(lse_e, kw["sinks"]) * LOG2E
    kw["out"].copy_(out.nan_to_num(0.0).unsqueeze(1))
    kw["lse"].copy_(torch.where(torch.isfinite(lse2), lse2, -1e30))


class _Segment:  # stands in for flashinfer.mla._core._SparseMLASegment (a frozen dataclass)
    def __init__(self, indices, lengths=None, kv_cache=None):
        self.indices, self.lengths, self.kv_cache = indices, lengths, kv_cache


def _case(kv_format, H, K, sink_kind, page_size, seed=0):
    g = torch.Generator().manual_seed(seed)
    T, W, pages = 6, 7, 3
    gap = 512 * 2 if kv_format != "fp8_ds_mla" else 0
    swa_cache = new_cache(kv_format, pages, page_size, page_gap=gap)
    cmp_cache = new_cache(kv_format, pages, page_size)
    n = pages * page_size
    kv_scale = 0.5 if kv_format == "fp8" else 1.0
    write_kv(swa_cache, torch.arange(n), torch.randn(n, 512, generator=g), kv_format, kv_scale)
    write_kv(cmp_cache, torch.arange(n), torch.randn(n, 512, generator=g) * 0.5, kv_format, kv_scale)
    q = (torch.randn(T, H, 512, generator=g) * 0.1).bfloat16()
    swa_idx = torch.randint(0, n, (T, W), generator=g, dtype=torch.int32)
    swa_idx[1, 2] = -1  # hole
    swa_idx[2, 0] = n + 5  # out of range: ignored, never read
    swa_idx[3, 1] = swa_idx[3, 0]  # duplicate
    swa_lens = torch.tensor([7, 3, 0, 5, 2, 0], dtype=torch.int32)
    cmp_idx = torch.randint(0, n, (T, K), generator=g, dtype=torch.int32)
    cmp_lens = torch.tensor([K, 0, 0, min(K, 3), 1, 0], dtype=torch.int32)  # rows 2 and 5: empty
    if K:
        cmp_idx[0, -1] = -1
    sink = {"none": None, "neg_inf": torch.full((H,), float("-inf")),
            "finite": torch.linspace(-1.0, 1.0, H)}[sink_kind]
    cmp = (cmp_cache, cmp_idx, cmp_lens) if K else (None, None, None)
    return (q, swa_cache, swa_idx, swa_lens, *cmp, sink, 0.06, kv_format, kv_scale)


def _reference(args):
    q = args[0]
    out = torch.empty(*q.shape, dtype=torch.bfloat16)
    lse = torch.empty(q.shape[:2])
    sparse_mla_reference(SparseMLAArgs(*args), out, lse)
    return out, lse


def _check(args, plan, interpret, out_tol):
    for _, _, kw in plan.calls:
        interpret(kw)
    q = args[0]
    out = torch.full((*q.shape,), float("nan"), dtype=torch.bfloat16)
    lse = torch.full(q.shape[:2], float("nan"))
    fi.finish(plan, q, args[7], args[8], args[9], args[10], out, lse)
    ref_out, ref_lse = _reference(args)
    assert not out.isnan().any() and not lse.isnan().any()
    assert (out.float() - ref_out.float()).abs().max() <= out_tol
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse)) and torch.equal(lse[~finite], ref_lse[~finite])
    assert (lse[finite] - ref_lse[finite]).abs().max() <= 2e-3
    assert not out[2].any() and not out[5].any()  # empty rows


@pytest.mark.parametrize("kv_format", ["bf16", "fp8"])
@pytest.mark.parametrize("H, K", [(5, 9), (64, 0), (130, 4)], ids=["H5-K9", "H64-K0", "H130-K4"])
@pytest.mark.parametrize("sink_kind", ["none", "neg_inf", "finite"])
def test_sm100_translation_matches_reference(kv_format, H, K, sink_kind):
    args = _case(kv_format, H, K, sink_kind, page_size=4)
    plan = fi.plan_sm100(*args, torch.empty(0, dtype=torch.uint8))
    assert [c[2]["query"].shape[2] for c in plan.calls] == [p for _, _, p in fi.head_chunks(H)]
    if kv_format == "fp8":
        assert plan.calls[0][2]["query"].dtype == torch.float8_e4m3fn
    # fp8: the e4m3 query (FlashInfer needs q and cache in one dtype) adds about 2^-4 relative error
    _check(args, plan, _interpret_sm100, 2e-2 if kv_format == "bf16" else 6e-2)


@pytest.mark.parametrize("H, K", [(5, 9), (16, 0), (130, 4)], ids=["H5-K9", "H16-K0", "H130-K4"])
@pytest.mark.parametrize("sink_kind", ["none", "neg_inf", "finite"])
def test_sm120_translation_matches_reference(H, K, sink_kind):
    args = _case("fp8_ds_mla", H, K, sink_kind, page_size=64)
    plan = fi.plan_sm120(*args, torch.empty(0, dtype=torch.uint8), segment_type=_Segment)
    segs = plan.calls[0][2]["sparse_mla_segments"]
    assert segs[0].indices.shape == (6, 128) and len(segs) == (2 if K else 1)
    assert all(kw["lse"].shape == (6, kw["query"].shape[2]) for _, _, kw in plan.calls)
    _check(args, plan, _interpret_sm120, 2e-2)


def test_workspace_static():
    ws = fi.default_workspace(torch.device("cpu"))
    assert ws.numel() == 128 * 1024 * 1024 and ws.dtype == torch.uint8 and not ws[:4096].any()
    assert fi.default_workspace(torch.device("cpu")) is ws
    fi._WORKSPACES.clear()
