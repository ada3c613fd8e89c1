"""Gluon scores and top-k kernels for ``fp4`` and ``fp8`` index keys on Hopper (sm_90): backend ``"gluon"``.

The same op, arguments and top-k levels as the ``triton`` backend
(:mod:`compile_ops.indexer.triton`). A top-k level that keeps its entries in id order runs
:func:`_topk_level_kernel`: the portable kernel's search, whose steps each count the
entries over a bound across the program, with one barrier a step (each warp's count, then
all warps' through shared memory) where ``tl.sum``'s block reduction takes three and a
chain of shuffles; a level that sorts stays on the portable kernel (``tl.sort``). The
scores kernel differs more. The portable kernel reads fp8 keys row by row (or, on
pages of whole 64-entry blocks, by TMA) with a ``tl.dot`` whose operand layout the compiler
chooses, and for ``fp4`` keys leaves it to the compiler to move the converted keys into
the MMA's operand layout, which costs more than the conversion. Here, for both formats:

* a ring of ``STAGES`` 64-entry blocks in shared memory, ``STAGES - 1`` of them in flight
  (``cp.async``, 16 bytes a copy, on pages of any size; each row's page is loaded a step
  before its copy), the rows' four scale bytes beside them;
* the token's queries quantized once per program as the keys are, into shared memory.

``fp8`` keys (128 e4m3 bytes and an fp32 scale a key) land in the ``wgmma`` operand's own
shared-memory layout: one 128-deep e4m3 product per block, issued before the next block's
copy and waited for after it, then ``scale * sum_h w[h] relu(.)``; a program of several
tokens of fewer than 64 heads (V4.1's 32) multiplies a pair of tokens' queries at once, the
product's columns the first token's heads, then the second's, and issues the next pair's
product before summing this pair's scores. The query is e4m3 with one power-of-two scale
per head, folded into its weight, as the portable kernel has it.

``fp4`` keys (64 bytes of e2m1 pairs and four ue8m0 bytes a key) go through registers:

* each lane loads, for its two rows of the product, the one 32-bit word per block of 32
  values that ``wgmma``'s register operand wants there;
* masks and shifts turn its eight e2m1 codes into e4m3 bytes (value times ``2**-6``,
  exactly; :func:`compile_ops._triton_quant.e2m1_as_e4m3`): the low nibbles are the
  operand's columns ``4 t .. 4 t + 3`` of the block, the high ones ``16 + 4 t ..``, and the
  query's columns are permuted to match, once per program;
* each block of 32 values is one 32-deep e4m3 ``wgmma`` (four per 64-entry block, issued
  together, one wait), whose fp32 result is exact; the key block's power-of-two scale
  multiplies it after. The query's blocks are e4m3 relative to its head's largest block
  (exact within 14 binades of it, :func:`_store_query`) and the head's scale joins its
  weight, so a score is the reference's sum of exact products, summed in fp32.

Program ``(b, s)`` takes ``TB`` consecutive tokens (:func:`compile_ops.indexer.triton.scores_tokens`:
one where a step may be all decode, up to :data:`GLUON_TOKENS` in a prefill step) and blocks
``s, s + S, ...`` of their entries (:func:`key_splits`: one wave of programs in a decode step,
:data:`PREFILL_WAVES` in a prefill step), as the portable kernel does: each request run among the
tokens reads a key block once into the ring, and every token of the run multiplies it by its
own queries (all ``TB`` tokens' queries stay in shared memory), so a prefill chunk of one
request reads its keys ``TB`` times fewer than one token a program does. It stores the same
scores (``-inf`` at holes, outside the token's candidate blocks and nowhere past its count);
for rows long enough that their top-k starts from groups of 16 entries, the groups' best
scores too (a warp's 16 rows of the product are one group: a reduction within the warp).

A prefill launch of four tokens a program over fp8 keys, 17 to 32 heads (V4.1's 32) and pages
of a power of two of at least 32 entries (:func:`prefill_descriptors`) runs
:func:`_prefill_scores_kernel` instead: the same programs and outputs, its warps split by
task (``warp_specialize``), as DeepGEMM's MQA-logits kernels split theirs. A loader warp copies
each key block by TMA (its keys and their scales, one copy each per page it spans) into a
ring; the products' warpgroup runs the two pairs' products of each block and sums each
token's heads as far as a lane holds them; a stores warpgroup adds a row's four lanes' sums,
masks (holes, candidate blocks, counts), stores the scores and takes the group maxima. So
the warps that issue the products issue little else, and no warp computes a copy's address
per row.

The kernels (both scores kernels and the top-k levels) are programmatic dependent launches
(``launch_pdl``): a launch may start while the stream's previous kernel ends, and each
program (each partition of one) waits for that kernel (``griddepcontrol.wait``) before its
first global access. None lets its own dependents
start early (``griddepcontrol.launch_dependents``): the next launch's programs would then
hold SM room while this one's still run, which measured slower (``docs/performance-indexer-history.md``).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
from torch._subclasses.functional_tensor import FunctionalTensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from compile_ops._triton_quant import (_E2M1X8_TO_E4M3, e2m1_rows, e2m1_value, power_of_two, to_e4m3,
                                      ue8m0_exponent)
from compile_ops.indexer.inputs import IndexerArgs, triton_args_unsupported
from compile_ops.indexer.triton import (BN, TOPK_GROUP, GroupMaxima, _level_entries, _local_count, _store_group_counts,
                                        indexer_candidates_triton, indexer_topk_and_candidates_triton,
                                        indexer_topk_triton, scores_tokens)
from compile_ops.mla.gluon import _async_load, _cta_barrier, _reinterpret, _wait_prior_grid
from compile_ops.mla.plan import num_sms

# programs per SM (4 warps each): one launch fills every SM once and each program streams
# its token's blocks; fewer leave too few copies in flight, more wait for registers
PROGRAMS_PER_SM = 4
# a prefill launch's programs (several tokens each, equal work) split their keys into this
# many waves of PROGRAMS_PER_SM programs an SM: a launch of one wave and a few programs
# more would take two waves' time
PREFILL_WAVES = 4
STAGES = 4  # key blocks in the ring (a power of two): three copies in flight while one block's products run
# an fp4 key's 64 bytes in shared memory, 16-byte chunk j of row r at chunk j ^ (r // 2) % 4:
# the copies stay 16 bytes, and a warp's word loads (8 rows, one chunk each) hit 32 banks
KEY_SWIZZLE = gl.constexpr(gl.SwizzledSharedLayout(16, 2, 4, [1, 0]))
GLUON_MAX_HEADS = 64  # four [64, heads] fp32 products in registers
# most tokens of one request a program takes in a prefill step: each key block it reads serves
# them all (their queries, 8 KB a token at 64 heads, stay in shared memory)
GLUON_TOKENS = 4
# registers a thread of a several-token fp8 program may hold: three programs an SM (the
# compiler's own choice, about 200, leaves room for two), without spills (tests/test_gluon_build.py)
PREFILL_FP8_REGISTERS = 168
# the warp-specialized prefill kernel (_prefill_scores_kernel): a ring of key blocks filled by
# TMA, a ring of the products' scores for the stores
PREFILL_KEY_STAGES = gl.constexpr(4)
PREFILL_SCORE_STAGES = gl.constexpr(2)
# its registers a thread: the launch's (two programs an SM: 2 x 3 warpgroups x 128 x 80 <= 64K),
# of which the loader's and the stores' warpgroups give theirs up to the products' (setmaxnreg)
PREFILL_REGISTERS = 80
PREFILL_LOADER_REGISTERS = gl.constexpr(40)
PREFILL_STORE_REGISTERS = gl.constexpr(80)


@gluon.jit
def _query_block(p_q, m_h, g: gl.constexpr, QL: gl.constexpr):
    """Block ``g`` (values ``32 g .. 32 g + 31``) of the token's queries quantized like the
    keys: ``(e2m1 codes [HI, 32] int32, ue8m0 exponents [HI] int32)``, the columns in the
    operand's order (column ``c < 16`` is value ``2 c``, ``16 + c`` value ``2 c + 1``)."""
    o_c = gl.arange(0, 32, gl.SliceLayout(0, QL))
    src = 32 * g + 2 * (o_c % 16) + o_c // 16
    return e2m1_rows(gl.load(p_q + src[None, :], mask=m_h[:, None], other=0.0).to(gl.float32))


