"""The indexer ops (``compile_ops.indexer``): reference vs a float64 oracle, the Triton
kernels (interpreter on CPU) vs the reference, the contract's edges, graph-safety.

Integer-valued queries, keys and weights make every score exact in fp32 and float64, so
ids must match exactly, ties included (they are frequent). Random-float data checks the
fp8 products against the oracle's scores within the e4m3 rounding.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import compile_ops
import oracle
from compile_ops.indexer.cache import INDEX_FORMATS, new_index_cache, read_index_keys
from compile_ops.indexer import ops
from compile_ops.indexer.inputs import global_ids, local_entries
from helpers import examples

pytestmark = pytest.mark.quick  # the quick subset: python -m pytest -m quick

i32 = torch.int32
FORMATS = sorted(INDEX_FORMATS)


def make_problem(index_format, T, Hi, R, B, page_size, *, seed, integer=True, holes=0, spare_pages=2):
    """Keys written at every slot of a cache, a shuffled block table with ``holes`` -1s, and
    per-token request rows and counts (some rows invalid, some counts past the table)."""
    gen = torch.Generator().manual_seed(seed)
    pages = R * B + spare_pages
    cache = new_index_cache(index_format, pages, page_size)
    n_slots = pages * page_size

    def values(*shape, bound):
        if integer:
            return torch.randint(-bound, bound + 1, shape, generator=gen).float()
        return torch.randn(*shape, generator=gen) * torch.rand(shape[0], *[1] * (len(shape) - 1), generator=gen).add(0.1)

    keys = values(n_slots, 128, bound=3)
    compile_ops.write_index_keys(cache, torch.arange(n_slots), keys, index_format)
    table = torch.randperm(pages, generator=gen)[: R * B].view(R, B).to(i32)
    flat = table.view(-1)
    flat[torch.randperm(flat.numel(), generator=gen)[:holes]] = -1
    q = values(T, Hi, 128, bound=2).view(T, Hi, 128).bfloat16()
    weights = values(T, Hi, bound=2)
    rows = torch.randint(-1, R + 1, (T,), generator=gen, dtype=i32)
    n = torch.randint(-1, B * page_size + 3, (T,), generator=gen, dtype=i32)
    return q, weights, cache, table, rows, n


def run_reference(q, weights, cache, table, rows, n, k, index_format):
    with compile_ops.use_backends(indexer="reference"):
        return compile_ops.indexer_topk(q, weights, cache, table, rows, n, k, index_format)


@pytest.mark.parametrize("index_format", FORMATS)
@settings(deadline=None, max_examples=examples(0.5))
@given(T=st.integers(1, 4), Hi=st.sampled_from([1, 3, 8]), k=st.integers(1, 40), page_size=st.sampled_from([1, 4, 16]),
       B=st.integers(1, 4), holes=st.integers(0, 2), seed=st.integers(0, 2**16))
def test_reference_equals_float64_oracle_exactly(index_format, T, Hi, k, page_size, B, holes, seed):
    """Exact scores: the same ids in the same order, ties by the lower id, -1 padding,
    invalid rows and holes skipped, counts past the table clamped."""
    args = make_problem(index_format, T, Hi, 3, B, page_size, seed=seed, holes=holes)
    got = run_reference(*args, k, index_format)
    want, _ = oracle.indexer_topk(*args, k, index_format)
    assert got.tolist() == want


@pytest.mark.parametrize("index_format", FORMATS)
def test_reference_float_data_within_rounding(index_format):
    """Random floats: the chosen ids' oracle scores are the oracle's top scores, up to the
    products' rounding (fp32 sums; e4m3 q for an fp8 cache is part of the contract)."""
    args = make_problem(index_format, 6, 8, 3, 8, 16, seed=3, integer=False, holes=2)
    got = run_reference(*args, 64, index_format)
    every, every_scores = oracle.indexer_topk(*args, 10**4, index_format)  # every valid entry, ranked
    for t in range(6):
        score_of = dict(zip(every[t], every_scores[t]))
        chosen = [c for c in got[t].tolist() if c >= 0]
        assert len(chosen) == min(64, len(every_scores[t]))
        tol = 1e-5 * max([1.0] + [abs(x) for x in every_scores[t]])
        for j, c in enumerate(chosen):
            assert abs(score_of[c] - every_scores[t][j]) <= tol, (t, j)


@pytest.mark.parametrize("index_format", FORMATS)
@pytest.mark.parametrize("case", [(5, 8, 3, 6, 16, 20, 1), (3, 32, 2, 40, 64, 100, 3), (2, 3, 1, 3, 4, 16, 0)],
                         ids=["small", "Hi32-k100", "k-past-capacity"])
