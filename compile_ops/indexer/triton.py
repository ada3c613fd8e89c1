"""Triton indexer: scores on the tensor cores, then an exact radix-select top-k per token.

The op's tensors go to the kernels as given (the request-row checks, DCP shard counts,
candidate restriction and the query's quantization happen inside), so a call is a few
launches: the scores kernel, a memset and two top-k kernels for a short row (a few more
for a long one). Every kernel is length-bounded: a token's programs stop at its ``n``
entries; nothing reads or scores past it, whatever the cache's capacity.

* ``_scores_kernel``, grid ``(T, S)``: program ``(t, s)`` quantizes the token's ``[Hi,
  128]`` queries (``fp8``: e4m3 with one power-of-two scale per head, folded into the
  weights), takes blocks ``s, s + S, ...`` of ``BN`` entries, gathers their keys through
  the block table (e4m3 bytes and the fp32 scale of an ``fp8`` cache, or bf16), ``tl.dot``\
  s them with the queries (fp32 accumulation) and stores ``scale * sum_h w[h] * relu(dot)``
  (``-inf`` at holes and outside the candidate blocks) into a scores buffer.
* the top-k (:func:`topk_of_rows`): the scores become order-preserving 32-bit keys, and
  ``32 / TOPK_DIGIT`` radix passes (``tl.histogram`` of the next digit among the keys that
  share the prefix so far) find the ``k``-th largest key exactly and how many entries equal
  to it to keep; then every entry above it and the lowest-id ones equal to it (so equal
  scores go to the lower id) are kept in id order and sorted by (score descending, id
  ascending) with ``tl.sort``. A short row is one program (``_row_topk_kernel``); a long
  one is split into segments, one program each, whose passes add into shared histograms
  (``_hist_kernel``; each pass's program reads the earlier passes' digits from them),
  count their kept entries (``_count_kernel``), store them after the earlier segments'
  (``_gather_kernel``) and sort (``_sort_kernel``).

Tokens go in chunks whose scores buffer stays under ``SCORES_BYTES``. Runs on CUDA tensors,
or on CPU tensors under ``TRITON_INTERPRET=1`` (loops then run to a compile-time bound).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch.fx.experimental.symbolic_shapes import statically_known_true

from compile_ops._launch import INTERPRET, launchable
from compile_ops._triton_quant import power_of_two, to_e4m3, ue8m0_exponent
from compile_ops.indexer.inputs import IndexerArgs, block_scores, candidate_mask
from compile_ops.mla.plan import num_sms

BN = 64  # entries per scores block
TOPK_BLOCK = 2048  # scores per step of the top-k passes
TOPK_DIGIT = 8  # bits per radix pass (32 / TOPK_DIGIT passes)
SCORES_BYTES = 256 << 20  # the scores buffer of one token chunk (a long prefill's bound)
SCORE_PROGRAMS_PER_SM = 16  # the scores kernel's grid: enough loads in flight to stream keys
TOPK_PROGRAMS_PER_SM = 4
MAX_SEGMENTS = 64  # segments a row's top-k passes split it into
# rows of up to this many top-k blocks take one program each; a longer row is split into
# segments over many programs: one program's serial steps cost more than the passes' launches
ROW_TOPK_BLOCKS = 1


@triton.jit
def _local_count(t2r, n_entries, i_t, R, L, rank, world, interleave):
    """Token ``i_t``'s request row (0 when it picks nothing) and how many entries it scores on
    this shard (``local_counts``)."""
    row = tl.load(t2r + i_t)
    n_g = tl.maximum(tl.load(n_entries + i_t), 0)
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
def _digit_hist(x, ok, prefix, PASS: tl.constexpr, DIGIT: tl.constexpr):
    """The histogram of pass ``PASS``'s digit of the keys of ``x`` (where ``ok``, not ``-inf``)
    whose higher digits are ``prefix``."""
    BINS: tl.constexpr = 1 << DIGIT
    shift: tl.constexpr = 32 - DIGIT * (PASS + 1)
    key = _sortable(x) ^ -2147483648  # unsigned order as bits; the masks undo sign extension
    m = ok & (x > float("-inf"))
    if PASS > 0:
        m = m & (((key >> (shift + DIGIT)) & ((1 << (DIGIT * PASS)) - 1)) == prefix)
    return tl.histogram((key >> shift) & (BINS - 1), BINS, mask=m)


@triton.jit
def _scores_kernel(
    q, w, t2r, n_entries, cache, table, allowed, scores, n_out,
    s_qt, s_qh, s_wt, s_page, s_bt, s_st, s_at, T, R, L, num_slots, page_size, Hi, S,
    rank, world, interleave, block, nb,
    HI: tl.constexpr, FP8: tl.constexpr, RESTRICT: tl.constexpr, BN: tl.constexpr, ITERS: tl.constexpr,
    UPCAST: tl.constexpr,
):
    i_t, i_s = tl.program_id(0), tl.program_id(1)
    row, n_t = _local_count(t2r, n_entries, i_t, R, L, rank, world, interleave)
    if i_s == 0:
        tl.store(n_out + i_t, n_t)
    nb_t = tl.cdiv(n_t, BN)
    o_h = tl.arange(0, HI)
    o_d = tl.arange(0, 128)
    m_h = o_h < Hi
    b_q = tl.load(q + i_t * s_qt + o_h[:, None] * s_qh + o_d[None, :], mask=m_h[:, None], other=0.0)
    b_w = tl.load(w + i_t * s_wt + o_h, mask=m_h, other=0.0)
    if FP8:  # q gets the keys' quantizer (quantize_e4m3); its power-of-two scale joins the weights
        b_qf = b_q.to(tl.float32)
        exponent = ue8m0_exponent(tl.max(tl.abs(b_qf), 1))
        b_q = to_e4m3(b_qf * power_of_two(254 - exponent)[:, None])
        b_w = b_w * power_of_two(exponent)
    o_n = tl.arange(0, BN)
    for i in range(0, ITERS if ITERS > 0 else tl.cdiv(tl.maximum(nb_t - i_s, 0), S)):
        c = (i_s + i * S) * BN + o_n
        m_c = c < n_t
        page = tl.load(table + row * s_bt + c // page_size, mask=m_c, other=-1).to(tl.int64)
        off = c % page_size
        m_c = m_c & (page >= 0) & (page * page_size + off < num_slots)
        if RESTRICT:  # entries outside the token's candidate blocks (global ids) score -inf
            blk = (((c // interleave) * world + rank) * interleave + c % interleave) // block
            m_c = m_c & (tl.load(allowed + i_t * s_at + blk, mask=m_c & (blk < nb), other=0) != 0)
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
        b_s = tl.where(m_c, tl.sum(tl.maximum(b_dot, 0.0) * b_w[None, :], 1) * b_scale, float("-inf"))
        tl.store(scores + i_t.to(tl.int64) * s_st + c, b_s, mask=c < n_t)


@triton.jit
def _select(h, prefix, need, FIRST: tl.constexpr, DIGIT: tl.constexpr):
    """One radix pass's digit of the ``k``-th largest key, from the pass's histogram ``h``:
    ``(prefix, need)`` extended by it, ``need`` the entries still to take at or below it
    (the first pass: ``need`` is ``k``, at most the valid entries)."""
    o_d = tl.arange(0, 1 << DIGIT)
    if FIRST:
        need = tl.minimum(need, tl.sum(h))
    at_or_above = tl.cumsum(h, 0, reverse=True)
    digit = tl.max(tl.where(at_or_above >= need, o_d, 0))
    need -= tl.sum(tl.where(o_d == digit, at_or_above - h, 0))
    return (prefix << DIGIT) | digit, need


@triton.jit
def _threshold(hist, i_t, T, K, PASSES: tl.constexpr, DIGIT: tl.constexpr):
    """``(prefix, need)`` after the first ``PASSES`` passes, from their histograms ``hist
    [passes, T, bins]``; after all of them the prefix is the ``k``-th largest key itself, in
    ``_sortable``'s signed order."""
    BINS: tl.constexpr = 1 << DIGIT
    o_d = tl.arange(0, BINS)
    prefix, need = _select(tl.load(hist + i_t * BINS + o_d), tl.zeros([], tl.int32), K, True, DIGIT)
    for p in tl.static_range(1, PASSES):
        prefix, need = _select(tl.load(hist + (p * T + i_t) * BINS + o_d), prefix, need, False, DIGIT)
    if PASSES * DIGIT == 32:
        prefix = prefix ^ -2147483648
    return prefix, need


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
def _hist_of(row, lo, hi, steps, prefix, PASS: tl.constexpr, DIGIT: tl.constexpr, BLOCK: tl.constexpr):
    """Pass ``PASS``'s histogram over entries ``[lo, hi)`` of a scores row."""
    o_b = tl.arange(0, BLOCK)
    h = tl.zeros([1 << DIGIT], tl.int32)
    for i in range(0, steps):
        c = lo + i * BLOCK + o_b
        h += _digit_hist(tl.load(row + c, mask=c < hi, other=float("-inf")), c < hi, prefix, PASS, DIGIT)
    return h


