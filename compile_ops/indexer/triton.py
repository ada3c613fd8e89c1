"""Triton indexer: scores on the tensor cores, then an exact radix-select top-k per token.

Two kernels, both length-bounded (a token's programs stop at its ``n`` entries; nothing
reads or scores past it, whatever the cache's capacity):

* ``_scores_kernel``, grid ``(T, S)``: program ``(t, s)`` takes blocks ``s, s + S, ...`` of
  ``BN`` entries of token ``t``, gathers their keys through the block table (e4m3 bytes and
  the fp32 scale of an ``fp8`` cache, or bf16), ``tl.dot``\\ s them with the token's
  ``[Hi, 128]`` queries (e4m3 x e4m3 or bf16 x bf16, fp32 accumulation) and stores
  ``scale * sum_h w[h] * relu(dot)`` (``-inf`` at holes) into a scores buffer.
* the top-k (:func:`topk_of_rows`): the scores become order-preserving 32-bit keys; each
  row is split into ``S`` segments, one program each. ``32 / TOPK_DIGIT`` radix passes
  (``_hist_kernel``: ``tl.histogram`` of the next digit among the keys that share the prefix
  so far, added up across segments; ``_select_kernel``: that digit, one program per row)
  find the ``k``-th largest key exactly and how many entries equal to it to keep;
  ``_count_kernel`` and ``_gather_kernel`` keep, in id order, every entry above it and the
  lowest-id ones equal to it (so equal scores go to the lower id), after the counts of the
  earlier segments; ``_sort_kernel`` orders the ``k`` kept ones by (score descending, id
  ascending) with ``tl.sort``.

Tokens go in chunks whose scores buffer stays under ``SCORES_BYTES``. Runs on CUDA tensors,
or on CPU tensors under ``TRITON_INTERPRET=1`` (loops then run to a compile-time bound).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.fx.experimental.symbolic_shapes import statically_known_true

from compile_ops._launch import INTERPRET, launchable
from compile_ops.indexer.inputs import IndexerArgs, block_scores, restrict_to_candidates
from compile_ops.mla.plan import num_sms

BN = 64  # entries per scores block
TOPK_BLOCK = 4096  # scores per step of the top-k passes
TOPK_DIGIT = 8  # bits per radix pass (32 / TOPK_DIGIT passes)
SCORES_BYTES = 256 << 20  # the scores buffer of one token chunk (a long prefill's bound)
SCORE_PROGRAMS_PER_SM = 16  # the scores kernel's grid: enough loads in flight to stream keys
TOPK_PROGRAMS_PER_SM = 4
MAX_SEGMENTS = 64  # segments a row's top-k passes split it into


@triton.jit
def _scores_kernel(
    q, w, cache, table, rows, n, scores,
    s_qt, s_qh, s_wt, s_page, s_bt, s_st, num_slots, page_size, Hi, S,
    HI: tl.constexpr, FP8: tl.constexpr, BN: tl.constexpr, ITERS: tl.constexpr, UPCAST: tl.constexpr,
):
    i_t, i_s = tl.program_id(0), tl.program_id(1)
    n_t = tl.load(n + i_t)
    row = tl.load(rows + i_t)
    nb = tl.cdiv(n_t, BN)
    o_h = tl.arange(0, HI)
    o_d = tl.arange(0, 128)
    m_h = o_h < Hi
    b_q = tl.load(q + i_t * s_qt + o_h[:, None] * s_qh + o_d[None, :], mask=m_h[:, None], other=0.0)
    b_w = tl.load(w + i_t * s_wt + o_h, mask=m_h, other=0.0)
    o_n = tl.arange(0, BN)
    for i in range(0, ITERS if ITERS > 0 else tl.cdiv(tl.maximum(nb - i_s, 0), S)):
        c = (i_s + i * S) * BN + o_n
        m_c = c < n_t
        page = tl.load(table + row * s_bt + c // page_size, mask=m_c, other=-1).to(tl.int64)
        off = c % page_size
        m_c = m_c & (page >= 0) & (page * page_size + off < num_slots)
        page = tl.where(m_c, page, 0)
        base = cache + page * s_page
        if FP8:
            b_k = tl.load(base[:, None] + off[:, None] * 128 + o_d[None, :], mask=m_c[:, None], other=0)
            b_k = b_k.to(tl.float8e4nv, bitcast=True)
            p_scale = (base + page_size * 128 + off * 4).to(tl.pointer_type(tl.float32))
            b_scale = tl.load(p_scale, mask=m_c, other=0.0)
        else:
            b_k = tl.load(base[:, None] + off[:, None] * 128 + o_d[None, :], mask=m_c[:, None], other=0.0)
            b_scale = tl.full([BN], 1.0, tl.float32)
        if UPCAST:  # the interpreter's bf16 products are not bf16's: take them in fp32
            b_dot = tl.dot(b_k.to(tl.float32), tl.trans(b_q.to(tl.float32)))
        else:
            b_dot = tl.dot(b_k, tl.trans(b_q))  # [BN, HI] fp32
        b_s = tl.sum(tl.maximum(b_dot, 0.0) * b_w[None, :], 1) * b_scale
        tl.store(scores + i_t.to(tl.int64) * s_st + c, tl.where(m_c, b_s, float("-inf")), mask=c < n_t)


@triton.jit
def _sortable(x):
    """fp32 -> int32 keys in the same order (negative floats' magnitude bits flipped; ``-0.0``
    made ``0.0`` first, so that equal scores have one key)."""
    bits = (x + 0.0).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 2147483647, bits)


@triton.jit
def _segment(scores, n, s_st, SEG, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """This program's row, its segment ``[lo, hi)`` of the row's entries, and its step count."""
    i_t, i_s = tl.program_id(0), tl.program_id(1)
    n_t = tl.load(n + i_t)
    lo = i_s * SEG
    hi = tl.minimum(n_t, lo + SEG)
    steps = ITERS if ITERS > 0 else tl.cdiv(tl.maximum(hi - lo, 0), BLOCK)
    return i_t, i_s, scores + i_t.to(tl.int64) * s_st, lo, hi, steps


@triton.jit
def _hist_kernel(
    scores, n, state, hist, s_st, SEG,
    PASS: tl.constexpr, DIGIT: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr,
):
    """Pass ``PASS``: the histogram of the next ``DIGIT`` bits of the keys of this segment
    that share the prefix found so far, added into ``hist[t]``."""
    i_t, i_s, row, lo, hi, steps = _segment(scores, n, s_st, SEG, BLOCK, ITERS)
    BINS: tl.constexpr = 1 << DIGIT
    shift = 32 - DIGIT * (PASS + 1)
    high_bits = (1 << (DIGIT * PASS)) - 1
    prefix = tl.load(state + i_t * 2)
    o_b = tl.arange(0, BLOCK)
    h = tl.zeros([BINS], tl.int32)
    for i in range(0, steps):
        c = lo + i * BLOCK + o_b
        x = tl.load(row + c, mask=c < hi, other=float("-inf"))
        key = _sortable(x) ^ -2147483648  # unsigned order as bits; the masks undo sign extension
        m = (c < hi) & (x > float("-inf"))
        if PASS > 0:
            m = m & (((key >> (shift + DIGIT)) & high_bits) == prefix)
        h += tl.histogram((key >> shift) & (BINS - 1), BINS, mask=m)
    tl.atomic_add(hist + i_t * BINS + tl.arange(0, BINS), h, sem="relaxed")


@triton.jit
def _select_kernel(hist, state, K, PASS: tl.constexpr, LAST: tl.constexpr, DIGIT: tl.constexpr):
    """The digit of the ``k``-th largest key after pass ``PASS``: ``state[t] = (prefix, need)``,
    ``need`` the entries still to take at or below the prefix; ``hist[t]`` zeroed again."""
    i_t = tl.program_id(0)
    BINS: tl.constexpr = 1 << DIGIT
    o_d = tl.arange(0, BINS)
    h = tl.load(hist + i_t * BINS + o_d)
    if PASS == 0:
        prefix = tl.zeros([], tl.int32)
        need = tl.minimum(K, tl.sum(h))  # valid entries: at most that many ids
    else:
        prefix = tl.load(state + i_t * 2)
        need = tl.load(state + i_t * 2 + 1)
    at_or_above = tl.cumsum(h, 0, reverse=True)
    digit = tl.max(tl.where(at_or_above >= need, o_d, 0))
    need -= tl.sum(tl.where(o_d == digit, at_or_above - h, 0))
    prefix = (prefix << DIGIT) | digit
    if LAST:  # the k-th largest key itself, in _sortable's signed order
        prefix = prefix ^ -2147483648
    tl.store(state + i_t * 2, prefix)
    tl.store(state + i_t * 2 + 1, need)
    tl.store(hist + i_t * BINS + o_d, tl.zeros([BINS], tl.int32))


@triton.jit
def _count_kernel(scores, n, state, counts, s_st, SEG, S, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """Entries of this segment above the threshold key, and equal to it: ``counts[t, s]``."""
    i_t, i_s, row, lo, hi, steps = _segment(scores, n, s_st, SEG, BLOCK, ITERS)
    thr = tl.load(state + i_t * 2)
    o_b = tl.arange(0, BLOCK)
    gt = tl.zeros([], tl.int32)
    eq = tl.zeros([], tl.int32)
    for i in range(0, steps):
        c = lo + i * BLOCK + o_b
        x = tl.load(row + c, mask=c < hi, other=float("-inf"))
        key = _sortable(x)
        ok = (c < hi) & (x > float("-inf"))
        gt += tl.sum((ok & (key > thr)).to(tl.int32))
        eq += tl.sum((ok & (key == thr)).to(tl.int32))
    tl.store(counts + (i_t * S + i_s) * 2, gt)
    tl.store(counts + (i_t * S + i_s) * 2 + 1, eq)


@triton.jit
def _gather_kernel(
    scores, n, state, counts, ids, vals, s_st, s_it, SEG, S,
    S_PAD: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr,
):
    """This segment's kept entries (above the threshold, and the lowest-id ``need`` equal to
    it over the whole row) into ``ids`` / ``vals`` after the earlier segments' ones."""
    i_t, i_s, row, lo, hi, steps = _segment(scores, n, s_st, SEG, BLOCK, ITERS)
    thr = tl.load(state + i_t * 2)
    need = tl.load(state + i_t * 2 + 1)
    o_s = tl.arange(0, S_PAD)
    before = o_s < i_s
    ties = tl.sum(tl.load(counts + (i_t * S + o_s) * 2 + 1, mask=before, other=0))
    taken = tl.sum(tl.load(counts + (i_t * S + o_s) * 2, mask=before, other=0)) + tl.minimum(ties, need)
    o_b = tl.arange(0, BLOCK)
    for i in range(0, steps):
        c = lo + i * BLOCK + o_b
        x = tl.load(row + c, mask=c < hi, other=float("-inf"))
        key = _sortable(x)
        ok = (c < hi) & (x > float("-inf"))
        eq = ok & (key == thr)
        eq_i = eq.to(tl.int32)
        keep = (ok & (key > thr)) | (eq & (ties + tl.cumsum(eq_i, 0) - eq_i < need))
        keep_i = keep.to(tl.int32)
        at = taken + tl.cumsum(keep_i, 0) - keep_i
        tl.store(ids + i_t * s_it + at, c, mask=keep)
        tl.store(vals + i_t * s_it + at, x, mask=keep)
        taken += tl.sum(keep_i)
        ties += tl.sum(eq_i)


