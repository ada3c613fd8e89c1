"""Warp-specialized Gluon kernel for ``dsv41::sparse_mla`` on Hopper (sm_90): backend ``"gluon"``.

Same contract, arguments, launch plan (:mod:`compile_ops.mla.plan`) and LSE merge
(:mod:`compile_ops.mla.merge`) as the ``tl`` kernel of :mod:`compile_ops.mla.triton`; only
the schedule on the SM differs. One program owns one token, 64 heads and a range of 64-row
blocks (SWA blocks first), and runs three warpgroups:

* a **producer** (4 warps) gathers each block's rows into a ring of two bf16 key tiles in
  shared memory: ``bf16`` rows by ``cp.async`` straight into the MMA layout; the fp8
  formats' raw bytes by ``cp.async`` into a staging buffer and the tile, converted in place
  (``cvt.rn.f16x2.e4m3x2``, then one exact ``mul.rn.bf16x2`` by the UE8M0 scale per two
  values); ``fp4_dsv41``'s packed bytes the same way, widened by byte-permute table
  lookups and one exact multiply by the e4m3 scale per two values. With two formats in one
  call the window's blocks are produced in its format, then the compressed ones in theirs.
  Slots are loaded two blocks ahead, so no copy waits for an index load;
* consumer **warpgroup 0** computes ``S = Q K^T`` (``wgmma`` m64n64, reading Q once), the
  online softmax and ``O[:, :256] += P K[:, :256]``, and hands ``P`` and the rescale factor
  to
* consumer **warpgroup 1**, which computes ``O[:, 256:] += P K[:, 256:]`` while warpgroup 0
  starts the next block.

So the gather and dequantization of block ``i + 1`` overlap the tensor-core work on block
``i`` (FlashMLA's SM90 sparse decoding splits its warps the same way; Triton's Gluon
tutorials show the ``warp_specialize`` / ``mbarrier`` idiom). The kernel is a programmatic
dependent launch: its programs may start while the stream's previous kernel runs, and every
partition waits on the device for it before touching global memory. With few programs
(small ``T``) two programs share each (token, head block, split), each storing 256 of the
512 output columns (``DSPLIT = 2``). How it works in full: ``docs/gluon.md``; figures:
``docs/performance-sparse-mla.md``.
"""
from __future__ import annotations

from typing import Optional

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from compile_ops import formats
from compile_ops.mla.merge import merge
from compile_ops.mla.inputs import SparseMLAArgs
from compile_ops.mla.plan import BN, UNSPECIALIZED, gluon_args_unsupported, plan

# The Gluon names that differ across the supported Triton releases (3.6 to 3.9), each the
# same operation under its newer name where the installed Triton has it: 3.7 renamed
# ``thread_barrier`` (a barrier of the program's threads) to ``barrier``; 3.8 renamed the
# ``cp.async`` copy ``async_copy_global_to_shared`` to ``async_load`` (3.9 removed the old
# name); 3.9 made the shared-memory view's ``_reinterpret`` public as ``reinterpret``.
_cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
_reinterpret = getattr(gl.shared_memory_descriptor, "reinterpret", None) or gl.shared_memory_descriptor._reinterpret

LOG2E = gl.constexpr(formats.LOG2E)

STAGES = 2  # key tiles in flight: Q (64 KB) + 2 x 64 KB + P (8 KB) (+ 16 KB fp8 staging) fill the 227 KB
# the producer's registers per thread (no spills in any format); the rest of 168 x 12 warps
# goes to the consumers (warpgroup 0: 504 - 176 - 112 = 216; it spills at 208)
PRODUCER_REGS = 112
RIGHT_REGS = 176  # warpgroup 1: 128 accumulator registers; 152 serializes its wgmma
MAX_REGS = 168


@gluon.jit
def _wait_prior_grid():
    """``griddepcontrol.wait``: this kernel is a programmatic dependent launch, so its programs
    may start while the stream's previous kernel still runs (for the attention kernel often
    the previous call's LSE merge, which reads the partials this call overwrites; the
    indexer's kernels, ``compile_ops.indexer.gluon``, wait here too). Every partition waits
    here for that kernel to finish, and for its writes, before its first global load or store."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _span(i_t, i_s, swa_len, cmp_len, W, K, n_split, BN: gl.constexpr):
    """This program's blocks ``[i_b0, i_b1)`` (SWA blocks first) and the segment lengths."""
    n_swa = gl.minimum(gl.maximum(gl.load(swa_len + i_t), 0), W)
    n_cmp = gl.minimum(gl.maximum(gl.load(cmp_len + i_t), 0), K)
    nb_swa = gl.cdiv(n_swa, BN)
    nb = nb_swa + gl.cdiv(n_cmp, BN)
    return n_swa, n_cmp, nb_swa, i_s * nb // n_split, (i_s + 1) * nb // n_split


@gluon.jit
def _slots(i_b, o_r, live, i_t, n_swa, n_cmp, nb_swa, seg, BN: gl.constexpr):
    """Slots of rows ``o_r`` of block ``i_b`` (SWA blocks first), ``-1`` for a hole, an entry
    past its ``lens``, a slot outside its cache, or when not ``live``.

    ``seg`` = (swa_kv, swa_idx, s_swa_t, s_swa_n, swa_page, swa_stride, swa_slots, and the
    same seven for the compressed segment)."""
    swa_kv, swa_idx, s_swa_t, s_swa_n, swa_page, swa_stride, swa_slots, \
        cmp_kv, cmp_idx, s_cmp_t, s_cmp_n, cmp_page, cmp_stride, cmp_slots = seg
    is_swa = i_b < nb_swa
    o_n = gl.where(is_swa, i_b, i_b - nb_swa) * BN + o_r
    p_idx = gl.where(is_swa, swa_idx + i_t * s_swa_t, cmp_idx + i_t * s_cmp_t)
    s_n = gl.where(is_swa, s_swa_n, s_cmp_n)
    n_len = gl.where(is_swa, n_swa, n_cmp)
    n_slots = gl.where(is_swa, swa_slots, cmp_slots)
    slot = gl.load(p_idx + o_n * s_n, mask=(o_n < n_len) & live, other=-1)
    return gl.where((slot >= 0) & (slot < n_slots), slot, -1)


@gluon.jit
def _cache(i_b, nb_swa, seg):
    """The cache block ``i_b`` reads: the SWA one for the first ``nb_swa`` blocks."""
    return gl.where(i_b < nb_swa, seg[0], seg[7])


