"""KV-cache formats: byte layouts, a reference quantizer and a reference dequantizer.

Every cache is a paged tensor ``[num_pages, page_size, row_width]`` whose pages are each
contiguous; only the page stride (``cache.stride(0)``) is free, so a cache may be a view
into a larger allocation. A *slot* is a token row: ``slot = page * page_size + offset``.

=============  ==========  =====  ===========================================================
``kv_format``  dtype       width  one page, in bytes
=============  ==========  =====  ===========================================================
``bf16``       bfloat16    512    ``page_size`` rows of 512 bf16
``fp8``        e4m3fn      512    ``page_size`` rows of 512 e4m3; value = e4m3 * ``kv_scale``
``fp8_ds_mla`` uint8       584    ``page_size`` data rows of 576 B (448 e4m3 NoPE values, then
                                  64 bf16 RoPE values), then ``page_size`` scale rows of 8 B
                                  (7 UE8M0 scales, one per 64 NoPE values, then 1 zero byte)
``fp8_dsv41``  uint8       528    ``page_size`` data rows of 512 e4m3 values, then
                                  ``page_size`` scale rows of 16 UE8M0 scales (one per 32)
``fp4_dsv41``  uint8       288    ``page_size`` data rows of 256 B (512 e2m1 values, two per
                                  byte, the even-numbered value in the low nibble), then
                                  ``page_size`` scale rows of 32 e4m3 scales (one per 16)
=============  ==========  =====  ===========================================================

A UE8M0 byte ``e`` means ``2**(e - 127)``. For a block with max magnitude ``amax`` the
quantizer picks ``e = ceil(log2(max(amax, 1e-4) / 448)) + 127`` and stores
``clamp(x / 2**(e - 127), -448, 448)`` rounded to nearest e4m3. ``fp4_dsv41`` (DeepSeek-V4.1's
compressed entries) takes per block of 16 the e4m3 scale ``s = e4m3(min(max(amax, 6 *
2**-9) / 6, 448))`` and stores ``clamp(x / s, -6, 6)`` rounded to nearest e2m1 (ties to
the even code), as DeepSeek's ``fp4_act_quant`` with e4m3 scales does.

Round-trip error of one value ``x`` (``docs/formats.md`` derives the bounds; the tests
check them): ``bf16`` is exact for bf16 input (``2**-8 * |x|`` for fp32 input); ``fp8``:
``2**-4 * |x| + 2**-10 * kv_scale`` while ``|x| <= 448 * kv_scale`` (saturates beyond);
``fp8_ds_mla`` / ``fp8_dsv41``: ``2**-4 * |x| + 2**-10 * s`` with ``s`` the block's scale
(``s < 2 * max(amax, 1e-4) / 448``), and ``fp8_ds_mla``'s RoPE dims are bf16 (``2**-8 * |x|``);
``fp4_dsv41``: ``2**-2 * |x| + 2**-2 * s`` while the block's ``6 * 2**-6 <= amax <= 6 * 448``
(a normal e4m3 scale, not saturated).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from compile_ops._checks import check_device, check_tensor

HEAD_DIM = 512
LOG2E = 1.0 / math.log(2.0)  # LSEs are base 2 everywhere: log2(x) = ln(x) * LOG2E
E4M3_MAX = 448.0
UE8M0_BIAS = 127
AMAX_FLOOR = 1e-4
E2M1_MAX = 6.0
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # of codes 0..7; code bit 3 is the sign
FP4_E4M3_AMAX_FLOOR = 6 * 2.0**-9  # an e4m3 fp4 scale is at least e4m3's smallest, 2**-9
FP4_UE8M0_AMAX_FLOOR = 6 * 2.0**-126  # a ue8m0 fp4 scale (index keys) is at least 2**-126


@dataclass(frozen=True)
class KVFormat:
    """Static description of one cache format.

    ``data_bytes`` and ``scale_bytes`` are the sizes of one token's data row and scale row;
    a page holds all its data rows first, then all its scale rows (no scale rows for
    ``bf16`` / ``fp8``). ``nope`` values are stored as e4m3 in blocks of ``block``
    values sharing one UE8M0 scale (``block == 0``: one per-tensor ``kv_scale``); the
    remaining ``512 - nope`` RoPE values are stored as bf16. ``fp4``: the values are e2m1
    instead, two per byte, and each block's scale is one e4m3 byte.
    """

    name: str
    dtype: torch.dtype
    row_width: int
    data_bytes: int
    scale_bytes: int
    nope: int
    block: int
    fp4: bool = False

    @property
    def bytes_per_token(self) -> int:
        return self.data_bytes + self.scale_bytes

    @property
    def tensor_scaled(self) -> bool:
        """e4m3 values under one per-tensor ``kv_scale`` (``fp8``)."""
        return self.nope > 0 and self.block == 0

    @property
    def bf16_rope(self) -> bool:
        """The RoPE values stored as bf16 after the e4m3 blocks (``fp8_ds_mla``)."""
        return 0 < self.nope < HEAD_DIM

    @property
    def data_elems(self) -> int:
        """Cache elements (of ``dtype``) in one token's data row."""
        return self.data_bytes // torch.empty(0, dtype=self.dtype).element_size()