def test_interpreter_equals_reference(index_format, case):
    """The Triton kernels (interpreted) pick exactly the reference's ids on exact data, in
    either order (``"id"``: the same ids, ascending)."""
    pytest.importorskip("triton")
    from compile_ops.indexer.reference import indexer_topk_reference
    from compile_ops.indexer.triton import indexer_topk_triton

    T, Hi, R, B, page_size, k, holes = case
    args = make_problem(index_format, T, Hi, R, B, page_size, seed=T + Hi, holes=holes)
    want = run_reference(*args, k, index_format)
    fmt = ops._check_topk(*args, k, index_format)
    got, _ = indexer_topk_triton(ops._args(*args, k, fmt))
    assert torch.equal(got, want)
    by_id = ops._args(*args, k, fmt, order="id")
    got, got_scores = indexer_topk_triton(by_id)
    want, want_scores = indexer_topk_reference(by_id)
    assert torch.equal(got, want) and torch.equal(got_scores, want_scores)
    by_score = run_reference(*args, k, index_format)
    for row, picked in zip(got.tolist(), by_score.tolist()):  # the same ids, ascending, then -1
        kept = [c for c in row if c >= 0]
        assert kept == sorted(c for c in picked if c >= 0) and row[len(kept):] == [-1] * (k - len(kept))


@pytest.mark.parametrize("page_size", [32, 64, 128])
def test_interpreter_bulk_copied_key_blocks_equal_the_oracle(page_size):
    """fp8 pages of whole 64-entry scores blocks are read one block per bulk copy (a TMA
    descriptor of the key bytes), smaller pages gathered row by row: holes, a page past
    the cache and a request's partly filled last page still give exactly the float64
    oracle's ids."""
    pytest.importorskip("triton")
    from compile_ops.indexer import triton as kernels

    q, weights, cache, table, rows, n = make_problem("fp8", 6, 8, 3, 3, page_size, seed=page_size, holes=1)
    assert (kernels.key_blocks(cache, True) is cache) == (page_size < kernels.BN)
    table[1, 1] = cache.shape[0] + 3  # past the cache: no entry
    rows[:3] = torch.tensor([0, 1, 2], dtype=i32)
    n[:3] = torch.tensor([3 * page_size, 2 * page_size - 5, page_size + 7], dtype=i32)
    args = (q, weights, cache, table, rows, n)
    want, _ = oracle.indexer_topk(*args, 50, "fp8")
    got, _ = kernels.indexer_topk_triton(ops._args(*args, 50, ops._check_topk(*args, 50, "fp8")))
    assert got.tolist() == want


def test_a_traced_launch_gathers_the_keys():
    """A bulk copy's descriptor holds the cache's address, which a trace (the op inlined
    into an AOTInductor package) does not know: traced, the same cache is gathered."""
    pytest.importorskip("triton")
    from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

    from compile_ops.indexer import triton as kernels

    cache = new_index_cache("fp8", 2, 64)
    assert kernels.key_blocks(cache, True) is not cache
    with FunctionalTensorMode():
        traced = FunctionalTensor.to_functional(cache)
        assert kernels.key_blocks(traced, True) is traced


@pytest.mark.parametrize("index_format", FORMATS)
def test_interpreter_segmented_rows_equal_reference(index_format, monkeypatch):
    """Rows long enough to split into segments: the segments' kept entries are sorted
    again, and the ids are exactly the reference's (short segments, so that these small
    rows split as 128K-entry rows do)."""
    pytest.importorskip("triton")
    from compile_ops.indexer import triton as kernels

    monkeypatch.setattr(kernels, "TOPK_SEGMENTS", (16, 16))
    args = make_problem(index_format, 3, 8, 2, 24, 16, seed=5, holes=2)
    assert len(kernels.topk_levels(24 * 16, 40, 16)) > 1
    want = run_reference(*args, 40, index_format)
    got, _ = kernels.indexer_topk_triton(ops._args(*args, 40, ops._check_topk(*args, 40, index_format)))
    assert torch.equal(got, want)


