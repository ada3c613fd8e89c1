"""Triton row store of ``write_kv`` and ``write_index_keys``: one program per row quantizes
it and stores its bytes (the same bytes as :mod:`compile_ops.kv.reference`). Runs on CUDA
tensors, or on CPU tensors under ``TRITON_INTERPRET=1``; nothing syncs or allocates, so
CUDA graphs capture it.

Given ``turn``, a program first RMS-normalises its row and turns its last dims by the row's
RoPE angles (a layer's window kv and index keys, ``graphs::write_turned``): the store reads
the projection's output as it lies, with no kernel between the two."""

from __future__ import annotations

from typing import Optional, Union

import torch
import triton
import triton.language as tl

from compile_ops._launch import launchable
from compile_ops._triton_quant import (e2m1_code, fp4_e4m3_scale, fp4_exponent, power_of_two, to_bf16, to_e4m3,
                                      ue8m0_exponent)
from compile_ops.formats import KVFormat
from compile_ops.indexer.cache import IndexFormat

RAW, TENSOR_SCALED, BLOCK_SCALED, FP4 = 0, 1, 2, 3  # how a format stores a row (the kernel's MODE)


@triton.jit
def _slot_ok(given, n_slots, like):
    # the row's slot is in range, as a mask shaped like ``like``: a scalar mask broadcast to
    # a store loses its boolean type in Triton 3.9's interpreter
    at = given + tl.zeros_like(like).to(tl.int64)
    return (at >= 0) & (at < n_slots)


@triton.jit
def _normed(row, o, mask, inv_rms, norm_w, TURNED: tl.constexpr):
    # the row's values at offsets ``o`` in fp32; turned rows: ``bf16(bf16(value) * inv_rms *
    # norm_w)``, rounded where the unfused layer rounds (its bf16 input and its norm's output)
    x = tl.load(row + o, mask=mask, other=0.0).to(tl.float32)
    if TURNED:
        w = tl.load(norm_w + o, mask=mask, other=0.0)
        x = to_bf16(to_bf16(x).to(tl.float32) * inv_rms * w).to(tl.float32)
    return x


