"""Triton indexer: scores on the tensor cores, then an exact top-k per token.

The op's tensors go to the kernels as given (the request-row checks, DCP shard counts,
candidate restriction and the query's quantization happen inside), so a call is a few
launches: the scores kernel and one top-k kernel per level of the top-k but the last,
which the last program to finish a row's part of the level before runs (one level for
rows of at most a few thousand entries). Every kernel is length-bounded: a token's
programs stop at its ``n`` entries; nothing reads or scores past it, whatever the cache's
capacity.

* ``_scores_kernel``, grid ``(T / TB, S)``: program ``(b, s)`` takes ``TB`` consecutive
  tokens (:func:`scores_tokens`: 1 in a step that may be all decode; a prefill step's
  blocks of a request's tokens, whose keys are then read once for the block, the
  queries of its tokens one ``[TB * Hi, 128]`` operand), quantizes their ``[Hi, 128]``
  queries (``fp8``: e4m3 with one power-of-two scale per head, folded into the
  weights), takes blocks ``s, s + S, ...`` of ``BN`` entries of each request run among
  its tokens (up to the run's last token's count), reads their keys through
  the block table (e4m3 bytes and the fp32 scale of an ``fp8`` cache, or bf16; an fp8
  block that is one page's run of entries as one TMA bulk copy, :func:`key_blocks`,
  else row by row), ``tl.dot``\
  s them with the queries (fp32 accumulation; ``fp4``: the query quantized like the keys,
  both as e4m3 bytes, one exact 32-deep product per block of 32 values times its two
  scales; on sm_90 the ``gluon`` backend's kernel computes the same scores of fp8 and fp4
  keys, :mod:`compile_ops.indexer.gluon`) and stores ``scale * sum_h w[h] * relu(dot)``
  (``-inf`` at holes and outside the candidate blocks) into a scores buffer.
* the top-k (:func:`topk_of_rows`): ``_segment_topk_kernel`` holds a segment of a row in
  one program's registers, turns its scores into order-preserving 32-bit keys, finds the
  ``k``-th largest key exactly by bisection of the key range (each step one count over the
  registers, at most 32 steps) and keeps every entry above it
  and the lowest-id ones equal to it, in id order. The kept entries of a row's segments
  are selected from again the same way until one program covers the row (the last
  selection runs in the program that finishes the row's part of the one before last,
  which a per-row count on ``tickets`` tells: no launch of its own); that program
  sorts its ``k`` by (score descending, id ascending) with ``tl.sort``, or keeps them in
  id order (``order="id"``: no sort). A row of at most ``TOPK_SEGMENTS[1]`` scores can be
  one launch of one program per row. :func:`topk_plan` states the launches.
* a long row's top-k (:func:`grouped`) starts from its groups' best scores
  (:class:`GroupMaxima`), which the scores kernel writes beside the scores; the selection
  of its best groups also bounds its entries (none under the ``k``-th best group's best
  score is in the top-k), so the selection among their entries searches only where more
  than ``k`` reach the bound.
* DeepSeek-V4.1's candidate blocks: ``_block_max_kernel`` takes each visible block's best
  score from the scores buffer (then the same top-k over the blocks), and for a top-k
  restricted to candidates ``_candidate_mask_kernel`` marks each token's blocks for the
  scores kernel; both work over a token's visible blocks only.

Tokens go in chunks whose scores buffer stays under ``SCORES_BYTES``. Runs on CUDA tensors,
or on CPU tensors under ``TRITON_INTERPRET=1`` (loops then run to a compile-time bound).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.fx.experimental.symbolic_shapes import statically_known_true
from triton.tools.tensor_descriptor import TensorDescriptor

from compile_ops._launch import INTERPRET, launchable
from compile_ops._triton_quant import (e2m1_as_e4m3, e2m1_code_as_e4m3, e2m1_rows, power_of_two, to_e4m3,
                                      ue8m0_exponent)
from compile_ops.indexer.inputs import IndexerArgs
from compile_ops.mla.plan import num_sms

BN = 64  # entries per scores block
TOPK_SEGMENTS = (2048, 8192)  # entries one top-k program selects from (in its registers)
TOPK_GATHER_SEGMENT = 4096  # ... when it gathers them through group ids (8192 spill registers)
TOPK_GROUP = 16  # entries per group of a long row's first selection
# a launch of at most this many programs an SM runs the rows' last level in its programs (a
# launch fewer); past it (a prefill chunk's thousands of rows) the last level's own launch is
# faster (docs/performance-indexer-history.md)
TOPK_THEN_PROGRAMS_PER_SM = 2
# rows of more than this many k * TOPK_GROUP entries select groups first (at k = 512: rows
# past one top-k program's segment, which would otherwise take a second level)
TOPK_GROUPED_FROM = 1
SCORES_BYTES = 256 << 20  # the scores buffer of one token chunk (a long prefill's bound)
SCORES_TOKENS = 4  # most tokens of one request a ``tl`` scores program takes (scores_tokens)
FP4_QUERY_ROWS = 64  # ... and at most this many query rows (tokens x heads) of fp4 keys: more spill on sm_90
# the scores kernel's (programs per SM, key blocks in flight per program) for keys gathered
# row by row / copied a block at a time (the best of H200 sweeps,
# docs/performance-indexer-history.md)
SCORE_LAUNCH = {False: (16, 1), True: (4, 3)}
MASK_CHUNK = 4096  # candidate-mask bytes one program clears per step
BLOCK_MAX_BLOCKS = 64  # candidate blocks one program of the block maxima takes per step
BLOCK_MAX_PROGRAMS_PER_SM = 16  # ... and its grid: enough loads in flight to stream the scores


@triton.jit
def _local_count(t2r, n_entries, i_t, R, L, rank, world, interleave, m_t=True):
    """Token ``i_t``'s request row (0 when it picks nothing) and how many entries it scores on
    this shard (``local_counts``); ``i_t`` may be a block of tokens, ``m_t`` those that exist."""
    row = tl.load(t2r + i_t, mask=m_t, other=-1)
    n_g = tl.maximum(tl.load(n_entries + i_t, mask=m_t, other=0), 0)
    span = world * interleave
    n = tl.minimum((n_g // span) * interleave + tl.minimum(tl.maximum(n_g % span - rank * interleave, 0), interleave), L)
    ok = (row >= 0) & (row < R) & (n > 0)
    return tl.where(ok, row, 0).to(tl.int64), tl.where(ok, n, 0)


@triton.jit
def _sortable(x):
    """fp32 -> int32 keys in the same order (negative floats' magnitude bits flipped; ``-0.0``
    made ``0.0`` first, so that equal scores have one key)."""
    bits = (x + 0.0).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 2147483647, bits)


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    """``a [M, K] @ b[N, K].T`` in fp32 (the interpreter's fp8 / bf16 products are not the
    hardware's: it takes them in fp32)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)))
    return tl.dot(a, tl.trans(b))


@triton.jit
def _fp4_query(p_q, m_h, g: tl.constexpr):
    """Block ``g`` (values ``32 g .. 32 g + 31``) of a token's queries ``[HI, 32]`` quantized
    like the keys (:func:`compile_ops.indexer.cache.quantize_e2m1`): ``(codes as e4m3 [HI,
    32], scale [HI] fp32)`` (the codes' values times ``2**-6``, :func:`e2m1_as_e4m3`)."""
    code, exponent = e2m1_rows(tl.load(p_q + 32 * g, mask=m_h[:, None], other=0.0).to(tl.float32))
    return e2m1_code_as_e4m3(code), power_of_two(exponent)


@triton.jit
def _fp4_block_dot(base, off, m_c, b_e, b_q, q_scale, g: tl.constexpr, UPCAST: tl.constexpr):
    """``[BN, HI]`` fp32 dots of block ``g`` of ``BN`` fp4 keys (page rows ``off`` at ``base``,
    ue8m0 bytes ``b_e`` int32, four a key) with the queries' block ``g`` (:func:`_fp4_query`):
    one 32-deep e4m3 product, then the two blocks' scales, exact powers of two."""
    b_b = tl.load(base[:, None] + off[:, None] * 64 + 16 * g + tl.arange(0, 16)[None, :], mask=m_c[:, None], other=0)
    k_scale = power_of_two((b_e >> (8 * g)) & 255)
    return _dot(e2m1_as_e4m3(b_b, UPCAST), b_q, UPCAST) * k_scale[:, None] * q_scale[None, :]


@triton.jit
def _scores_kernel(
    q, w, t2r, n_entries, cache, keys, table, allowed, scores, n_out, tickets, gmax, g_counts,
    s_qt, s_qh, s_wt, s_page, s_bt, s_st, s_at, s_gt, T, R, L, num_slots, page_size, Hi, S,
    rank, world, interleave, block, nb, K,
    HI: tl.constexpr, TB: tl.constexpr, FP8: tl.constexpr, RESTRICT: tl.constexpr, BN: tl.constexpr,
    ITERS: tl.constexpr, UPCAST: tl.constexpr, TMA: tl.constexpr, FP4: tl.constexpr, GROUPS: tl.constexpr,
    G: tl.constexpr,
):
    i_b, i_s = tl.program_id(0), tl.program_id(1)
    # the program's TB tokens; their queries are the rows of one [TB * HI, 128] operand
    o_j = tl.arange(0, TB)
    t_j = i_b * TB + o_j
    m_j = t_j < T
    row_j, n_j = _local_count(t2r, n_entries, t_j, R, L, rank, world, interleave, m_j)
    if i_s == 0:
        tl.store(n_out + t_j, n_j, mask=m_j)
        tl.store(tickets + t_j, tl.zeros_like(n_j), mask=m_j)  # (topk_of_rows)
        if GROUPS:
            _store_group_counts(g_counts, t_j, T, n_j, K, G, m_j)
    o_h = tl.arange(0, TB * HI)
    t_h = i_b * TB + o_h // HI
    m_h = (o_h % HI < Hi) & (t_h < T)
    o_d = tl.arange(0, 128)
    b_w = tl.load(w + t_h * s_wt + o_h % HI, mask=m_h, other=0.0)
    p_q = q + t_h.to(tl.int64)[:, None] * s_qt + (o_h % HI)[:, None] * s_qh
    if not FP4:
        b_q = tl.load(p_q + o_d[None, :], mask=m_h[:, None], other=0.0)
    if FP8:  # q gets the keys' quantizer (quantize_e4m3); its power-of-two scale joins the weights
        b_qf = b_q.to(tl.float32)
        exponent = ue8m0_exponent(tl.max(tl.abs(b_qf), 1))
        b_q = to_e4m3(b_qf * power_of_two(254 - exponent)[:, None])
        b_w = b_w * power_of_two(exponent)
    if FP4:  # q quantized like the keys (quantize_e2m1): one e4m3 tile and scale per block of 32
        b_w = b_w * 4096.0  # the keys' and the query's 2**-6 (e2m1_as_e4m3)
        p_q = p_q + tl.arange(0, 32)[None, :]
        q0, qs0 = _fp4_query(p_q, m_h, 0)
        q1, qs1 = _fp4_query(p_q, m_h, 1)
        q2, qs2 = _fp4_query(p_q, m_h, 2)
        q3, qs3 = _fp4_query(p_q, m_h, 3)
    o_n = tl.arange(0, BN)
    # a request's tokens are contiguous in a step: the block holds runs of a few rows, and
    # each run's keys are read once for all its tokens
    for g in tl.static_range(TB):
        row = tl.sum(tl.where(o_j == g, row_j, 0))
        before = tl.sum(tl.where(o_j == g - 1, row_j + 1, 0)) - 1  # the row of token g - 1 (-1: none)
        in_run = (row_j == row) & (o_j >= g) & m_j & (row != before)  # (a run starting at g)
        n_run = tl.max(tl.where(in_run, n_j, 0))
        for i in range(0, ITERS if ITERS > 0 else tl.cdiv(tl.maximum(tl.cdiv(n_run, BN) - i_s, 0), S)):
            c = (i_s + i * S) * BN + o_n
            m_c = c < n_run
            page = tl.load(table + row * s_bt + c // page_size, mask=m_c, other=-1).to(tl.int64)
            off = c % page_size
            m_c = m_c & (page >= 0) & (page * page_size + off < num_slots)
            page = tl.where(m_c, page, 0)
            base = cache + page * s_page
            b_scale = tl.full([BN], 1.0, tl.float32)
            if FP4:  # 64 bytes of e2m1 pairs, then (after the page's rows) 4 ue8m0 bytes
                b_e = tl.load((base + page_size * 64 + off * 4).to(tl.pointer_type(tl.int32)), mask=m_c, other=0)
                b_dot = _fp4_block_dot(base, off, m_c, b_e, q0, qs0, 0, UPCAST)
                b_dot += _fp4_block_dot(base, off, m_c, b_e, q1, qs1, 1, UPCAST)
                b_dot += _fp4_block_dot(base, off, m_c, b_e, q2, qs2, 2, UPCAST)
                b_dot += _fp4_block_dot(base, off, m_c, b_e, q3, qs3, 3, UPCAST)
            else:
                if TMA:  # the block is one page's run of BN entries: one bulk copy, no address per byte
                    first_c = (i_s + i * S) * BN
                    p_blk = tl.load(table + row * s_bt + first_c // page_size, mask=first_c < n_run, other=-1)
                    b_k = tl.reshape(keys.load([p_blk, first_c % page_size, 0]), [BN, 128])  # e4m3; past the cache: 0
                else:
                    b_k = tl.load(base[:, None] + off[:, None] * 128 + o_d[None, :], mask=m_c[:, None], other=0.0)
                    if FP8:
                        b_k = b_k.to(tl.float8e4nv, bitcast=True)
                if FP8:
                    b_scale = tl.load((base + page_size * 128 + off * 4).to(tl.pointer_type(tl.float32)), mask=m_c,
                                      other=0.0)
                b_dot = _dot(b_k, b_q, UPCAST)  # [BN, TB * HI] fp32
            b_s = tl.sum(tl.reshape(tl.maximum(b_dot, 0.0) * b_w[None, :], [BN, TB, HI]), 2) * b_scale[:, None]
            m_s = m_c[:, None] & (c[:, None] < n_j[None, :])
            if RESTRICT:  # entries outside the token's candidate blocks (global ids) score -inf
                blk = (((c // interleave) * world + rank) * interleave + c % interleave) // block
                m_s = m_s & (tl.load(allowed + t_j[None, :] * s_at + blk[:, None], mask=m_s & (blk[:, None] < nb),
                                     other=0) != 0)
            b_s = tl.where(m_s, b_s, float("-inf"))  # [BN, TB]
            m_out = (c[:, None] < n_j[None, :]) & in_run[None, :]
            tl.store(scores + t_j.to(tl.int64)[None, :] * s_st + c[:, None], b_s, mask=m_out)
            if GROUPS:  # the top-k's first pass over a long row, while its scores are in registers
                _store_group_maxima(b_s, (i_s + i * S) * BN, n_j, gmax + t_j.to(tl.int64) * s_gt, G, BN, in_run)


@triton.jit
def _visible_blocks(t2r, n_entries, i_t, R, LW, block):
    """Token ``i_t``'s global candidate blocks that hold an entry it may see,
    ``ceil(min(n, L * world) / block)`` (0 when it picks nothing), and its pinned block,
    that of its newest entry (``pinned_blocks``; -1: none)."""
    row = tl.load(t2r + i_t)
    n_g = tl.minimum(tl.maximum(tl.load(n_entries + i_t), 0), LW)
    n_g = tl.where((row >= 0) & (row < R), n_g, 0)
    return tl.cdiv(n_g, block), tl.where(n_g > 0, (n_g - 1) // block, -1)


@triton.jit
def _candidate_mask_kernel(cand, t2r, n_entries, allowed, s_ct, s_at, C, R, LW, block,
                           C_PAD: tl.constexpr, CHUNK: tl.constexpr, ITERS: tl.constexpr):
    """Program ``t``: ``allowed[t, b]`` (int8) is 1 for the blocks ``b`` among ``cand[t, :C]``,
    0 for the others, over the token's visible blocks only (the scores kernel reads no
    other): cleared first, then the candidates set, in one program (the barrier orders
    the two)."""
    i_t = tl.program_id(0)
    nb_t, _ = _visible_blocks(t2r, n_entries, i_t, R, LW, block)
    row = allowed + i_t.to(tl.int64) * s_at
    o = tl.arange(0, CHUNK)
    for i in range(0, ITERS if ITERS > 0 else tl.cdiv(nb_t, CHUNK)):
        tl.store(row + i * CHUNK + o, tl.zeros([CHUNK], tl.int8), mask=i * CHUNK + o < nb_t)
    tl.debug_barrier()
    o_c = tl.arange(0, C_PAD)
    b = tl.load(cand + i_t.to(tl.int64) * s_ct + o_c, mask=o_c < C, other=-1)
    tl.store(row + b, tl.full([C_PAD], 1, tl.int8), mask=(b >= 0) & (b < nb_t))


@triton.jit
def _block_max_kernel(scores, n, t2r, n_entries, out, n_out, s_st, s_ot, R, LW, rank, world, interleave, block, S,
                      BB: tl.constexpr, BP: tl.constexpr, ITERS: tl.constexpr):
    """Program ``(t, s)``: the best score of each of token ``t``'s visible candidate blocks
    ``s, s + S, ...`` (``BB`` blocks of ``block <= BP`` global ids a step) into ``out`` (the
    ids this rank holds, local column ``c < n[t]`` of ``scores``; ``-inf``: none; the pinned
    block ``+inf``); program 0 stores the visible block count into ``n_out``. Blocks past
    it are not written."""
    i_t, i_s = tl.program_id(0), tl.program_id(1)
    nb_t, pinned = _visible_blocks(t2r, n_entries, i_t, R, LW, block)
    if i_s == 0:
        tl.store(n_out + i_t, nb_t)
    n_t = tl.load(n + i_t)
    o_b = tl.arange(0, BB)
    o_j = tl.arange(0, BP)
    span = world * interleave
    for i in range(0, ITERS if ITERS > 0 else tl.cdiv(tl.maximum(tl.cdiv(nb_t, BB) - i_s, 0), S)):
        b = (i_s + i * S) * BB + o_b
        g = b[:, None] * block + o_j[None, :]  # [BB, BP] global ids
        c = (g // span) * interleave + g % interleave  # the local column, where this rank holds g
        m = (o_j[None, :] < block) & ((g // interleave) % world == rank) & (c < n_t)
        x = tl.load(scores + i_t.to(tl.int64) * s_st + c, mask=m, other=float("-inf"))
        best = tl.max(tl.where(x > float("-inf"), x, float("-inf")), 1)  # NaN is no entry
        tl.store(out + i_t.to(tl.int64) * s_ot + b, tl.where(b == pinned, float("inf"), best), mask=b < nb_t)


@triton.jit
def _kth_key(key, ok, K):
    """``(thr, need)``: the ``K``-th largest of the keys ``key`` where ``ok`` (the smallest of
    them when fewer) and how many keys equal to it to keep, by bisection of the key range:
    each step counts the keys at or above its middle (one reduction over the registers);
    the search stops once exactly ``K`` keys are at or above its lower bound, or the range
    is one key wide."""
    want = tl.minimum(K, tl.sum(ok.to(tl.int32)))
    lo = tl.min(tl.where(ok, key, 2147483647)).to(tl.int64)  # count(key >= lo) >= want
    hi = tl.max(tl.where(ok, key, -2147483648)).to(tl.int64) + 1  # count(key >= hi) < want
    at_lo = tl.sum(ok.to(tl.int32))
    while (hi - lo > 1) & (at_lo != want):
        mid = lo + (hi - lo) // 2
        at_mid = tl.sum((ok & (key >= mid.to(tl.int32))).to(tl.int32))
        up = at_mid >= want
        lo = tl.where(up, mid, lo)
        at_lo = tl.where(up, at_mid, at_lo)
        hi = tl.where(up, hi, mid)
    thr = tl.min(tl.where(ok & (key >= lo.to(tl.int32)), key, 2147483647))
    return thr, want - tl.sum((ok & (key > thr)).to(tl.int32))


@triton.jit
def _sort_row(ids, vals, taken, K, K_PAD: tl.constexpr):
    """A row's ``taken`` kept entries by (score descending, id ascending); ``-1`` / ``-inf`` after."""
    o_k = tl.arange(0, K_PAD)
    m_k = o_k < taken
    b_id = tl.load(ids + o_k, mask=m_k, other=0)
    b_x = tl.load(vals + o_k, mask=m_k, other=0.0)
    # (key, id) in one int64: descending order is score descending, then id ascending
    packed = tl.where(m_k, (_sortable(b_x).to(tl.int64) << 32) | (4294967295 - b_id.to(tl.int64)), -9223372036854775808)
    packed = tl.sort(packed, 0, descending=True)
    b_id = (4294967295 - (packed & 4294967295)).to(tl.int32)
    high = (packed >> 32).to(tl.int32)
    bits = tl.where(high < 0, high ^ 2147483647, high).to(tl.float32, bitcast=True)
    tl.debug_barrier()  # every lane has read the unsorted row before any overwrites it
    m_out = o_k < K
    tl.store(ids + o_k, tl.where(m_k, b_id, -1), mask=m_out)
    tl.store(vals + o_k, tl.where(m_k, bits, float("-inf")), mask=m_out)


@triton.jit
def _store_group_counts(g_counts, i_t, T, n_t, K, G: tl.constexpr, m_t=True):
    """Row ``t``'s group count (``g_counts[0, t]``) and its candidate count, ``G`` per group
    the group top-k can keep (``g_counts[1, t]``), of its ``n_t`` scores (``i_t`` may be a
    block of rows, ``m_t`` those that exist)."""
    tl.store(g_counts + i_t, tl.cdiv(n_t, G), mask=m_t)
    tl.store(g_counts + T + i_t, tl.minimum(tl.cdiv(n_t, G), K) * G, mask=m_t)


@triton.jit
def _store_group_maxima(x, first, n_t, gmax_row, G: tl.constexpr, BLOCK: tl.constexpr, m_t=True):
    """The best of each group of ``G`` among ``x [BLOCK, rows]``, scores ``first ..`` of rows of
    ``n_t [rows]`` (``-inf`` past them; NaN is no entry, as in the selection), into
    ``gmax_row [rows]`` pointers (``-inf``: none valid; groups past a row's and rows outside
    ``m_t`` not written)."""
    x = tl.where(x > float("-inf"), x, float("-inf"))
    o_g = first // G + tl.arange(0, BLOCK // G)
    best = tl.max(tl.reshape(x, [BLOCK // G, G, x.shape[1]]), 1)
    tl.store(gmax_row[None, :] + o_g[:, None], best, mask=(o_g[:, None] < tl.cdiv(n_t, G)[None, :]) & m_t[None, :])


@triton.jit
def _group_max_kernel(scores, n, gmax, g_counts, s_st, s_gt, T, K, G: tl.constexpr, BLOCK: tl.constexpr):
    """Program ``(t, s)``: the group maxima (:func:`_store_group_maxima`) of row ``t``'s scores
    ``[s * BLOCK, (s + 1) * BLOCK)``; program 0 also stores the row's counts
    (:func:`_store_group_counts`). The scores kernels write the same beside the scores."""
    i_t, i_s = tl.program_id(0), tl.program_id(1)
    n_t = tl.maximum(tl.load(n + i_t), 0)
    if i_s == 0:
        _store_group_counts(g_counts, i_t, T, n_t, K, G)
    if i_s * BLOCK < n_t:
        c = i_s * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(scores + i_t.to(tl.int64) * s_st + c, mask=c < n_t, other=float("-inf"))
        o_1 = tl.arange(0, 1)
        _store_group_maxima(x[:, None], i_s * BLOCK, n_t + o_1, gmax + i_t.to(tl.int64) * s_gt + o_1, G, BLOCK,
                            o_1 == 0)


@triton.jit
def _level_entries(src_vals, src_ids, n_src, bound, i_t, c, n_t, s_src, s_ids, PREV_COVER, SOURCE: tl.constexpr,
                   G: tl.constexpr, K_PAD: tl.constexpr):
    """``(ids, scores, keys, ok)`` of a top-k level's entries ``c`` of row ``i_t`` (``n_t``
    scores) from its ``SOURCE`` (:func:`_segment_topk_kernel`): ``ok`` where an entry exists,
    scores more than ``-inf`` and, from a row's kept groups, is at or above ``bound[i_t]``.
    Shared by the ``gluon`` backend's level kernel (``c`` in its layout)."""
    if SOURCE == 0:
        valid = c < n_t
        idx = c
        x = tl.load(src_vals + i_t.to(tl.int64) * s_src + c, mask=valid, other=float("-inf"))
    elif SOURCE == 1:  # the slots of the earlier level's programs that had entries
        valid = c < tl.cdiv(n_t, PREV_COVER) * K_PAD
        idx = tl.load(src_ids + i_t.to(tl.int64) * s_ids + c, mask=valid, other=0)
        x = tl.load(src_vals + i_t.to(tl.int64) * s_src + c, mask=valid, other=float("-inf"))
    else:
        group = tl.load(src_ids + i_t.to(tl.int64) * s_ids + c // G, mask=c < n_t, other=-1)
        idx = group * G + c % G
        valid = (group >= 0) & (idx < tl.load(n_src + i_t))
        x = tl.load(src_vals + i_t.to(tl.int64) * s_src + idx, mask=valid, other=float("-inf"))
    key = _sortable(x)
    ok = valid & (x > float("-inf"))
    if SOURCE == 2:  # under the K-th best group's best: not in the top-K
        ok = ok & (key >= tl.load(bound + i_t))
    return idx, x, key, ok


@triton.jit
def _select_segment(src_vals, src_ids, n_src, cand_vals, cand_ids, ids, vals, bound, i_t, i_s, n_t, s_src, s_ids,
                    s_cand, s_out, K, PREV_COVER, COVER, SOURCE: tl.constexpr, G: tl.constexpr, SEG: tl.constexpr,
                    K_PAD: tl.constexpr, LAST: tl.constexpr, SORTED: tl.constexpr, BOUND: tl.constexpr):
    """Program ``i_s``'s part of a level (:func:`_segment_topk_kernel`) for row ``i_t`` of
    ``n_t`` scores."""
    o = tl.arange(0, SEG)
    idx, x, key, ok = _level_entries(src_vals, src_ids, n_src, bound, i_t, i_s * SEG + o, n_t, s_src, s_ids,
                                     PREV_COVER, SOURCE, G, K_PAD)
    held = tl.sum(ok.to(tl.int32))
    thr = tl.full([], -2147483648, tl.int32)  # keep every entry ...
    need = K
    if held > K:  # ... unless this program holds more than K
        thr, need = _kth_key(key, ok, K)
    eq = (ok & (key == thr)).to(tl.int32)
    keep = (ok & (key > thr)) | ((eq != 0) & (tl.cumsum(eq, 0) - eq < need))
    keep_i = keep.to(tl.int32)
    at = tl.cumsum(keep_i, 0) - keep_i
    taken = tl.sum(keep_i)
    o_k = tl.arange(0, K_PAD)
    if LAST or n_t <= COVER:
        if BOUND:
            tl.store(bound + i_t, thr)
        tl.store(ids + i_t * s_out + at, idx, mask=keep)
        tl.store(vals + i_t * s_out + at, x, mask=keep)
        if SORTED:
            tl.debug_barrier()  # the kept entries are stored before the sort reads them
            _sort_row(ids + i_t * s_out, vals + i_t * s_out, taken, K, K_PAD)
        else:
            after = (o_k >= taken) & (o_k < K)
            tl.store(ids + i_t * s_out + o_k, tl.full([K_PAD], -1, tl.int32), mask=after)
            tl.store(vals + i_t * s_out + o_k, tl.full([K_PAD], float("-inf"), tl.float32), mask=after)
    else:
        at_cand = i_t.to(tl.int64) * s_cand + i_s * K_PAD
        tl.store(cand_ids + at_cand + at, idx, mask=keep)
        tl.store(cand_vals + at_cand + at, x, mask=keep)
        tl.store(cand_vals + at_cand + o_k, tl.full([K_PAD], float("-inf"), tl.float32), mask=o_k >= taken)


@triton.jit
def _last_to_finish(tickets, i_t, programs):
    """Whether this program is the last of row ``i_t``'s ``programs`` to finish its part of
    a launch: each counts itself done on ``tickets[i_t]`` (once its stores are made, which
    the last one then sees), and the last sets the count back to 0 for the next launch."""
    tl.debug_barrier()  # every thread's stores are made before the count says so
    last = tl.atomic_add(tickets + i_t, 1, sem="acq_rel") == programs - 1
    if last:
        tl.store(tickets + i_t, 0)
    return last


@triton.jit
def _segment_topk_kernel(
    src_vals, src_ids, n, n_src, cand_vals, cand_ids, ids, vals, bound, tickets, s_src, s_ids, s_cand, s_out, K,
    PREV_COVER, COVER, SOURCE: tl.constexpr, G: tl.constexpr, SEG: tl.constexpr, K_PAD: tl.constexpr,
    LAST: tl.constexpr, SORTED: tl.constexpr, BOUND: tl.constexpr, THEN_SEG: tl.constexpr,
):
    """One level of the top-k: program ``(t, s)`` holds entries ``[s * SEG, (s + 1) * SEG)``
    of row ``t``'s first ``n[t]`` and keeps their best ``K`` (:func:`_kth_key`; equal scores go
    to the lower id) in id order, ``-inf`` after. ``SOURCE`` 0: the row's scores (``-inf`` =
    none); 1: the entries the level before kept, ``K_PAD`` slots per program; 2: the entries
    of the row's kept groups (``src_ids [T, K]``: group ids in id order, ``-1`` after; entry
    ``c`` is entry ``c % G`` of group ``c // G``, of the ``n_src[t]`` scores; only those at or
    above ``bound[t]`` count). Where it covers the whole row (``n[t] <= COVER``) it stores the
    row's ``K`` ids / scores: sorted by (score descending, id ascending) if ``SORTED``, else
    in id order; ``-1`` / ``-inf`` after; with ``BOUND`` (the selection of a row's groups) also
    ``bound[t]``, the key of its ``K``-th best score when it has more than ``K`` (else the
    lowest key: no bound): at least ``K`` of the row's entries score that or more, so none
    below it is in the row's top-``K``. Programs with nothing to do (past the row's entries,
    or a row an earlier level finished: ``n[t] <= PREV_COVER``) return at once; so does the
    search of a program holding at most ``K`` entries (it keeps them all). With ``THEN_SEG``
    the row's last program to finish (:func:`_last_to_finish`; ``tickets [T]`` int32, 0 on
    entry and on exit) then runs the row's last level over the ``THEN_SEG`` slots the
    programs kept, so the last level is no launch of its own."""
    i_t, i_s = tl.program_id(0), tl.program_id(1)
    n_t = tl.maximum(tl.load(n + i_t), 0)
    if (n_t > PREV_COVER) & ((i_s == 0) | (i_s * COVER < n_t)):
        _select_segment(src_vals, src_ids, n_src, cand_vals, cand_ids, ids, vals, bound, i_t, i_s, n_t, s_src, s_ids,
                        s_cand, s_out, K, PREV_COVER, COVER, SOURCE, G, SEG, K_PAD, LAST, SORTED, BOUND)
        if THEN_SEG > 0:
            if n_t > COVER:
                if _last_to_finish(tickets, i_t, tl.cdiv(n_t, COVER)):
                    _select_segment(cand_vals, cand_ids, n_src, cand_vals, cand_ids, ids, vals, bound, i_t, 0, n_t,
                                    s_cand, s_cand, s_cand, s_out, K, COVER, n_t, 1, G, THEN_SEG, K_PAD, True, SORTED,
                                    BOUND)


def one_chunk(T, L: int) -> bool:
    """Whether the scores of ``T`` tokens over ``L`` entries fit one scratch chunk, known
    without a guard (a traced ``T`` is bounded by its range, e.g. an export's ``Dim``)."""
    return statically_known_true(T * 4 * L <= SCORES_BYTES)


def topk_segment(T, L: int, sms: int) -> int:
    """Entries per top-k program for ``T`` rows of ``L`` scores on ``sms`` SMs: the most (up
    to ``TOPK_SEGMENTS[1]``) that still give every SM a program, at least
    ``TOPK_SEGMENTS[0]``: one program's search takes longer than another level's
    launch. A traced (symbolic) ``T`` counts as one row, since the segment sets compile-time
    sizes."""
    rows = T if isinstance(T, int) else 1
    seg = TOPK_SEGMENTS[1]
    while seg > TOPK_SEGMENTS[0] and rows * triton.cdiv(L, seg) < sms:
        seg //= 2
    return seg


def topk_levels(L: int, k: int, segment: int) -> list[tuple[int, int, int]]:
    """The top-k's levels for rows of ``L`` scores: ``(seg, programs, cover)`` each, ``seg``
    the entries one program selects from (a power of two, at least ``4 * k_pad``), ``programs``
    per row and ``cover`` the scores one program's result stands for; the last level has
    one program per row. A row of at most ``segment`` scores is one level of one program."""
    k_pad = triton.next_power_of_2(k)
    seg = max(triton.next_power_of_2(segment), 4 * k_pad)
    if L <= seg:
        return [(max(triton.next_power_of_2(max(L, 1)), k_pad), 1, L)]
    levels, width, cover = [], L, 1  # width: entries per row to select from at this level
    while width > seg:
        programs = triton.cdiv(width, seg)
        cover *= seg if not levels else seg // k_pad
        levels.append((seg, programs, cover))
        width = programs * k_pad
    levels.append((triton.next_power_of_2(width), 1, L))
    return levels


class TopkLaunch(NamedTuple):
    """One ``_segment_topk_kernel`` launch: ``programs`` per row, each selecting from ``seg``
    entries of its ``source`` (0: the row's scores, 1: the level before's kept entries, 2: a
    long row's kept groups' entries); ``cover`` scores per program's result, ``k_pad`` slots
    per result; ``last``: the level that writes the row's result, ``sort``: by score (else
    in id order); ``then_seg``: where not 0, the row's last level (one program selecting
    from ``then_seg`` slots, those this launch's programs kept) runs in the program that
    finishes the row's part of this launch last, so it is no launch of its own."""

    source: int
    seg: int
    programs: int
    cover: int
    k_pad: int
    last: bool
    sort: bool
    then_seg: int = 0

    @property
    def warps(self) -> int:
        """Warps of a program holding ``seg`` (or ``then_seg``) entries: 16 at 8K, whose
        registers 8 warps would spill."""
        seg = max(self.seg, self.then_seg)
        return 16 if seg >= 8192 else 8 if seg >= 2048 else 4


def _selection(T, L: int, k: int, sms: int, segment: Optional[int], source: int, sort: bool) -> list[TopkLaunch]:
    """The launches of one selection of ``k`` among rows of ``L`` entries (:func:`topk_levels`),
    the last level run by the launch of the level before where that launch is at most
    ``TOPK_THEN_PROGRAMS_PER_SM`` programs an SM (``TopkLaunch.then_seg``; a traced ``T``
    counts as one row); a program gathering its entries through group ids (``source`` 2)
    holds at most ``TOPK_GATHER_SEGMENT``."""
    segment = segment or topk_segment(T, L, sms)
    levels = topk_levels(L, k, min(segment, TOPK_GATHER_SEGMENT) if source == 2 else segment)
    k_pad = triton.next_power_of_2(k)
    launches = [TopkLaunch(source if i == 0 else 1, seg, programs, cover, k_pad, i == len(levels) - 1, sort)
                for i, (seg, programs, cover) in enumerate(levels)]
    rows = T if isinstance(T, int) else 1
    if len(launches) > 1 and rows * launches[-2].programs <= TOPK_THEN_PROGRAMS_PER_SM * sms:
        launches[-2:] = [launches[-2]._replace(then_seg=launches[-1].seg)]
    return launches


def grouped(L: int, k: int) -> bool:
    """Whether the top-k of rows of ``L`` scores goes through their groups' best scores."""
    return L > TOPK_GROUPED_FROM * triton.next_power_of_2(k) * TOPK_GROUP


GROUP_MAX_BLOCK = 256 * TOPK_GROUP  # scores per program of the group maxima


def group_slots(L: int) -> int:
    """Group maxima slots of a row of ``L`` scores (whole programs of ``GROUP_MAX_BLOCK``)."""
    return triton.cdiv(L, GROUP_MAX_BLOCK) * GROUP_MAX_BLOCK // TOPK_GROUP


class GroupMaxima(NamedTuple):
    """The first pass of a long row's top-k (:func:`grouped`): ``best [T, group_slots(L)]``
    fp32, each group of ``TOPK_GROUP`` scores' best (:func:`_store_group_maxima`), and
    ``counts [2, T]`` int32, each row's groups and candidate entries
    (:func:`_store_group_counts`). The scores kernels write them beside the scores; for
    scores from elsewhere ``_group_max_kernel`` does."""

    best: torch.Tensor
    counts: torch.Tensor

    @staticmethod
    def empty(T, L: int, device) -> "GroupMaxima":
        return GroupMaxima(torch.empty((T, group_slots(L)), dtype=torch.float32, device=device),
                           torch.empty((2, T), dtype=torch.int32, device=device))


def topk_plan(T, L: int, k: int, sms: int, segment: Optional[int] = None, sort: bool = True) -> list[list[TopkLaunch]]:
    """The top-k launches of ``T`` rows of ``L`` scores (:func:`topk_of_rows`): one selection,
    or for a long row (:func:`grouped`) the selection of its best groups (in id order) and
    then of their entries; the last launch sorts by score if ``sort``."""
    if not grouped(L, k):
        return [_selection(T, L, k, sms, segment, 0, sort)]
    return [_selection(T, group_slots(L), k, sms, segment, 0, False),
            _selection(T, k * TOPK_GROUP, k, sms, segment, 2, sort)]


def _launch(levels: list[TopkLaunch], src, n, ids, vals, k, tickets, groups=None, n_src=None, bound=None,
            store_bound: bool = False, level_kernel=None) -> None:
    """``levels`` over ``src [T, L]`` (a first ``source`` 2: entries addressed through
    ``groups``, at or above ``bound``), ending in ``ids`` / ``vals`` (and, ``store_bound``,
    the row's ``k``-th best key into ``bound``); ``tickets [T]`` int32 zeros, zeros again
    after. ``level_kernel``: a kernel of ``_segment_topk_kernel``'s arguments less ``SORTED``
    plus ``W`` (its warps), for the levels that do not sort and hold at least one entry per
    thread; it is launched as a programmatic dependent of the kernel before it, so it must
    wait for that kernel (``griddepcontrol.wait``) before its first global access."""
    T = src.shape[0]
    src_vals, src_ids, prev_cover = src, groups if levels[0].source == 2 else n, -1
    for level in levels:
        if level.last:
            cand_vals, cand_ids = vals, ids
        else:
            cand_vals = torch.empty((T, level.programs * level.k_pad), dtype=torch.float32, device=src.device)
            cand_ids = torch.empty((T, level.programs * level.k_pad), dtype=torch.int32, device=src.device)
        arguments = (src_vals, src_ids, n, n if n_src is None else n_src, cand_vals, cand_ids, ids, vals,
                     n if bound is None else bound, tickets, src_vals.stride(0),
                     src_ids.stride(0) if src_ids.dim() == 2 else 0, cand_vals.stride(0), ids.stride(0), k, prev_cover,
                     level.cover)
        constants = dict(SOURCE=level.source, G=TOPK_GROUP, SEG=level.seg, K_PAD=level.k_pad, LAST=level.last,
                         BOUND=store_bound, THEN_SEG=level.then_seg, num_warps=level.warps)
        if level_kernel is not None and not level.sort and all(seg >= 32 * level.warps
                                                                for seg in (level.seg, level.then_seg) if seg):
            level_kernel[(T, level.programs)](*arguments, W=level.warps, launch_pdl=True, **constants)
        else:
            launchable(_segment_topk_kernel, src)[(T, level.programs)](*arguments, SORTED=level.sort, **constants)
        src_vals, src_ids, prev_cover = cand_vals, cand_ids, level.cover


def group_maxima_of(scores: torch.Tensor, n: torch.Tensor, k: int) -> GroupMaxima:
    """The :class:`GroupMaxima` of the top-``k`` of rows of ``scores [T, L]`` (their first
    ``n[t]``), in one launch, for scores that no scores kernel wrote."""
    T, L = scores.shape
    maxima = GroupMaxima.empty(T, L, scores.device)
    launchable(_group_max_kernel, scores)[(T, triton.cdiv(L, GROUP_MAX_BLOCK))](
        scores, n, maxima.best, maxima.counts, scores.stride(0), maxima.best.stride(0), T, k, G=TOPK_GROUP,
        BLOCK=GROUP_MAX_BLOCK)
    return maxima


def topk_of_rows(scores: torch.Tensor, n: torch.Tensor, ids: torch.Tensor, vals: torch.Tensor, k: int,
                 segment: Optional[int] = None, sort: bool = True, maxima: Optional[GroupMaxima] = None,
                 level_kernel=None, tickets: Optional[torch.Tensor] = None) -> None:
    """The exact top-``k`` of each row's first ``n[t]`` scores (``-inf`` = none) into ``ids`` /
    ``vals [T, k]``, by (score descending, id ascending), or in id order unless ``sort``
    (the same entries; no sort): each level of :func:`topk_levels`
    splits a row into segments (one program each) and keeps their best ``k``, which contain
    the row's; the level whose one program covers a row's entries sorts and writes its
    result, and later levels skip it. A long row (:func:`grouped`) first takes the best score
    of each group of ``TOPK_GROUP`` entries and the top-``k`` groups by it, whose entries
    hold the row's top-``k`` (a group beaten by ``k`` groups' best entries has none); the
    levels then select from those ``k * TOPK_GROUP`` entries. ``segment``: the entries a
    program selects from (:func:`topk_segment`); ``maxima``: a long row's group maxima where
    the scores kernel wrote them (else one launch takes them from ``scores``); ``level_kernel``:
    the ``gluon`` backend's kernel for the levels that do not sort (:func:`_launch`);
    ``tickets``: ``[T]`` int32 zeros (the scores kernel zeroes them; a launch that runs a
    row's last level counts its programs on them and leaves them zero), or ``None`` for a
    fill of its own."""
    T, L = scores.shape
    plan = topk_plan(T, L, k, num_sms(scores.device), segment, sort)
    if tickets is None:
        tickets = torch.zeros((T,), dtype=torch.int32, device=scores.device)
    if len(plan) == 1:
        _launch(plan[0], scores, n, ids, vals, k, tickets, level_kernel=level_kernel)
        return
    if maxima is None:
        maxima = group_maxima_of(scores, n, k)
    n_groups, n_cand = maxima.counts
    groups = torch.empty((T, k), dtype=torch.int32, device=scores.device)
    bound = torch.empty((T,), dtype=torch.int32, device=scores.device)
    _launch(plan[0], maxima.best, n_groups, groups, vals, k, tickets, bound=bound, store_bound=True,
            level_kernel=level_kernel)
    _launch(plan[1], scores, n_cand, ids, vals, k, tickets, groups=groups, n_src=n, bound=bound,
            level_kernel=level_kernel)


def global_blocks(args: IndexerArgs) -> int:
    """Candidate blocks of ``candidate_block`` global ids that the tables address, on all
    of the shard's ranks."""
    L = args.block_table.shape[1] * args.cache.shape[1]
    return triton.cdiv(L * args.shard[1], args.candidate_block)


def mark_candidates(args: IndexerArgs, lo: int, hi: int) -> torch.Tensor:
    """``[hi - lo, nb]`` int8 (:func:`global_blocks`): 1 where a block is among tokens
    ``lo:hi``'s ``args.candidates``, over each token's visible blocks (the rest unset)."""
    cand = args.candidates[lo:hi]
    L = args.block_table.shape[1] * args.cache.shape[1]
    allowed = torch.empty((hi - lo, global_blocks(args)), dtype=torch.int8, device=cand.device)
    launchable(_candidate_mask_kernel, cand)[(hi - lo,)](
        cand, args.token_to_req[lo:hi], args.n_entries[lo:hi], allowed, cand.stride(0), allowed.stride(0),
        cand.shape[1], args.block_table.shape[0], L * args.shard[1], args.candidate_block,
        C_PAD=triton.next_power_of_2(max(cand.shape[1], 1)), CHUNK=MASK_CHUNK,
        ITERS=triton.cdiv(allowed.shape[1], MASK_CHUNK) if INTERPRET else 0)
    return allowed


def visible_block_scores(args: IndexerArgs, scores: torch.Tensor, n: torch.Tensor, lo: int,
                         hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(blocks [hi - lo, nb] fp32, visible [hi - lo] int32)``: tokens ``lo:hi``'s candidate
    block scores (:func:`compile_ops.indexer.inputs.block_scores`) from their local
    ``scores`` and counts ``n``, written for each token's ``visible`` blocks only."""
    rank, world, interleave = args.shard
    L = args.block_table.shape[1] * args.cache.shape[1]
    nb, block = global_blocks(args), args.candidate_block
    blocks = torch.empty((hi - lo, nb), dtype=torch.float32, device=scores.device)
    visible = torch.empty((hi - lo,), dtype=torch.int32, device=scores.device)
    BB = BLOCK_MAX_BLOCKS
    steps = triton.cdiv(nb, BB)
    S = torch.sym_max(1, torch.sym_min(steps, BLOCK_MAX_PROGRAMS_PER_SM * num_sms(scores.device) // (hi - lo)))
    launchable(_block_max_kernel, scores)[(hi - lo, S)](
        scores, n, args.token_to_req[lo:hi], args.n_entries[lo:hi], blocks, visible, scores.stride(0),
        blocks.stride(0), args.block_table.shape[0], L * world, rank, world, interleave, block, S,
        BB=BB, BP=triton.next_power_of_2(block), ITERS=triton.cdiv(steps, S) if INTERPRET else 0)
    return blocks, visible


def key_blocks(cache: torch.Tensor, fp8: bool):
    """A TMA descriptor of an fp8 cache's key bytes, ``[num_pages, page_size, 128]`` e4m3 in
    boxes of ``BN`` entries (the scores kernel then copies each block in one bulk copy), or
    ``cache`` itself where a page is not whole blocks or its stride is not 16-byte aligned
    (the kernel then gathers the keys row by row). Pages of 32 entries (DeepSeek's 64-token
    blocks at ratio 2) are gathered: a 32-entry block per bulk copy measured slower than the
    gather (docs/performance-indexer-history.md). A traced launch (``lowering.inductor`` inlining
    the op into an AOTInductor package) gathers too: a descriptor holds the address, which
    a trace does not know."""
    pages, page_size = cache.shape[:2]
    if not fp8 or page_size % BN or (page_size * cache.shape[2]) % 16 or isinstance(cache, FunctionalTensor) \
            or cache.data_ptr() % 16:
        return cache
    return TensorDescriptor(cache.view(torch.float8_e4m3fn), [pages, page_size, 128],
                            [page_size * cache.shape[2], 128, 1], [1, BN, 128])


def launch_scores(args: IndexerArgs, lo: int, hi: int, scores: torch.Tensor, n: torch.Tensor, tickets: torch.Tensor,
                  allowed: torch.Tensor, maxima: Optional[GroupMaxima]) -> None:
    """``_scores_kernel`` over tokens ``lo:hi``: their scores into ``scores [hi - lo, L]`` fp32
    and local counts into ``n [hi - lo]`` int32, zeros into their top-k's ``tickets [hi - lo]``
    int32 (:func:`topk_of_rows`; ``allowed``: the chunk's candidate mask,
    :func:`mark_candidates`, or any tensor when the call has no candidates), and the top-k's
    group maxima of them into ``maxima`` unless ``None``."""
    q, w, cache, table = args.q, args.weights, args.cache, args.block_table
    R, page_size = table.shape[0], cache.shape[1]
    L = table.shape[1] * page_size
    rank, world, interleave = args.shard
    keys = key_blocks(cache, args.fmt.fp8)
    programs_per_sm, stages = SCORE_LAUNCH[keys is not cache]
    blocks = triton.cdiv(L, BN)
    HI = max(16, triton.next_power_of_2(q.shape[1]))
    TB = scores_tokens(hi - lo, R, max(1, FP4_QUERY_ROWS // HI) if args.fmt.fp4 else SCORES_TOKENS)
    S = torch.sym_max(1, torch.sym_min(blocks, programs_per_sm * num_sms(q.device) // triton.cdiv(hi - lo, TB)))
    gmax, g_counts = (scores, n) if maxima is None else maxima  # (unread without the maxima)
    launchable(_scores_kernel, q)[(triton.cdiv(hi - lo, TB), S)](
        q[lo:hi], w[lo:hi], args.token_to_req[lo:hi], args.n_entries[lo:hi], cache, keys, table, allowed, scores, n,
        tickets, gmax, g_counts, q.stride(0), q.stride(1), w.stride(0), cache.stride(0), table.stride(0),
        scores.stride(0), allowed.stride(0), gmax.stride(0), hi - lo, R, L, cache.shape[0] * page_size, page_size,
        q.shape[1], S, rank, world, interleave, args.candidate_block, allowed.shape[-1], args.k,
        HI=HI, TB=TB, FP8=args.fmt.fp8, RESTRICT=args.candidates is not None,
        BN=BN, ITERS=triton.cdiv(blocks, S) if INTERPRET else 0, UPCAST=INTERPRET, TMA=keys is not cache,
        FP4=args.fmt.fp4, GROUPS=maxima is not None, G=TOPK_GROUP, num_stages=stages, num_warps=4 * TB,
    )


def scores_tokens(T, R: int, most: int = SCORES_TOKENS) -> int:
    """Tokens one program of the ``tl`` scores kernel takes (a block of consecutive tokens;
    the keys of each request run among them are read once for all its tokens): 1 where the
    step may be all decode (``T <= R``: one token per request row), else the largest power
    of two up to ``most`` and ``T // R`` (the least mean run). A traced ``T``: 1."""
    if not isinstance(T, int) or T <= R:
        return 1
    tb = 1
    while 2 * tb <= min(most, T // R):
        tb *= 2
    return tb


def _per_chunk(args: IndexerArgs, widths: tuple[int, ...], select, launch,
               ids_of_rows: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Scores of token chunks (each under ``SCORES_BYTES``) by ``launch`` (:func:`launch_scores`'s
    arguments), then ``select(scores, n, tickets, lo, hi, outs, maxima)`` (``n``: the chunk's
    local counts; ``tickets``: its top-k's, zeroed by the scores kernel; ``maxima``: the group
    maxima the scores kernel wrote where ``ids_of_rows`` (the
    call selects entries of its rows) and the rows are long, :func:`grouped`, else ``None``)
    fills rows ``lo:hi`` of each ``(ids [T, width] int32, vals [T, width] fp32)`` output
    pair, one per ``widths``; only shapes steer the launches."""
    args = args._replace(q=args.q.contiguous(), weights=args.weights.contiguous())
    T = args.q.shape[0]
    L = args.block_table.shape[1] * args.cache.shape[1]
    device = args.q.device
    outs = [(torch.empty((T, width), dtype=torch.int32, device=device),
             torch.empty((T, width), dtype=torch.float32, device=device)) for width in widths]
    if one_chunk(T, L):  # (a traced T: the lowering inlines only such calls)
        chunks = [(0, T)]
    else:
        chunk = max(1, SCORES_BYTES // (4 * L))
        chunks = [(lo, min(T, lo + chunk)) for lo in range(0, T, chunk)]
    for lo, hi in chunks:
        scores = torch.empty((hi - lo, L), dtype=torch.float32, device=device)
        n, tickets = torch.empty((2, hi - lo), dtype=torch.int32, device=device)
        maxima = GroupMaxima.empty(hi - lo, L, device) if ids_of_rows and grouped(L, args.k) else None
        launch(args, lo, hi, scores, n, tickets, n if args.candidates is None else mark_candidates(args, lo, hi),
               maxima)
        select(scores, n, tickets, lo, hi, [(ids[lo:hi], vals[lo:hi]) for ids, vals in outs], maxima)
    return outs


def _select_ids(args: IndexerArgs, scores, n, tickets, out, maxima: Optional[GroupMaxima], level_kernel=None) -> None:
    topk_of_rows(scores, n, *out, args.k, sort=args.order == "score", maxima=maxima, level_kernel=level_kernel,
                 tickets=tickets)


def _select_blocks(args: IndexerArgs, scores, n, tickets, lo, hi, out, width: int, level_kernel=None) -> None:
    blocks, visible = visible_block_scores(args, scores, n, lo, hi)
    topk_of_rows(blocks, visible, *out, width, sort=args.order == "score", level_kernel=level_kernel,
                 tickets=tickets)


def indexer_topk_triton(args: IndexerArgs, launch=launch_scores, level_kernel=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [T, k] int32, scores [T, k] fp32)`` of a validated call (see
    :class:`compile_ops.indexer.inputs.IndexerArgs`), its scores by ``launch``, its top-k's
    unsorted levels by ``level_kernel`` (:func:`topk_of_rows`)."""
    return _per_chunk(args, (args.k,), lambda scores, n, tickets, lo, hi, outs, maxima: _select_ids(
        args, scores, n, tickets, outs[0], maxima, level_kernel), launch, ids_of_rows=True)[0]


def indexer_candidates_triton(args: IndexerArgs, launch=launch_scores,
                              level_kernel=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(blocks [T, k] int32, block scores [T, k] fp32)`` of a validated call."""
    return _per_chunk(args, (args.k,), lambda scores, n, tickets, lo, hi, outs, maxima: _select_blocks(
        args, scores, n, tickets, lo, hi, outs[0], args.k, level_kernel), launch, ids_of_rows=False)[0]


def indexer_topk_and_candidates_triton(args: IndexerArgs, launch=launch_scores, level_kernel=None):
    """``((ids, scores) [T, k], (blocks, block scores) [T, n_blocks])`` of a validated call,
    the two top-k over one scores buffer."""

    def select(scores, n, tickets, lo, hi, outs, maxima):
        _select_ids(args, scores, n, tickets, outs[0], maxima, level_kernel)
        _select_blocks(args, scores, n, tickets, lo, hi, outs[1], args.n_blocks, level_kernel)

    ids, blocks = _per_chunk(args, (args.k, args.n_blocks), select, launch, ids_of_rows=True)
    return ids, blocks


# the names of this module's kernels, as a profile shows them
KERNEL_NAMES = tuple(k.fn.__name__ for k in (_scores_kernel, _segment_topk_kernel, _group_max_kernel,
                                             _candidate_mask_kernel, _block_max_kernel))