@gluon.jit
def _row_offsets(slot, i_b, nb_swa, seg, DATA: gl.constexpr, SCALE: gl.constexpr, PAGE_SHIFT: gl.constexpr):
    """:func:`_slots` -> (block ``i_b``'s cache, each row's data and scale offsets in it, in
    elements, valid); an invalid row's offsets are its page base and are never read."""
    swa_kv, swa_idx, s_swa_t, s_swa_n, swa_page, swa_stride, swa_slots, \
        cmp_kv, cmp_idx, s_cmp_t, s_cmp_n, cmp_page, cmp_stride, cmp_slots = seg
    is_swa = i_b < nb_swa
    page = gl.where(is_swa, swa_page, cmp_page)
    stride = gl.where(is_swa, swa_stride, cmp_stride)
    valid = slot >= 0
    slot = gl.maximum(slot, 0)
    if PAGE_SHIFT:  # `page` holds log2(page size)
        o_page = (slot >> page).to(gl.int64) * stride
        off = slot & ((1 << page) - 1)
        page = 1 << page
    else:
        o_page = (slot // page).to(gl.int64) * stride
        off = slot % page
    return _cache(i_b, nb_swa, seg), o_page + off * DATA, o_page + page * DATA + off * SCALE, valid


@gluon.jit
def _convert(x, e, SCALED: gl.constexpr):
    """int32 words ``x`` (four e4m3 bytes each, along the last axis) and their UE8M0 scale
    bytes ``e`` (broadcast over the last axis) -> ``[rows, 4 * words]`` bf16: each byte times
    ``2^(e - 127)``, or unscaled when not ``SCALED``.
    The e4m3 values are exact in bf16 and the scale is a power of two, so the one rounding
    (``mul.rn.bf16x2``, after ``cvt.rn.f16x2.e4m3x2`` and fp32) is that of the exact product."""
    e = e.to(gl.int32)
    scale = gl.where(e == 0, 0x400040, (e << 23) | (e << 7))  # 2^(e - 127) as a bf16 pair (subnormal at 0)
    k0, k1, k2, k3 = gl.inline_asm_elementwise(
        """{
        .reg .b16 lo, hi, a0, a1, b0, b1;
        .reg .b32 a, b;
        .reg .f32 f0, f1, f2, f3;
        mov.b32 {lo, hi}, $4;
        cvt.rn.f16x2.e4m3x2 a, lo;
        cvt.rn.f16x2.e4m3x2 b, hi;
        mov.b32 {a0, a1}, a;
        mov.b32 {b0, b1}, b;
        cvt.f32.f16 f0, a0;
        cvt.f32.f16 f1, a1;
        cvt.f32.f16 f2, b0;
        cvt.f32.f16 f3, b1;
        cvt.rn.bf16x2.f32 a, f1, f0;
        cvt.rn.bf16x2.f32 b, f3, f2;
        """ + ("""mul.rn.bf16x2 a, a, $5;
        mul.rn.bf16x2 b, b, $5;
        """ if SCALED else "") + """mov.b32 {$0, $1}, a;
        mov.b32 {$2, $3}, b;
        }""",
        "=h,=h,=h,=h,r,r", [x, scale], (gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16), is_pure=True, pack=1)
    # byte b of word w is column 4 w + b
    k = gl.join(gl.join(k0, k2), gl.join(k1, k3))
    return gl.reshape(k, [x.shape[0], x.numel // x.shape[0] * 4])


@gluon.jit
def _dequantize(src, NB: gl.constexpr, off: gl.constexpr, tile, scales, j0: gl.constexpr, j1: gl.constexpr,
                NOPE: gl.constexpr, BLOCK: gl.constexpr, BN: gl.constexpr):
    """The e4m3 bytes of column blocks ``j0 <= j < j1`` (64 columns of every row, 4 KB at
    ``_raw_words(src, NB)[off + j]``) -> bf16 columns ``64 j .. 64 j + 63`` of
    ``tile``, times their UE8M0 scale bytes (``scales[row, NS j ..]``; ``fp8`` has none).
    Block ``j + 1`` is loaded before block ``j`` is stored: the pass is bound by load
    latency, which this overlaps."""
    NS: gl.constexpr = _scales_per_64(BLOCK)  # scale bytes per 64 columns
    LW: gl.constexpr = gl.BlockedLayout([1, 1, 4], [8, NS, 4 // NS], [4, 1, 1], [2, 1, 0])
    raw = _raw_words(src, NB, NOPE, BLOCK, BN)
    x, e = _raw_block(raw, off, scales, j0, NOPE, BLOCK, BN, LW)
    for j in gl.static_range(j0, j1):
        # the next block's loads go out before this block's store (never overlapping it)
        if j + 1 < j1:
            x_next, e_next = _raw_block(raw, off, scales, j + 1, NOPE, BLOCK, BN, LW)
        tile.slice(64 * j, 64, dim=1).store(_convert(x, e, not _tensor_scaled(NOPE, BLOCK)))
        if j + 1 < j1:
            x, e = x_next, e_next


@gluon.jit
def _raw_words(buf, NB: gl.constexpr, NOPE: gl.constexpr, BLOCK: gl.constexpr, BN: gl.constexpr):
    """``buf`` (a key tile: ``NB = 16``, or the staging buffer: ``NB = 4``) as ``NB`` 4 KB
    raw column blocks of words ``[NB, BN, NS, 16 / NS]``."""
    NS: gl.constexpr = _scales_per_64(BLOCK)
    return _reinterpret(buf, gl.int32, [NB, BN, NS, 16 // NS], gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0]))


@gluon.jit
def _raw_block(raw, off: gl.constexpr, scales, j: gl.constexpr, NOPE: gl.constexpr, BLOCK: gl.constexpr, BN: gl.constexpr,
               LW: gl.constexpr):
    """Column block ``j``'s raw words ``[BN, NS, 16 / NS]`` and scale bytes ``[BN, NS, 1]``."""
    NS: gl.constexpr = _scales_per_64(BLOCK)
    x = raw.index(off + j).load(LW)
    if _tensor_scaled(NOPE, BLOCK):  # one scale for the whole cache, applied to the scores and the output
        e = gl.full([BN, NS, 1], 127, gl.uint8, LW)
    else:
        e = scales.slice(NS * j, NS, dim=1).load(gl.SliceLayout(2, LW)).expand_dims(2)
    return x, e


@gluon.jit
def _producer(kbuf, stage_buf, scale_buf, bias, ready, empty, i_t, i_s, span_args, seg,
              NOPE: gl.constexpr, BLOCK: gl.constexpr, FP4: gl.constexpr, DATA: gl.constexpr, SCALE: gl.constexpr,
              CMP_NOPE: gl.constexpr, CMP_BLOCK: gl.constexpr, CMP_FP4: gl.constexpr, CMP_DATA: gl.constexpr,
              CMP_SCALE: gl.constexpr, MIXED: gl.constexpr, SROW: gl.constexpr, PAGE_SHIFT: gl.constexpr,
              BN: gl.constexpr, STAGES: gl.constexpr):
    """The producer warpgroup: each block's rows into the next free tile (``empty``), its
    score bias next to it, then ``ready`` (see the module docstring). With two formats
    (``MIXED``) the window's blocks are produced in its format, then the compressed
    cache's in the ``CMP_*`` one."""
    _wait_prior_grid()
    swa_len, cmp_len, W, K, n_split = span_args
    n_swa, n_cmp, nb_swa, i_b0, i_b1 = _span(i_t, i_s, swa_len, cmp_len, W, K, n_split, BN)
    slot_args = (i_t, n_swa, n_cmp, nb_swa, seg)
    bufs = (kbuf, stage_buf, scale_buf, bias, ready, empty)
    if MIXED:
        i_mid = gl.minimum(gl.maximum(nb_swa, i_b0), i_b1)
        _produce(bufs, i_b0, i_mid, 0, slot_args, NOPE, BLOCK, FP4, DATA, SCALE, SROW, PAGE_SHIFT, BN, STAGES)
        _produce(bufs, i_mid, i_b1, i_mid - i_b0, slot_args, CMP_NOPE, CMP_BLOCK, CMP_FP4, CMP_DATA, CMP_SCALE, SROW,
                 PAGE_SHIFT, BN, STAGES)
    else:
        _produce(bufs, i_b0, i_b1, 0, slot_args, NOPE, BLOCK, FP4, DATA, SCALE, SROW, PAGE_SHIFT, BN, STAGES)


@gluon.jit
def _produce(bufs, i_b0, i_b1, base, slot_args, NOPE: gl.constexpr, BLOCK: gl.constexpr, FP4: gl.constexpr,
             DATA: gl.constexpr, SCALE: gl.constexpr, SROW: gl.constexpr, PAGE_SHIFT: gl.constexpr, BN: gl.constexpr,
             STAGES: gl.constexpr):
    """Blocks ``[i_b0, i_b1)``, all in one format, into the tiles from the program's block
    ``base`` on (which picks the tile and barrier phase). Every block's slots are loaded two
    blocks ahead: loaded one block ahead, ptxas placed their first use before this block's
    copies, which then waited for the index load. Returns with no copy in flight."""
    kbuf, stage_buf, scale_buf, bias, ready, empty = bufs
    nb_swa, seg = slot_args[3], slot_args[4]
    n = i_b1 - i_b0
    if NOPE == 0:  # 16 bytes per thread and cp.async, 4 rows of 128 bytes per warp and copy
        LC: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        o_r = gl.arange(0, BN, gl.SliceLayout(1, LC))
        o_d = gl.arange(0, 512, gl.SliceLayout(0, LC))
        slot_next = _slots(i_b0, o_r, n > 0, *slot_args, BN)
        slot_after = _slots(i_b0 + 1, o_r, n > 1, *slot_args, BN)
        for i in range(n):
            st = (base + i) % STAGES
            slot, slot_next = slot_next, slot_after
            slot_after = _slots(i_b0 + i + 2, o_r, i + 2 < n, *slot_args, BN)
            kv, o_row, _, valid = _row_offsets(slot, i_b0 + i, nb_swa, seg, DATA, SCALE, PAGE_SHIFT)
            mbarrier.wait(empty.index(st), (((base + i) // STAGES) & 1) ^ 1)
            bias.index(st).store(gl.where(valid, 0.0, float("-inf")))
            # straight into the MMA layout; `ready` completes when the copies land: no
            # waiting here, so the next tile's copies go out as soon as it is free (up to
            # two tiles in flight)
            _async_load(kbuf.index(st), (kv + o_row)[:, None] + o_d[None, :],
                                                   mask=valid[:, None])
            async_copy.mbarrier_arrive(ready.index(st))
            _cta_barrier()
            mbarrier.arrive(ready.index(st), count=1)
    else:
        # fp8: raw column blocks 0..3 of block i + 1 (and its scale bytes) go by cp.async into
        # `stage_buf` while block i is converted, so their latency overlaps it; the rest of
        # a block's raw bytes (and fp8_ds_mla's bf16 RoPE columns) go into its tile once it
        # is free (see _copy_tile), and are converted in place after the staged ones. fp4:
        # the same with the packed bytes, those of columns 0..255 staged (8 KB), those of
        # columns 256..511 in the tile's last 8 KB
        L_ROW: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, _fp4_copy_layout() if FP4 else _copy_layout()))
        o_r = gl.arange(0, BN, L_ROW)
        NCB: gl.constexpr = NOPE // 64
        if _tensor_scaled(NOPE, BLOCK):  # no scale bytes: ``scale_buf`` is the key tiles, never read as scales
            scales = scale_buf
        else:
            scales = _reinterpret(scale_buf, gl.uint8, [STAGES, BN, SROW], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
        rows_next = _copy_staged(stage_buf, scale_buf.index(base % STAGES), _slots(i_b0, o_r, n > 0, *slot_args, BN), i_b0,
                                 nb_swa, seg, DATA, SCALE, PAGE_SHIFT, NOPE, BLOCK, FP4, BN)
        async_copy.commit_group()
        slot_next = _slots(i_b0 + 1, o_r, n > 1, *slot_args, BN)
        for i in range(n):
            st = (base + i) % STAGES
            p_row, valid = rows_next
            slot_after = _slots(i_b0 + i + 2, o_r, i + 2 < n, *slot_args, BN)
            tile = kbuf.index(st)
            mbarrier.wait(empty.index(st), (((base + i) // STAGES) & 1) ^ 1)
            bias.index(st).store(gl.where(valid, 0.0, float("-inf")))
            _copy_tile(tile, p_row, valid, NOPE, BLOCK, FP4, BN)
            async_copy.commit_group()
            async_copy.wait_group(1)  # block i's staged bytes have landed
            _cta_barrier()
            if FP4:
                _dequantize_fp4(stage_buf, 8, 0, tile, scales.index(st), 0, BN)
            else:
                _dequantize(stage_buf, 4, 0, tile, scales.index(st), 0, 4, NOPE, BLOCK, BN)
            _cta_barrier()  # every thread has read the staged bytes
            rows_next = _copy_staged(stage_buf, scale_buf.index((base + i + 1) % STAGES), slot_next, i_b0 + i + 1, nb_swa, seg,
                                     DATA, SCALE, PAGE_SHIFT, NOPE, BLOCK, FP4, BN)
            slot_next = slot_after
            async_copy.commit_group()
            async_copy.wait_group(1)  # block i's tile part has landed
            _cta_barrier()
            if FP4:
                _dequantize_fp4(tile, 32, 28, tile, scales.index(st), 4, BN)
            else:
                _dequantize(tile, 16, _raw_offset(NOPE), tile, scales.index(st), 4, NCB, NOPE, BLOCK, BN)
            fence_async_shared()
            _cta_barrier()
            mbarrier.arrive(ready.index(st), count=1)
        async_copy.wait_group(0)  # the (masked) staged copy past the last block: nothing in flight


@gluon.constexpr_function
def _fp4_copy_layout():
    """fp4 packed copies ``[4 column blocks, BN, 8 words]`` (32 bytes of a row per 64
    columns): 16 bytes per thread and cp.async, a warp covering 16 rows x 32 bytes."""
    return gl.BlockedLayout([1, 1, 4], [1, 16, 2], [1, 4, 1], [2, 1, 0])


@gluon.jit
def _copy_fp4_rows(dst, p_row, valid, j0: gl.constexpr, BN: gl.constexpr):
    """The packed bytes of column blocks ``j0 .. j0 + 3`` of the rows at ``p_row`` (byte
    pointers; zeros where not ``valid``) into ``dst [4, BN, 8]`` int32 words, by
    ``cp.async`` (for the caller to commit)."""
    L3: gl.constexpr = _fp4_copy_layout()
    o_j = gl.arange(0, 4, gl.SliceLayout(1, gl.SliceLayout(2, L3)))[:, None, None]
    o_w = gl.arange(0, 8, gl.SliceLayout(0, gl.SliceLayout(1, L3)))[None, None, :]
    _async_load(dst, p_row.to(gl.pointer_type(gl.int32))[None, :, None] + (j0 + o_j) * 8 + o_w,
                mask=valid[None, :, None])


@gluon.jit
def _copy_fp4(stage_buf, scale_st, slot, i_b, nb_swa, seg, DATA: gl.constexpr, SCALE: gl.constexpr,
              PAGE_SHIFT: gl.constexpr, BN: gl.constexpr):
    """:func:`_copy_staged` for ``fp4_dsv41``: block ``i_b``'s packed bytes of column
    blocks 0..3 (rows ``slot``) into the first 8 KB of ``stage_buf`` (``[BN, 8]`` words
    each) and its e4m3 scale bytes into ``scale_st``."""
    kv, o_row, o_scale, valid = _row_offsets(slot, i_b, nb_swa, seg, DATA, SCALE, PAGE_SHIFT)
    p_row = kv + gl.multiple_of(o_row, 16)
    _copy_fp4_rows(_packed_words(stage_buf, 8, BN).slice(0, 4), p_row, valid, 0, BN)
    SW: gl.constexpr = SCALE // 4
    LS: gl.constexpr = gl.BlockedLayout([1, 4], [16, 2], [4, 1], [1, 0])  # rows as in the copy layout
    p_scale = gl.convert_layout(kv + gl.multiple_of(o_scale, 16), gl.SliceLayout(1, LS))
    o_s = gl.arange(0, SW, gl.SliceLayout(0, LS))
    _async_load(scale_st.slice(0, SW, dim=1), p_scale.to(gl.pointer_type(gl.int32))[:, None] + o_s[None, :],
                mask=gl.convert_layout(valid, gl.SliceLayout(1, LS))[:, None])
    return p_row, valid


@gluon.jit
def _packed_words(buf, NB: gl.constexpr, BN: gl.constexpr):
    """``buf`` (the staging buffer: ``NB = 8``, or a key tile: ``NB = 32``) as ``NB``
    packed fp4 column blocks of words ``[NB, BN, 8]`` (2 KB each)."""
    return _reinterpret(buf, gl.int32, [NB, BN, 8], gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0]))


@gluon.jit
def _dequantize_fp4(raw, NB: gl.constexpr, r0: gl.constexpr, tile, scales, j0: gl.constexpr, BN: gl.constexpr):
    """Packed column blocks ``r0 .. r0 + 3`` of ``raw`` (:func:`_packed_words`) -> bf16 column
    blocks ``j0 .. j0 + 3`` of ``tile``, each value times its e4m3 scale (``scales [BN, >=
    32]`` bytes, one per 16 values). Block ``j + 1`` is loaded before block ``j`` is stored,
    which overlaps the loads' latency; the last store waits for every thread's loads, as it
    may overwrite the packed bytes (column blocks 4..7 lie in the tile's last 8 KB)."""
    LW: gl.constexpr = gl.BlockedLayout([1, 1, 2], [8, 4, 1], [4, 1, 1], [2, 1, 0])  # [BN, 4 scale blocks, 2 words]
    words = _reinterpret(raw, gl.int32, [NB, BN, 4, 2], gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0]))
    LE: gl.constexpr = gl.SliceLayout(2, LW)
    x = words.index(r0).load(LW)
    e = scales.slice(4 * j0, 4, dim=1).load(LE).expand_dims(2)
    for j in gl.static_range(4):
        if j + 1 < 4:
            x_next = words.index(r0 + j + 1).load(LW)
            e_next = scales.slice(4 * (j0 + j + 1), 4, dim=1).load(LE).expand_dims(2)
        else:
            _cta_barrier()
        tile.slice(64 * (j0 + j), 64, dim=1).store(_convert_fp4(x, e))
        if j + 1 < 4:
            x, e = x_next, e_next


# _convert_fp4's PTX: a word ($8, eight e2m1 codes, the first in the low nibble) and its
# block's scale as a bf16 pair ($9) into eight bf16 values $0..$7; $10 / $11 and $12 / $13
# are the high and low bytes of the bf16 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 (byte tables
# for prmt, passed in so that they stay in registers). For four codes (a half-word) at a
# time: two byte permutes look the magnitudes' bytes up, a third spreads the four sign bits
# over bytes (its sign-replicating mode: codes 1 and 3 have theirs in the top bit of bytes
# of x, codes 0 and 2 in bytes of x << 4), two more interleave the bytes into two bf16
# pairs, and one exact multiply each applies the scale (an e2m1 value times an e4m3 scale
# has at most 6 significant bits: exact in bf16).
_E2M1X8_TO_BF16 = gl.constexpr("""{
.reg .b32 m, m2, x4, h, l, s, w;
and.b32 m, $8, 0x77777777;
shr.b32 m2, m, 16;
shl.b32 x4, $8, 4;
""" + "".join(f"""prmt.b32 h, $10, $11, {sel};
prmt.b32 l, $12, $13, {sel};
prmt.b32 s, $8, x4, {signs};
and.b32 s, s, 0x80808080;
or.b32 h, h, s;
prmt.b32 w, l, h, 0x5140;
mul.rn.bf16x2 w, w, $9;
mov.b32 {{${4 * half}, ${4 * half + 1}}}, w;
prmt.b32 w, l, h, 0x7362;
mul.rn.bf16x2 w, w, $9;
mov.b32 {{${4 * half + 2}, ${4 * half + 3}}}, w;
""" for half, sel, signs in ((0, "m", "0x9D8C"), (1, "m2", "0xBFAE"))) + "}")


@gluon.jit
def _convert_fp4(x, e):
    """int32 words ``x [rows, blocks, 2]`` (eight e2m1 codes each, along the last axis) and
    their blocks' e4m3 scale bytes ``e [rows, blocks, 1]`` -> ``[rows, 16 * blocks]`` bf16."""
    scale = e.to(gl.float8e4nv, bitcast=True).to(gl.float32).to(gl.bfloat16).to(gl.int16, bitcast=True)
    scale = scale.to(gl.int32) & 0xFFFF
    L: gl.constexpr = x.type.layout
    t0 = gl.full(x.shape, 0x3F3F3F00, gl.int32, L)
    t1 = gl.full(x.shape, 0x40404040, gl.int32, L)
    t2 = gl.full(x.shape, 0xC0800000 - (1 << 32), gl.int32, L)
    t3 = gl.full(x.shape, 0xC0804000 - (1 << 32), gl.int32, L)
    k = gl.inline_asm_elementwise(_E2M1X8_TO_BF16, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r,r,r",
                                  [x, scale | (scale << 16), t0, t1, t2, t3],
                                  (gl.bfloat16, ) * 8, is_pure=True, pack=1)
    # value v of word w is column 8 w + v
    k = gl.join(gl.join(gl.join(k[0], k[4]), gl.join(k[2], k[6])), gl.join(gl.join(k[1], k[5]), gl.join(k[3], k[7])))
    return gl.reshape(k, [x.shape[0], x.numel // x.shape[0] * 8])


@gluon.constexpr_function
def _tensor_scaled(NOPE, BLOCK):
    """e4m3 values under one per-tensor scale (``fp8``): no scale bytes in the rows."""
    return NOPE > 0 and BLOCK == 0


@gluon.constexpr_function
def _scale_row_bytes(SCALE, CMP_SCALE):
    """Bytes of a row's scales in the scale buffer: the larger format's, at least 16."""
    return max(16, SCALE, CMP_SCALE)


@gluon.constexpr_function
def _bf16_rope(NOPE):
    """The RoPE columns ``NOPE..511`` stored as bf16 after the e4m3 ones (``fp8_ds_mla``)."""
    return 0 < NOPE < 512


@gluon.constexpr_function
def _scales_per_64(BLOCK):
    """UE8M0 scale bytes per 64 columns (one per ``BLOCK`` values; 1 when unscaled)."""
    return 64 // BLOCK if BLOCK else 1


@gluon.constexpr_function
def _raw_offset(NOPE):
    """Where a tile holds its block's raw column blocks ``r >= 4``: ``raw[off + r]`` (4 KB
    each). bf16 column block ``j`` (``raw[2 j]``, ``raw[2 j + 1]``) then overwrites only raw
    blocks already read, given that :func:`_dequantize` loads block ``j + 1`` before storing
    block ``j``: ``fp8_ds_mla`` (raw 4..6 at 8..10, RoPE at 14..15): ``j = 4`` covers raw 4
    and 5, ``j = 5`` raw 6; the others (raw 4..7 at 12..15): ``j = 6`` covers raw 4 and 5,
    ``j = 7`` raw 6 and 7."""
    return 4 if _bf16_rope(NOPE) else 8


@gluon.constexpr_function
def _copy_layout():
    """fp8 raw copies ``[column blocks, BN, 16 words]``: 16 bytes per thread and cp.async, a
    warp covering 8 rows x 64 bytes."""
    return gl.BlockedLayout([1, 1, 4], [1, 8, 4], [1, 4, 1], [2, 1, 0])


@gluon.jit
def _copy_staged(stage_buf, scale_st, slot, i_b, nb_swa, seg, DATA: gl.constexpr, SCALE: gl.constexpr,
                 PAGE_SHIFT: gl.constexpr, NOPE: gl.constexpr, BLOCK: gl.constexpr, FP4: gl.constexpr,
                 BN: gl.constexpr):
    """Block ``i_b``'s raw column blocks 0..3 (rows ``slot``) into ``stage_buf`` and its scale
    bytes into ``scale_st``, by ``cp.async`` (for the caller to commit); ``FP4``:
    :func:`_copy_fp4`. Returns each row's pointer and whether it is valid, for the rest of
    the block (:func:`_copy_tile`)."""
    if FP4:
        p_byte, valid = _copy_fp4(stage_buf, scale_st, slot, i_b, nb_swa, seg, DATA, SCALE, PAGE_SHIFT, BN)
    else:
        L3: gl.constexpr = _copy_layout()
        kv, o_row, o_scale, valid = _row_offsets(slot, i_b, nb_swa, seg, DATA, SCALE, PAGE_SHIFT)
        p_byte = kv + gl.multiple_of(o_row, 16)
        p_row = p_byte.to(gl.pointer_type(gl.int32))
        o_j = gl.arange(0, 4, gl.SliceLayout(1, gl.SliceLayout(2, L3)))[:, None, None]
        o_w = gl.arange(0, 16, gl.SliceLayout(0, gl.SliceLayout(1, L3)))[None, None, :]
        _async_load(stage_buf, p_row[None, :, None] + o_j * 16 + o_w, mask=valid[None, :, None])
        if not _tensor_scaled(NOPE, BLOCK):
            SW: gl.constexpr = SCALE // 4
            LS: gl.constexpr = gl.BlockedLayout([1, SW], [8, 4], [4, 1], [1, 0])  # rows as in L3: no layout conversion
            p_scale = gl.convert_layout(kv + gl.multiple_of(o_scale, SCALE), gl.SliceLayout(1, LS))
            o_s = gl.arange(0, SW, gl.SliceLayout(0, LS))
            _async_load(
                scale_st.slice(0, SW, dim=1), p_scale.to(gl.pointer_type(gl.int32))[:, None] + o_s[None, :],
                mask=gl.convert_layout(valid, gl.SliceLayout(1, LS))[:, None])
    return p_byte, valid


@gluon.jit
def _copy_tile(tile, p_row, valid, NOPE: gl.constexpr, BLOCK: gl.constexpr, FP4: gl.constexpr, BN: gl.constexpr):
    """A block's raw column blocks ``r >= 4`` into its (free) tile at ``raw[_raw_offset + r]``
    (4 KB each), and ``fp8_ds_mla``'s bf16 RoPE columns straight into columns 448..511, by
    ``cp.async`` (for the caller to commit); ``FP4``: the packed bytes of columns 256..511
    into the tile's last 8 KB (packed column blocks 28..31 of :func:`_packed_words`)."""
    if FP4:
        _copy_fp4_rows(_packed_words(tile, 32, BN).slice(28, 4), p_row, valid, 4, BN)
    else:
        _copy_fp8_tile(tile, p_row, valid, NOPE, BLOCK, BN)


@gluon.jit
def _copy_fp8_tile(tile, p_row, valid, NOPE: gl.constexpr, BLOCK: gl.constexpr, BN: gl.constexpr):
    """:func:`_copy_tile` for the fp8 formats."""
    L3: gl.constexpr = _copy_layout()
    NCB: gl.constexpr = NOPE // 64
    RB: gl.constexpr = _raw_offset(NOPE) + 4
    raw = _reinterpret(tile, gl.int32, [16, BN, 16], gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0]))
    o_j = gl.arange(0, 4, gl.SliceLayout(1, gl.SliceLayout(2, L3)))[:, None, None]
    o_w = gl.arange(0, 16, gl.SliceLayout(0, gl.SliceLayout(1, L3)))[None, None, :]
    _async_load(
        raw.slice(RB, 4), p_row.to(gl.pointer_type(gl.int32))[None, :, None] + (4 + o_j) * 16 + o_w,
        mask=valid[None, :, None] & (4 + o_j < NCB))
    if _bf16_rope(NOPE):
        LR: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
        p_rope = gl.convert_layout(p_row + NOPE, gl.SliceLayout(1, LR)).to(gl.pointer_type(gl.bfloat16))
        o_c = gl.arange(0, 512 - NOPE, gl.SliceLayout(0, LR))
        _async_load(
            tile.slice(NOPE, 512 - NOPE, dim=1), p_rope[:, None] + o_c[None, :],
            mask=gl.convert_layout(valid, gl.SliceLayout(1, LR))[:, None])


@gluon.jit
def _softmax(s, b, m_i, l_i, qk_scale):
    """One block's scores -> bf16 weights ``p``, with the running max ``m_i`` and the
    running row sum ``l_i`` (each row lives in one warp's quad: no shared memory)."""
    s = s * qk_scale + b[None, :]
    m_new = gl.maximum(m_i, gl.max(s, 1))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s - m_use[:, None])
    alpha = gl.exp2(m_i - m_use)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p.to(gl.bfloat16), alpha, m_new, l_i


@gluon.jit
def _consumer_left(q_smem, kbuf, bias, p_smem, alpha_smem, ml_smem, ready, empty, p_ready, p_free, fin,
                   q_ptrs, i_t, i_hb, i_s, c_left, span_args, qk_scale, epilogue_args,
                   BN: gl.constexpr, STAGES: gl.constexpr, NCB: gl.constexpr):
    """Warpgroup 0: ``S = Q K^T`` for the whole block (``wgmma`` m64n64, reading Q once), the
    softmax, and ``O += P K`` for the ``NCB`` output column blocks from ``c_left`` on (the
    left half of the program's columns) with ``P`` from registers; hands ``P`` and the
    rescale factor to :func:`_consumer_right` through shared memory, and the final row max
    and sum after the last block; then stores its output column blocks and the LSE
    (:func:`_epilogue`) here, not after ``warp_specialize``, which returns only once every
    partition has finished: so both halves' stores overlap."""
    _wait_prior_grid()
    swa_len, cmp_len, W, K, n_split = span_args
    _, _, _, i_b0, i_b1 = _span(i_t, i_s, swa_len, cmp_len, W, K, n_split, BN)
    n = i_b1 - i_b0
    q_ptr, q_mask = q_ptrs
    _async_load(q_smem, q_ptr, mask=q_mask)
    async_copy.commit_group()
    async_copy.wait_group(0)
    fence_async_shared()
    _cta_barrier()

    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
    chunks = _column_blocks(kbuf, BN, STAGES)
    o = (gl.zeros([64, 64], gl.float32, O_L), ) * NCB
    m_i = gl.full([64], float("-inf"), gl.float32, gl.SliceLayout(1, S_L))
    l_i = gl.zeros([64], gl.float32, gl.SliceLayout(1, S_L))
    for i in range(n):
        st = i % STAGES
        mbarrier.wait(ready.index(st), (i // STAGES) & 1)
        fence_async_shared()  # the producer's cp.async writes, seen by wgmma (async proxy)
        tile = kbuf.index(st)
        s = gl.zeros([64, BN], gl.float32, S_L)
        for c in gl.static_range(8):
            s = warpgroup_mma(q_smem.slice(64 * c, 64, dim=1), tile.slice(64 * c, 64, dim=1).permute((1, 0)), s,
                              use_acc=c > 0, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        p, alpha, m_i, l_i = _softmax(s, bias.index(st).load(gl.SliceLayout(0, S_L)), m_i, l_i, qk_scale)
        # this half's P K goes out first and runs while P is handed over (the rescales are
        # in _pv_async)
        o = _pv_async(gl.convert_layout(p, P_L), gl.convert_layout(alpha, gl.SliceLayout(1, O_L)), chunks,
                      st * 8 + c_left, o, NCB)
        mbarrier.wait(p_free, (i & 1) ^ 1, pred=i > 0)  # the right half has used P of block i - 1
        p_smem.store(p)
        alpha_smem.store(alpha)
        _cta_barrier()
        mbarrier.arrive(p_ready, count=1)
        o = warpgroup_mma_wait(num_outstanding=0, deps=o)
        _cta_barrier()
        mbarrier.arrive(empty.index(st), count=1)
    ml_smem.index(0).store(m_i)
    ml_smem.index(1).store(l_i)
    _cta_barrier()
    mbarrier.arrive(fin, count=1)
    m_i = gl.convert_layout(m_i, gl.SliceLayout(1, O_L))
    l_i = gl.convert_layout(l_i, gl.SliceLayout(1, O_L))
    # Q's buffer: no longer read (the last S = Q K^T has been waited for)
    _epilogue(o, m_i, l_i, 64 * c_left, i_t, i_hb, i_s, epilogue_args, q_smem, NCB)


@gluon.jit
def _consumer_right(kbuf, p_smem, alpha_smem, ml_smem, empty, p_ready, p_free, fin,
                    i_t, i_hb, i_s, c_right, span_args, epilogue_args,
                    BN: gl.constexpr, STAGES: gl.constexpr, NCB: gl.constexpr):
    """Warpgroup 1: ``O += P K`` for the ``NCB`` output column blocks from ``c_right`` on (the
    right half of the program's columns) with :func:`_consumer_left`'s ``P`` (loaded
    into registers, which frees ``p_smem`` before the product) and rescale factor, then
    stores its output column blocks (:func:`_epilogue`)."""
    _wait_prior_grid()
    swa_len, cmp_len, W, K, n_split = span_args
    _, _, _, i_b0, i_b1 = _span(i_t, i_s, swa_len, cmp_len, W, K, n_split, BN)
    n = i_b1 - i_b0
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
    chunks = _column_blocks(kbuf, BN, STAGES)
    o = (gl.zeros([64, 64], gl.float32, O_L), ) * NCB
    for i in range(n):
        st = i % STAGES
        mbarrier.wait(p_ready, i & 1)
        p = p_smem.load(P_L)
        alpha = alpha_smem.load(gl.SliceLayout(1, O_L))
        _cta_barrier()
        mbarrier.arrive(p_free, count=1)
        o = _pv_async(p, alpha, chunks, st * 8 + c_right, o, NCB)
        o = warpgroup_mma_wait(num_outstanding=0, deps=o)
        _cta_barrier()
        mbarrier.arrive(empty.index(st), count=1)
    mbarrier.wait(fin, 0)
    m_i = ml_smem.index(0).load(gl.SliceLayout(1, O_L))
    l_i = ml_smem.index(1).load(gl.SliceLayout(1, O_L))
    # a key tile: every product has been waited for (warpgroup 0's before it arrived `fin`)
    _epilogue(o, m_i, l_i, 64 * c_right, i_t, i_hb, i_s, epilogue_args, kbuf.index(0), NCB)


@gluon.jit
def _column_blocks(kbuf, BN: gl.constexpr, STAGES: gl.constexpr):
    """The key tiles as ``[STAGES * 8, BN, 64]``: column block ``c`` of stage ``st`` is
    ``index(8 st + c)``, indexable at run time (an NVMMA tile of 512 columns lies in memory
    as eight 64-column tiles, 8 KB apart)."""
    return _reinterpret(kbuf, gl.bfloat16, [STAGES * 8, BN, 64], gl.NVMMASharedLayout.get_default_for([BN, 64], gl.bfloat16))


@gluon.jit
def _pv_async(p, alpha, chunks, c0, o, NCB: gl.constexpr):
    """``o[c] = o[c] * alpha + P K[:, 64 c ..]`` for the ``NCB`` output column blocks ``o``,
    K's column block ``c`` being ``chunks.index(c0 + c)`` (``wgmma`` m64n64; ``P`` from
    registers), issued: returns the products in flight, for ``warpgroup_mma_wait``."""
    # all rescales before the first product: interleaved with them, ptxas waited for the
    # products in flight before each rescale (C7517), which serialized them
    scaled = ()
    for c in gl.static_range(NCB):
        scaled = scaled + (o[c] * alpha[:, None], )
    res = ()
    for c in gl.static_range(NCB):
        res = res + (warpgroup_mma(p, chunks.index(c0 + c), scaled[c], is_async=True), )
    return res


@gluon.jit
def _epilogue(o, m_i, l_i, c0, i_t, i_hb, i_s, epilogue_args, buf, NCB: gl.constexpr):
    """Store output columns ``[c0, c0 + 64 NCB)`` of this program (the ``NCB`` column blocks
    ``o``): normalised output and base-2 LSE (``-inf`` when it saw nothing) into the
    partials; with one split, fold the sink in and write ``out`` and ``lse`` directly. The
    caller with column 0 writes the LSE. The bf16 output goes through ``buf`` (shared memory
    no one reads any more) so that each warp writes whole rows (straight from the ``wgmma``
    layout a warp instruction writes 16 bytes in each of eight rows). The fp32 partials are
    stored straight: 32 bytes per row already, so a round trip through shared memory would
    only add latency."""
    out, lse, part_o, part_lse, sink, T, H, n_split, has_sink, kv_scale = epilogue_args
    O_L: gl.constexpr = o[0].type.layout
    o_h = i_hb * 64 + gl.arange(0, 64, gl.SliceLayout(1, O_L))
    m_h = o_h < H
    scale = gl.where(l_i > 0, kv_scale / l_i, 0.0)
    lse_p = gl.where(l_i > 0, gl.where(m_i == float("-inf"), 0.0, m_i) + gl.log2(l_i), float("-inf"))
    if n_split == 1:
        # fold the sink in: one more partial, with lse = sink * log2(e) and output 0
        sk = gl.load(sink + o_h, mask=m_h & (has_sink != 0), other=float("-inf")) * LOG2E
        mx = gl.maximum(lse_p, sk)
        mx = gl.where(mx == float("-inf"), 0.0, mx)
        lse_all = mx + gl.log2(gl.exp2(lse_p - mx) + gl.exp2(sk - mx))
        w = gl.where(lse_all == float("-inf"), 0.0, gl.exp2(lse_p - lse_all))
        # a view of all of ``buf`` (Triton >= 3.8 reinterprets only at equal size), of which
        # the first 64 NCB columns hold the rows
        rows_bf16 = _reinterpret(buf, gl.bfloat16, [64, 512], gl.SwizzledSharedLayout(8, 1, 8, order=[1, 0]))
        for c in gl.static_range(NCB):
            rows_bf16.slice(64 * c, 64, dim=1).store((o[c] * scale[:, None] * w[:, None]).to(gl.bfloat16))
        gl.store(lse + i_t * H + o_h, lse_all, mask=m_h & (c0 == 0))
        _cta_barrier()
        L: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])  # a row per warp instruction
        r_h = i_hb * 64 + gl.arange(0, 64, gl.SliceLayout(1, L))
        r_v = c0 + gl.arange(0, 64 * NCB, gl.SliceLayout(0, L))
        gl.store(out + (i_t * H + r_h[:, None]) * 512 + r_v[None, :], rows_bf16.slice(0, 64 * NCB, dim=1).load(L),
                 mask=(r_h < H)[:, None])
    else:  # fp32 straight from the wgmma layout: 32 bytes per row and warp instruction
        o_row = (i_s * T + i_t) * H + o_h
        o_v = gl.arange(0, 64, gl.SliceLayout(0, O_L))
        for c in gl.static_range(NCB):
            gl.store(part_o + o_row[:, None] * 512 + (c0 + 64 * c + o_v)[None, :], o[c] * scale[:, None],
                     mask=m_h[:, None])
        gl.store(part_lse + o_row, lse_p, mask=m_h & (c0 == 0))


@gluon.jit(do_not_specialize=UNSPECIALIZED)
def _sparse_mla_ws_kernel(
    q, out, lse, part_o, part_lse, sink,
    swa_kv, swa_idx, swa_len, cmp_kv, cmp_idx, cmp_len,
    T, H, W, K, n_split, has_sink, qk_scale, kv_scale,
    s_qt, s_qh, s_swa_t, s_swa_n, s_cmp_t, s_cmp_n,
    swa_page, swa_stride, swa_slots, cmp_page, cmp_stride, cmp_slots,
    NOPE: gl.constexpr, BLOCK: gl.constexpr, FP4: gl.constexpr, DATA: gl.constexpr, SCALE: gl.constexpr,
    CMP_NOPE: gl.constexpr, CMP_BLOCK: gl.constexpr, CMP_FP4: gl.constexpr, CMP_DATA: gl.constexpr,
    CMP_SCALE: gl.constexpr, MIXED: gl.constexpr, PAGE_SHIFT: gl.constexpr,
    BN: gl.constexpr, STAGES: gl.constexpr, DSPLIT: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    RIGHT_REGS: gl.constexpr,
):
    """Grid ``(T * ceil(H / 64) * DSPLIT, n_split)``; arguments as ``triton._sparse_mla_kernel``'s.
    With ``DSPLIT = 2`` two programs share a (token, head block, split), each gathering the
    whole rows (``S`` needs all 512 columns) but computing and storing only its 256 output
    columns: half the ``P K`` and half the stores on each program's path (small T)."""
    # let the LSE merge (a programmatic dependent launch) start now: it waits for this grid
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False,
                              pack=1)
    qk_scale = qk_scale.to(gl.float32)
    kv_scale = kv_scale.to(gl.float32)
    i_p, i_s = gl.program_id(0), gl.program_id(1)
    n_hb = gl.cdiv(H, 64)
    i_d = i_p % DSPLIT
    i_p = i_p // DSPLIT
    i_t, i_hb = i_p // n_hb, i_p % n_hb
    NCB: gl.constexpr = 4 // DSPLIT  # output column blocks per consumer warpgroup
    c_left = i_d * (2 * NCB)

    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 512], gl.bfloat16)
    k_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, 512], gl.bfloat16)
    p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, BN], gl.bfloat16)
    b_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [64, 512], q_layout)
    kbuf = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, 512], k_layout)
    if NOPE == 0:  # bf16 (never with a second format)
        stage_buf = kbuf
    else:  # fp8: raw column blocks 0..3 of the next block; fp4: all of its packed rows (see _produce)
        stage_buf = gl.allocate_shared_memory(gl.int32, [4, BN, 16], gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0]))
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [64, BN], p_layout)
    alpha_smem = gl.allocate_shared_memory(gl.float32, [64], b_layout)
    ml_smem = gl.allocate_shared_memory(gl.float32, [2, 64], b_layout)
    bias = gl.allocate_shared_memory(gl.float32, [STAGES, BN], b_layout)
    SROW: gl.constexpr = _scale_row_bytes(SCALE, CMP_SCALE if MIXED else SCALE)
    if _tensor_scaled(NOPE, BLOCK):
        scale_buf = kbuf
    else:  # each row's scale bytes (8, 16 or 32), filled by cp.async
        scale_buf = gl.allocate_shared_memory(gl.int32, [STAGES, BN, SROW // 4],
                                              gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    p_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    p_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    fin = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumer warpgroups release a tile
    mbarrier.init(p_ready, count=1)
    mbarrier.init(p_free, count=1)
    mbarrier.init(fin, count=1)

    LQ: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    o_h = i_hb * 64 + gl.arange(0, 64, gl.SliceLayout(1, LQ))
    o_d = gl.arange(0, 512, gl.SliceLayout(0, LQ))
    q_ptrs = (q + i_t * s_qt + o_h[:, None] * s_qh + o_d[None, :], (o_h < H)[:, None])
    span_args = (swa_len, cmp_len, W, K, n_split)
    seg = (swa_kv, swa_idx, s_swa_t, s_swa_n, swa_page, swa_stride, swa_slots,
           cmp_kv, cmp_idx, s_cmp_t, s_cmp_n, cmp_page, cmp_stride, cmp_slots)
    epilogue_args = (out, lse, part_o, part_lse, sink, T, H, n_split, has_sink, kv_scale)
    gl.warp_specialize([
        (_consumer_left, (q_smem, kbuf, bias, p_smem, alpha_smem, ml_smem, ready, empty, p_ready, p_free, fin,
                          q_ptrs, i_t, i_hb, i_s, c_left, span_args, qk_scale, epilogue_args, BN, STAGES, NCB)),
        (_consumer_right, (kbuf, p_smem, alpha_smem, ml_smem, empty, p_ready, p_free, fin,
                           i_t, i_hb, i_s, c_left + NCB, span_args, epilogue_args, BN, STAGES, NCB)),
        (_producer, (kbuf, stage_buf, scale_buf, bias, ready, empty, i_t, i_s, span_args, seg,
                     NOPE, BLOCK, FP4, DATA, SCALE, CMP_NOPE, CMP_BLOCK, CMP_FP4, CMP_DATA, CMP_SCALE, MIXED, SROW,
                     PAGE_SHIFT, BN, STAGES)),
    ], [4, 4], [RIGHT_REGS, PRODUCER_REGS])


def launch_options(fmt: formats.KVFormat, page_shift: bool, dsplit: int, cmp_fmt: Optional[formats.KVFormat] = None
                   ) -> dict:
    """Every :func:`_sparse_mla_ws_kernel` launch's compile-time arguments and options
    (``num_warps``, ``maxnreg``): the formats' kernel constants (``cmp_fmt``: the compressed
    cache's, when not ``fmt``), the page shift and ``dsplit`` (1 or 2 programs per head
    block)."""
    cmp_fmt = cmp_fmt or fmt
    return dict(
        NOPE=fmt.nope, BLOCK=fmt.block, FP4=fmt.fp4, DATA=fmt.data_elems, SCALE=fmt.scale_bytes,
        CMP_NOPE=cmp_fmt.nope, CMP_BLOCK=cmp_fmt.block, CMP_FP4=cmp_fmt.fp4, CMP_DATA=cmp_fmt.data_elems,
        CMP_SCALE=cmp_fmt.scale_bytes, MIXED=cmp_fmt != fmt, PAGE_SHIFT=page_shift,
        BN=BN, STAGES=STAGES, DSPLIT=dsplit, PRODUCER_REGS=PRODUCER_REGS, RIGHT_REGS=RIGHT_REGS,
        num_warps=4, maxnreg=MAX_REGS, launch_pdl=True,
    )


def sparse_mla_gluon(args: SparseMLAArgs, out, lse, *, n_split: Optional[int] = None) -> None:
    """The ``"gluon"`` backend of ``dsv41::sparse_mla``: arguments, launch plan and LSE merge
    as :func:`compile_ops.mla.triton.sparse_mla_triton`'s, around this kernel. Raises
    ``ValueError`` for a layout the kernel cannot read
    (:func:`compile_ops.mla.plan.gluon_args_unsupported`; the op's dispatch asks first)."""
    reason = gluon_args_unsupported(args)
    if reason is not None:
        raise ValueError(reason)
    launch = plan(args, out, lse, split_small_T=True, n_split=n_split)
    if launch is None:
        return
    if launch.traced or args.q.device.type != "cuda":
        raise RuntimeError("the Gluon kernel runs eagerly on sm_90 only: not traced, not interpreted")
    options = launch_options(launch.fmt, launch.page_shift, launch.dsplit, launch.cmp_fmt)
    _sparse_mla_ws_kernel[launch.grid](*launch.args, **options)
    merge(launch, out, lse, after_gluon=True)