@triton.jit
def _keep_of(row, lo, hi, steps, thr, need, ties, taken, ids, vals, BLOCK: tl.constexpr):
    """Entries ``[lo, hi)`` above the threshold key, and the ones equal to it while fewer
    than ``need`` of the row's were kept (``ties`` seen before ``lo``), stored in id order
    at ``ids`` / ``vals`` from ``taken`` on; returns the new ``taken``."""
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
        tl.store(ids + at, c, mask=keep)
        tl.store(vals + at, x, mask=keep)
        taken += tl.sum(keep_i)
        ties += tl.sum(eq_i)
    return taken


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
def _row_topk_kernel(
    scores, n, hist, ids, vals, s_st, s_it, K,
    PASSES: tl.constexpr, DIGIT: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr, K_PAD: tl.constexpr,
):
    """A whole row's top-k in one program: the radix passes after the first (whose histogram
    ``_hist_kernel`` added into ``hist[0, t]``), the kept entries, their sort."""
    i_t = tl.program_id(0)
    row = scores + i_t.to(tl.int64) * s_st
    hi = tl.load(n + i_t)
    steps = ITERS if ITERS > 0 else tl.cdiv(hi, BLOCK)
    BINS: tl.constexpr = 1 << DIGIT
    prefix, need = _select(tl.load(hist + i_t * BINS + tl.arange(0, BINS)), tl.zeros([], tl.int32), K, True, DIGIT)
    for p in tl.static_range(1, PASSES):
        prefix, need = _select(_hist_of(row, 0, hi, steps, prefix, p, DIGIT, BLOCK), prefix, need, False, DIGIT)
    at_ids, at_vals = ids + i_t * s_it, vals + i_t * s_it
    zero = tl.zeros([], tl.int32)
    taken = _keep_of(row, zero, hi, steps, prefix ^ -2147483648, need, zero, zero, at_ids, at_vals, BLOCK)
    tl.debug_barrier()  # the kept entries are stored before the sort reads them
    _sort_row(at_ids, at_vals, taken, K, K_PAD)


