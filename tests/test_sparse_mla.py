"""sparse_mla / sparse_mla_out (reference backend) against the float64 oracle."""

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import compile_ops
from compile_ops.formats import KV_FORMATS, new_cache

import oracle
from helpers import examples, make_cache, make_indices

pytestmark = pytest.mark.quick  # the quick subset: python -m pytest -m quick


case = st.fixed_dictionaries(
    {
        "T": st.integers(1, 5),
        "H": st.integers(1, 128),
        "W": st.integers(0, 8),
        "K": st.integers(0, 12),
        "page_size": st.sampled_from([1, 2, 3, 16, 64, 256]),
        "num_pages": st.integers(0, 3),
        "page_gap": st.sampled_from([0, 5]),
        "kv_format": st.sampled_from(sorted(KV_FORMATS)),
        "sink": st.sampled_from(["none", "-inf", "finite"]),
        "with_cmp": st.booleans(),
        "seed": st.integers(0, 2**31 - 1),
    }
)


def build(c):
    gen = torch.Generator().manual_seed(c["seed"])
    kv_scale = 0.5 if c["kv_format"] == "fp8" else 1.0
    swa_pages = max(1, min(c["num_pages"], 64 // c["page_size"] + 1))
    swa_cache = make_cache(c["kv_format"], swa_pages, c["page_size"], c["page_gap"], kv_scale, gen=gen)
    swa_idx, swa_lens = make_indices(c["T"], c["W"], swa_pages * c["page_size"], gen=gen)
    cmp = (None, None, None)
    if c["with_cmp"]:
        cmp_pages = min(c["num_pages"], 64 // c["page_size"] + 1)
        cmp_cache = make_cache(c["kv_format"], cmp_pages, c["page_size"], 0, kv_scale, gen=gen)
        cmp = (cmp_cache, *make_indices(c["T"], c["K"], cmp_pages * c["page_size"], gen=gen))
    q = torch.randn(c["T"], c["H"], 512, generator=gen).to(torch.bfloat16)
    sink = {
        "none": None,
        "-inf": torch.full((c["H"],), -math.inf),
        "finite": torch.randn(c["H"], generator=gen) * 2,
    }[c["sink"]]
    sm_scale = float(torch.rand((), generator=gen) * 0.1 + 0.01)
    return (q, swa_cache, swa_idx, swa_lens, *cmp, sink, sm_scale, c["kv_format"], kv_scale)


def assert_matches_oracle(out, lse, args, cmp_kv_format=None):
    want_out, want_lse = oracle.sparse_mla(*args, cmp_kv_format=cmp_kv_format)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    got = out.double().numpy()
    # bf16 output rounding (2**-8 relative) plus fp32 accumulation
    tol = 2.0**-8 * np.abs(want_out) + 1e-5 * (np.abs(want_out).max() + 1)
    assert np.all(np.abs(got - want_out) <= tol), np.abs(got - want_out).max()
    got_lse = lse.double().numpy()
    assert np.array_equal(np.isneginf(got_lse), np.isneginf(want_lse))
    finite = np.isfinite(want_lse)
    assert np.allclose(got_lse[finite], want_lse[finite], rtol=1e-5, atol=1e-4)


@settings(max_examples=examples(), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case)
def test_sparse_mla_matches_float64_oracle(c):
    args = build(c)
    out, lse = compile_ops.sparse_mla(*args)
    assert out.shape == (c["T"], c["H"], 512) and out.dtype == torch.bfloat16
    assert lse.shape == (c["T"], c["H"]) and lse.dtype == torch.float32
    assert_matches_oracle(out, lse, args)


@settings(max_examples=examples(0.25), deadline=None)
@given(case)
def test_sparse_mla_out_fills_caller_buffers(c):
    args = build(c)
    out = torch.full((c["T"], c["H"], 512), float("nan"), dtype=torch.bfloat16)
    lse = torch.full((c["T"], c["H"]), float("nan"))
    assert compile_ops.sparse_mla_out(*args, out, lse) is None
    assert_matches_oracle(out, lse, args)


@settings(max_examples=examples(0.5), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case, st.sampled_from(["fp4_dsv41", "fp8_dsv41", "bf16"]))
def test_two_cache_formats_match_the_oracle(c, cmp_kv_format):
    """DeepSeek-V4.1's caches: window rows in one format, compressed entries in another
    (``cmp_kv_format``; V4.1: fp8_dsv41 and fp4_dsv41). Both ops against the oracle, which
    decodes each cache in its own format."""
    args = list(build({**c, "with_cmp": True}))
    pages, page_size = args[4].shape[:2]
    args[4] = make_cache(cmp_kv_format, pages, page_size, 0, args[10], gen=torch.Generator().manual_seed(c["seed"]))
    out, lse = compile_ops.sparse_mla(*args, cmp_kv_format)
    assert_matches_oracle(out, lse, args, cmp_kv_format)
    out_buf = torch.full_like(out, float("nan"))
    lse_buf = torch.full_like(lse, float("nan"))
    compile_ops.sparse_mla_out(*args, out_buf, lse_buf, None, cmp_kv_format)
    assert torch.equal(out_buf, out) and torch.equal(lse_buf, lse)


def test_two_formats_name_the_compressed_cache_when_it_is_not_in_its_format():
    """A compressed cache whose rows are not ``cmp_kv_format``'s, or an unknown
    ``cmp_kv_format``, is a ValueError naming the argument; the tl kernel reads V4.1's two
    formats, and refuses a pair with ``bf16`` or ``fp8`` rows, saying where it goes."""
    from compile_ops import backends
    from compile_ops.mla.inputs import SparseMLAArgs

    q = torch.randn(1, 4, 512).bfloat16()
    window, entries = new_cache("fp8_dsv41", 1, 4), new_cache("fp4_dsv41", 1, 4)
    idx, lens = torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    call = (q, window, idx, lens, window, idx, lens, None, 0.1, "fp8_dsv41", 1.0)
    with pytest.raises(ValueError, match="cmp_cache holds kv_format 'fp4_dsv41'"):
        compile_ops.sparse_mla(*call, "fp4_dsv41")
    with pytest.raises(ValueError, match="kv_format must be one of"):
        compile_ops.sparse_mla(*call[:4], entries, *call[5:], "fp4")
    args = SparseMLAArgs(*call[:4], entries, *call[5:], None, "fp4_dsv41")
    _, limits, _ = backends._check_family("sparse_mla")["triton"]
    assert limits(args) is None
    assert limits(args._replace(cmp_kv_format=None, cmp_cache=window)) is None
    bf16 = new_cache("bf16", 1, 4)
    assert "the reference backend reads them" in limits(args._replace(cmp_cache=bf16, cmp_kv_format="bf16"))
    fp8 = new_cache("fp8", 1, 4)
    assert "per-block scales" in limits(args._replace(swa_cache=fp8, kv_format="fp8"))


@pytest.mark.parametrize("sink", [None, -math.inf, 0.7], ids=["no-sink", "sink=-inf", "sink=0.7"])
def test_empty_rows(sink):
    cache = new_cache("bf16", 1, 4)
    q = torch.randn(2, 3, 512).bfloat16()
    idx = torch.tensor([[0, 1], [-1, 9]], dtype=torch.int32)
    lens = torch.tensor([0, 2], dtype=torch.int32)
    sink_t = None if sink is None else torch.full((3,), sink)
    out, lse = compile_ops.sparse_mla(q, cache, idx, lens, None, None, None, sink_t, 0.1)
    assert torch.equal(out, torch.zeros_like(out))
    want = -math.inf if sink is None else sink * math.log2(math.e)
    assert torch.equal(lse, torch.full_like(lse, want))