@triton.jit
def _sort_kernel(state, counts, ids, vals, s_it, K, S, S_PAD: tl.constexpr, K_PAD: tl.constexpr):
    """The row's kept entries by (score descending, id ascending); ``-1`` / ``-inf`` after."""
    i_t = tl.program_id(0)
    need = tl.load(state + i_t * 2 + 1)
    o_s = tl.arange(0, S_PAD)
    m_s = o_s < S
    taken = (tl.sum(tl.load(counts + (i_t * S + o_s) * 2, mask=m_s, other=0))
             + tl.minimum(tl.sum(tl.load(counts + (i_t * S + o_s) * 2 + 1, mask=m_s, other=0)), need))
    o_k = tl.arange(0, K_PAD)
    m_k = o_k < taken
    b_id = tl.load(ids + i_t * s_it + o_k, mask=m_k, other=0)
    b_x = tl.load(vals + i_t * s_it + o_k, mask=m_k, other=0.0)
    # (key, id) in one int64: descending order is score descending, then id ascending
    packed = tl.where(m_k, (_sortable(b_x).to(tl.int64) << 32) | (4294967295 - b_id.to(tl.int64)), -9223372036854775808)
    packed = tl.sort(packed, 0, descending=True)
    b_id = (4294967295 - (packed & 4294967295)).to(tl.int32)
    high = (packed >> 32).to(tl.int32)
    bits = tl.where(high < 0, high ^ 2147483647, high).to(tl.float32, bitcast=True)
    tl.debug_barrier()  # every lane has read the unsorted row before any overwrites it
    m_out = o_k < K
    tl.store(ids + i_t * s_it + o_k, tl.where(m_k, b_id, -1), mask=m_out)
    tl.store(vals + i_t * s_it + o_k, tl.where(m_k, bits, float("-inf")), mask=m_out)