@triton.jit
def _hist_kernel(
    scores, n, hist, s_st, SEG, T, K,
    PASS: tl.constexpr, DIGIT: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr,
):
    """Pass ``PASS`` of a segmented row: its segment's histogram of the next digit among the
    keys that share the prefix of the earlier passes, added into ``hist[PASS, t]``."""
    i_t, i_s, row, lo, hi, steps = _segment(scores, n, s_st, SEG, BLOCK, ITERS)
    prefix, _ = _threshold(hist, i_t, T, K, PASS, DIGIT)
    h = _hist_of(row, lo, hi, steps, prefix, PASS, DIGIT, BLOCK)
    tl.atomic_add(hist + (PASS * T + i_t) * (1 << DIGIT) + tl.arange(0, 1 << DIGIT), h, sem="relaxed")


@triton.jit
def _count_kernel(scores, n, hist, counts, s_st, SEG, S, T, K,
                  PASSES: tl.constexpr, DIGIT: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """Entries of this segment above the threshold key, and equal to it: ``counts[t, s]``."""
    i_t, i_s, row, lo, hi, steps = _segment(scores, n, s_st, SEG, BLOCK, ITERS)
    thr, _ = _threshold(hist, i_t, T, K, PASSES, DIGIT)
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
    scores, n, hist, counts, ids, vals, s_st, s_it, SEG, S, T, K,
    PASSES: tl.constexpr, DIGIT: tl.constexpr, S_PAD: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr,
):
    """This segment's kept entries (above the threshold, and the lowest-id ``need`` equal to
    it over the whole row) into ``ids`` / ``vals`` after the earlier segments' ones."""
    i_t, i_s, row, lo, hi, steps = _segment(scores, n, s_st, SEG, BLOCK, ITERS)
    thr, need = _threshold(hist, i_t, T, K, PASSES, DIGIT)
    o_s = tl.arange(0, S_PAD)
    before = o_s < i_s
    ties = tl.sum(tl.load(counts + (i_t * S + o_s) * 2 + 1, mask=before, other=0))
    taken = tl.sum(tl.load(counts + (i_t * S + o_s) * 2, mask=before, other=0)) + tl.minimum(ties, need)
    _keep_of(row, lo, hi, steps, thr, need, ties, taken, ids + i_t * s_it, vals + i_t * s_it, BLOCK)


