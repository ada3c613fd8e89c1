"""topk_to_slots, dcp_topk_to_slots and swa_indices (reference backend) against oracles."""

import pytest
import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import compile_ops

import oracle
from helpers import examples

pytestmark = pytest.mark.quick  # the quick subset: python -m pytest -m quick


tables = st.fixed_dictionaries(
    {
        "T": st.integers(1, 9),
        "K": st.integers(1, 40),
        "R": st.integers(1, 4),
        "B": st.integers(0, 6),
        "block_size": st.sampled_from([1, 2, 3, 4, 64, 256]),
        "seed": st.integers(0, 2**31 - 1),
    }
)


def build(c):
    """topk ids with -1 holes, ids past the table, negative table entries, padding rows,
    token_to_req values outside the table."""
    gen = torch.Generator().manual_seed(c["seed"])
    T, K, R, B, bs = c["T"], c["K"], c["R"], c["B"], c["block_size"]
    max_id = (B + 1) * bs
    topk = torch.randint(-1, max_id + 1, (T, K), generator=gen, dtype=torch.int32)
    topk[torch.rand(T, K, generator=gen) < 0.2] = -1
    block_table = torch.randint(-1, 50, (R, B), generator=gen, dtype=torch.int32)
    token_to_req = torch.randint(-1, R + 1, (T,), generator=gen, dtype=torch.int32)
    is_valid = torch.rand(T, generator=gen) < 0.8
    return topk, token_to_req, block_table, bs, is_valid


def assert_slots(got, want):
    slots, lens = got
    assert slots.dtype == torch.int32 and lens.dtype == torch.int32
    np.testing.assert_array_equal(slots.numpy(), want[0])
    np.testing.assert_array_equal(lens.numpy(), want[1])


@settings(max_examples=examples(), deadline=None)
@given(tables)
def test_topk_to_slots_matches_oracle(c):
    args = build(c)
    assert_slots(compile_ops.topk_to_slots(*args), oracle.topk_to_slots(*args))


@settings(max_examples=examples(), deadline=None)
@given(tables, st.integers(1, 8), st.sampled_from([1, 2, 4, 64]), st.data())
def test_dcp_topk_to_slots_matches_oracle(c, world, interleave, data):
    rank = data.draw(st.integers(0, world - 1))
    args = (*build(c), rank, world, interleave)
    assert_slots(compile_ops.dcp_topk_to_slots(*args), oracle.dcp_topk_to_slots(*args))


@settings(max_examples=examples(0.5), deadline=None)
@given(tables, st.integers(1, 8), st.sampled_from([1, 4]))
def test_dcp_shards_partition_the_single_rank_slots(c, world, interleave):
    """Every valid id lands on exactly one rank: the per-rank counts add up to world 1's."""
    topk, token_to_req, _, bs, is_valid = build(c)
    wide = torch.arange(64, dtype=torch.int32).repeat(c["R"], 1)
    total = sum(
        compile_ops.dcp_topk_to_slots(topk, token_to_req, wide, bs, is_valid, r, world, interleave)[1]
        for r in range(world)
    )
    unsharded = compile_ops.dcp_topk_to_slots(topk, token_to_req, wide, bs, is_valid, 0, 1, interleave)[1]
    assert torch.equal(total, unsharded)


@settings(max_examples=examples(), deadline=None)
@given(tables, st.integers(1, 300), st.data())
def test_swa_indices_matches_oracle(c, window, data):
    gen = torch.Generator().manual_seed(c["seed"])
    _, token_to_req, block_table, page_size, _ = build(c)
    limit = (c["B"] + 1) * page_size + window
    positions = torch.randint(-1, limit, (c["T"],), generator=gen, dtype=torch.int32)
    args = (positions, token_to_req, block_table, page_size, window)
    got = compile_ops.swa_indices(*args)
    assert got[0].shape == (c["T"], window)
    assert_slots(got, oracle.swa_indices(*args))