KV_FORMATS: dict[str, KVFormat] = {
    f.name: f
    for f in (
        KVFormat("bf16", torch.bfloat16, 512, 1024, 0, 0, 0),
        KVFormat("fp8", torch.float8_e4m3fn, 512, 512, 0, 512, 0),
        KVFormat("fp8_ds_mla", torch.uint8, 584, 576, 8, 448, 64),
        KVFormat("fp8_dsv41", torch.uint8, 528, 512, 16, 512, 32),
        KVFormat("fp4_dsv41", torch.uint8, 288, 256, 32, 512, 16, fp4=True),
    )
}


def get_format(kv_format: object) -> KVFormat:
    """The :class:`KVFormat` named ``kv_format``; ``ValueError`` for an unknown name."""
    if not isinstance(kv_format, str):
        raise TypeError(f"kv_format must be a str, got {type(kv_format).__name__}")
    fmt = KV_FORMATS.get(kv_format)
    if fmt is None:
        raise ValueError(f"kv_format must be one of {sorted(KV_FORMATS)}, got {kv_format!r}")
    return fmt


def check_cache(name: str, cache: object, kv_format: str, device=None) -> KVFormat:
    """Validate a paged cache of ``kv_format`` (dtype, rank, row width, page contiguity)."""
    fmt = get_format(kv_format)
    check_tensor(name, cache, fmt.dtype, 3, device)
    if cache.shape[-1] != fmt.row_width:
        raise ValueError(
            f"{name} holds kv_format {kv_format!r}, whose rows are {fmt.row_width} wide "
            f"([num_pages, page_size, {fmt.row_width}] {fmt.dtype}), got shape "
            f"{tuple(cache.shape)}"
        )
    if cache.shape[1] > 1 and (cache.stride(2) != 1 or cache.stride(1) != fmt.row_width):
        raise ValueError(
            f"{name} must be contiguous within each page (strides (*, {fmt.row_width}, 1)); "
            f"got strides {cache.stride()}"
        )
    return fmt


def new_cache(
    kv_format: str,
    num_pages: int,
    page_size: int,
    *,
    device=None,
    page_gap: Optional[int] = None,
) -> torch.Tensor:
    """A zeroed cache ``[num_pages, page_size, row_width]``.

    ``page_gap`` extra elements between pages make ``stride(0)`` larger than a page, as
    when a cache is a view into a bigger pool. ``None`` (default) pads ``fp8_ds_mla`` pages
    to a multiple of 576 bytes, the alignment FlashMLA's SM90 kernels need, and the other
    formats not at all.
    """
    fmt = get_format(kv_format)
    device = check_device("device", device)
    if page_gap is None:
        page_gap = -(page_size * fmt.row_width) % 576 if kv_format == "fp8_ds_mla" else 0
    pool = torch.zeros(num_pages, page_size * fmt.row_width + page_gap, dtype=fmt.dtype, device=device)
    return pool[:, : page_size * fmt.row_width].view(num_pages, page_size, fmt.row_width)


def num_slots(cache: torch.Tensor) -> int:
    """Token rows of a paged cache: ``num_pages * page_size`` (valid slots are below it)."""
    return cache.shape[0] * cache.shape[1]