@gluon.jit
def _store_query(q_smem, code, exponent, top, g):
    """A block's query values times ``2 ** (133 - top)`` as e4m3 into ``q_smem[g]``: the
    head's largest block (exponent ``top``) as its e2m1 values times ``2**6`` (at most 384),
    a block ``d`` binades below it times ``2 ** (6 - d)``, exact for ``d <= 14`` (e4m3's
    smallest step is ``2**-9``); a block further below, whose products are under ``2**-14``
    of the head's largest, is rounded to that step."""
    x = e2m1_value(code) * power_of_two(gl.maximum(exponent - top, -133)[:, None] + 133)
    q_smem.index(g).store(to_e4m3(x))


@gluon.jit
def _pages(table, row, n_t, blk, s_bt, page_size, PAGE_SHIFT: gl.constexpr, BN: gl.constexpr, CROW: gl.constexpr):
    """Block ``blk``'s page per row (``[BN]`` int32 in ``CROW``; ``-1``: past the token's
    count or a hole), or its one page (int32) where pages hold whole blocks (a power of two
    of at least ``BN`` entries), loaded one step before its copy so that no copy waits on it."""
    if PAGE_SHIFT >= 0 and (1 << PAGE_SHIFT) >= BN:
        return gl.load(table + row * s_bt + ((blk * BN) >> PAGE_SHIFT), mask=blk * BN < n_t, other=-1)
    else:
        c = blk * BN + gl.arange(0, BN, CROW)
        if PAGE_SHIFT >= 0:  # a power-of-two page: no integer division per row
            i_p = c >> PAGE_SHIFT
        else:
            i_p = c // page_size
        return gl.load(table + row * s_bt + i_p, mask=c < n_t, other=-1)