@triton.jit
def _sort_kernel(hist, counts, ids, vals, s_it, S, T, K,
                 PASSES: tl.constexpr, DIGIT: tl.constexpr, S_PAD: tl.constexpr, K_PAD: tl.constexpr):
    """A segmented row's kept entries, sorted."""
    i_t = tl.program_id(0)
    _, need = _threshold(hist, i_t, T, K, PASSES, DIGIT)
    o_s = tl.arange(0, S_PAD)
    m_s = o_s < S
    taken = (tl.sum(tl.load(counts + (i_t * S + o_s) * 2, mask=m_s, other=0))
             + tl.minimum(tl.sum(tl.load(counts + (i_t * S + o_s) * 2 + 1, mask=m_s, other=0)), need))
    _sort_row(ids + i_t * s_it, vals + i_t * s_it, taken, K, K_PAD)


def one_chunk(T, L: int) -> bool:
    """Whether the scores of ``T`` tokens over ``L`` entries fit one scratch chunk, known
    without a guard (a traced ``T`` is bounded by its range, e.g. an export's ``Dim``)."""
    return statically_known_true(T * 4 * L <= SCORES_BYTES)


def segments(T, L: int, device: torch.device, block: int) -> tuple[int, int]:
    """``(S, seg)``: the top-k splits each of ``T`` rows of ``L`` scores into ``S`` segments of
    ``seg`` (a multiple of ``block``); one segment (one program per row, no cross-program
    passes) for rows of at most ``ROW_TOPK_BLOCKS * block`` or when the rows alone fill the GPU. A
    traced (symbolic) ``T`` takes one token's count, since ``S`` sets compile-time sizes."""
    if L <= ROW_TOPK_BLOCKS * block:
        return 1, max(L, 1)
    per_token = TOPK_PROGRAMS_PER_SM * num_sms(device) // (T if isinstance(T, int) else 1)
    S = max(1, min(MAX_SEGMENTS, per_token, triton.cdiv(L, block)))
    seg = triton.cdiv(triton.cdiv(L, S), block) * block
    return triton.cdiv(L, seg), seg


def topk_of_rows(scores: torch.Tensor, n: torch.Tensor, ids: torch.Tensor, vals: torch.Tensor, k: int,
                 block: Optional[int] = None) -> None:
    """The exact top-``k`` of each row's first ``n[t]`` scores (``-inf`` = none) into ``ids`` /
    ``vals [T, k]``: radix passes over :func:`segments` of every row at once, then one sort
    (any segment count gives the same ids); ``block``: scores per step of the passes
    (``TOPK_BLOCK``)."""
    T, L = scores.shape
    block = block or TOPK_BLOCK
    bins, passes = 1 << TOPK_DIGIT, 32 // TOPK_DIGIT
    S, seg = segments(T, L, scores.device, block)
    iters = triton.cdiv(seg, block) if INTERPRET else 0
    launch = lambda kernel, grid: launchable(kernel, scores)[grid]  # noqa: E731
    hist = torch.zeros((passes, T, bins), dtype=torch.int32, device=scores.device)
    launch(_hist_kernel, (T, S))(scores, n, hist, scores.stride(0), seg, T, k,
                                 PASS=0, DIGIT=TOPK_DIGIT, BLOCK=block, ITERS=iters)
    k_pad = triton.next_power_of_2(k)
    if S == 1:
        launch(_row_topk_kernel, (T,))(scores, n, hist, ids, vals, scores.stride(0), ids.stride(0), k, PASSES=passes,
                                       DIGIT=TOPK_DIGIT, BLOCK=block, ITERS=iters, K_PAD=k_pad, num_warps=16)
        return
    for p in range(1, passes):
        launch(_hist_kernel, (T, S))(scores, n, hist, scores.stride(0), seg, T, k,
                                     PASS=p, DIGIT=TOPK_DIGIT, BLOCK=block, ITERS=iters)
    counts = torch.empty((T, S, 2), dtype=torch.int32, device=scores.device)
    launch(_count_kernel, (T, S))(scores, n, hist, counts, scores.stride(0), seg, S, T, k,
                                  PASSES=passes, DIGIT=TOPK_DIGIT, BLOCK=block, ITERS=iters)
    s_pad = triton.next_power_of_2(S)
    launch(_gather_kernel, (T, S))(scores, n, hist, counts, ids, vals, scores.stride(0), ids.stride(0), seg, S, T, k,
                                   PASSES=passes, DIGIT=TOPK_DIGIT, S_PAD=s_pad, BLOCK=block, ITERS=iters)
    launch(_sort_kernel, (T,))(hist, counts, ids, vals, ids.stride(0), S, T, k,
                               PASSES=passes, DIGIT=TOPK_DIGIT, S_PAD=s_pad, K_PAD=k_pad, num_warps=16)