def one_chunk(T, L: int) -> bool:
    """Whether the scores of ``T`` tokens over ``L`` entries fit one scratch chunk, known
    without a guard (a traced ``T`` is bounded by its range, e.g. an export's ``Dim``)."""
    return statically_known_true(T * 4 * L <= SCORES_BYTES)


def topk_of_rows(scores: torch.Tensor, n: torch.Tensor, ids: torch.Tensor, vals: torch.Tensor, k: int,
                 block: int = TOPK_BLOCK) -> None:
    """The exact top-``k`` of each row's first ``n[t]`` scores (``-inf`` = none) into ``ids`` /
    ``vals [T, k]``: radix passes over ``S`` segments of every row at once (segments of a
    multiple of ``block`` scores), then one sort. A traced (symbolic) ``T`` takes one token's
    segment count, since ``S`` sets compile-time sizes; any ``S`` gives the same ids."""
    T, L = scores.shape
    per_token = TOPK_PROGRAMS_PER_SM * num_sms(scores.device) // (T if isinstance(T, int) else 1)
    S = max(1, min(MAX_SEGMENTS, per_token, triton.cdiv(L, block)))
    seg = triton.cdiv(triton.cdiv(L, S), block) * block
    S = triton.cdiv(L, seg)
    bins = 1 << TOPK_DIGIT
    hist = torch.zeros((T, bins), dtype=torch.int32, device=scores.device)
    state = torch.zeros((T, 2), dtype=torch.int32, device=scores.device)
    counts = torch.empty((T, S, 2), dtype=torch.int32, device=scores.device)
    iters = triton.cdiv(seg, block) if INTERPRET else 0
    passes = 32 // TOPK_DIGIT
    for p in range(passes):
        launchable(_hist_kernel, scores)[(T, S)](scores, n, state, hist, scores.stride(0), seg,
                                                 PASS=p, DIGIT=TOPK_DIGIT, BLOCK=block, ITERS=iters)
        launchable(_select_kernel, scores)[(T,)](hist, state, k, PASS=p, LAST=p == passes - 1, DIGIT=TOPK_DIGIT)
    launchable(_count_kernel, scores)[(T, S)](scores, n, state, counts, scores.stride(0), seg, S,
                                              BLOCK=block, ITERS=iters)
    s_pad = triton.next_power_of_2(S)
    launchable(_gather_kernel, scores)[(T, S)](scores, n, state, counts, ids, vals, scores.stride(0), ids.stride(0),
                                               seg, S, S_PAD=s_pad, BLOCK=block, ITERS=iters)
    launchable(_sort_kernel, scores)[(T,)](state, counts, ids, vals, ids.stride(0), k, S,
                                           S_PAD=s_pad, K_PAD=triton.next_power_of_2(k), num_warps=16)