def page_bytes(cache: torch.Tensor) -> torch.Tensor:
    """``[num_pages, page_bytes]`` uint8 view of ``cache`` honouring its page stride (a view,
    since each page is contiguous; no ``as_strided``, so torch.compile traces it)."""
    return cache.view(torch.uint8).flatten(1)


def row_byte_index(fmt: KVFormat, page_size: int, offset: torch.Tensor) -> torch.Tensor:
    """Byte offsets inside a page of each slot's data row then scale row: ``[..., bytes_per_token]``."""
    data = offset.unsqueeze(-1) * fmt.data_bytes + torch.arange(fmt.data_bytes, device=offset.device)
    if fmt.scale_bytes == 0:
        return data
    scale = (
        page_size * fmt.data_bytes
        + offset.unsqueeze(-1) * fmt.scale_bytes
        + torch.arange(fmt.scale_bytes, device=offset.device)
    )
    return torch.cat([data, scale], dim=-1)


def ue8m0_exponent(amax: torch.Tensor) -> torch.Tensor:
    """``ceil(log2(max(amax, 1e-4) / 448)) + 127`` computed exactly with frexp."""
    mantissa, exponent = torch.frexp(amax.clamp_min(AMAX_FLOOR) / E4M3_MAX)
    return exponent - (mantissa == 0.5).to(exponent.dtype) + UE8M0_BIAS