def _per_chunk(args: IndexerArgs, select) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores of token chunks (each under ``SCORES_BYTES``) by ``_scores_kernel``, then
    ``select(scores, n, lo, hi, ids, vals)`` (``n``: the chunk's local counts) fills rows
    ``lo:hi`` of ``(ids, vals [T, k])``; only shapes steer the launches."""
    q, w, cache, table = args.q.contiguous(), args.weights.contiguous(), args.cache, args.block_table
    T, Hi = q.shape[:2]
    R, page_size = table.shape[0], cache.shape[1]
    L = table.shape[1] * page_size
    rank, world, interleave = args.shard
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
        n = torch.empty((hi - lo,), dtype=torch.int32, device=q.device)
        allowed = candidate_mask(args, lo, hi) if args.candidates is not None else n
        S = torch.sym_max(1, torch.sym_min(blocks, SCORE_PROGRAMS_PER_SM * sms // (hi - lo)))
        launchable(_scores_kernel, q)[(hi - lo, S)](
            q[lo:hi], w[lo:hi], args.token_to_req[lo:hi], args.n_entries[lo:hi], cache, table, allowed, scores, n, q.stride(0), q.stride(1), w.stride(0), cache.stride(0), table.stride(0), scores.stride(0),
            allowed.stride(0), hi - lo, R, L, cache.shape[0] * page_size, page_size, Hi, S,
            rank, world, interleave, args.candidate_block, allowed.shape[-1] - 1,
            HI=HI, FP8=args.fmt.fp8, RESTRICT=args.candidates is not None, BN=BN,
            ITERS=triton.cdiv(blocks, S) if INTERPRET else 0, UPCAST=INTERPRET,
            # deeper key prefetch once many tokens share the SMs
            num_stages=4 if statically_known_true(hi - lo >= 32) else 2,
        )
        select(scores, n, lo, hi, ids[lo:hi], vals[lo:hi])
    return ids, vals


def indexer_topk_triton(args: IndexerArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [T, k] int32, scores [T, k] fp32)`` of a validated call (see
    :class:`compile_ops.indexer.inputs.IndexerArgs`)."""

    def select(scores, n, lo, hi, ids, vals):
        topk_of_rows(scores, n, ids, vals, args.k)

    return _per_chunk(args, select)


def indexer_candidates_triton(args: IndexerArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """``(blocks [T, k] int32, block scores [T, k] fp32)`` of a validated call."""

    def select(scores, n, lo, hi, ids, vals):
        blocks = block_scores(scores, args, lo, hi)
        every = torch.full((hi - lo,), blocks.shape[1], dtype=torch.int32, device=blocks.device)
        topk_of_rows(blocks, every, ids, vals, args.k)

    return _per_chunk(args, select)


# the names of this module's kernels, as a profile shows them
KERNEL_NAMES = tuple(k.fn.__name__ for k in (_scores_kernel, _row_topk_kernel, _hist_kernel, _count_kernel,
                                             _gather_kernel, _sort_kernel))