def _per_chunk(args: IndexerArgs, select) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores of token chunks (each under ``SCORES_BYTES``) by ``_scores_kernel``, then
    ``select(scores, lo, hi, ids, vals)`` fills rows ``lo:hi`` of ``(ids, vals [T, k])``;
    only shapes steer the launches."""
    q, w, cache, table, rows, n = args.q, args.weights, args.cache, args.block_table, args.rows, args.n
    T, Hi = q.shape[:2]
    page_size = cache.shape[1]
    L = table.shape[1] * page_size
    ids = torch.empty((T, args.k), dtype=torch.int32, device=q.device)
    vals = torch.empty((T, args.k), dtype=torch.float32, device=q.device)
    HI = max(16, triton.next_power_of_2(Hi))
    sms = num_sms(q.device)
    blocks = triton.cdiv(L, BN)
    if one_chunk(T, L):  # (a traced T: the lowering inlines only such calls)
        chunks = [(0, T)]
    else:
        chunk = max(1, SCORES_BYTES // (4 * L))
        chunks = [(lo, min(T, lo + chunk)) for lo in range(0, T, chunk)]
    for lo, hi in chunks:
        scores = torch.empty((hi - lo, L), dtype=torch.float32, device=q.device)
        S = torch.sym_max(1, torch.sym_min(blocks, SCORE_PROGRAMS_PER_SM * sms // (hi - lo)))
        launchable(_scores_kernel, q)[(hi - lo, S)](
            q[lo:hi], w[lo:hi], cache, table, rows[lo:hi], n[lo:hi], scores,
            q.stride(0), q.stride(1), w.stride(0), cache.stride(0), table.stride(0), scores.stride(0),
            cache.shape[0] * page_size, page_size, Hi, S,
            HI=HI, FP8=args.fmt.fp8, BN=BN, ITERS=triton.cdiv(blocks, S) if INTERPRET else 0, UPCAST=INTERPRET,
            # deeper key prefetch once many tokens share the SMs
            num_stages=4 if statically_known_true(hi - lo >= 32) else 2,
        )
        select(scores, lo, hi, ids[lo:hi], vals[lo:hi])
    return ids, vals


def indexer_topk_triton(args: IndexerArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [T, k] int32, scores [T, k] fp32)`` of a validated call (see
    :class:`compile_ops.indexer.inputs.IndexerArgs`)."""

    def select(scores, lo, hi, ids, vals):
        topk_of_rows(restrict_to_candidates(scores, args, lo, hi), args.n[lo:hi], ids, vals, args.k)

    return _per_chunk(args, select)


def indexer_candidates_triton(args: IndexerArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """``(blocks [T, k] int32, block scores [T, k] fp32)`` of a validated call."""

    def select(scores, lo, hi, ids, vals):
        blocks = block_scores(scores, args, lo, hi)
        every = torch.full((hi - lo,), blocks.shape[1], dtype=torch.int32, device=blocks.device)
        topk_of_rows(blocks, every, ids, vals, args.k)

    return _per_chunk(args, select)