@pytest.mark.parametrize("index_format", FORMATS)
@pytest.mark.parametrize("shard", [(0, 1, 1), (1, 2, 2)], ids=["one-rank", "rank1-of-2-I2"])
def test_interpreter_group_maxima_written_beside_the_scores(index_format, shard, monkeypatch):
    """Long rows take the top-k through their groups' best scores, which the scores kernel
    writes as it scores (no launch reads the scores back for them): the ids, in either
    order, with and without candidate blocks, on a DCP rank too, are exactly the
    reference's, with holes, invalid request rows and counts past the table (groups of 4
    entries, so that these short rows go through groups as 32K-entry rows do)."""
    pytest.importorskip("triton")
    from compile_ops.indexer import triton as kernels
    from compile_ops.indexer.reference import indexer_candidates_reference, indexer_topk_reference

    monkeypatch.setattr(kernels, "TOPK_GROUPED_FROM", 1)
    monkeypatch.setattr(kernels, "TOPK_GROUP", 4)
    monkeypatch.setattr(kernels, "_group_max_kernel", None)  # a launch of it would fail
    args = make_problem(index_format, 5, 8, 2, 4, 16, seed=11 + shard[0], holes=1)
    assert kernels.grouped(4 * 16, 6)
    fmt = ops._check_topk(*args, 6, index_format)
    blocks = indexer_candidates_reference(ops._args(*args, 3, fmt, candidate_block=8, shard=shard))[0]
    for order in ("score", "id"):
        plain = ops._args(*args, 6, fmt, shard=shard, order=order)
        for got, want in zip(kernels.indexer_topk_triton(plain), indexer_topk_reference(plain)):
            assert torch.equal(got, want)
        inside = ops._args(*args, 6, fmt, candidates=blocks, candidate_block=8, shard=shard, order=order)
        for got, want in zip(kernels.indexer_topk_triton(inside), indexer_topk_reference(inside)):
            assert torch.equal(got, want)
    # the maxima themselves: each valid group's best score, and the rows' counts
    T, L = 5, 4 * 16
    scores, n = torch.full((T, L), float("nan")), torch.empty(T, dtype=i32)
    maxima = kernels.GroupMaxima(torch.full((T, kernels.group_slots(L)), float("nan")), torch.empty(2, T, dtype=i32))
    tickets = torch.full((T,), 7, dtype=i32)
    kernels.launch_scores(plain, 0, T, scores, n, tickets, n, maxima)
    assert not tickets.any()  # the top-k's tickets zeroed for it
    groups = -(-n // 4)
    assert torch.equal(maxima.counts, torch.stack([groups, groups.clamp(max=6) * 4]))
    for t in range(T):
        want = torch.nn.functional.pad(scores[t, :n[t]], (0, 4 * groups[t] - n[t]), value=float("-inf"))
        assert torch.equal(maxima.best[t, :groups[t]], want.view(-1, 4).amax(1)), t


@pytest.mark.parametrize("index_format", FORMATS)
@pytest.mark.parametrize("tokens", [2, 4])
@pytest.mark.parametrize("shard, grouped", [((0, 1, 1), False), ((0, 1, 1), True), ((1, 2, 2), True)],
                         ids=["one-rank", "groups", "rank1-of-2-I2-groups"])
def test_interpreter_token_blocks_equal_reference(index_format, tokens, shard, grouped, monkeypatch):
    """A scores program of several tokens (a prefill step: runs of one request's tokens,
    each seeing a few more entries than the one before, runs starting and ending inside a
    block, padding and invalid rows between them) reads each run's keys once for its
    tokens: the ids in either order, with and without candidate blocks, the candidate
    blocks, and (``grouped``) the group maxima the top-k starts from are exactly the
    reference's."""
    rows = torch.tensor([1, 1, 1, 0, 0, 0, 0, 0, -1, 3, 2, 2, 9], dtype=i32)  # 9: no such row
    n = torch.tensor([7, 8, 9, 13, 14, 15, 16, 17, 0, 30, 1, 2, 5], dtype=i32)
    _token_blocks_equal_reference(index_format, tokens, shard, grouped, rows, n, monkeypatch)


@pytest.mark.parametrize("index_format", FORMATS)
def test_interpreter_token_blocks_of_interleaved_requests_equal_reference(index_format, monkeypatch):
    """The op takes a step's tokens in any order: where one request's tokens are not
    consecutive (a program's block holds two requests in turn, a request's run starting
    again after another's), the ids, candidate blocks and group maxima are still exactly
    the reference's."""
    rows = torch.tensor([1, 0, 1, 0, 2, 1, 2, 1, -1, 3, 0, 3, 0], dtype=i32)
    n = torch.tensor([7, 13, 8, 14, 1, 9, 2, 10, 0, 30, 15, 31, 16], dtype=i32)
    _token_blocks_equal_reference(index_format, 4, (0, 1, 1), True, rows, n, monkeypatch)


def _token_blocks_equal_reference(index_format, tokens, shard, grouped, rows, n, monkeypatch):
    """The checks of the two tests above: ``tokens`` tokens a scores program over a 13-token
    step of request ``rows`` seeing ``n`` entries each (times the shard's world size)."""
    pytest.importorskip("triton")
    from compile_ops.indexer import triton as kernels
    from compile_ops.indexer.reference import indexer_candidates_reference, indexer_topk_reference

    monkeypatch.setattr(kernels, "scores_tokens", lambda T, R, most: tokens)
    if grouped:
        monkeypatch.setattr(kernels, "TOPK_GROUPED_FROM", 1)
        monkeypatch.setattr(kernels, "TOPK_GROUP", 4)
        monkeypatch.setattr(kernels, "_group_max_kernel", None)  # a launch of it would fail
    q, w, cache, table, _, _ = make_problem(index_format, 13, 3, 4, 5, 4, seed=tokens + shard[1], holes=2)
    args = (q, w, cache, table, rows, n * shard[1])
    fmt = ops._check_topk(*args, 6, index_format)
    blocks = ops._args(*args, 3, fmt, candidate_block=4, shard=shard)
    want_blocks = indexer_candidates_reference(blocks)[0]
    assert torch.equal(kernels.indexer_candidates_triton(blocks)[0], want_blocks)
    for order in ("score", "id"):
        for candidates in (None, want_blocks):
            call = ops._args(*args, 6, fmt, candidates=candidates, candidate_block=4, shard=shard, order=order)
            for got, want in zip(kernels.indexer_topk_triton(call), indexer_topk_reference(call)):
                assert torch.equal(got, want), (order, candidates is not None)


def test_scores_tokens_follow_the_step_shape():
    """One token a program where a step may be all decode (no more tokens than request
    rows) or its size is traced; else the least mean run of a request's tokens, a power of
    two up to ``SCORES_TOKENS``."""
    from compile_ops.indexer.triton import SCORES_TOKENS, scores_tokens

    assert [scores_tokens(T, 256) for T in (1, 256, 257, 511, 512, 1024, 4096)] == [1, 1, 1, 1, 2, 4, SCORES_TOKENS]
    assert scores_tokens(4096, 256, most=2) == 2
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    assert scores_tokens(ShapeEnv().create_unbacked_symint(), 256) == 1


def test_gluon_prefill_launch_runs_several_waves_of_programs():
    """A decode launch fills the SMs once; a prefill launch's programs (equal work each) run
    ``PREFILL_WAVES`` waves or more, so that one just past a whole wave (410 blocks of 4
    tokens over 132 SMs: the V4.1 stack's chunk of 1638 tokens) does not take two waves'
    time for one's work; never more splits than key blocks."""
    gluon = pytest.importorskip("compile_ops.indexer.gluon")
    programs = gluon.PROGRAMS_PER_SM * 132
    assert gluon.key_splits(64, 1, 1024, 132) == programs // 64
    assert gluon.key_splits(1, 1, 128, 132) == 128
    for blocks in (205, 410, 819, 1024):
        S = gluon.key_splits(blocks, 4, 640, 132)
        assert blocks * S >= gluon.PREFILL_WAVES * programs > blocks * (S - 1)
    assert gluon.key_splits(410, 4, 3, 132) == 3
    assert gluon.key_splits(10**6, 4, 640, 132) == gluon.key_splits(10**6, 1, 640, 132) == 1


@pytest.mark.parametrize("index_format, page_size", [("bf16", 4), ("fp8", 4), ("fp8", 64)])
@pytest.mark.parametrize("rank, world, interleave", [(0, 2, 1), (1, 2, 1), (1, 2, 4), (2, 3, 2)])
def test_interpreter_dcp_shard_equals_reference(index_format, page_size, rank, world, interleave):
    """A DCP rank's call (global counts, this rank's cache; fp8 pages of 64 entries take
    the bulk copies): the kernels count the rank's entries and map its columns to global
    candidate blocks themselves; the ids, with and without candidates, and the candidate
    blocks are exactly the reference's."""
    pytest.importorskip("triton")
    from compile_ops.indexer import triton as kernels
    from compile_ops.indexer.reference import indexer_candidates_reference, indexer_topk_reference

    args = make_problem(index_format, 8, 3, 2, 3, page_size, seed=rank + 7 * interleave, holes=1)
    gen = torch.Generator().manual_seed(world)
    # global counts, past the rank's 3 * page_size addressable entries and short of them
    args = (*args[:5], torch.randint(-1, world * 3 * page_size + 3, (8,), generator=gen, dtype=i32))
    fmt = ops._check_topk(*args, 6, index_format)
    shard = (rank, world, interleave)
    plain = ops._args(*args, 6, fmt, shard=shard)
    assert torch.equal(kernels.indexer_topk_triton(plain)[0], indexer_topk_reference(plain)[0])
    blocks = ops._args(*args, 3, fmt, candidate_block=2, shard=shard)
    want_blocks = indexer_candidates_reference(blocks)[0]
    assert torch.equal(kernels.indexer_candidates_triton(blocks)[0], want_blocks)
    inside = ops._args(*args, 6, fmt, candidates=want_blocks, candidate_block=2, shard=shard)
    assert torch.equal(kernels.indexer_topk_triton(inside)[0], indexer_topk_reference(inside)[0])


@pytest.mark.parametrize("index_format", FORMATS)
def test_write_index_keys_round_trip(index_format):
    """Written keys read back within the stated bound (fp8: ``2**-4 |x| + 2**-10 s``; fp4:
    ``2**-2 |x| + 2**-2 s`` with ``s`` its block's scale; bf16: bf16 rounding); ``-1`` and
    out-of-range slots write nothing."""
    cache = new_index_cache(index_format, 3, 4)
    keys = torch.randn(5, 128) * torch.tensor([1e-3, 1.0, 30.0, 0.0, 7.0]).unsqueeze(1)
    slots = torch.tensor([0, 5, -1, 11, 12])
    compile_ops.write_index_keys(cache, slots, keys, index_format)
    back = read_index_keys(cache, torch.tensor([0, 5, 11]), index_format)
    kept = keys[[0, 1, 3]]
    if index_format == "fp8":
        scale = 2.0 ** torch.ceil(torch.log2(kept.abs().amax(1, keepdim=True).clamp_min(1e-4) / 448))
        bound = 2**-4 * kept.abs() + 2**-10 * scale
    elif index_format == "fp4":  # s >= amax / 6 (a power of two), under 2 * amax / 6 (up to fp32 rounding)
        scale = 2 * kept.unflatten(1, (4, 32)).abs().amax(2, keepdim=True).clamp_min(6 * 2.0**-126) / 6
        bound = (2**-2 * kept.unflatten(1, (4, 32)).abs() + 2**-2 * scale * (1 + 2**-20)).flatten(1)
    else:
        bound = 2**-8 * kept.abs()
    assert ((back - kept).abs() <= bound).all()
    untouched = [s for s in range(12) if s not in (0, 5, 11)]
    assert (read_index_keys(cache, torch.tensor(untouched), index_format) == 0).all()


BAD = {
    "q dtype": (lambda a: a.update(q=a["q"].float()), TypeError, "q must have dtype torch.bfloat16"),
    "q width": (lambda a: a.update(q=a["q"][..., :64]), ValueError, r"q must be \[T, Hi, 128\]"),
    "weights shape": (lambda a: a.update(weights=a["weights"][:, :2]), ValueError, "weights must be"),
    "weights dtype": (lambda a: a.update(weights=a["weights"].double()), TypeError, "weights must have dtype"),
    "cache width": (lambda a: a.update(index_cache=a["index_cache"][..., :128]), ValueError, "index_cache must be"),
    "format": (lambda a: a.update(index_format="fp6"), ValueError, "index_format must be one of"),
    "table dtype": (lambda a: a.update(block_table=a["block_table"].long()), TypeError, "block_table must have dtype"),
    "rows length": (lambda a: a.update(token_to_req=a["token_to_req"][:1]), ValueError, r"token_to_req.shape\[0\]"),
    "n dtype": (lambda a: a.update(n_entries=a["n_entries"].long()), TypeError, "n_entries must have dtype"),
    "k": (lambda a: a.update(k=0), ValueError, "k must be"),
}


@pytest.mark.parametrize("case", BAD.values(), ids=BAD.keys())
def test_bad_input_names_the_argument(case):
    edit, error, match = case
    q, weights, cache, table, rows, n = make_problem("fp8", 3, 4, 2, 2, 4, seed=0)
    a = dict(q=q, weights=weights, index_cache=cache, block_table=table, token_to_req=rows, n_entries=n, k=4,
             index_format="fp8")
    edit(a)
    with pytest.raises(error, match=match):
        compile_ops.indexer_topk(**a)


@pytest.mark.parametrize("index_format", FORMATS)
def test_opcheck(index_format):
    args = make_problem(index_format, 3, 4, 2, 2, 4, seed=1, holes=1)
    result = torch.library.opcheck(torch.ops.dsv41.indexer_topk.default, (*args, 5, index_format))
    assert all(v == "SUCCESS" for v in result.values()), result
    cache = args[2]
    keys = torch.randn(3, 128)
    result = torch.library.opcheck(torch.ops.dsv41.write_index_keys.default, (cache, torch.tensor([1, -1, 3]), keys, index_format))
    assert all(v == "SUCCESS" for v in result.values()), result


def test_compiled_equals_eager_without_breaks():
    """``torch.compile(fullgraph=True)`` of a step that writes keys and picks ids: one graph,
    no break, the eager ids."""
    q, weights, cache, table, rows, n = make_problem("fp8", 4, 8, 2, 3, 16, seed=5)
    keys = torch.randn(4, 128)

    def step(cache, q, weights, n):
        compile_ops.write_index_keys(cache, torch.arange(4), keys, "fp8")
        return compile_ops.indexer_topk(q, weights, cache, table, rows, n, 12, "fp8")

    eager_cache = cache.clone()
    want = step(eager_cache, q, weights, n)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    got = torch.compile(step, fullgraph=True, dynamic=True)(cache, q, weights, n)
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
    assert torch.equal(got, want) and torch.equal(cache, eager_cache)


def test_local_entries_and_global_ids_follow_the_interleave_rule():
    """The DCP sharding helpers agree with ``dcp_topk_to_slots``'s rule, id by id."""
    for world in (1, 2, 4):
        for interleave in (1, 4):
            n = torch.arange(0, 70, dtype=i32)
            for rank in range(world):
                owned = [c for c in range(70) if (c // interleave) % world == rank]
                counts = local_entries(n, rank, world, interleave).tolist()
                assert counts == [sum(1 for c in owned if c < m) for m in range(70)]
                ids = global_ids(torch.arange(len(owned), dtype=i32), rank, world, interleave)
                assert ids.tolist() == owned


@pytest.mark.parametrize("k", [1, 7, 64])
@pytest.mark.parametrize("grouped", [False, True], ids=["entries", "groups-first"])
@pytest.mark.parametrize("ties", [True, False], ids=["ties", "distinct"])
def test_interpreter_topk_over_many_segments(k, grouped, ties, monkeypatch):
    """The segmented top-k (segments' best entries selected from again over several levels,
    ties kept by the lower id across segment borders), and the same rows taken through
    their groups' best scores first (distinct scores: few of the kept groups' entries reach
    the k-th best group's best, the bound the selection among them counts from), equal a
    stable sort, with ``-inf`` holes, a NaN (no entry) and short rows."""
    pytest.importorskip("triton")
    from compile_ops.indexer import triton as kernels
    from compile_ops.indexer.reference import topk_of_scores

    monkeypatch.setattr(kernels, "TOPK_GROUPED_FROM", 1 if grouped else 1 << 30)
    monkeypatch.setattr(kernels, "TOPK_GROUP", 4)  # k * 4 entries of 64 groups fit these rows
    gen = torch.Generator().manual_seed(k)
    T, L = 5, 700
    assert kernels.grouped(L, k) == grouped
    scores = torch.randint(-6, 7, (T, L), generator=gen).float() if ties else torch.randn(T, L, generator=gen)
    scores[:, ::9] = float("-inf")
    scores[1] = -0.0  # -0.0 and 0.0 are one score
    scores[1, ::2] = 0.0
    scores[2, 3] = float("nan")
    n = torch.tensor([700, 300, 33, 0, 5], dtype=i32)
    entries = (torch.arange(L) < n.unsqueeze(1)) & ~scores.isnan()
    masked = torch.where(entries, scores, float("-inf"))
    want_ids, want_vals = topk_of_scores(masked, k)
    ids, vals = torch.empty(T, k, dtype=i32), torch.empty(T, k)
    kernels.topk_of_rows(scores, n, ids, vals, k, segment=16)
    assert torch.equal(ids, want_ids)
    assert torch.equal(vals, want_vals)


@settings(deadline=None, max_examples=examples(0.3))
@given(T=st.integers(1, 3), L=st.integers(1, 300), k=st.integers(1, 20), segment=st.sampled_from([16, 64]),
       group=st.sampled_from([2, 4]), grouped=st.booleans(), spread=st.integers(1, 8), sort=st.booleans(),
       then=st.booleans(), seed=st.integers(0, 2**16))
def test_interpreter_topk_levels_equal_a_stable_sort(T, L, k, segment, group, grouped, spread, sort, then, seed):
    """Any row length, ``k``, segment and group size, groups first or not: the levels' ids
    and scores are a stable sort's (ties frequent: scores drawn from ``spread`` values);
    unsorted, the same ids and scores in id order. The last level in the launch before it
    (``then``) or in one of its own; the launches that run a row's last level in their last
    program leave its ticket at 0, ready for the next launch."""
    pytest.importorskip("triton")
    from compile_ops.indexer import triton as kernels
    from compile_ops.indexer.reference import by_id, topk_of_scores

    gen = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, spread, (T, L), generator=gen).float()
    scores[torch.rand(T, L, generator=gen) < 0.2] = float("-inf")
    n = torch.randint(0, L + 1, (T,), generator=gen, dtype=i32)
    want_ids, want_vals = topk_of_scores(torch.where(torch.arange(L) < n.unsqueeze(1), scores, float("-inf")), k)
    if not sort:
        want_ids, order = by_id(want_ids)
        want_vals = want_vals.gather(1, order)
    ids, vals, tickets = torch.empty(T, k, dtype=i32), torch.empty(T, k), torch.zeros(T, dtype=i32)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernels, "TOPK_GROUP", group)
        patch.setattr(kernels, "TOPK_GROUPED_FROM", 1 if grouped else 1 << 30)
        patch.setattr(kernels, "TOPK_THEN_PROGRAMS_PER_SM", 1 << 20 if then else 0)
        kernels.topk_of_rows(scores, n, ids, vals, k, segment=segment, sort=sort, tickets=tickets)
    assert torch.equal(ids, want_ids)
    assert torch.equal(vals, want_vals)
    assert not tickets.any()


def test_triton_limits_send_auto_to_the_reference():
    """A k or a head count past the Triton kernels' limits: ``auto`` takes the reference,
    an explicit ``triton`` raises the reason (asked of a CUDA device, without running)."""
    from compile_ops import backends
    from compile_ops.indexer.inputs import TRITON_MAX_K, triton_args_unsupported

    args = make_problem("fp8", 2, 4, 2, 2, 4, seed=0)
    fmt = ops._check_topk(*args, TRITON_MAX_K + 1, "fp8")
    too_many = ops._args(*args, TRITON_MAX_K + 1, fmt)
    assert "k <= 4096" in triton_args_unsupported(too_many)
    assert triton_args_unsupported(ops._args(*args, 16, fmt)) is None
    wide = too_many._replace(k=16, q=torch.zeros(2, 129, 128))
    assert "at most 128 heads" in triton_args_unsupported(wide)
    cuda = torch.device("cuda")
    with pytest.MonkeyPatch.context() as mp:  # a triton backend that could run here
        mp.setitem(backends._REGISTRY["indexer"], "triton",
                   (lambda device, fmt: None, *backends._REGISTRY["indexer"]["triton"][1:]))
        assert backends.resolve("indexer", cuda, None, too_many)[0] == "reference"
        with compile_ops.use_backends(indexer="triton"), pytest.raises(ValueError, match="k <= 4096"):
            backends.resolve("indexer", cuda, None, too_many)


def oracle_candidates(args, n_blocks, block, index_format):
    """``indexer_candidates`` in float64 from every visible entry's score: blocks by the max
    of their entries, the newest visible entry's block first, ties by the lower block."""
    every, scores = oracle.indexer_topk(*args, 10**4, index_format)
    _, _, cache, table, rows, n = args
    L = table.shape[1] * cache.shape[1]
    out = []
    for t in range(len(every)):
        best = {}
        for c, s in zip(every[t], scores[t]):
            best[c // block] = max(best.get(c // block, float("-inf")), s)
        if 0 <= int(rows[t]) < table.shape[0] and int(n[t]) > 0:
            best[(min(int(n[t]), L) - 1) // block] = float("inf")
        ranked = sorted(best, key=lambda b: (-best[b], b))[:n_blocks]
        out.append(ranked + [-1] * (n_blocks - len(ranked)))
    return out


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("index_format", FORMATS)
@settings(deadline=None, max_examples=examples(0.3))
@given(T=st.integers(1, 4), n_blocks=st.integers(1, 6), block=st.sampled_from([1, 3, 8]), page_size=st.sampled_from([4, 16]),
       B=st.integers(1, 3), holes=st.integers(0, 2), seed=st.integers(0, 2**16))
def test_candidates_equal_a_brute_force_block_scorer(backend, index_format, T, n_blocks, block, page_size, B, holes, seed):
    """DeepSeek-V4.1's first level: each token's best blocks by the max score of their visible
    entries, its newest block always kept, exactly (integer data); then the second level, the
    top-k inside them, equals the oracle's top-k over only those blocks' entries."""
    if backend == "triton":
        pytest.importorskip("triton")
    args = make_problem(index_format, T, 4, 3, B, page_size, seed=seed, holes=holes)
    want = oracle_candidates(args, n_blocks, block, index_format)
    every, _ = oracle.indexer_topk(*args, 10**4, index_format)
    with compile_ops.use_backends(indexer=backend):
        if backend == "triton":  # interpreted kernels, called past the op's device rule
            from compile_ops.indexer import triton as kernels

            fmt = ops._check_topk(*args, n_blocks, index_format)
            got, _ = kernels.indexer_candidates_triton(ops._args(*args, n_blocks, fmt, candidate_block=block))
            inside, _ = kernels.indexer_topk_triton(ops._args(*args, 5, fmt, candidates=got, candidate_block=block))
        else:
            got = compile_ops.indexer_candidates(*args, n_blocks, block, index_format)
            inside = compile_ops.indexer_topk(*args, 5, index_format, got, block)
    assert got.tolist() == want
    for t in range(T):
        kept = [c for c in every[t] if c // block in want[t]][:5]
        assert inside[t].tolist() == kept + [-1] * (5 - len(kept))


def test_candidates_opcheck_and_bad_input():
    args = make_problem("fp8", 3, 4, 2, 2, 4, seed=1, holes=1)
    for op, extra in ((torch.ops.dsv41.indexer_candidates.default, (3, 2, "fp8")),
                      (torch.ops.dsv41.indexer_topk.default, (5, "fp8", torch.tensor([[0, -1]] * 3, dtype=i32), 2))):
        result = torch.library.opcheck(op, (*args, *extra))
        assert all(v == "SUCCESS" for v in result.values()), result
    with pytest.raises(ValueError, match="candidate_block"):
        compile_ops.indexer_candidates(*args, 3, 0, "fp8")
    with pytest.raises(ValueError, match="candidates"):
        compile_ops.indexer_topk(*args, 5, "fp8", torch.zeros(2, 1, dtype=i32), 2)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("index_format", FORMATS)
@pytest.mark.parametrize("order", ["score", "id"])
@pytest.mark.parametrize("shard", [(0, 1, 1), (1, 2, 1), (0, 3, 2)], ids=["one-rank", "rank1-of-2", "rank0-of-3-I2"])
def test_topk_and_candidates_equal_the_two_ops(backend, index_format, order, shard):
    """One scoring, both results: the ids equal ``indexer_topk``'s and the blocks
    ``indexer_candidates``' (a DCP rank's call included), each with its scores, both in
    ``order``."""
    if backend == "triton":
        pytest.importorskip("triton")
    from compile_ops.indexer import reference
    from compile_ops.indexer import triton as kernels

    impl = {"reference": reference, "triton": kernels}[backend]
    suffix = "_reference" if backend == "reference" else "_triton"
    args = make_problem(index_format, 6, 3, 2, 3, 4, seed=shard[0] + 5 * shard[1], holes=1)
    fmt = ops._check_topk(*args, 5, index_format)
    both = getattr(impl, "indexer_topk_and_candidates" + suffix)(
        ops._args(*args, 5, fmt, candidate_block=3, shard=shard, order=order, n_blocks=4))
    ids = getattr(impl, "indexer_topk" + suffix)(ops._args(*args, 5, fmt, candidate_block=3, shard=shard, order=order))
    blocks, block_scores = getattr(impl, "indexer_candidates" + suffix)(
        ops._args(*args, 4, fmt, candidate_block=3, shard=shard))
    if order == "id":  # the same blocks in ascending order
        blocks, moved = reference.by_id(blocks)
        block_scores = block_scores.gather(1, moved)
    for got, want in zip(both, (ids, (blocks, block_scores))):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_topk_and_candidates_op_opcheck_and_bad_input():
    args = make_problem("fp8", 3, 4, 2, 2, 4, seed=2, holes=1)
    for extra in ((5, 3, 2, "fp8"), (5, 3, 2, "fp8", "id")):
        result = torch.library.opcheck(torch.ops.dsv41.indexer_topk_and_candidates.default, (*args, *extra))
        assert all(v == "SUCCESS" for v in result.values()), result
    ids, blocks = compile_ops.indexer_topk_and_candidates(*args, 5, 3, 2, "fp8")
    assert torch.equal(ids, compile_ops.indexer_topk(*args, 5, "fp8"))
    assert torch.equal(blocks, compile_ops.indexer_candidates(*args, 3, 2, "fp8"))
    with pytest.raises(ValueError, match="n_blocks"):
        compile_ops.indexer_topk_and_candidates(*args, 5, 0, 2, "fp8")
    with pytest.raises(ValueError, match="order"):
        compile_ops.indexer_topk_and_candidates(*args, 5, 3, 2, "fp8", "position")


def test_fp4_index_key_bytes_equal_deepseeks_quantizer():
    """``fp4`` index keys hold, byte for byte, what DeepSeek-V4.1's ``fp4_act_quant`` (32-value
    blocks, ue8m0 scales) makes of them: ``s = 2**ceil(log2(fp32(max(amax, 6 * 2**-126) *
    fp32(1/6))))``, values ``clamp(x / s, -6, 6)`` rounded to nearest e2m1 (ties to the even
    code); written independently in float64 from the oracle's rounding."""
    gen = torch.Generator().manual_seed(5)
    keys = torch.randn(5, 128, generator=gen) * torch.tensor([1.0, 1e-30, 6.0, 0.0, 3e5]).unsqueeze(1)
    keys[0, :12] = torch.tensor([6.0, 3.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.0, -1.25, 1.5])
    cache = new_index_cache("fp4", 1, 5)
    compile_ops.write_index_keys(cache, torch.arange(5), keys, "fp4")
    page = cache.view(torch.uint8).reshape(-1).numpy()
    for i, row in enumerate(keys.double().numpy()):
        for j, block in enumerate(row.reshape(4, 32)):
            s = oracle._fp4_scale(float(np.abs(block).max()))
            assert page[5 * 64 + i * 4 + j] == round(np.log2(s)) + 127
            y = np.clip(block / s, -6, 6)
            codes = [int(np.where(oracle._e2m1(np.arange(8)) == abs(v))[0][0]) | (8 * bool(neg))
                     for v, neg in zip(oracle._round_e2m1(y), np.signbit(y))]
            data = page[i * 64 + j * 16 : i * 64 + (j + 1) * 16]
            assert [int(b) & 15 for b in data] == codes[0::2] and [int(b) >> 4 for b in data] == codes[1::2]
