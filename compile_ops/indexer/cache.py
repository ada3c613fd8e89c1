"""The index-key cache: paged 128-wide indexer keys, fp8 with one fp32 scale per entry, fp4
with one ue8m0 scale per 32 values (DeepSeek-V4.1's), or bf16.

A cache is a tensor ``[num_pages, page_size, row_width]`` addressed like the compressed KV
cache, by the same block table: entry ``c`` of request ``r`` lives in slot
``block_table[r, c // page_size] * page_size + c % page_size``.

==================  ========  =====  =======================================================
``index_format``    dtype     width  one page, in bytes
==================  ========  =====  =======================================================
``fp8``             uint8     132    ``page_size`` rows of 128 e4m3 values, then ``page_size``
                                     fp32 scales (DeepGEMM's ``fp8_paged_mqa_logits`` layout)
``fp4``             uint8     68     ``page_size`` rows of 64 B (128 e2m1 values, two per byte,
                                     the even-numbered value in the low nibble), then
                                     ``page_size`` rows of 4 ue8m0 scales (one per 32 values)
``bf16``            bfloat16  128    ``page_size`` rows of 128 bf16 values (exact tests)
==================  ========  =====  =======================================================

Quantization (``fp8``): per entry, ``s = 2**ceil(log2(max(amax, 1e-4) / 448))`` (a power of
two, DeepSeek's ``ue8m0`` scale format) and ``e4m3 = round(clamp(x / s, -448, 448))``; the
stored scale is ``s`` as fp32. A value's error is at most ``2**-4 * |x| + 2**-10 * s``
(``s < 2 * max(amax, 1e-4) / 448``); ``docs/formats.md`` derives it.

Quantization (``fp4``, DeepSeek's ``fp4_act_quant`` with ue8m0 scales): per block of 32 values,
``s = 2**ceil(log2(max(amax, 6 * 2**-126) * fl(1/6)))`` (the fp32 product, then the next power
of two from its bits) and ``e2m1 = round(clamp(x / s, -6, 6))`` (nearest, ties to the even
code); the stored scale is the byte ``log2(s) + 127``. Error: ``2**-2 * |x| + 2**-2 * s``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compile_ops._checks import check_device, check_tensor
from compile_ops.formats import (E2M1_MAX, E4M3_MAX, FP4_UE8M0_AMAX_FLOOR, UE8M0_BIAS, e2m1_codes, e2m1_values,
                                 locate_slots, pack_e2m1, page_bytes, row_byte_index, ue8m0_exponent, unpack_e2m1)

INDEX_DIM = 128
FP4_BLOCK = 32  # values per ue8m0 scale of an fp4 key (and of the query quantized like it)


@dataclass(frozen=True)
class IndexFormat:
    """One index-key cache format: a page holds its ``data_bytes`` rows, then its
    ``scale_bytes`` rows (the row store of :mod:`compile_ops.kv` takes it as it takes a
    :class:`compile_ops.formats.KVFormat`); ``fp4``: e2m1 values under ue8m0 scales of
    ``block`` values each, else e4m3 under one fp32 scale (with scale bytes) or bf16."""

    name: str
    dtype: torch.dtype
    row_width: int
    data_bytes: int
    scale_bytes: int
    block: int = 0
    fp4: bool = False

    @property
    def bytes_per_token(self) -> int:
        return self.data_bytes + self.scale_bytes

    @property
    def fp8(self) -> bool:
        return self.scale_bytes > 0 and not self.fp4


INDEX_FORMATS = {
    "fp8": IndexFormat("fp8", torch.uint8, INDEX_DIM + 4, INDEX_DIM, 4),
    "fp4": IndexFormat("fp4", torch.uint8, INDEX_DIM // 2 + INDEX_DIM // FP4_BLOCK, INDEX_DIM // 2,
                       INDEX_DIM // FP4_BLOCK, FP4_BLOCK, fp4=True),
    "bf16": IndexFormat("bf16", torch.bfloat16, INDEX_DIM, 2 * INDEX_DIM, 0),
}


def get_index_format(index_format: object) -> IndexFormat:
    if not isinstance(index_format, str) or index_format not in INDEX_FORMATS:
        raise ValueError(f"index_format must be one of {sorted(INDEX_FORMATS)}, got {index_format!r}")
    return INDEX_FORMATS[index_format]


def check_index_cache(name: str, cache: object, index_format: str, device=None) -> IndexFormat:
    """``cache`` must be a ``[pages, page_size, row_width]`` tensor of ``index_format`` whose
    pages are each contiguous (the page stride is free)."""
    fmt = get_index_format(index_format)
    check_tensor(name, cache, fmt.dtype, 3, device)
    if cache.shape[2] != fmt.row_width:
        raise ValueError(f"{name} must be [pages, page_size, {fmt.row_width}] for index_format {fmt.name!r}, "
                         f"got shape {tuple(cache.shape)}")
    if cache.stride(2) != 1 or cache.stride(1) != fmt.row_width:
        raise ValueError(f"{name}'s pages must each be contiguous, got strides {cache.stride()}")
    return fmt


def new_index_cache(index_format: str, num_pages: int, page_size: int, device=None) -> torch.Tensor:
    """A zeroed index-key cache ``[num_pages, page_size, row_width]``."""
    fmt = get_index_format(index_format)
    return torch.zeros(num_pages, page_size, fmt.row_width, dtype=fmt.dtype, device=check_device("device", device))


def quantize_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``x [..., 128]`` -> ``(e4m3 [..., 128], scale [...] fp32)``, one power-of-two scale
    per row (the rule of the module docstring; used for the keys and the queries)."""
    x = x.float()
    exponent = ue8m0_exponent(x.abs().amax(-1))
    # a contiguous scale (ones_like(x[..., 0]) would keep x's row stride): its bytes are viewed
    scale = torch.ldexp(torch.ones(x.shape[:-1], device=x.device), exponent - UE8M0_BIAS)
    return (x / scale.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def fp4_exponent(amax: torch.Tensor) -> torch.Tensor:
    """int32 ue8m0 bytes of the fp4 scales of blocks with max magnitudes ``amax`` (the rule of
    the module docstring): ``ceil(log2(max(amax, 6 * 2**-126) * fl(1/6))) + 127`` from the bits."""
    bits = (amax.float().clamp_min(FP4_UE8M0_AMAX_FLOOR) * torch.tensor(1 / E2M1_MAX, dtype=torch.float32)).view(torch.int32)
    return ((bits >> 23) & 255) + ((bits & 0x7FFFFF) != 0).int()


def quantize_e2m1(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``x [..., 128]`` -> ``(e2m1 codes [..., 128] uint8, ue8m0 exponents [..., 4] int32)``,
    one scale per 32 values (the ``fp4`` rule of the module docstring; the keys and, in the
    indexer, the queries)."""
    blocks = x.float().unflatten(-1, (-1, FP4_BLOCK))
    exponent = fp4_exponent(blocks.abs().amax(-1))
    scale = torch.ldexp(torch.ones(exponent.shape, device=x.device), exponent - UE8M0_BIAS)
    return e2m1_codes((blocks / scale.unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX)).flatten(-2), exponent


def dequantize_e2m1(codes_or_bytes: torch.Tensor, exponent: torch.Tensor, packed: bool) -> torch.Tensor:
    """fp32 ``[..., 128]`` of e2m1 values (codes ``[..., 128]``, or bytes ``[..., 64]`` if
    ``packed``) times their blocks' ``2 ** (exponent - 127)``."""
    values = unpack_e2m1(codes_or_bytes) if packed else e2m1_values(codes_or_bytes)
    scale = torch.ldexp(torch.ones(exponent.shape, device=values.device), exponent.int() - UE8M0_BIAS)
    return (values.unflatten(-1, (-1, FP4_BLOCK)) * scale.unsqueeze(-1)).flatten(-2)


def encode_index_rows(keys: torch.Tensor, index_format: str) -> torch.Tensor:
    """Keys ``[N, 128]`` (any float dtype) -> cache bytes ``[N, bytes_per_token]`` uint8."""
    fmt = get_index_format(index_format)
    if fmt.fp4:
        codes, exponent = quantize_e2m1(keys)
        return torch.cat([pack_e2m1(codes), exponent.to(torch.uint8)], -1)
    if fmt.fp8:
        values, scale = quantize_e4m3(keys)
        # the scale's 4 bytes from a flat view: a [N, 1] view's size-1 dim may get stride 0
        # in Inductor's layout, which a dtype view refuses
        return torch.cat([values.view(torch.uint8), scale.contiguous().view(torch.uint8).view(-1, 4)], -1)
    return keys.to(torch.bfloat16).view(torch.uint8)


def read_index_keys(cache: torch.Tensor, slots: torch.Tensor, index_format: str) -> torch.Tensor:
    """Dequantized keys of ``slots`` (int tensor, any shape ``S``): fp32 ``[*S, 128]``; slots
    that are ``-1`` or outside the cache read as zeros, their memory never touched."""
    fmt = check_index_cache("cache", cache, index_format)
    if cache.shape[0] * cache.shape[1] == 0:
        return torch.zeros(*slots.shape, INDEX_DIM, device=cache.device)
    page, offset, valid = locate_slots(cache, slots)
    rows = page_bytes(cache)[page.unsqueeze(-1), row_byte_index(fmt, cache.shape[1], offset)]
    if fmt.fp4:
        keys = dequantize_e2m1(rows[..., : fmt.data_bytes], rows[..., fmt.data_bytes :], packed=True)
    elif fmt.fp8:
        values = rows[..., :INDEX_DIM].contiguous().view(torch.float8_e4m3fn).float()
        keys = values * rows[..., INDEX_DIM:].contiguous().view(torch.float32)
    else:
        keys = rows.contiguous().view(torch.bfloat16).float()
    return keys * valid.unsqueeze(-1)