@gluon.jit
def _candidate_bits(allowed, t0, lo, hi, n_t, blk, s_at, rank, world, interleave, block, nb, TB: gl.constexpr,
                    BN: gl.constexpr, CROW: gl.constexpr):
    """Block ``blk``'s rows as ``[BN]`` int32 bits in ``CROW``: bit ``u`` where token ``t0 + u``
    (one of the run ``lo:hi``) may score the row's entry, which lies in one of its candidate
    blocks (global ids); loaded one step before the copy, as the pages are, so that neither
    the copy nor a token's scores wait on the candidates."""
    c = blk * BN + gl.arange(0, BN, CROW)
    g_blk = (((c // interleave) * world + rank) * interleave + c % interleave) // block
    m = (c < n_t) & (g_blk < nb)
    bits = gl.zeros([BN], gl.int32, CROW)
    for u in gl.static_range(TB):
        t = t0 + u
        ok = gl.load(allowed + t * s_at + g_blk, mask=m & (t >= lo) & (t < hi), other=0) != 0
        bits = bits | (ok.to(gl.int32) << u)
    return bits


@gluon.jit
def _run_bits(allowed, t0, lo, hi, n_t, blk, s_at, rank, world, interleave, block, nb, RESTRICT: gl.constexpr,
              TB: gl.constexpr, BN: gl.constexpr, CROW: gl.constexpr):
    """Which of the program's tokens ``t0 ..`` score block ``blk``'s rows: with ``RESTRICT``
    :func:`_candidate_bits`, else every token's bit (the rows past ``n_t`` are no entry)."""
    if RESTRICT:
        return _candidate_bits(allowed, t0, lo, hi, n_t, blk, s_at, rank, world, interleave, block, nb, TB, BN, CROW)
    else:
        return gl.full([BN], (1 << TB) - 1, gl.int32, CROW)


@gluon.jit
def _copy_block(kbuf, ebuf, vbuf, stage, page, bits, cache, n_t, blk, s_page, num_slots, page_size,
                PAGE_SHIFT: gl.constexpr, BN: gl.constexpr, ROW_BYTES: gl.constexpr, CPL: gl.constexpr):
    """Start copying block ``blk``'s keys (``page``: :func:`_pages`) into ring slot ``stage``:
    the rows' ``ROW_BYTES`` key bytes into ``kbuf`` (``kbuf``'s dtype), their four scale
    bytes (after the page's rows) into ``ebuf`` (``cp.async``, 16 and 4 bytes a copy; rows
    no token scores are zero-filled), and which tokens score each row into ``vbuf`` (``bits``
    where the row holds an entry, :func:`_candidate_bits`; else 0)."""
    CROW: gl.constexpr = gl.SliceLayout(1, CPL)
    o_r = gl.arange(0, BN, CROW)
    c = blk * BN + o_r
    if PAGE_SHIFT >= 0 and (1 << PAGE_SHIFT) >= BN:  # one page, its consecutive rows
        off = ((blk * BN) & ((1 << PAGE_SHIFT) - 1)) + o_r
    elif PAGE_SHIFT >= 0:
        off = c & (page_size - 1)
    else:
        off = c % page_size
    page = page.to(gl.int64)
    valid = (c < n_t) & (page >= 0) & (page * page_size + off < num_slots) & (bits != 0)
    # (a hole's rows address page 0: their copies are masked and read nothing)
    base = cache + gl.where(page >= 0, page, 0) * s_page
    o_b = gl.arange(0, ROW_BYTES, gl.SliceLayout(0, CPL))
    rows = (base + off * ROW_BYTES).to(gl.pointer_type(kbuf.dtype))
    _async_load(kbuf.index(stage), rows[:, None] + o_b[None, :], mask=valid[:, None])
    _async_load(ebuf.index(stage), (base + page_size * ROW_BYTES + off * 4).to(gl.pointer_type(gl.int32)), mask=valid)
    async_copy.commit_group()
    vbuf.index(stage).store(gl.where(valid, bits, 0))


@gluon.jit
def _operand(packed, A_L: gl.constexpr):
    """uint8 ``[BN, 16]`` words of e2m1 pairs -> the e4m3 operand ``[BN, 32]``: low nibbles in
    columns 0..15, high in 16..31, in ``A_L`` (the same registers: no data moves)."""
    lo, hi = gl.inline_asm_elementwise(_E2M1X8_TO_E4M3, "=r,=r,r", [packed], dtype=(gl.uint8, gl.uint8),
                                       is_pure=True, pack=4)
    x = gl.reshape(gl.permute(gl.join(lo, hi), (0, 2, 1)), [packed.shape[0], 32])
    return gl.convert_layout(x.to(gl.float8e4nv, bitcast=True), A_L)


@gluon.jit
def _block_scores(o0, o1, o2, o3, exps, q_smem, first, b_w, zero):
    """``[BN]`` scores of one block of keys for one token (``o0 .. o3``: the keys' operands of
    its four blocks of 32 values, :func:`_operand`; ``exps``: the rows' ue8m0 bytes;
    ``q_smem[first:first + 4]``: the token's query blocks ``[HI, 32]``): four 32-deep e4m3 products (issued
    together, one wait), each times its key block's power-of-two scale, summed, then
    ``sum_h w[h] relu(.)`` (the query's scales are in its values and in ``b_w``)."""
    a0 = warpgroup_mma(o0, q_smem.index(first).permute((1, 0)), zero, use_acc=False, is_async=True)
    a1 = warpgroup_mma(o1, q_smem.index(first + 1).permute((1, 0)), zero, use_acc=False, is_async=True)
    a2 = warpgroup_mma(o2, q_smem.index(first + 2).permute((1, 0)), zero, use_acc=False, is_async=True)
    a3 = warpgroup_mma(o3, q_smem.index(first + 3).permute((1, 0)), zero, use_acc=False, is_async=True)
    a0, a1, a2, a3 = warpgroup_mma_wait(num_outstanding=0, deps=(a0, a1, a2, a3))
    x = a0 * _key_scale(exps, 0)[:, None]
    x = a1 * _key_scale(exps, 1)[:, None] + x
    x = a2 * _key_scale(exps, 2)[:, None] + x
    x = a3 * _key_scale(exps, 3)[:, None] + x
    return gl.sum(gl.maximum(x, 0.0) * b_w[None, :], 1)


@gluon.jit
def _key_scale(exps, g: gl.constexpr):
    """The power-of-two scale of the keys' block ``g`` (ue8m0 byte ``g`` of ``exps``)."""
    return power_of_two((exps >> (8 * g)) & 255)


@gluon.jit
def _fp4_query(q_smem, first, q, w, i_t, s_qt, s_qh, s_wt, Hi, HI: gl.constexpr, COL: gl.constexpr):
    """Token ``i_t``'s queries quantized like fp4 keys into ``q_smem[first:first + 4]`` ``[HI, 32]`` e4m3
    (:func:`_store_query`); returns its weights times each head's scale ``[HI]`` fp32."""
    QL: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
    o_h = gl.arange(0, HI, gl.SliceLayout(1, QL))
    m_h = o_h < Hi
    p_q = q + i_t * s_qt + o_h[:, None] * s_qh
    c0, e0 = _query_block(p_q, m_h, 0, QL)
    c1, e1 = _query_block(p_q, m_h, 1, QL)
    c2, e2 = _query_block(p_q, m_h, 2, QL)
    c3, e3 = _query_block(p_q, m_h, 3, QL)
    top = gl.maximum(gl.maximum(e0, e1), gl.maximum(e2, e3))
    _store_query(q_smem, c0, e0, top, first)
    _store_query(q_smem, c1, e1, top, first + 1)
    _store_query(q_smem, c2, e2, top, first + 2)
    _store_query(q_smem, c3, e3, top, first + 3)
    # the head's scale 2 ** (top - 127) over _store_query's 2**6, times the keys' 2**6 (e2m1_as_e4m3)
    o_w = gl.arange(0, HI, COL)
    return gl.load(w + i_t * s_wt + o_w, mask=o_w < Hi, other=0.0) * gl.convert_layout(power_of_two(top), COL)


@gluon.jit
def _fp8_query(q_smem, q, w, i_t, s_qt, s_qh, s_wt, Hi, HI: gl.constexpr):
    """Token ``i_t``'s queries quantized like fp8 keys (e4m3, one power-of-two scale per head,
    :func:`compile_ops._triton_quant.ue8m0_exponent`) into ``q_smem [HI, 128]``; returns its
    weights times each head's scale ``[HI]`` fp32."""
    QL: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    o_h = gl.arange(0, HI, gl.SliceLayout(1, QL))
    o_d = gl.arange(0, 128, gl.SliceLayout(0, QL))
    x = gl.load(q + i_t * s_qt + o_h[:, None] * s_qh + o_d[None, :], mask=(o_h < Hi)[:, None], other=0.0)
    x = x.to(gl.float32)
    exponent = ue8m0_exponent(gl.max(gl.abs(x), 1))
    q_smem.store(to_e4m3(x * power_of_two(254 - exponent)[:, None]))
    return gl.load(w + i_t * s_wt + o_h, mask=o_h < Hi, other=0.0) * power_of_two(exponent)


@gluon.jit
def _token_scores(b_s, bits, first, t, i_t, run_j, n_j, o_j, p_scores, s_st, gmax, s_gt, BN: gl.constexpr,
                  G: gl.constexpr, GROUPS: gl.constexpr):
    """Token ``t`` (index ``i_t`` of the program's block) of a run (``run_j`` of the block's
    tokens ``o_j``, counts ``n_j``): its scores ``b_s [BN]`` of entries ``first ..`` (``-inf``
    where bit ``i_t`` of the rows' ``bits`` is clear: a hole, or outside its candidate
    blocks) stored up to its own count, and the top-k's group maxima of them."""
    c = first + gl.arange(0, BN, b_s.type.layout)
    n_t = gl.sum(gl.where((o_j == i_t) & run_j, n_j, 0), 0)  # 0: not in the run
    seen = c < n_t
    b_s = gl.where(((bits >> i_t) & 1) != 0, b_s, float("-inf"))
    gl.store(p_scores + t.to(gl.int64) * s_st + c, b_s, mask=seen)
    if GROUPS:  # the top-k's first pass, while the scores are in registers (a warp's rows: one group)
        x = gl.where(b_s > float("-inf"), b_s, float("-inf"))  # NaN is no entry
        if o_j.shape[0] > 1:  # the block was scored up to the run's largest count: not a later token's entries
            x = gl.where(seen, x, float("-inf"))
        best = gl.max(gl.reshape(x, [BN // G, G]), 1)
        o_g = first // G + gl.arange(0, BN // G, best.type.layout)
        gl.store(gmax + t.to(gl.int64) * s_gt + o_g, best, mask=o_g < gl.cdiv(n_t, G))


@gluon.jit
def _program_tokens(t2r, n_entries, i_b, T, R, L, rank, world, interleave, TB: gl.constexpr, JL: gl.constexpr):
    """Program block ``i_b``'s ``TB`` tokens in layout ``JL``: ``(o_j, t_j, m_j, row_j, n_j)``,
    their index in the block and in the launch, which exist, their request rows and their
    local counts."""
    o_j = gl.arange(0, TB, JL)
    t_j = i_b * TB + o_j
    m_j = t_j < T
    row_j, n_j = _local_count(t2r, n_entries, t_j, R, L, rank, world, interleave, m_j)
    return o_j, t_j, m_j, row_j, n_j


@gluon.jit
def _store_counts(n_out, tickets, g_counts, t_j, n_j, m_j, T, K, G: gl.constexpr, GROUPS: gl.constexpr):
    """Program column 0's stores for tokens ``t_j`` (``m_j``: those that exist): their local
    counts ``n_j`` into ``n_out``, zeros into the top-k's ``tickets``, and with ``GROUPS`` the
    group counts (:func:`compile_ops.indexer.triton._store_group_counts`)."""
    gl.store(n_out + t_j, n_j, mask=m_j)
    gl.store(tickets + t_j, gl.zeros_like(n_j), mask=m_j)
    if GROUPS:
        _store_group_counts(g_counts, t_j, T, n_j, K, G, m_j)


@gluon.jit
def _run_at(g, o_j, row_j, n_j, m_j, i_s, BN: gl.constexpr):
    """Whether token ``g`` of the program starts a request run whose keys program column
    ``i_s`` reads, and the run: ``(starts, row, run_j, n_t, nb_t)`` (its request row, which of
    the program's tokens ``o_j`` are in it, its largest count and key blocks)."""
    row = gl.sum(gl.where(o_j == g, row_j, 0), 0)
    before = gl.sum(gl.where(o_j == g - 1, row_j + 1, 0), 0) - 1  # the row of token g - 1 (-1: none)
    run_j = (row_j == row) & (o_j >= g) & m_j
    n_t = gl.max(gl.where(run_j, n_j, 0), 0)
    nb_t = gl.cdiv(n_t, BN)
    return (row != before) & (i_s < nb_t), row, run_j, n_t, nb_t


@gluon.jit
def _scores_kernel(
    q, w, t2r, n_entries, cache, table, allowed, scores, n_out, tickets, gmax, g_counts,
    s_qt, s_qh, s_wt, s_page, s_bt, s_st, s_at, s_gt, T, R, L, num_slots, page_size, Hi, S,
    rank, world, interleave, block, nb, K,
    HI: gl.constexpr, TB: gl.constexpr, RESTRICT: gl.constexpr, BN: gl.constexpr, PAGE_SHIFT: gl.constexpr,
    STAGES: gl.constexpr, FP4: gl.constexpr, GROUPS: gl.constexpr, G: gl.constexpr,
):
    """Program ``(b, s)``: for each of tokens ``b TB .. b TB + TB - 1``, ``scores[t, c] = sum_h
    w[t, h] * relu(q[t, h] . key[c])`` (fp8: times the key's scale) over blocks ``s, s + S,
    ...`` of ``BN`` entries (``-inf`` at holes and outside its candidate blocks), each
    request run among the tokens reading its keys once for all of them (up to the run's
    largest count); ``n_out[t]`` the local counts and ``tickets[t]`` 0 (program 0; the top-k's,
    :func:`compile_ops.indexer.triton.topk_of_rows`); with ``GROUPS`` the top-k's
    group maxima and counts too (:class:`compile_ops.indexer.triton.GroupMaxima`)."""
    # fp8 keys: where one token's product is narrower than 64 (V4.1's 32 heads), a pair of
    # tokens' queries are one product's columns, as wide as a 64-head token's
    PAIR: gl.constexpr = TB > 1 and not FP4 and HI < 64
    STEP: gl.constexpr = 2 if PAIR else 1  # tokens a product
    # tokens of the products in flight together: two pairs' products (a 64-head token's product
    # beside another's spills under the prefill register limit)
    PIPE: gl.constexpr = 2 * STEP if PAIR and TB > STEP else STEP
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, STEP * HI, 32])
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=4)
    # A_L's registers, lanes and warps for one block's 16 packed bytes: a lane's word per row
    KL: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [8, 0]], lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[BN, 16])
    ROW: gl.constexpr = gl.SliceLayout(1, ACC)
    COL: gl.constexpr = gl.SliceLayout(0, ACC)
    JL: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])  # the program's tokens
    ROW_BYTES: gl.constexpr = 64 if FP4 else 128
    # the copies: 16 bytes a lane, a row's bytes over ROW_BYTES // 16 lanes
    CPL: gl.constexpr = gl.BlockedLayout([1, 16], [512 // ROW_BYTES, ROW_BYTES // 16], [4, 1], [1, 0])
    CROW: gl.constexpr = gl.SliceLayout(1, CPL)

    # a programmatic dependent launch (launch_scores_gluon): nothing is read or written
    # before the stream's previous kernel has finished
    _wait_prior_grid()
    i_b, i_s = gl.program_id(0), gl.program_id(1)
    o_j, t_j, m_j, row_j, n_j = _program_tokens(t2r, n_entries, i_b, T, R, L, rank, world, interleave, TB, JL)
    if i_s == 0:
        _store_counts(n_out, tickets, g_counts, t_j, n_j, m_j, T, K, G, GROUPS)
    if i_s < gl.cdiv(gl.max(n_j, 0), BN):
        w_smem = gl.allocate_shared_memory(gl.float32, [TB // STEP, STEP * HI], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        if FP4:
            q_smem = gl.allocate_shared_memory(gl.float8e4nv, [4 * TB, HI, 32],
                                               gl.NVMMASharedLayout.get_default_for([HI, 32], gl.float8e4nv))
            for u in range(TB):  # (a loop, not unrolled: one token's query in registers at a time)
                t = i_b * TB + u
                w_smem.index(u).store(_fp4_query(q_smem, 4 * u, q, w, t, s_qt, s_qh, s_wt,
                                                 gl.where(t < T, Hi, 0), HI, COL))
            # registers are the products' operand: a swizzle for the word loads
            kbuf = gl.allocate_shared_memory(gl.uint8, [STAGES, BN, 64], KEY_SWIZZLE)
        else:
            q_smem = gl.allocate_shared_memory(gl.float8e4nv, [TB // STEP, STEP * HI, 128],
                                               gl.NVMMASharedLayout.get_default_for([STEP * HI, 128], gl.float8e4nv))
            for u in gl.static_range(TB):  # token u: rows (u % STEP) HI .. of product u // STEP
                t = i_b * TB + u
                w_smem.index(u // STEP).slice((u % STEP) * HI, HI).store(
                    _fp8_query(q_smem.index(u // STEP).slice((u % STEP) * HI, HI), q, w, t, s_qt, s_qh, s_wt,
                               gl.where(t < T, Hi, 0), HI))
            # the products read the keys from shared memory: the MMA's layout
            kbuf = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BN, 128],
                                             gl.NVMMASharedLayout.get_default_for([BN, 128], gl.float8e4nv))
        fence_async_shared()
        zero = gl.zeros([BN, STEP * HI], gl.float32, ACC)
        ebuf = gl.allocate_shared_memory(gl.int32, [STAGES, BN], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        vbuf = gl.allocate_shared_memory(gl.int32, [STAGES, BN], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        # a request's tokens are contiguous in a step: the block holds runs of a few rows
        for g in range(TB):
            starts, row, run_j, n_t, nb_t = _run_at(g, o_j, row_j, n_j, m_j, i_s, BN)
            if starts:  # a run starts at token g
                lo = i_b * TB + g  # the run: tokens lo:hi
                hi = lo + gl.sum(run_j.to(gl.int32), 0)
                # blocks i_s, i_s + S, ... in a ring of STAGES slots: STAGES - 1 copies in flight
                for p in gl.static_range(STAGES - 1):
                    page = _pages(table, row, n_t, i_s + p * S, s_bt, page_size, PAGE_SHIFT, BN, CROW)
                    bits = _run_bits(allowed, i_b * TB, lo, hi, n_t, i_s + p * S, s_at, rank, world, interleave,
                                     block, nb, RESTRICT, TB, BN, CROW)
                    _copy_block(kbuf, ebuf, vbuf, p, page, bits, cache, n_t, i_s + p * S, s_page, num_slots,
                                page_size, PAGE_SHIFT, BN, ROW_BYTES, CPL)
                page = _pages(table, row, n_t, i_s + (STAGES - 1) * S, s_bt, page_size, PAGE_SHIFT, BN, CROW)
                bits = _run_bits(allowed, i_b * TB, lo, hi, n_t, i_s + (STAGES - 1) * S, s_at, rank, world,
                                 interleave, block, nb, RESTRICT, TB, BN, CROW)
                for i in range(0, gl.cdiv(nb_t - i_s, S)):
                    blk = i_s + i * S
                    ahead = blk + (STAGES - 1) * S
                    next_page = _pages(table, row, n_t, ahead + S, s_bt, page_size, PAGE_SHIFT, BN, CROW)
                    next_bits = _run_bits(allowed, i_b * TB, lo, hi, n_t, ahead + S, s_at, rank, world, interleave,
                                          block, nb, RESTRICT, TB, BN, CROW)
                    async_copy.wait_group(STAGES - 2)  # this thread's copies of block blk have landed ...
                    if not FP4:
                        fence_async_shared()  # ... visible to the tensor cores' reads ...
                    _cta_barrier()  # ... and every thread's; the slot refilled below was read one step ago
                    st = i % STAGES
                    keys = kbuf.index(st)
                    _copy_block(kbuf, ebuf, vbuf, (i + STAGES - 1) % STAGES, page, bits, cache, n_t, ahead, s_page,
                                num_slots, page_size, PAGE_SHIFT, BN, ROW_BYTES, CPL)
                    scored = vbuf.index(st).load(ROW)  # bit j: token j scores the row
                    exps = ebuf.index(st).load(ROW)
                    if FP4:  # the keys' operands once for all the tokens
                        o0 = _operand(keys.slice(0, 16, dim=1).load(KL), A_L)
                        o1 = _operand(keys.slice(16, 16, dim=1).load(KL), A_L)
                        o2 = _operand(keys.slice(32, 16, dim=1).load(KL), A_L)
                        o3 = _operand(keys.slice(48, 16, dim=1).load(KL), A_L)
                        for j in range(TB):  # (a loop, not unrolled: one token's product in registers at a time)
                            b_s = _block_scores(o0, o1, o2, o3, exps, q_smem, 4 * j, w_smem.index(j).load(COL), zero)
                            _token_scores(b_s, scored, blk * BN, i_b * TB + j, j, run_j, n_j, o_j, scores, s_st, gmax,
                                          s_gt, BN, G, GROUPS)
                    else:  # one 128-deep product from shared memory for STEP tokens
                        scale = exps.to(gl.float32, bitcast=True)  # the keys' fp32 scales
                        # up to two products in flight (PIPE): the second runs on the tensor cores while the
                        # first's scores are summed
                        for j0 in range(0, TB, PIPE):
                            acc = warpgroup_mma(keys, q_smem.index(j0 // STEP).permute((1, 0)), zero, use_acc=False,
                                                is_async=True)
                            for d in gl.static_range(0, PIPE, STEP):
                                j = j0 + d
                                if d + STEP < PIPE:
                                    second = warpgroup_mma(keys, q_smem.index(j // STEP + 1).permute((1, 0)), zero,
                                                          use_acc=False, is_async=True)
                                    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
                                else:
                                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                                x = gl.maximum(acc, 0.0) * w_smem.index(j // STEP).load(COL)[None, :]
                                if PAIR:  # the first token's heads, then the second's
                                    first = (gl.arange(0, STEP * HI, COL) < HI)[None, :]
                                    _token_scores(gl.sum(gl.where(first, x, 0.0), 1) * scale, scored, blk * BN,
                                                  i_b * TB + j, j, run_j, n_j, o_j, scores, s_st, gmax, s_gt, BN, G,
                                                  GROUPS)
                                    _token_scores(gl.sum(gl.where(first, 0.0, x), 1) * scale, scored, blk * BN,
                                                  i_b * TB + j + 1, j + 1, run_j, n_j, o_j, scores, s_st, gmax, s_gt,
                                                  BN, G, GROUPS)
                                else:
                                    _token_scores(gl.sum(x, 1) * scale, scored, blk * BN, i_b * TB + j, j, run_j, n_j,
                                                  o_j, scores, s_st, gmax, s_gt, BN, G, GROUPS)
                                if d + STEP < PIPE:
                                    acc = second
                    page = next_page
                    bits = next_bits
                async_copy.wait_group(0)  # the masked copies past the last block: nothing left in flight
                _cta_barrier()  # every thread's reads of the ring done before the next run refills it


@gluon.jit
def _prefill_loader(keys, scales, kbuf, ebuf, ready, empty, t2r, n_entries, table, i_b, i_s, S, T, R, L, rank, world,
                    interleave, s_bt, s_page, num_slots, page_size, TB: gl.constexpr, BN: gl.constexpr,
                    PAGE_SHIFT: gl.constexpr, STAGES: gl.constexpr):
    """The loader warp: each run's key blocks ``i_s, i_s + S, ...`` into the ring, a block as one
    TMA copy of its keys and one of their scales per page it spans (pages of 32 or of at least
    ``BN`` entries), each pair signalling ``ready`` once: with its bytes, or at once where its
    page is a hole or past the run's count (the rows then hold stale bytes, which
    :func:`_prefill_stores` masks). A block's pages are loaded before the wait for its slot."""
    _wait_prior_grid()
    ROWS: gl.constexpr = BN if PAGE_SHIFT >= 6 else (1 << PAGE_SHIFT)
    o_j, _, m_j, row_j, n_j = _program_tokens(t2r, n_entries, i_b, T, R, L, rank, world, interleave, TB,
                                           gl.BlockedLayout([1], [32], [1], [0]))  # (one warp)
    used = 0
    for g in range(TB):
        starts, row, run_j, n_t, nb_t = _run_at(g, o_j, row_j, n_j, m_j, i_s, BN)
        if starts:
            steps = gl.cdiv(nb_t - i_s, S)
            for i in range(steps):
                k = used + i
                st = k % STAGES
                first = (i_s + i * S) * BN
                page = gl.load(table + row * s_bt + (first >> PAGE_SHIFT), mask=first < n_t, other=-1)
                if ROWS < BN:  # the block's second page
                    second = gl.load(table + row * s_bt + ((first + ROWS) >> PAGE_SHIFT), mask=first + ROWS < n_t,
                                     other=-1)
                mbarrier.wait(empty.index(st), ((k // STAGES) & 1) ^ 1)  # (a new barrier: passes)
                _load_rows(keys, scales, kbuf, ebuf, ready, st, page, first, 0, n_t, s_page, num_slots, page_size,
                           ROWS)
                if ROWS < BN:
                    _load_rows(keys, scales, kbuf, ebuf, ready, st, second, first + ROWS, ROWS, n_t, s_page,
                               num_slots, page_size, ROWS)
            used += steps


@gluon.jit
def _load_rows(keys, scales, kbuf, ebuf, ready, st, page, first, at, n_t, s_page, num_slots, page_size,
               ROWS: gl.constexpr):
    """Entries ``first .. first + ROWS - 1`` (on ``page``) into rows ``at ..`` of ring slot
    ``st``: their key bytes and their scales, two TMA copies signalling ``ready[st]`` with
    their bytes, or (a hole, past the count or the cache) a plain arrival."""
    go = (first < n_t) & (page >= 0) & (page.to(gl.int64) * page_size < num_slots)
    off = first & (page_size - 1)
    bar = ready.index(st)
    mbarrier.expect(bar, ROWS * 132, pred=go)
    tma.async_copy_global_to_shared(keys, [page * (s_page // 128) + off, 0], bar, kbuf.index(st).slice(at, ROWS, dim=0),
                                    pred=go)
    scale_row = page * (s_page // (4 * ROWS)) + (page_size * 128 + 4 * off) // (4 * ROWS)
    tma.async_copy_global_to_shared(scales, [scale_row, 0], bar, ebuf.index(st).slice(at, ROWS, dim=1), pred=go)
    mbarrier.arrive(bar, pred=~go)


@gluon.jit
def _prefill_products(q, w, q_smem, w_smem, kbuf, scale_rows, epi, ready, empty, full, free, t2r, n_entries, i_b,
                      i_s, S, T, R, L, rank, world, interleave, s_qt, s_qh, s_wt, Hi, HI: gl.constexpr,
                      TB: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, EPI: gl.constexpr):
    """The products' warpgroup (the default partition): the program's ``TB`` tokens' queries
    quantized into shared memory (:func:`_fp8_query`), then for each key block two
    ``[BN, 2 HI]`` products (a pair of tokens each; the second in flight while the first's
    scores are summed) and each row's and token's ``scale * sum_h w[h] relu(.)`` over the
    heads each lane of a quad holds (:func:`_lane_sums`), ``[BN, TB, 4]``, into the score
    ring's slot for :func:`_prefill_stores`."""
    _wait_prior_grid()
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 2 * HI, 32])
    ROW: gl.constexpr = gl.SliceLayout(1, ACC)
    COL: gl.constexpr = gl.SliceLayout(0, ACC)
    for u in gl.static_range(TB):  # token u: rows (u % 2) HI .. of pair u // 2
        t = i_b * TB + u
        w_smem.index(u // 2).slice((u % 2) * HI, HI).store(
            _fp8_query(q_smem.index(u // 2).slice((u % 2) * HI, HI), q, w, t, s_qt, s_qh, s_wt,
                       gl.where(t < T, Hi, 0), HI))
    fence_async_shared()
    _cta_barrier()
    w_a = w_smem.index(0).load(COL)
    w_b = w_smem.index(1).load(COL)
    first = (gl.arange(0, 2 * HI, COL) < HI)[None, :]  # a pair's columns: its first token's heads
    acc_a = gl.zeros([BN, 2 * HI], gl.float32, ACC)
    acc_b = gl.zeros([BN, 2 * HI], gl.float32, ACC)
    o_j, _, m_j, row_j, n_j = _program_tokens(t2r, n_entries, i_b, T, R, L, rank, world, interleave, TB,
                                           gl.BlockedLayout([1], [32], [4], [0]))
    used = 0
    for g in range(TB):
        starts, row, run_j, n_t, nb_t = _run_at(g, o_j, row_j, n_j, m_j, i_s, BN)
        if starts:
            steps = gl.cdiv(nb_t - i_s, S)
            for i in range(steps):
                k = used + i
                st = k % STAGES
                mbarrier.wait(ready.index(st), (k // STAGES) & 1)
                key = kbuf.index(st)
                # (use_acc=False: the accumulators' registers, not their values)
                acc_a = warpgroup_mma(key, q_smem.index(0).permute((1, 0)), acc_a, use_acc=False, is_async=True)
                acc_b = warpgroup_mma(key, q_smem.index(1).permute((1, 0)), acc_b, use_acc=False, is_async=True)
                scale = scale_rows.index(st).load(ROW).to(gl.float32, bitcast=True)  # the keys' fp32 scales
                acc_a = warpgroup_mma_wait(num_outstanding=1, deps=(acc_a, ))
                part_a = _lane_sums(gl.maximum(acc_a, 0.0) * w_a[None, :], scale, HI)
                acc_b = warpgroup_mma_wait(num_outstanding=0, deps=(acc_b, ))
                _cta_barrier()  # every warp's products of the block done: its slot is free
                mbarrier.arrive(empty.index(st), count=1)
                part_b = _lane_sums(gl.maximum(acc_b, 0.0) * w_b[None, :], scale, HI)
                e = k % EPI
                mbarrier.wait(free.index(e), ((k // EPI) & 1) ^ 1)  # (a new barrier: passes)
                # [BN, TB, 4]: token 2 a + b at [:, a, b] (one store: no barrier between rows)
                parts = gl.reshape(gl.permute(gl.join(part_a, part_b), (0, 3, 1, 2)), [BN, TB, 4])
                epi.index(e).store(parts)
                _cta_barrier()
                mbarrier.arrive(full.index(e), count=1)
            used += steps


@gluon.jit
def _lane_sums(x, scale, HI: gl.constexpr):
    """A pair's ``[BN, 2 HI]`` weighted ReLUs -> ``[BN, 2, 4]``: each token's sum over the heads
    one lane of a quad holds (column ``8 i + 2 q + j`` in lane ``q``), summed in registers,
    times the rows' key scales ``scale [BN]``."""
    x = gl.sum(gl.sum(gl.reshape(x, [x.shape[0], 2, HI // 8, 4, 2]), 2), 3)
    rows: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, x.type.layout))
    return x * gl.convert_layout(scale, rows)[:, None, None]


@gluon.jit
def _prefill_stores(epi, full, free, t2r, n_entries, table, allowed, scores, n_out, tickets, gmax, g_counts, i_b, i_s,
                    S, T, R, L, rank, world, interleave, s_bt, s_st, s_at, s_gt, num_slots, page_size, block, nb, K,
                    TB: gl.constexpr, BN: gl.constexpr, PAGE_SHIFT: gl.constexpr, RESTRICT: gl.constexpr,
                    GROUPS: gl.constexpr, G: gl.constexpr, EPI: gl.constexpr):
    """The stores' warpgroup: ``n_out`` and ``tickets`` (and the group counts) of the program's
    tokens (program column 0), then each block's ``[BN, TB]`` scores, its slot's four partial
    sums a row and token added: ``-inf`` at holes and outside a token's candidate blocks
    (``RESTRICT``), stored up to each token's own count, with the top-k's group maxima
    (``GROUPS``)."""
    _wait_prior_grid()
    # a row's two tokens a thread, their four partial sums each
    PL: gl.constexpr = gl.BlockedLayout([1, 2, 4], [32, 1, 1], [2, 2, 1], [2, 0, 1])
    EL: gl.constexpr = gl.SliceLayout(2, PL)
    CL: gl.constexpr = gl.SliceLayout(1, EL)
    TL: gl.constexpr = gl.SliceLayout(0, EL)
    _, t_u, m_u, _, n_u = _program_tokens(t2r, n_entries, i_b, T, R, L, rank, world, interleave, TB, TL)
    if i_s == 0:
        _store_counts(n_out, tickets, g_counts, t_u, n_u, m_u, T, K, G, GROUPS)
    GL: gl.constexpr = gl.SliceLayout(1, gl.BlockedLayout([1, 1, 2], [2, 16, 1], [2, 1, 2], [1, 0, 2]))
    # the runs, as the other partitions find them
    o_j, _, m_j, row_j, n_j = _program_tokens(t2r, n_entries, i_b, T, R, L, rank, world, interleave, TB,
                                           gl.BlockedLayout([1], [32], [4], [0]))
    used = 0
    for g in range(TB):
        starts, row, run_j, n_t, nb_t = _run_at(g, o_j, row_j, n_j, m_j, i_s, BN)
        if starts:
            run_u = gl.convert_layout(run_j, TL)
            steps = gl.cdiv(nb_t - i_s, S)
            if GROUPS:  # the run's tokens' group counts, in the group maxima's layout
                t_g = gl.convert_layout(t_u, gl.SliceLayout(0, GL))
                n_g = gl.convert_layout(gl.where(run_u, gl.cdiv(n_u, G), 0), gl.SliceLayout(0, GL))
            for i in range(steps):
                k = used + i
                e = k % EPI
                c = (i_s + i * S) * BN + gl.arange(0, BN, CL)
                # each row's page (a hole, or past the cache: no entry), loaded before the wait
                page = gl.load(table + row * s_bt + (c >> PAGE_SHIFT), mask=c < n_t, other=-1)
                ok = ((c < n_t) & (page >= 0) & (page.to(gl.int64) * page_size + (c & (page_size - 1)) < num_slots))
                ok = ok[:, None] & run_u[None, :]
                if RESTRICT:  # inside the token's candidate blocks (global ids)
                    g_blk = (((c // interleave) * world + rank) * interleave + c % interleave) // block
                    ok = ok & (gl.load(allowed + t_u[None, :] * s_at + g_blk[:, None],
                                       mask=ok & (g_blk < nb)[:, None], other=0) != 0)
                mbarrier.wait(full.index(e), (k // EPI) & 1)
                v = gl.sum(epi.index(e).load(PL), 2)  # a quad's four partial sums
                _cta_barrier()  # every warp has read the slot
                mbarrier.arrive(free.index(e), count=1)
                b_s = gl.where(ok, v, float("-inf"))
                seen = (c[:, None] < n_u[None, :]) & run_u[None, :]
                gl.store(scores + t_u.to(gl.int64)[None, :] * s_st + c[:, None], b_s, mask=seen)
                if GROUPS:  # the top-k's first pass, while the scores are in registers
                    x = gl.where(seen & (b_s > float("-inf")), b_s, float("-inf"))  # NaN is no entry
                    best = gl.convert_layout(gl.max(gl.reshape(x, [BN // G, G, TB]), 1), GL)
                    o_g = (i_s + i * S) * (BN // G) + gl.arange(0, BN // G, gl.SliceLayout(1, GL))
                    gl.store(gmax + t_g.to(gl.int64)[None, :] * s_gt + o_g[:, None], best,
                             mask=o_g[:, None] < n_g[None, :])
            used += steps


@gluon.jit
def _prefill_scores_kernel(
    q, w, t2r, n_entries, keys, scales, table, allowed, scores, n_out, tickets, gmax, g_counts,
    s_qt, s_qh, s_wt, s_page, s_bt, s_st, s_at, s_gt, T, R, L, num_slots, page_size, Hi, S,
    rank, world, interleave, block, nb, K,
    HI: gl.constexpr, TB: gl.constexpr, RESTRICT: gl.constexpr, BN: gl.constexpr, PAGE_SHIFT: gl.constexpr,
    GROUPS: gl.constexpr, G: gl.constexpr,
):
    """:func:`_scores_kernel`'s program ``(b, s)`` (the same outputs) for fp8 keys and ``TB`` (4)
    tokens of 17 to 32 heads (``HI`` 32), on pages of 32 or more entries, warp-specialized: a loader
    warp fills a ring of key blocks by TMA (:func:`_prefill_loader`), the products'
    warpgroup runs two pairs' products a block and sums their scores
    (:func:`_prefill_products`), a stores warpgroup masks and stores them with the group
    maxima (:func:`_prefill_stores`), so that the products' warps issue only the products and
    their sums."""
    STAGES: gl.constexpr = PREFILL_KEY_STAGES
    EPI: gl.constexpr = PREFILL_SCORE_STAGES
    ROWS: gl.constexpr = BN if PAGE_SHIFT >= 6 else (1 << PAGE_SHIFT)
    i_b, i_s = gl.program_id(0), gl.program_id(1)
    rows: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])  # unswizzled rows, each indexed as one
    q_smem = gl.allocate_shared_memory(gl.float8e4nv, [2, 2 * HI, 128],
                                       gl.NVMMASharedLayout.get_default_for([2 * HI, 128], gl.float8e4nv))
    w_smem = gl.allocate_shared_memory(gl.float32, [2, 2 * HI], rows)
    kbuf = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BN, 128], keys.layout)
    ebuf = gl.allocate_shared_memory(gl.int32, [STAGES, 1, BN], scales.layout)
    # (no swizzle: each slot's BN scales in order, as the copies write them)
    scale_rows = _reinterpret(ebuf, gl.int32, [STAGES, BN], rows)
    epi = gl.allocate_shared_memory(gl.float32, [EPI, BN, TB, 4], gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    full = gl.allocate_shared_memory(gl.int64, [EPI, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [EPI, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=BN // ROWS)  # each of a block's copies signals once
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(EPI):
        mbarrier.init(full.index(i), count=1)
        mbarrier.init(free.index(i), count=1)
    fence_async_shared()
    gl.warp_specialize([
        (_prefill_products, (q, w, q_smem, w_smem, kbuf, scale_rows, epi, ready, empty, full, free, t2r, n_entries,
                             i_b, i_s, S, T, R, L, rank, world, interleave, s_qt, s_qh, s_wt, Hi, HI, TB, BN, STAGES,
                             EPI)),
        (_prefill_stores, (epi, full, free, t2r, n_entries, table, allowed, scores, n_out, tickets, gmax, g_counts,
                           i_b, i_s, S, T, R, L, rank, world, interleave, s_bt, s_st, s_at, s_gt, num_slots, page_size,
                           block, nb, K, TB, BN, PAGE_SHIFT, RESTRICT, GROUPS, G, EPI)),
        (_prefill_loader, (keys, scales, kbuf, ebuf, ready, empty, t2r, n_entries, table, i_b, i_s, S, T, R, L, rank,
                           world, interleave, s_bt, s_page, num_slots, page_size, TB, BN, PAGE_SHIFT, STAGES)),
    ], [4, 1], [PREFILL_STORE_REGISTERS, PREFILL_LOADER_REGISTERS])


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _reduce(x, axis: gl.constexpr, KIND: gl.constexpr):
    """``x``'s sum (``KIND`` 0), min (1) or max (2) along ``axis``."""
    if KIND == 0:
        out = gl.sum(x, axis=axis)
    elif KIND == 1:
        out = gl.min(x, axis=axis)
    else:
        out = gl.max(x, axis=axis)
    return out


@gluon.jit
def _warp_parts(x, scratch, KIND: gl.constexpr, W: gl.constexpr):
    """Each warp's :func:`_reduce` of int32 ``x [SEG]`` (warp ``w`` holding entries
    ``w SEG / W ..``: within the warp, no barrier) into ``scratch [W]``."""
    scratch.store(_reduce(gl.reshape(x, [W, x.shape[0] // W]), 1, KIND))


@gluon.jit
def _parts_total(scratch, KIND: gl.constexpr, RL: gl.constexpr):
    """The program's total of :func:`_warp_parts` (after a barrier): every thread reduces the
    ``W`` parts itself (``RL``: all ``W`` in each thread)."""
    return _reduce(scratch.load(RL), 0, KIND)


@gluon.jit
def _program_sum(x, scratch, W: gl.constexpr, RL: gl.constexpr):
    """The sum of int32 ``x [SEG]`` over the program with one barrier: each warp's part, then
    the parts through ``scratch``. Consecutive calls use other ``scratch`` buffers (each a
    shared-memory allocation of its own), so none waits to overwrite one."""
    _warp_parts(x, scratch, 0, W)
    _cta_barrier()
    return _parts_total(scratch, 0, RL)


@gluon.jit
def _kth_key_fast(key, ok, K, held, scr, W: gl.constexpr, RL: gl.constexpr):
    """``compile_ops.indexer.triton._kth_key`` (``held``: the count of ``ok``), its program-wide
    reductions one barrier each (``scr``: six ``[W]`` buffers, :func:`_program_sum`), its
    search steps two an iteration (one per buffer of the first two)."""
    want = gl.minimum(K, held)
    _warp_parts(gl.where(ok, key, 2147483647), scr[2], 1, W)
    _warp_parts(gl.where(ok, key, -2147483648), scr[3], 2, W)
    _cta_barrier()
    lo = _parts_total(scr[2], 1, RL).to(gl.int64)  # count(key >= lo) >= want
    hi = _parts_total(scr[3], 2, RL).to(gl.int64) + 1  # count(key >= hi) < want
    at_lo = held
    while (hi - lo > 1) & (at_lo != want):
        mid = lo + (hi - lo) // 2
        at_mid = _program_sum((ok & (key >= mid.to(gl.int32))).to(gl.int32), scr[0], W, RL)
        up = at_mid >= want
        lo = gl.where(up, mid, lo)
        at_lo = gl.where(up, at_mid, at_lo)
        hi = gl.where(up, hi, mid)
        # the second step runs whether or not the first ended the search, and changes nothing
        # if it did (no branch: the scratch buffers' barriers stay one a step)
        going = (hi - lo > 1) & (at_lo != want)
        mid = lo + (hi - lo) // 2
        at_mid = _program_sum((ok & (key >= mid.to(gl.int32))).to(gl.int32), scr[1], W, RL)
        up = going & (at_mid >= want)
        lo = gl.where(up, mid, lo)
        at_lo = gl.where(up, at_mid, at_lo)
        hi = gl.where(going & (at_mid < want), mid, hi)
    _warp_parts(gl.where(ok & (key >= lo.to(gl.int32)), key, 2147483647), scr[4], 1, W)
    _cta_barrier()
    thr = _parts_total(scr[4], 1, RL)
    return thr, want - _program_sum((ok & (key > thr)).to(gl.int32), scr[5], W, RL)


@gluon.jit
def _select_segment(src_vals, src_ids, n_src, cand_vals, cand_ids, ids, vals, bound, i_t, i_s, n_t, s_src, s_ids,
                    s_cand, s_out, K, PREV_COVER, COVER, scr, held_scr, SOURCE: gl.constexpr, G: gl.constexpr,
                    SEG: gl.constexpr, K_PAD: gl.constexpr, LAST: gl.constexpr, BOUND: gl.constexpr,
                    W: gl.constexpr):
    """``compile_ops.indexer.triton._select_segment`` in id order with ``W`` warps
    (``scr``, ``held_scr``: the program-wide reductions' ``[W]`` buffers, :func:`_program_sum`)."""
    LS: gl.constexpr = gl.BlockedLayout([SEG // (32 * W)], [32], [W], [0])  # warp w: entries w SEG / W ..
    RL: gl.constexpr = gl.BlockedLayout([W], [32], [W], [0])  # the W warps' sums in every thread
    KL: gl.constexpr = gl.BlockedLayout([K_PAD // (32 * W) if K_PAD >= 32 * W else 1], [32], [W], [0])
    idx, x, key, ok = _level_entries(src_vals, src_ids, n_src, bound, i_t, i_s * SEG + gl.arange(0, SEG, LS), n_t,
                                     s_src, s_ids, PREV_COVER, SOURCE, G, K_PAD)
    held = _program_sum(ok.to(gl.int32), held_scr, W, RL)
    thr = gl.to_tensor(-2147483648)  # keep every entry ...
    need = K
    if held > K:  # ... unless this program holds more than K
        thr, need = _kth_key_fast(key, ok, K, held, scr, W, RL)
    eq = (ok & (key == thr)).to(gl.int32)
    keep = (ok & (key > thr)) | ((eq != 0) & (gl.associative_scan(eq, 0, _add) - eq < need))
    keep_i = keep.to(gl.int32)
    at = gl.associative_scan(keep_i, 0, _add) - keep_i
    taken = gl.sum(keep_i, axis=0)
    o_k = gl.arange(0, K_PAD, KL)
    if LAST or n_t <= COVER:
        if BOUND:
            gl.store(bound + i_t, thr)
        gl.store(ids + i_t * s_out + at, idx, mask=keep)
        gl.store(vals + i_t * s_out + at, x, mask=keep)
        after = (o_k >= taken) & (o_k < K)
        gl.store(ids + i_t * s_out + o_k, gl.full([K_PAD], -1, gl.int32, KL), mask=after)
        gl.store(vals + i_t * s_out + o_k, gl.full([K_PAD], float("-inf"), gl.float32, KL), mask=after)
    else:
        at_cand = i_t.to(gl.int64) * s_cand + i_s * K_PAD
        gl.store(cand_ids + at_cand + at, idx, mask=keep)
        gl.store(cand_vals + at_cand + at, x, mask=keep)
        gl.store(cand_vals + at_cand + o_k, gl.full([K_PAD], float("-inf"), gl.float32, KL), mask=o_k >= taken)


@gluon.jit
def _last_to_finish(tickets, i_t, programs):
    """``compile_ops.indexer.triton._last_to_finish``."""
    _cta_barrier()  # every thread's stores are made before the count says so
    last = gl.atomic_add(tickets + i_t, 1, sem="acq_rel") == programs - 1
    if last:
        gl.store(tickets + i_t, 0)
    return last


@gluon.jit
def _topk_level_kernel(
    src_vals, src_ids, n, n_src, cand_vals, cand_ids, ids, vals, bound, tickets, s_src, s_ids, s_cand, s_out, K,
    PREV_COVER, COVER, SOURCE: gl.constexpr, G: gl.constexpr, SEG: gl.constexpr, K_PAD: gl.constexpr,
    LAST: gl.constexpr, BOUND: gl.constexpr, THEN_SEG: gl.constexpr, W: gl.constexpr,
):
    """``compile_ops.indexer.triton._segment_topk_kernel`` in id order (no ``SORTED``) with
    ``W`` warps: the same entries, ids and order; its search's steps each one barrier
    (:func:`_program_sum`) where the portable kernel's block reductions take three."""
    # [W] buffers of the program-wide reductions (_program_sum), one allocation each
    SCR: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    scr = (gl.allocate_shared_memory(gl.int32, [W], SCR), gl.allocate_shared_memory(gl.int32, [W], SCR),
           gl.allocate_shared_memory(gl.int32, [W], SCR), gl.allocate_shared_memory(gl.int32, [W], SCR),
           gl.allocate_shared_memory(gl.int32, [W], SCR), gl.allocate_shared_memory(gl.int32, [W], SCR))
    held_scr = gl.allocate_shared_memory(gl.int32, [W], SCR)
    _wait_prior_grid()  # a programmatic dependent launch, as the scores kernel is
    i_t, i_s = gl.program_id(0), gl.program_id(1)
    n_t = gl.maximum(gl.load(n + i_t), 0)
    if (n_t > PREV_COVER) & ((i_s == 0) | (i_s * COVER < n_t)):
        _select_segment(src_vals, src_ids, n_src, cand_vals, cand_ids, ids, vals, bound, i_t, i_s, n_t, s_src, s_ids,
                        s_cand, s_out, K, PREV_COVER, COVER, scr, held_scr, SOURCE, G, SEG, K_PAD, LAST, BOUND, W)
        if THEN_SEG > 0:
            if n_t > COVER:
                if _last_to_finish(tickets, i_t, gl.cdiv(n_t, COVER)):
                    _select_segment(cand_vals, cand_ids, n_src, cand_vals, cand_ids, ids, vals, bound, i_t, 0, n_t,
                                    s_cand, s_cand, s_cand, s_out, K, COVER, n_t, scr, held_scr, 1, G, THEN_SEG, K_PAD,
                                    True, BOUND, W)


def launch_scores_gluon(args: IndexerArgs, lo: int, hi: int, scores: torch.Tensor, n: torch.Tensor,
                        tickets: torch.Tensor, allowed: torch.Tensor, maxima: Optional[GroupMaxima]) -> None:
    """:func:`_scores_kernel` over tokens ``lo:hi`` (the arguments of
    :func:`compile_ops.indexer.triton.launch_scores`), :data:`GLUON_TOKENS` tokens a program in
    a prefill step (:func:`compile_ops.indexer.triton.scores_tokens`)."""
    q, w, cache, table = args.q, args.weights, args.cache, args.block_table
    R, page_size = table.shape[0], cache.shape[1]
    L = table.shape[1] * page_size
    rank, world, interleave = args.shard
    TB = scores_tokens(hi - lo, R, GLUON_TOKENS)
    blocks = triton.cdiv(hi - lo, TB)
    S = key_splits(blocks, TB, triton.cdiv(L, BN), num_sms(q.device))
    gmax, g_counts = (scores, n) if maxima is None else maxima  # (unread without the maxima)
    HI = max(16, triton.next_power_of_2(q.shape[1]))
    PAGE_SHIFT = page_size.bit_length() - 1 if page_size & (page_size - 1) == 0 else -1
    descriptors = prefill_descriptors(cache) if TB == GLUON_TOKENS and HI == 32 and not args.fmt.fp4 else None
    if descriptors is not None:
        _prefill_scores_kernel[(blocks, S)](
            q[lo:hi], w[lo:hi], args.token_to_req[lo:hi], args.n_entries[lo:hi], *descriptors, table, allowed, scores,
            n, tickets, gmax, g_counts, q.stride(0), q.stride(1), w.stride(0), cache.stride(0), table.stride(0),
            scores.stride(0), allowed.stride(0), gmax.stride(0), hi - lo, R, L, cache.shape[0] * page_size, page_size,
            q.shape[1], S, rank, world, interleave, args.candidate_block, allowed.shape[-1], args.k,
            HI=HI, TB=TB, RESTRICT=args.candidates is not None, BN=BN, PAGE_SHIFT=PAGE_SHIFT,
            GROUPS=maxima is not None, G=TOPK_GROUP, num_warps=4, maxnreg=PREFILL_REGISTERS, launch_pdl=True)
        return
    _scores_kernel[(blocks, S)](
        q[lo:hi], w[lo:hi], args.token_to_req[lo:hi], args.n_entries[lo:hi], cache, table, allowed, scores, n,
        tickets, gmax, g_counts, q.stride(0), q.stride(1), w.stride(0), cache.stride(0), table.stride(0),
        scores.stride(0), allowed.stride(0), gmax.stride(0), hi - lo, R, L, cache.shape[0] * page_size, page_size,
        q.shape[1], S, rank, world, interleave, args.candidate_block, allowed.shape[-1], args.k,
        HI=HI, TB=TB, RESTRICT=args.candidates is not None, BN=BN, PAGE_SHIFT=PAGE_SHIFT, STAGES=STAGES,
        FP4=args.fmt.fp4, GROUPS=maxima is not None, G=TOPK_GROUP, num_warps=4,
        maxnreg=max_registers(TB, args.fmt.fp4), launch_pdl=True)


def prefill_descriptors(cache: torch.Tensor) -> Optional[tuple[TensorDescriptor, TensorDescriptor]]:
    """TMA descriptors of an fp8 index cache ``[num_pages, page_size, 132]`` for
    :func:`_prefill_scores_kernel`, or ``None`` where its pages are not a power of two of at
    least 32 entries (nor contiguous rows): its key bytes as rows of 128 e4m3 in boxes of
    ``ROWS = min(page_size, BN)`` rows, and its scale bytes as rows of ``ROWS`` int32 (a
    box's scales), one box each; a page's keys start at key row ``page * s_page / 128``, its
    scales at scale row ``(page * s_page + page_size * 128) / (4 ROWS)``."""
    pages, page_size, row_width = cache.shape
    s_page = cache.stride(0)
    rows = min(page_size, BN)
    if (not pages or page_size < 32 or page_size & (page_size - 1) or cache.stride(1) != row_width
            or cache.stride(2) != 1 or s_page % (4 * rows)):
        return None
    keys = TensorDescriptor(cache.view(torch.float8_e4m3fn), [(pages - 1) * (s_page // 128) + page_size, 128],
                            [128, 1], [rows, 128], gl.NVMMASharedLayout.get_default_for([BN, 128], gl.float8e4nv))
    scale_rows = ((pages - 1) * s_page + page_size * row_width) // (4 * rows)
    scales = TensorDescriptor(cache.view(torch.int32), [scale_rows, rows],
                              [rows, 1], [1, rows], gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32,
                                                                         rank=2))
    return keys, scales


def key_splits(blocks: int, tokens: int, key_blocks: int, sms: int) -> int:
    """``S``, the programs of each of a launch's ``blocks`` blocks of ``tokens`` tokens (each
    program takes every ``S``-th of the ``key_blocks`` blocks of ``BN`` entries): one wave of
    :data:`PROGRAMS_PER_SM` programs an SM over ``sms`` SMs where a step may be all decode
    (``tokens == 1``), :data:`PREFILL_WAVES` waves in a prefill step; at least 1, at most
    ``key_blocks``."""
    programs = PROGRAMS_PER_SM * sms
    splits = programs // blocks if tokens == 1 else triton.cdiv(PREFILL_WAVES * programs, blocks)
    return max(1, min(key_blocks, splits))


def max_registers(tokens: int, fp4: bool) -> Optional[int]:
    """The register limit of a launch of ``tokens`` tokens a program (``None``: the compiler's)."""
    return PREFILL_FP8_REGISTERS if tokens > 1 and not fp4 else None


def gluon_args_unsupported(args: IndexerArgs) -> Optional[str]:
    """The ``gluon`` backend's limits: ``None`` when its scores kernel takes this call."""
    if isinstance(args.q, FunctionalTensor):
        return "a traced launch (lowering.inductor) runs the triton backend's kernels"
    if args.q.shape[1] > GLUON_MAX_HEADS:
        return f"the Gluon scores kernel takes at most {GLUON_MAX_HEADS} heads, got {args.q.shape[1]}"
    cache = args.cache
    if cache.stride(0) % 16 or cache.storage_offset() % 16:  # uint8: strides in bytes
        return ("the Gluon scores kernel copies keys 16 bytes at a time: it needs the index cache's pages "
                f"16-byte aligned, got a page stride of {cache.stride(0)} bytes at offset {cache.storage_offset()}")
    return triton_args_unsupported(args)


indexer_topk_gluon = functools.partial(indexer_topk_triton, launch=launch_scores_gluon, level_kernel=_topk_level_kernel)
indexer_candidates_gluon = functools.partial(indexer_candidates_triton, launch=launch_scores_gluon,
                                             level_kernel=_topk_level_kernel)
indexer_topk_and_candidates_gluon = functools.partial(indexer_topk_and_candidates_triton, launch=launch_scores_gluon,
                                                      level_kernel=_topk_level_kernel)