def e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """fp32 ``y`` (within +-6) rounded to the nearest e2m1 value, ties to the even code, as
    4-bit codes ``s mmm`` (uint8; :data:`E2M1_MAGNITUDES` ``[mmm]``, negative values and
    ``-0.0`` with the sign bit): steps of 0.5 below 2, of 1 up to 4, then 4 and 6."""
    mag = y.abs()
    code = torch.where(mag < 2, torch.round(mag * 2), torch.where(mag < 4, 2 + torch.round(mag), 4 + torch.round(mag / 2)))
    return code.to(torch.uint8) | (torch.signbit(y).to(torch.uint8) << 3)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of 4-bit e2m1 ``codes`` (any integer dtype, values 0..15): magnitudes
    :data:`E2M1_MAGNITUDES` ``[m]`` of ``m = code & 7`` (``m / 2`` below 4, ``m - 2`` below 6,
    else ``2m - 8``; arithmetic, so no table is copied to the device), negative with bit 3."""
    m = (codes & 7).float()
    magnitude = torch.where(m < 4, m / 2, torch.where(m < 6, m - 2, 2 * m - 8))
    return torch.where((codes & 8) != 0, -magnitude, magnitude)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Codes ``[..., 2n]`` -> bytes ``[..., n]`` uint8, the even-numbered code in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """fp32 values ``[..., 2n]`` of e2m1 bytes ``[..., n]`` uint8 (:func:`pack_e2m1`)."""
    return torch.stack([e2m1_values(packed & 15), e2m1_values(packed >> 4)], -1).flatten(-2)


def fp4_e4m3_scale(amax: torch.Tensor) -> torch.Tensor:
    """The e4m3 scale of blocks with max magnitudes ``amax``: ``e4m3(max(amax, 6 * 2**-9) / 6)``,
    rounded to nearest even and saturated at 448 (float8_e4m3fn)."""
    return (amax.float().clamp_min(FP4_E4M3_AMAX_FLOOR) / E2M1_MAX).clamp_max(E4M3_MAX).to(torch.float8_e4m3fn)


def encode_rows(kv: torch.Tensor, kv_format: str, kv_scale: float = 1.0) -> torch.Tensor:
    """Quantize ``kv [N, 512]`` (any float dtype) to cache bytes ``[N, bytes_per_token]`` uint8."""
    fmt = get_format(kv_format)
    kv = kv.float()
    if fmt.name == "bf16":
        return kv.to(torch.bfloat16).view(torch.uint8)
    if fmt.name == "fp8":
        return (kv / kv_scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    n = kv.shape[0]
    blocks = kv[:, : fmt.nope].reshape(n, fmt.nope // fmt.block, fmt.block)
    if fmt.fp4:
        scale = fp4_e4m3_scale(blocks.abs().amax(-1))
        codes = e2m1_codes((blocks / scale.float().unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX))
        return torch.cat([pack_e2m1(codes.reshape(n, fmt.nope)), scale.view(torch.uint8)], dim=-1)
    exponent = ue8m0_exponent(blocks.abs().amax(-1))
    scale = torch.ldexp(torch.ones_like(blocks[..., 0]), exponent - UE8M0_BIAS)
    e4m3 = (blocks / scale.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    parts = [e4m3.reshape(n, fmt.nope).view(torch.uint8)]
    if fmt.nope < HEAD_DIM:
        parts.append(kv[:, fmt.nope :].to(torch.bfloat16).view(torch.uint8))
    scale_bytes = torch.zeros(n, fmt.scale_bytes, dtype=torch.uint8, device=kv.device)
    scale_bytes[:, : exponent.shape[1]] = exponent.to(torch.uint8)
    parts.append(scale_bytes)
    return torch.cat(parts, dim=-1)


def decode_rows(rows: torch.Tensor, kv_format: str, kv_scale: float = 1.0) -> torch.Tensor:
    """Dequantize cache bytes ``[..., bytes_per_token]`` uint8 to fp32 ``[..., 512]``."""
    fmt = get_format(kv_format)
    lead = rows.shape[:-1]
    rows = rows.reshape(-1, fmt.bytes_per_token).contiguous()
    if fmt.name == "bf16":
        out = rows.view(torch.bfloat16).float()
    elif fmt.name == "fp8":
        out = rows.view(torch.float8_e4m3fn).float() * kv_scale
    elif fmt.fp4:
        scale = rows[:, fmt.data_bytes :].view(torch.float8_e4m3fn).float()
        values = unpack_e2m1(rows[:, : fmt.data_bytes]).reshape(rows.shape[0], HEAD_DIM // fmt.block, fmt.block)
        out = (values * scale.unsqueeze(-1)).reshape(rows.shape[0], HEAD_DIM)
    else:
        n, nblocks = rows.shape[0], fmt.nope // fmt.block
        values = rows[:, : fmt.nope].view(torch.float8_e4m3fn).float().reshape(n, nblocks, fmt.block)
        exponent = rows[:, fmt.data_bytes : fmt.data_bytes + nblocks].int() - UE8M0_BIAS
        scale = torch.ldexp(torch.ones(exponent.shape, device=rows.device), exponent)
        parts = [(values * scale.unsqueeze(-1)).reshape(n, fmt.nope)]
        if fmt.nope < HEAD_DIM:
            parts.append(rows[:, fmt.nope : fmt.data_bytes].contiguous().view(torch.bfloat16).float())
        out = torch.cat(parts, dim=-1)
    return out.reshape(*lead, HEAD_DIM)


def locate_slots(cache: torch.Tensor, slots: torch.Tensor):
    """Page, in-page byte index and validity of each slot (invalid slots point at slot 0)."""
    fmt_pages, page_size = cache.shape[0], cache.shape[1]
    slots = slots.long()
    valid = (slots >= 0) & (slots < fmt_pages * page_size)
    safe = torch.where(valid, slots, 0)
    return safe // page_size, safe % page_size, valid


def read_kv(cache: torch.Tensor, slots: torch.Tensor, kv_format: str, kv_scale: float = 1.0) -> torch.Tensor:
    """Dequantized rows of ``slots`` (int tensor, any shape ``S``): fp32 ``[*S, 512]``.

    Slots that are ``-1`` or outside ``[0, num_pages * page_size)`` read as zeros; their
    memory is never touched. ``slots`` that are not integers (float, bool) are an error.
    """
    fmt = check_cache("cache", cache, kv_format)
    if not isinstance(slots, torch.Tensor) or slots.dtype.is_floating_point or slots.dtype.is_complex \
            or slots.dtype == torch.bool:
        what = slots.dtype if isinstance(slots, torch.Tensor) else type(slots).__name__
        raise TypeError(f"slots must be an integer torch.Tensor, got {what}")
    if num_slots(cache) == 0:
        return torch.zeros(*slots.shape, HEAD_DIM, device=cache.device)
    page, offset, valid = locate_slots(cache, slots)
    rows = page_bytes(cache)[page.unsqueeze(-1), row_byte_index(fmt, cache.shape[1], offset)]
    return decode_rows(rows, kv_format, kv_scale) * valid.unsqueeze(-1)
