"""The indexer's Triton and Gluon kernels on the GPU against the plain-torch reference (``pytest -m gpu``).

Integer-valued data makes every score exact in any accumulation order, so ids must be
equal, ties included; shapes span the decode and prefill ranges of the indexer issue.
"""

import importlib

import pytest
import torch

import compile_ops
from test_indexer import make_problem

pytestmark = pytest.mark.gpu
i32 = torch.int32


def big_problem(T, Hi, n_max, page_size=64, seed=0, causal=False, index_format="fp8"):
    """``T`` tokens over ``min(T, 4)`` requests of ``n_max`` entries' capacity; random
    per-token counts (or causal: ``n_max - T + 1 + t``), integer keys (fp4: dyadic values
    of a few bits once quantized, still exact sums), a hole per request."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    R = 1 if causal else min(T, 4)
    B = n_max // page_size
    cache = compile_ops.indexer.cache.new_index_cache(index_format, R * B + 1, page_size, device="cuda")
    n_slots = (R * B + 1) * page_size
    keys = torch.randint(-7, 8, (n_slots, 128), device="cuda", generator=gen).float()
    compile_ops.write_index_keys(cache, torch.arange(n_slots, device="cuda"), keys, index_format)
    table = torch.randperm(R * B + 1, device="cuda", generator=gen)[: R * B].view(R, B).to(i32)
    table[:, B // 3] = -1
    q = torch.randint(-2, 3, (T, Hi, 128), device="cuda", generator=gen).bfloat16()
    weights = torch.randint(-3, 4, (T, Hi), device="cuda", generator=gen).float()
    rows = torch.arange(T, device="cuda", dtype=i32) % R
    if causal:
        n = n_max - T + 1 + torch.arange(T, device="cuda", dtype=i32)
    else:
        n = torch.randint(1, n_max + 1, (T,), device="cuda", generator=gen, dtype=i32)
    return q, weights, cache, table, rows, n


def both(args, k, index_format="fp8", backend="auto", **kwargs):
    """The op on ``backend`` (``auto``: on sm_90, Gluon's scores kernel) and on the reference."""
    with compile_ops.use_backends(indexer="reference"):
        want = compile_ops.indexer_topk(*args, k, index_format, **kwargs)
    assert compile_ops.backend_for("indexer", "cuda", index_format) == "gluon"
    with compile_ops.use_backends(indexer=backend):
        return compile_ops.indexer_topk(*args, k, index_format, **kwargs), want


def assert_picks_the_top_scores(args, k, index_format, rel_tol):
    """The op's ``k`` ids hold the reference's top scores (all of a token's valid entries
    when fewer), each within ``rel_tol`` of the token's largest |score|."""
    from compile_ops.indexer import ops
    from compile_ops.indexer.reference import scores_reference

    norm = ops._args(*args, k, ops._check_topk(*args, k, index_format))
    scores = scores_reference(norm, 0, args[0].shape[0])
    got = compile_ops.indexer_topk(*args, k, index_format)
    ok = got >= 0
    picked = torch.where(ok, scores.gather(1, got.clamp_min(0).long()), float("-inf"))
    best = scores.topk(k, dim=1).values
    tol = rel_tol * scores.masked_fill(scores.isinf(), 0).abs().amax(1, keepdim=True)
    assert (ok.sum(1) == (best > float("-inf")).sum(1)).all()
    assert ((picked - best).abs().masked_fill(~ok, 0) <= tol).all()


CASES = [(1, 64, 2048, 1 << 19), (8, 32, 1024, 1 << 17), (64, 64, 512, 1 << 15), (256, 32, 2048, 1 << 13),
         (64, 32, 2048, 1 << 15)]


@pytest.mark.parametrize("index_format", ["fp8", "fp4"])
@pytest.mark.parametrize("T,Hi,k,n_max", CASES, ids=[f"T{c[0]}-Hi{c[1]}-k{c[2]}-n{c[3]}" for c in CASES])
def test_gpu_matches_reference(T, Hi, k, n_max, index_format):
    got, want = both(big_problem(T, Hi, n_max, seed=T, index_format=index_format), k, index_format)
    assert torch.equal(got, want)


@pytest.mark.parametrize("index_format", ["fp4", "fp8"])
@pytest.mark.parametrize("backend", ["gluon", "triton"])
@pytest.mark.parametrize("page_size", [16, 32, 48, 128])
def test_gpu_keys_on_both_scores_kernels(backend, page_size, index_format):
    """Keys through the Gluon scores kernel and the tl one, on pages smaller than a block
    (32: DeepSeek's 64-token blocks at ratio 2), not a power of two, and larger than a
    block, in score and id order."""
    args = big_problem(64, 32, 3 * 2048, page_size=page_size, seed=page_size, index_format=index_format)
    for order in ("score", "id"):
        got, want = both(args, 512, index_format, backend, order=order)
        assert torch.equal(got, want)


@pytest.mark.parametrize("index_format", ["fp4", "fp8"])
@pytest.mark.parametrize("backend", ["gluon", "triton"])
def test_gpu_long_rows_take_group_maxima_from_each_scores_kernel(backend, index_format):
    """Rows of 64K entries start their top-k from the groups' best scores, which each scores
    kernel writes beside the scores: the ids in both orders, and on a DCP rank (its local
    rows still long), are exactly the reference's."""
    from compile_ops.indexer import ops
    from compile_ops.indexer import triton as kernels
    from compile_ops.indexer.reference import indexer_topk_reference

    module = importlib.import_module(f"compile_ops.indexer.{backend}")
    args = big_problem(16, 64, 1 << 16, seed=9, index_format=index_format)
    assert kernels.grouped(1 << 16, 512)
    for order in ("score", "id"):
        got, want = both(args, 512, index_format, backend, order=order)
        assert torch.equal(got, want)
    global_counts = (*args[:5], 2 * args[5])
    shard = ops._args(*global_counts, 512, ops._check_topk(*global_counts, 512, index_format), shard=(1, 2, 64))
    assert torch.equal(getattr(module, f"indexer_topk_{backend}")(shard)[0], indexer_topk_reference(shard)[0])


@pytest.mark.parametrize("index_format", ["fp4", "fp8"])
@pytest.mark.parametrize("backend", ["gluon", "triton"])
def test_gpu_candidates_and_capture(backend, index_format):
    """Keys inside candidate blocks (the scores kernel's mask), replayed from a CUDA graph
    with new counts and no host sync."""
    q, weights, cache, table, rows, n = big_problem(16, 32, 1 << 14, seed=5, index_format=index_format)
    gen = torch.Generator(device="cuda").manual_seed(2)
    cand = torch.randint(-1, (1 << 14) // 64, (16, 24), device="cuda", generator=gen, dtype=i32)
    args = (q, weights, cache, table, rows, n)
    kw = dict(candidates=cand, candidate_block=64)
    with compile_ops.use_backends(indexer=backend):
        compile_ops.indexer_topk(*args, 256, index_format, **kw)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = compile_ops.indexer_topk(*args, 256, index_format, **kw)
    torch.cuda.set_sync_debug_mode("error")
    try:
        n.copy_(torch.randint(1, 1 << 14, (16,), device="cuda", generator=gen, dtype=i32))
        graph.replay()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    with compile_ops.use_backends(indexer="reference"):
        want = compile_ops.indexer_topk(*args, 256, index_format, **kw)
    assert torch.equal(out, want)


@pytest.mark.parametrize("index_format", ["fp4", "fp8"])
@pytest.mark.parametrize("backend", ["gluon", "triton"])
@pytest.mark.parametrize("rank, world, interleave", [(1, 2, 1), (0, 2, 64), (2, 3, 16)])
def test_gpu_dcp_shard_on_both_scores_kernels(backend, index_format, rank, world, interleave):
    """A DCP rank's call (global counts, this rank's cache) on each scores kernel: the ids,
    with and without candidate blocks, and the blocks are exactly the reference's."""
    from compile_ops.indexer import ops
    from compile_ops.indexer.reference import indexer_candidates_reference, indexer_topk_reference

    module = importlib.import_module(f"compile_ops.indexer.{backend}")
    q, weights, cache, table, rows, n = big_problem(16, 32, 1 << 13, page_size=32, seed=rank + world,
                                                    index_format=index_format)
    args = (q, weights, cache, table, rows, world * n)  # global counts: this rank holds about n
    fmt = ops._check_topk(*args, 256, index_format)
    shard = (rank, world, interleave)
    plain = ops._args(*args, 256, fmt, shard=shard)
    assert torch.equal(getattr(module, f"indexer_topk_{backend}")(plain)[0], indexer_topk_reference(plain)[0])
    blocks = ops._args(*args, 24, fmt, candidate_block=64, shard=shard)
    want_blocks = indexer_candidates_reference(blocks)[0]
    assert torch.equal(getattr(module, f"indexer_candidates_{backend}")(blocks)[0], want_blocks)
    inside = ops._args(*args, 256, fmt, candidates=want_blocks, candidate_block=64, shard=shard)
    assert torch.equal(getattr(module, f"indexer_topk_{backend}")(inside)[0], indexer_topk_reference(inside)[0])


def test_gpu_fp4_query_blocks_far_below_their_head():
    """A query block 20 binades under its head's largest (the Gluon kernel rounds it to
    ``2**-15`` of that block's scale): the chosen ids' reference scores are the reference's
    top scores within ``2**-14`` of their size."""
    q, weights, cache, table, rows, n = big_problem(8, 32, 1 << 13, seed=7, index_format="fp4")
    q = q.float()
    q[:, :, 32:64] *= 2.0 ** -20
    q = q.bfloat16()
    assert_picks_the_top_scores((q, weights.abs(), cache, table, rows, n), 256, "fp4", 2.0 ** -14)


def test_gpu_causal_prefill_chunk():
    """A 4 096-token prefill chunk: every token its own causal count."""
    got, want = both(big_problem(4096, 64, 8192, causal=True), 512)
    assert torch.equal(got, want)


@pytest.mark.parametrize("index_format", ["fp8", "fp4"])
@pytest.mark.parametrize("backend", ["gluon", "triton"])
@pytest.mark.parametrize("page_size", [32, 64])
def test_gpu_prefill_token_blocks_on_both_scores_kernels(backend, index_format, page_size):
    """Prefill chunks on each scores kernel, several tokens a program (``scores_tokens``):
    one request's 1 024-token chunk, and chunks of three requests whose runs (333, 500 and
    191 tokens) start and end inside the programs' token blocks, with and without candidate
    blocks (each token its own), and the same tokens in a shuffled order (a request's
    tokens not consecutive, its runs restarting inside a block): ids in both orders equal
    the reference's."""
    from compile_ops.indexer.gluon import GLUON_TOKENS
    from compile_ops.indexer.triton import SCORES_TOKENS, scores_tokens

    one = big_problem(1024, 32, 8192, page_size=page_size, causal=True, index_format=index_format)
    assert scores_tokens(1024, 1) == SCORES_TOKENS and scores_tokens(1024, 1, GLUON_TOKENS) == GLUON_TOKENS > 1
    q, weights, cache, _, _, _ = big_problem(1024, 32, 8192, page_size=page_size, index_format=index_format)
    lengths = torch.tensor([333, 500, 191], device="cuda")
    rows = torch.repeat_interleave(torch.arange(3, device="cuda", dtype=i32), lengths)
    last = torch.cumsum(lengths, 0)[rows.long()] - 1
    n = (8192 - (last - torch.arange(1024, device="cuda"))).to(i32)
    B = 8192 // page_size
    table = torch.randperm(cache.shape[0], device="cuda")[: 3 * B].view(3, B).to(i32)
    three = (q, weights, cache, table, rows, n)
    cand = torch.randint(-1, 8192 // 64, (1024, 48), device="cuda", dtype=i32)
    shuffle = torch.randperm(1024, device="cuda")
    shuffled = (q[shuffle], weights[shuffle], cache, table, rows[shuffle], n[shuffle])
    for args, kw in ((one, {}), (three, {}), (three, dict(candidates=cand, candidate_block=64)), (shuffled, {}),
                     (shuffled, dict(candidates=cand[shuffle], candidate_block=64))):
        for order in ("score", "id"):
            got, want = both(args, 512, index_format, backend, order=order, **kw)
            assert torch.equal(got, want), (order, kw.keys())


@pytest.mark.parametrize("order", ["score", "id"])
@pytest.mark.parametrize("backend", ["gluon", "triton"])
def test_gpu_prefill_group_maxima_count_only_each_tokens_entries(backend, order):
    """A causal chunk whose rows (16K entries) take the top-k's groups, several tokens a
    program: every group's last entry scores high, the higher the newer (no ties), the others
    low. A token whose newest group ends past its count must not see that group's last
    entry, which a later token of its program scores: it would outrank every group the
    token sees and push out the oldest of its top-k. The ids equal the reference's."""
    from compile_ops.indexer.gluon import GLUON_TOKENS
    from compile_ops.indexer.triton import SCORES_TOKENS, TOPK_GROUP, grouped

    T, heads, n_max, k, page = 256, 32, 16384, 512, 64
    q, weights, cache, table, rows, n = big_problem(T, heads, n_max, page_size=page, causal=True)
    tokens = GLUON_TOKENS if backend == "gluon" else SCORES_TOKENS  # a program's (one request's chunk)
    # a program's first token whose program scores the last entry of its newest group (entry n + 2)
    assert grouped(n_max, k) and tokens >= 3 and ((n[::tokens] + 2) % TOPK_GROUP == TOPK_GROUP - 1).any()
    entry = torch.arange(n_max, device="cuda")
    slots = table[0, entry // page].long() * page + entry % page
    # a key's values sum to its score (all-ones queries): a group's last entry 500 + its group,
    # as values of at most 15 (exact in e4m3 under the row's power-of-two scale), the others 1 or 2
    total = torch.where(entry % TOPK_GROUP == TOPK_GROUP - 1, 500 + entry // TOPK_GROUP, 1 + entry % 2)
    d = torch.arange(128, device="cuda")
    keys = (total[:, None] - 15 * d[None, :]).clamp(0, 15).float()
    mapped = slots >= 0
    compile_ops.write_index_keys(cache, slots[mapped], keys[mapped], "fp8")
    q.fill_(1)
    weights.fill_(1)
    got, want = both((q, weights, cache, table, rows, n), k, "fp8", backend, order=order)
    assert torch.equal(got, want)


def test_gpu_graph_replay_new_lengths_no_sync():
    """Captured once; replays with new counts give the reference's ids; no host sync."""
    args = list(big_problem(8, 64, 1 << 14, seed=3))
    out = compile_ops.indexer_topk(*args, 1024, "fp8")  # compiles the kernels
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = compile_ops.indexer_topk(*args, 1024, "fp8")
    gen = torch.Generator(device="cuda").manual_seed(9)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            args[5].copy_(torch.randint(0, 1 << 14, (8,), device="cuda", generator=gen, dtype=i32))
            graph.replay()
            compile_ops.indexer_topk(*args, 1024, "fp8")  # eager too, under the sync check
    finally:
        torch.cuda.set_sync_debug_mode("default")
    with compile_ops.use_backends(indexer="reference"):
        want = compile_ops.indexer_topk(*args, 1024, "fp8")
    assert torch.equal(out, want)


def test_gpu_random_floats_pick_the_top_scores():
    """Random floats (fp8 products, fp32 accumulation): the chosen ids' reference scores are
    the reference's top scores within the accumulation's rounding."""
    q, weights, cache, table, rows, n = make_problem("fp8", 8, 64, 4, 64, 64, seed=1, integer=False)
    args = (q.cuda(), weights.cuda(), cache.cuda(), table.cuda(), rows.cuda(), n.cuda())
    assert_picks_the_top_scores(args, 256, "fp8", 1e-4)


@pytest.mark.parametrize("sort", [False, True])
@pytest.mark.parametrize("T, L, k", [(1, 512, 512), (1, 8192, 512), (3, 20000, 512), (64, 65536, 512),
                                     (4, 1 << 18, 512), (16, 8192, 2048), (2, 40000, 2048)])
def test_gpu_gluon_topk_levels_equal_the_portable_ones(T, L, k, sort):
    """The top-k with its id-order levels on the Gluon kernel (the ``gluon`` backend's) keeps
    the ids and scores the portable kernel keeps, bit for bit, and both a stable sort's:
    rows of many equal scores, ``-inf`` holes, counts from none to the whole row, single-
    and multi-level plans (the last level run by the last program of the launch before it),
    long rows through their groups. Calls on one ``tickets`` buffer leave it at 0, so a
    second call (as a replay) selects the same."""
    from compile_ops.backends import hopper_with_gluon
    from compile_ops.indexer import triton as tri
    from compile_ops.indexer.reference import by_id, topk_of_scores

    if hopper_with_gluon(torch.device("cuda")) is not None:
        pytest.skip(hopper_with_gluon(torch.device("cuda")))
    from compile_ops.indexer.gluon import _topk_level_kernel

    gen = torch.Generator(device="cuda").manual_seed(T * L + k)
    scores = torch.randint(-50, 50, (T, L), device="cuda", generator=gen).float() / 4  # many ties
    scores[:, ::7] = float("-inf")
    n = torch.randint(0, L + 1, (T,), device="cuda", generator=gen, dtype=i32)
    n[0] = L
    want_ids, want_vals = topk_of_scores(
        torch.where(torch.arange(L, device="cuda") < n.unsqueeze(1), scores, float("-inf")), k)
    if not sort:
        want_ids, order = by_id(want_ids)
        want_vals = want_vals.gather(1, order)
    tickets = torch.zeros(T, dtype=i32, device="cuda")
    for level_kernel in (None, _topk_level_kernel):
        for _ in range(2):
            ids, vals = torch.empty(T, k, dtype=i32, device="cuda"), torch.empty(T, k, device="cuda")
            tri.topk_of_rows(scores, n, ids, vals, k, sort=sort, level_kernel=level_kernel, tickets=tickets)
            assert torch.equal(ids, want_ids) and torch.equal(vals, want_vals)
    assert not tickets.any()
