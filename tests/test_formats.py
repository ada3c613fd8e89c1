"""KV-cache formats: byte layout against the oracle's decoder and the documented error bounds."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compile_ops import write_kv
from compile_ops.formats import KV_FORMATS, get_format, new_cache, read_kv

import oracle
from helpers import examples

pytestmark = pytest.mark.quick  # the quick subset: python -m pytest -m quick



def bound(kv_format, x, kv_scale):
    """The per-value round-trip bound stated in compile_ops.formats / docs/formats.md."""
    x = x.double()
    if kv_format == "bf16":
        return 2.0**-8 * x.abs()
    if kv_format == "fp8":
        return 2.0**-4 * x.abs() + 2.0**-10 * kv_scale
    fmt = get_format(kv_format)
    blocks = x[:, : fmt.nope].reshape(x.shape[0], -1, fmt.block)
    if fmt.fp4:  # the e4m3 scale is amax / 6 rounded to 3 mantissa bits
        scale = blocks.abs().amax(-1, keepdim=True) / 6 * (1 + 2.0**-4)
        return (2.0**-2 * blocks.abs() + 2.0**-2 * scale).reshape(x.shape[0], -1)
    scale = 2 * blocks.abs().amax(-1).clamp_min(1e-4) / 448
    nope = 2.0**-4 * blocks.abs() + 2.0**-10 * scale.unsqueeze(-1)
    return torch.cat([nope.reshape(x.shape[0], -1), 2.0**-8 * x[:, fmt.nope :].abs()], 1)


@settings(max_examples=examples(0.6), deadline=None)
@given(
    st.sampled_from(sorted(KV_FORMATS)),
    st.integers(1, 5),
    st.sampled_from([1, 3, 64, 256]),
    st.sampled_from([0, 9]),
    st.floats(1e-6, 1e3),
    st.integers(0, 2**31 - 1),
)
def test_round_trip_within_documented_bound(kv_format, num_pages, page_size, page_gap, magnitude, seed):
    gen = torch.Generator().manual_seed(seed)
    n = min(num_pages * page_size, 40)
    kv = torch.randn(n, 512, generator=gen) * magnitude
    kv[:, :32] *= 1e-3  # blocks of tiny values next to large ones
    if kv_format == "fp4_dsv41":  # the stated bound holds while a block's e4m3 scale is normal, not saturated
        kv = kv.clamp(-6 * 448, 6 * 448)
        kv = torch.where(kv.unflatten(1, (32, 16)).abs().amax(2, keepdim=True) < 6 * 2.0**-6, 0.0,
                         kv.unflatten(1, (32, 16))).flatten(1)
    kv_scale = magnitude / 50 if kv_format == "fp8" else 1.0  # no saturation below 22 sigma
    if kv_format == "bf16":
        kv = kv.bfloat16().float()
    cache = new_cache(kv_format, num_pages, page_size, page_gap=page_gap)
    slots = torch.randperm(num_pages * page_size, generator=gen)[:n].int()
    write_kv(cache, slots, kv, kv_format, kv_scale)
    back = read_kv(cache, slots, kv_format, kv_scale)
    err = (back.double() - kv.double()).abs()
    if kv_format == "bf16":
        assert torch.equal(back, kv)
    else:
        assert torch.all(err <= bound(kv_format, kv, kv_scale) * (1 + 1e-6)), (err - bound(kv_format, kv, kv_scale)).max()
    decode = oracle.slot_decoder(cache, kv_format, kv_scale)
    want = np.stack([decode(int(s)) for s in slots])
    np.testing.assert_allclose(back.double().numpy(), want, rtol=2.0**-23, atol=0)  # fp32 * kv_scale


@pytest.mark.parametrize("kv_format", ["fp8_ds_mla", "fp8_dsv41"])
def test_ue8m0_scale_bytes(kv_format):
    """Scale byte = ceil(log2(max(amax, 1e-4) / 448)) + 127, incl. exact powers of two."""
    fmt = get_format(kv_format)
    amaxes = [448.0, 449.0, 1.0, 1e-9, 3.5e-2, 2.0**-20 * 448]
    kv = torch.zeros(len(amaxes), 512)
    for i, a in enumerate(amaxes):
        kv[i, : fmt.nope] = a * torch.linspace(-1, 1, fmt.nope).sign()
    cache = new_cache(kv_format, 1, len(amaxes))
    write_kv(cache, torch.arange(len(amaxes)), kv, kv_format)
    page = cache.view(torch.uint8).reshape(-1)
    for i, a in enumerate(amaxes):
        at = len(amaxes) * fmt.data_bytes + i * fmt.scale_bytes
        ratio = float(np.float32(max(a, 1e-4)) / np.float32(448))
        assert page[at].item() == math.ceil(math.log2(ratio)) + 127


@pytest.mark.parametrize("kv_format", sorted(KV_FORMATS))
def test_write_skips_invalid_slots_and_touches_nothing_else(kv_format):
    cache = new_cache(kv_format, 2, 4, page_gap=3)
    pool = cache.untyped_storage()
    before = torch.empty(0, dtype=torch.uint8).set_(pool).clone()
    kv = torch.randn(4, 512)
    write_kv(cache, torch.tensor([-1, 8, 100, 5], dtype=torch.int32), kv, kv_format)
    after = torch.empty(0, dtype=torch.uint8).set_(pool)
    changed = (after != before).nonzero().flatten()
    fmt = get_format(kv_format)
    elem = cache.element_size()
    page_bytes = cache.stride(0) * elem
    page1 = page_bytes  # slot 5 = page 1, offset 1
    allowed = set(range(page1 + fmt.data_bytes, page1 + 2 * fmt.data_bytes))
    if fmt.scale_bytes:
        s0 = page1 + 4 * fmt.data_bytes + fmt.scale_bytes
        allowed |= set(range(s0, s0 + fmt.scale_bytes))
    assert changed.numel() > 0 and set(changed.tolist()) <= allowed
    assert torch.equal(read_kv(cache, torch.tensor([-1, 8, 100]), kv_format), torch.zeros(3, 512))


@pytest.mark.parametrize("slots", [torch.tensor([1.0]), torch.tensor([True]), [1]], ids=["float", "bool", "list"])
def test_read_kv_refuses_slots_that_are_not_integers(slots):
    """A float or bool index would read rows of its rounded or 0/1 values: refused."""
    with pytest.raises(TypeError, match="slots must be an integer torch.Tensor"):
        read_kv(new_cache("bf16", 1, 4), slots, "bf16")


def test_bytes_per_token_matches_design():
    assert {k: f.bytes_per_token for k, f in KV_FORMATS.items()} == {
        "bf16": 1024,
        "fp8": 512,
        "fp8_ds_mla": 584,
        "fp8_dsv41": 528,
        "fp4_dsv41": 288,
    }


@pytest.mark.parametrize("kv_format", list(KV_FORMATS))
def test_write_kv_slots_int32_or_int64_as_documented(kv_format):
    """docs/ops.md: write_kv's slots may be int32 or int64 (engines' slot mappings), the same
    rows either way; any other dtype is a TypeError naming the argument."""
    kv = torch.randn(3, 512)
    caches = []
    for dtype in (torch.int32, torch.int64):
        cache = new_cache(kv_format, 2, 4)
        write_kv(cache, torch.tensor([6, -1, 1], dtype=dtype), kv, kv_format)
        caches.append(cache)
    assert torch.equal(caches[0].view(torch.uint8), caches[1].view(torch.uint8))
    with pytest.raises(TypeError, match="slots must have dtype torch.int32 or torch.int64, got torch.int16"):
        write_kv(new_cache(kv_format, 2, 4), torch.tensor([0, 1, 2], dtype=torch.int16), kv, kv_format)


def test_fp4_bytes_equal_deepseeks_quantizer():
    """``fp4_dsv41`` rows hold, byte for byte, what DeepSeek-V4.1's ``fp4_act_quant`` (16-value
    blocks, e4m3 scales) makes of them: per block ``s = e4m3(fp32(max(amax, 6 * 2**-9) / 6))``,
    values ``clamp(x / s, -6, 6)`` rounded to nearest e2m1 (ties to the even code), two per
    byte with the even-numbered value in the low nibble. Written independently here in
    float64 from the oracle's rounding; rows with exact ties, a saturating block, tiny and
    zero blocks, and negative zeros."""
    gen = torch.Generator().manual_seed(3)
    kv = torch.randn(6, 512, generator=gen) * torch.tensor([1.0, 1e-4, 300.0, 0.0, 4e3, 1.0]).unsqueeze(1)
    kv[0, :16] = torch.tensor([6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -2.5, -5.0, 0.1, -0.0, 4.5, 1.0, 2.0])
    kv[5, 16:32] = 1e-12  # under the amax floor: the scale is e4m3's smallest
    cache = new_cache("fp4_dsv41", 1, 6)
    write_kv(cache, torch.arange(6), kv, "fp4_dsv41")
    page = cache.view(torch.uint8).reshape(-1).numpy()
    e4m3_codes = {float(v): b for b, v in enumerate(oracle.E4M3) if np.isfinite(v) and not (v == 0 and b)}
    for i, row in enumerate(kv.double().numpy()):
        for j, block in enumerate(row.reshape(32, 16)):
            amax = max(float(np.float32(np.abs(block).max())), 6 * 2.0**-9)
            s = float(oracle._round_e4m3(np.array([float(np.float32(amax) / np.float32(6))]))[0])
            assert page[6 * 256 + i * 32 + j] == e4m3_codes[s]
            values = oracle._round_e2m1(np.clip(block.astype(np.float32) / np.float32(s), -6, 6))
            signs = np.signbit(np.clip(block.astype(np.float32) / np.float32(s), -6, 6))
            codes = [int(np.where(oracle._e2m1(np.arange(8)) == abs(v))[0][0]) | (8 * bool(neg))
                     for v, neg in zip(values, signs)]
            data = page[i * 256 + j * 8 : i * 256 + (j + 1) * 8]
            assert [int(b) & 15 for b in data] == codes[0::2] and [int(b) >> 4 for b in data] == codes[1::2]


def test_e2m1_values_equal_the_bit_level_decoder():
    """The 16 e2m1 codes decode to :data:`E2M1_MAGNITUDES` and their negatives, as the
    oracle's decoder of the bits (bias 1, one mantissa bit, ``ee = 0`` subnormal) reads them."""
    from compile_ops.formats import E2M1_MAGNITUDES, e2m1_values

    got = e2m1_values(torch.arange(16)).double().numpy()
    np.testing.assert_array_equal(got, oracle._e2m1(np.arange(16)))
    np.testing.assert_array_equal(np.abs(got[:8]), E2M1_MAGNITUDES)
    assert np.signbit(got[8:]).all() and not np.signbit(got[:8]).any()