@triton.jit
def _row_values(row, o, mask, inv_rms, norm_w, cos, sin, D: tl.constexpr, TURNED: tl.constexpr):
    # what the store quantizes at offsets ``o`` of a row: its values, or with ``TURNED`` dims
    # the normalised row whose last ``TURNED`` dims (pair ``i``: ``D - TURNED + 2i``, ``+ 1``)
    # are turned as ``graphs.rope.apply_rope`` turns them, then rounded to bf16
    x = _normed(row, o, mask, inv_rms, norm_w, TURNED)
    if TURNED:
        turned = mask & (o >= D - TURNED)
        other = _normed(row, o ^ 1, turned, inv_rms, norm_w, TURNED)  # the pair's other value
        i_p = tl.where(turned, (o - (D - TURNED)) // 2, 0)
        c = tl.load(cos + i_p, mask=turned, other=1.0)
        s = tl.load(sin + i_p, mask=turned, other=0.0)
        # (even, odd) -> (even c - odd s, odd c + even s)
        sign = tl.where(o % 2 == 0, -1.0, 1.0)
        x = tl.where(turned, to_bf16(x * c + (other * sign) * s).to(tl.float32), x)
    return x


@triton.jit
def _store_rows_kernel(
    cache, s_page, values, s_v, slots, s_s, n_slots, page_size, kv_scale, norm_w, eps, cos, sin, s_c,
    MODE: tl.constexpr, D: tl.constexpr, NOPE: tl.constexpr, QB: tl.constexpr, NB: tl.constexpr,
    NB_PAD: tl.constexpr, DATA: tl.constexpr, SCALE: tl.constexpr, FP32_SCALE: tl.constexpr,
    E4M3_SCALE: tl.constexpr, TURNED: tl.constexpr,
):
    """Row ``i``: ``values[i, :D]`` quantized into slot ``slots[i]`` (nothing where it is
    ``-1`` or out of range). ``RAW``: the values as the cache's dtype; ``TENSOR_SCALED``:
    e4m3 of ``value / kv_scale``; ``BLOCK_SCALED``: the first ``NOPE`` values as e4m3 in
    ``NB`` blocks of ``QB``, each under a power-of-two scale (``SCALE`` scale bytes per row:
    ue8m0 exponents, zero padded, or one fp32), the other ``D - NOPE`` as bf16; ``FP4``:
    all ``D`` values as e2m1 codes, two per byte (the even-numbered in the low nibble), in
    ``NB`` blocks of ``QB``, each under an e4m3 scale byte (``E4M3_SCALE``) or a ue8m0 one.
    ``TURNED > 0``: the values are ``rms_norm(bf16(values[i]), norm_w, eps)`` with the last
    ``TURNED`` dims turned by ``cos[i]``, ``sin[i]`` (``[TURNED / 2]`` fp32 each, row
    stride ``s_c``), bf16 (:func:`_row_values`)."""
    i_n = tl.program_id(0).to(tl.int64)
    given = tl.load(slots + i_n * s_s).to(tl.int64)
    ok = (given >= 0) & (given < n_slots)
    slot = tl.where(ok, given, 0)
    page = slot // page_size
    off = slot - page * page_size
    base = cache + page * s_page
    row = values + i_n * s_v
    cos += i_n * s_c
    sin += i_n * s_c
    inv_rms = 0.0
    if TURNED:
        # (floats as fp32, as eagerly: Inductor, tracing the launch, passes them as fp64)
        x = to_bf16(tl.load(row + tl.arange(0, D)).to(tl.float32)).to(tl.float32)
        inv_rms = tl.math.rsqrt(tl.sum(x * x, 0) / D + tl.cast(eps, tl.float32))
    if MODE == 0:
        o_d = tl.arange(0, D)
        x = _row_values(row, o_d, o_d < D, inv_rms, norm_w, cos, sin, D, TURNED)
        tl.store(base + off * D + o_d, to_bf16(x), mask=_slot_ok(given, n_slots, o_d))
    elif MODE == 1:
        o_d = tl.arange(0, D)
        x = _row_values(row, o_d, o_d < D, inv_rms, norm_w, cos, sin, D, TURNED)
        x = tl.math.div_rn(x, tl.cast(kv_scale, tl.float32))
        tl.store(base + off * D + o_d, to_e4m3(x), mask=_slot_ok(given, n_slots, o_d))
    elif MODE == 3:
        o_b = tl.arange(0, NB)
        o_p = tl.arange(0, QB // 2)
        o_v = o_b[:, None] * QB + tl.arange(0, QB)[None, :]
        x = _row_values(row, o_v, o_v < D, inv_rms, norm_w, cos, sin, D, TURNED)
        amax = tl.max(tl.abs(x), 1)
        if E4M3_SCALE:
            scale = fp4_e4m3_scale(amax)
            scale_byte = scale.to(tl.float8e4nv).to(tl.uint8, bitcast=True)  # exact: already an e4m3 value
        else:
            exponent = fp4_exponent(amax)
            scale = power_of_two(exponent)
            scale_byte = exponent.to(tl.uint8)
        codes = e2m1_code(tl.clamp(tl.math.div_rn(x, scale[:, None]), -6.0, 6.0))
        lo, hi = tl.split(tl.reshape(codes, [NB, QB // 2, 2]))
        o_v = o_b[:, None] * (QB // 2) + o_p[None, :]
        tl.store(base + off * DATA + o_v, (lo | (hi << 4)).to(tl.uint8), mask=_slot_ok(given, n_slots, o_v))
        tl.store(base + page_size * DATA + off * SCALE + o_b, scale_byte, mask=_slot_ok(given, n_slots, o_b))
    else:
        o_b = tl.arange(0, NB_PAD)
        o_q = tl.arange(0, QB)
        o_v = o_b[:, None] * QB + o_q[None, :]
        m_b = o_b < NB
        x = _row_values(row, o_v, m_b[:, None] & (o_q[None, :] < QB), inv_rms, norm_w, cos, sin, D, TURNED)
        exponent = ue8m0_exponent(tl.max(tl.abs(x), 1))
        inverse = power_of_two(254 - exponent)  # 1 / scale, exact
        e4m3 = to_e4m3(x * inverse[:, None]).to(tl.uint8, bitcast=True)
        data = base + off * DATA
        tl.store(data + o_v, e4m3, mask=_slot_ok(given, n_slots, o_v) & m_b[:, None])
        if NOPE < D:  # the RoPE values, bf16 after the e4m3 ones, stored a byte at a time:
            # under an odd page stride (a cache viewed out of a larger pool) they sit at odd
            # addresses, where a 2-byte store faults
            o_r = tl.arange(0, D - NOPE)
            x = _row_values(row, NOPE + o_r, o_r < D - NOPE, inv_rms, norm_w, cos, sin, D, TURNED)
            rope = to_bf16(x).to(tl.uint16, bitcast=True)
            tl.store(data + NOPE + 2 * o_r, (rope & 0xFF).to(tl.uint8), mask=_slot_ok(given, n_slots, o_r))
            tl.store(data + NOPE + 2 * o_r + 1, (rope >> 8).to(tl.uint8), mask=_slot_ok(given, n_slots, o_r))
        scales = base + page_size * DATA + off * SCALE
        if FP32_SCALE:
            tl.store(scales.to(tl.pointer_type(tl.float32)) + o_b, power_of_two(exponent),
                     mask=_slot_ok(given, n_slots, o_b) & m_b)
        else:
            tl.store(scales + o_b, tl.where(m_b, exponent, 0).to(tl.uint8),
                     mask=_slot_ok(given, n_slots, o_b) & (o_b < SCALE))


def _layout(fmt: Union[KVFormat, IndexFormat], turned: int) -> dict:
    """The kernel's compile-time description of ``fmt``'s row, ``turned`` dims turned (0:
    none): every constexpr, since Inductor, when it traces the launch, passes only the
    arguments given (no defaults)."""
    return {**_row_layout(fmt), "TURNED": turned}


def _row_layout(fmt: Union[KVFormat, IndexFormat]) -> dict:
    if fmt.fp4:
        return dict(MODE=FP4, D=2 * fmt.data_bytes, NOPE=0, QB=fmt.block, NB=fmt.scale_bytes, NB_PAD=fmt.scale_bytes,
                    DATA=fmt.data_bytes, SCALE=fmt.scale_bytes, FP32_SCALE=False, E4M3_SCALE=isinstance(fmt, KVFormat))
    if isinstance(fmt, IndexFormat):
        if not fmt.fp8:
            return dict(MODE=RAW, D=fmt.row_width, NOPE=0, QB=1, NB=1, NB_PAD=1, DATA=fmt.row_width, SCALE=0,
                        FP32_SCALE=False, E4M3_SCALE=False)
        return dict(MODE=BLOCK_SCALED, D=fmt.data_bytes, NOPE=fmt.data_bytes, QB=fmt.data_bytes, NB=1, NB_PAD=1,
                    DATA=fmt.data_bytes, SCALE=fmt.scale_bytes, FP32_SCALE=True, E4M3_SCALE=False)
    if fmt.nope == 0 or fmt.tensor_scaled:
        return dict(MODE=RAW if fmt.nope == 0 else TENSOR_SCALED, D=fmt.row_width, NOPE=0, QB=1, NB=1, NB_PAD=1,
                    DATA=fmt.row_width, SCALE=0, FP32_SCALE=False, E4M3_SCALE=False)
    nb = fmt.nope // fmt.block
    return dict(MODE=BLOCK_SCALED, D=512, NOPE=fmt.nope, QB=fmt.block, NB=nb,
                NB_PAD=triton.next_power_of_2(max(nb, fmt.scale_bytes)), DATA=fmt.data_bytes,
                SCALE=fmt.scale_bytes, FP32_SCALE=False, E4M3_SCALE=False)


def write_rows_triton(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor,
                      fmt: Union[KVFormat, IndexFormat], kv_scale: float = 1.0,
                      turn: Optional[tuple[torch.Tensor, float, torch.Tensor, torch.Tensor]] = None) -> None:
    """Quantize ``values [N, width]`` (any float dtype, unit stride along a row) into
    ``fmt``'s rows and store row ``i`` at ``slots[i]`` of ``cache``; rows whose slot is
    ``-1`` or out of range store nothing (masked, never addressed). ``turn = (norm_weight
    [width] fp32, eps, cos, sin [N, P] fp32)``: each row RMS-normalised and its last ``2P``
    dims turned first (``graphs::write_turned``)."""
    values = values if values.stride(-1) == 1 else values.contiguous()
    norm_w, eps, cos, sin = turn if turn is not None else (values, 0.0, values, values)
    turned = 0 if turn is None else 2 * cos.shape[1]
    launchable(_store_rows_kernel, cache)[(slots.shape[0],)](
        cache, cache.stride(0), values, values.stride(0), slots, slots.stride(0), cache.shape[0] * cache.shape[1],
        cache.shape[1], float(kv_scale), norm_w, float(eps), cos, sin, cos.stride(0), **_layout(fmt, turned),
    )
