"""lse_combine (reference backend) against the float64 oracle."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import compile_ops

import oracle
from helpers import examples

pytestmark = pytest.mark.quick  # the quick subset: python -m pytest -m quick



@settings(max_examples=examples(), deadline=None)
@given(
    st.integers(1, 8),
    st.integers(1, 4),
    st.integers(1, 130),
    st.sampled_from([1, 7, 64, 512]),
    st.sampled_from([torch.float32, torch.bfloat16]),
    st.integers(0, 2**31 - 1),
)
def test_lse_combine_matches_oracle(N, T, H, D, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    partial_out = torch.randn(N, T, H, D, generator=gen).to(dtype)
    partial_lse = torch.randn(N, T, H, generator=gen) * 20
    special = torch.rand(N, T, H, generator=gen)
    partial_lse[special < 0.3] = -math.inf
    partial_lse[(special > 0.3) & (special < 0.32)] = math.nan
    partial_lse[(special > 0.32) & (special < 0.34)] = math.inf
    partial_out[special < 0.1] = math.nan  # an empty partial's output must not leak in
    out, lse = compile_ops.lse_combine(partial_out, partial_lse)
    assert out.dtype == dtype and lse.dtype == torch.float32
    clean = partial_lse.clone()
    clean[torch.isnan(clean) | (clean == math.inf)] = -math.inf
    want_out, want_lse = oracle.lse_combine(torch.nan_to_num(partial_out), clean)
    rel = 2.0**-8 if dtype == torch.bfloat16 else 1e-6
    got = out.double().numpy()
    assert np.all(np.abs(got - want_out) <= rel * np.abs(want_out) + 1e-5 * (1 + np.abs(want_out).max()))
    got_lse = lse.double().numpy()
    assert np.array_equal(np.isneginf(got_lse), np.isneginf(want_lse))
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(got_lse[finite], want_lse[finite], rtol=1e-6, atol=1e-5)


def test_all_empty_partials_give_zero_and_minus_inf():
    out, lse = compile_ops.lse_combine(torch.ones(3, 2, 4, 8), torch.full((3, 2, 4), -math.inf))
    assert torch.equal(out, torch.zeros(2, 4, 8))
    assert torch.equal(lse, torch.full((2, 4), -math.inf))


@pytest.mark.parametrize("weights", [(0.0, 0.0), (3.0, -1.0)], ids=["equal", "skewed"])
def test_two_partials_hand_computed(weights):
    o = torch.stack([torch.full((1, 1, 2), 1.0), torch.full((1, 1, 2), 5.0)])
    out, lse = compile_ops.lse_combine(o, torch.tensor(weights).view(2, 1, 1))
    a, b = 2.0 ** weights[0], 2.0 ** weights[1]
    assert lse.item() == pytest.approx(math.log2(a + b))
    assert out[0, 0, 0].item() == pytest.approx((a * 1 + b * 5) / (a + b))
