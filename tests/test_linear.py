"""The block-scaled FP8 linear (``dsv41::fp8_linear``) on the CPU, in both of DeepSeek's
weight layouts (128 x 128 blocks with fp32 scales, 32 x 32 with ue8m0 scales): the
quantizer's error bound, the reference against a float64 oracle of the dequantized
operands, the Triton kernel under the interpreter against the reference, the fake kernel
(opcheck), bad inputs, and an sm_90 build of the kernel."""

from __future__ import annotations

import pytest
import numpy as np
import torch

import compile_ops
from compile_ops.bench.linear import FLASH_PROJECTIONS
from compile_ops.linear import dequantize_blocks, fp8_linear, quantize_blocks, quantize_tokens
from compile_ops.linear.quant import E4M3_MAX, LAYOUTS
from test_opcheck import opcheck

pytestmark = pytest.mark.quick  # the quick subset: python -m pytest -m quick

SHAPES = [(1, 64, 64), (3, 200, 300), (20, 128, 256), (17, 384, 130)]
BLOCKS = [pytest.param(128, id="128-fp32"), pytest.param(32, id="32-ue8m0")]


def _e4m3_bound(x: torch.Tensor, scale_per_value: torch.Tensor) -> torch.Tensor:
    """Largest rounding error of e4m3 at ``x`` (3 mantissa bits; subnormal step 2**-9)."""
    return 2**-4 * x.abs() + 2**-9 * scale_per_value


def _is_power_of_two(s: torch.Tensor) -> bool:
    mantissa, _ = torch.frexp(s.float())
    return bool((mantissa == 0.5).all())


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("N, K", [(64, 64), (200, 300), (384, 130)])
def test_block_quantizer_rounds_within_the_e4m3_bound(N, K, block):
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(N)) * torch.logspace(-3, 2, K)
    q, scale = quantize_blocks(w, block)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (-(-N // block), -(-K // block))
    assert scale.dtype == LAYOUTS[block].scale_dtype
    per_value = scale.float().repeat_interleave(block, 0)[:N].repeat_interleave(block, 1)[:, :K]
    assert ((dequantize_blocks(q, scale) - w).abs() <= _e4m3_bound(w, per_value)).all()
    assert q.float().abs().amax() <= E4M3_MAX
    assert torch.equal(quantize_blocks(torch.zeros(3, 5), block)[1].float(), torch.ones(1, 1))
    if block == 32:  # the smallest power of two >= amax / 448: never clipped, less than 2x larger
        padded = torch.zeros(-(-N // block) * block, -(-K // block) * block)
        padded[:N, :K] = w
        amax = padded.view(-(-N // block), block, -(-K // block), block).abs().amax(dim=(1, 3))
        assert _is_power_of_two(scale)
        assert (scale.float() >= amax / E4M3_MAX).all() and (scale.float() < 2 * amax / E4M3_MAX).all()


@pytest.mark.parametrize("block", BLOCKS)
def test_token_quantizer_rounds_within_the_e4m3_bound(block):
    x = torch.randn(7, 300, generator=torch.Generator().manual_seed(1)) * 30
    q, scale = quantize_tokens(x, block)
    assert scale.shape == (7, -(-300 // block)) and scale.dtype == torch.float32
    per_value = scale.repeat_interleave(block, 1)[:, :300]
    back = q.float() * per_value
    assert ((back - x).abs() <= _e4m3_bound(x, per_value)).all()
    if block == 32:
        assert _is_power_of_two(scale)


def test_power_of_two_scales_are_the_next_power_of_two_of_amax_over_448():
    """DeepSeek's ``fast_round_scale``: ``2 ** ceil(log2(amax / 448))``, exact powers kept."""
    x = torch.tensor([[448.0] * 32, [449.0] * 32, [224.0] * 31 + [0.0], [0.0] * 32, [3e-3] * 32])
    _, scale = quantize_tokens(x, 32)
    assert scale.flatten().tolist() == [1.0, 2.0, 0.5, 1.0, 2.0**-17]


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("M, N, K", SHAPES)
def test_reference_equals_the_float64_product_of_the_quantized_operands(M, N, K, block):
    gen = torch.Generator().manual_seed(M * N)
    x = torch.randn(M, K, generator=gen).bfloat16()
    wq, ws = quantize_blocks(torch.randn(N, K, generator=gen) / K**0.5, block)
    with compile_ops.use_backends(linear="reference"):
        got = fp8_linear(x, wq, ws)
    xq, xs = quantize_tokens(x, block)
    rounded = xq.double() * xs.double().repeat_interleave(block, 1)[:, :K]
    xd = x.double() if M <= LAYOUTS[block].weight_only_tokens else rounded
    oracle = xd @ dequantize_blocks(wq, ws).double().t()
    assert got.dtype == torch.bfloat16 and got.shape == (M, N)
    assert ((got.double() - oracle).abs() <= 2**-8 * oracle.abs() + 1e-5).all()  # one bf16 rounding


@pytest.mark.parametrize("block", BLOCKS)
def test_decode_sized_calls_are_weight_only(block):
    """Up to the layout's ``weight_only_tokens`` (64 with 128-blocks, 256 with 32-blocks)
    the activations stay bf16 (the product of the bf16 tokens and the dequantized weight);
    one token more and they are quantized."""
    most = LAYOUTS[block].weight_only_tokens
    assert most == {128: 64, 32: 256}[block]
    gen = torch.Generator().manual_seed(block)
    x = (torch.randn(most + 1, 256, generator=gen) * 3).bfloat16()
    wq, ws = quantize_blocks(torch.randn(128, 256, generator=gen) / 16, block)
    w = dequantize_blocks(wq, ws).double()
    with compile_ops.use_backends(linear="reference"):
        small = fp8_linear(x[:most], wq, ws).double()
        large = fp8_linear(x, wq, ws).double()
    exact = x.double() @ w.t()
    xq, xs = quantize_tokens(x, block)
    rounded = (xq.double() * xs.double().repeat_interleave(block, 1)) @ w.t()
    bf16 = 2**-8 * exact.abs() + 1e-5
    assert ((small - exact[:most]).abs() <= bf16[:most]).all()
    assert ((large - rounded).abs() <= 2**-8 * rounded.abs() + 1e-5).all()
    assert not ((large - exact).abs() <= bf16).all()  # the activations' rounding shows


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("M, N, K, splits", [(1, 64, 64, 1), (3, 200, 300, 3), (20, 128, 256, 2), (17, 384, 130, 2),
                                             (2, 128, 1024, 8), (70, 256, 640, 5), (600, 2048, 256, 1), (1, 200, 1300, 11),
                                             (130, 96, 160, 2)])
def test_triton_kernel_equals_the_reference(M, N, K, splits, block):
    """Quantized inside the GEMM as ``quantize_tokens`` does, with K split over ``splits``
    programs per tile (fewer tiles than two per SM) or not (600 x 2048: 160 tiles); with
    32-blocks past 256 tokens, both operands dequantized to bf16 and multiplied by torch."""
    from compile_ops.linear.reference import fp8_linear_reference
    from compile_ops.linear.triton import fp8_linear_triton, k_splits

    gen = torch.Generator().manual_seed(K)
    x = (torch.randn(M, K, generator=gen) * torch.logspace(-2, 1, K)).bfloat16()
    x[0, :block] = 0  # an all-zero block: scale 1, not a division by zero
    wq, ws = quantize_blocks(torch.randn(N, K, generator=gen) / K**0.5, block)
    want = fp8_linear_reference(x, wq, ws).float()
    got = fp8_linear_triton(x, wq, ws).float()
    assert ((got - want).abs() <= 2**-7 * want.abs().max()).all()  # summation order + one bf16 rounding
    if block == 128:  # (32-blocks: 4x the K blocks, split as finely)
        assert k_splits(M, N, K) == splits


def test_dequantized_operands_are_the_quantized_values_exactly():
    """The cuBLAS path of 32-blocks past their weight-only calls multiplies bf16 operands
    that are the quantized values exactly: the weight times its ue8m0 scales, the tokens'
    e4m3 codes times theirs (tiny, huge, zero and partial blocks included)."""
    from compile_ops.linear.triton import dequantize_triton, round_tokens_triton

    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(21, 200, generator=gen) * torch.logspace(-30, 30, 200)).bfloat16()
    x[3, :32] = 0
    xq, xs = quantize_tokens(x, 32)
    assert torch.equal(round_tokens_triton(x).double(), xq.double() * xs.double().repeat_interleave(32, 1)[:, :200])
    wq, ws = quantize_blocks(torch.randn(70, 200, generator=gen) * torch.logspace(-20, 20, 200), 32)
    assert torch.equal(dequantize_triton(wq, ws.view(torch.uint8)).double(), dequantize_blocks(wq, ws).double())


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("M", [1, 19, 300])
def test_grouped_linear_equals_one_linear_per_group(M, block):
    """``groups = 4``: output columns of group g are x's K columns of group g times W_g."""
    from compile_ops.linear.reference import fp8_linear_reference
    from compile_ops.linear.triton import fp8_linear_triton

    gen = torch.Generator().manual_seed(M)
    G, N, K = 4, 128, 256
    x = torch.randn(M, G * K, generator=gen).bfloat16()
    wq, ws = quantize_blocks(torch.randn(G * N, K, generator=gen) / K**0.5, block)
    rows = N // block  # scale rows per group
    with compile_ops.use_backends(linear="reference"):
        grouped = fp8_linear(x, wq, ws, 4)
        per_group = torch.cat([fp8_linear(x[:, g * K:(g + 1) * K], wq[g * N:(g + 1) * N], ws[g * rows:(g + 1) * rows])
                               for g in range(G)], 1)
    assert torch.equal(grouped, per_group)
    got = fp8_linear_triton(x, wq, ws, 4).float()
    want = fp8_linear_reference(x, wq, ws, 4).float()
    assert ((got - want).abs() <= 2**-7 * want.abs().max()).all()


@pytest.mark.parametrize("block", BLOCKS)
def test_fake_kernel_and_schema(block):
    wq, ws = quantize_blocks(torch.randn(130, 200), block)
    opcheck(torch.ops.dsv41.fp8_linear.default, (torch.randn(5, 200).bfloat16(), wq, ws))
    wq, ws = quantize_blocks(torch.randn(256, 128), block)
    opcheck(torch.ops.dsv41.fp8_linear.default, (torch.randn(3, 256).bfloat16(), wq, ws, 2))


@pytest.mark.parametrize("args, says", [
    (lambda w, s: (torch.randn(2, 199).bfloat16(), w, s), "x must be \\[M, groups \\* K\\] with K = weight.shape\\[1\\] = 200"),
    (lambda w, s: (torch.randn(2, 400).bfloat16(), w, s, 2), "N / groups a multiple of 128"),
    (lambda w, s: (torch.randn(2, 200).bfloat16(), w, s[:, :1]), "weight_scale \\(.*\\) must be \\[ceil\\(N/"),
    (lambda w, s: (torch.randn(2, 200).bfloat16(), w.float(), s), "weight"),
    (lambda w, s: (torch.randn(2, 200).bfloat16(), w, s.to(torch.bfloat16)), "float32 or torch.float8_e8m0fnu"),
    (lambda w, s: (torch.randn(2, 200).bfloat16(), w, s.float() if s.dtype != torch.float32 else s.to(torch.float8_e8m0fnu)),
     "weight_scale \\(.*\\) must be \\[ceil\\(N/"),
], ids=["K", "groups-blocks", "scale-shape", "weight-dtype", "scale-dtype", "scale-of-the-other-layout"])
@pytest.mark.parametrize("block", BLOCKS)
def test_bad_inputs_are_refused(args, says, block):
    wq, ws = quantize_blocks(torch.randn(130, 200), block)
    with pytest.raises((ValueError, TypeError), match=says):
        fp8_linear(*args(wq, ws))


@pytest.mark.parametrize("block", [64, 0, [128, 32], [32, 32, 1], True])
def test_other_block_layouts_are_refused(block):
    from compile_ops.linear import layout_of_block

    with pytest.raises(ValueError, match="128 x 128 with fp32 scales .* or 32 x 32 with ue8m0|must be square"):
        layout_of_block(block)


SM90_BUILD = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from compile_ops.linear import triton as kernels



def build(kernel, signature, constants):
    names = list(signature)
    constants = {(names.index(k),): v for k, v in constants.items()}
    return triton.compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", 90, 32)).asm["ptx"]


def gemm(scale, a="*fp8e4nv"):
    return {"a": a, "a_s": "*fp32", "b": "*fp8e4nv", "b_s": scale, "c": "*fp32", "M": "i32", "N": "i32",
            "K": "i32", "stride_am": "i32", "stride_asm": "i32", "stride_ask": "i32", "stride_bn": "i32",
            "stride_bs": "i32", "stride_cm": "i32", "GROUP_N": "i32", "BLOCKS_PER_SPLIT": "i32", "BM": "constexpr",
            "BN": "constexpr", "BK": "constexpr", "ITERS": "constexpr", "PARTIAL": "constexpr",
            "BF16_A": "constexpr", "UPCAST": "constexpr", "SB": "constexpr", "SWAP": "constexpr"}


for bm in (16, 64):  # the block-scaled GEMM: 128-blocks (32-blocks past weight-only run on cuBLAS)
    ptx = build(kernels._fp8_gemm_kernel, gemm("*fp32"),
                {"BM": bm, "BN": 128, "BK": 128, "ITERS": 0, "PARTIAL": bm == 16,
                 "BF16_A": False, "UPCAST": False, "SB": 0, "SWAP": False})
    print(f"{bm}x128", "wgmma" in ptx or "mma.sync" in ptx)
# weight-only decode calls, bf16 tokens: 128-blocks, then 32-blocks' three tiles (weight_only_tile)
for sb, bm, bn, bk, swap in ((0, 16, 128, 128, False), (32, 16, 64, 128, True), (32, 64, 64, 64, False),
                             (32, 128, 64, 64, False)):
    ptx = build(kernels._fp8_gemm_kernel, gemm("*u8" if sb else "*fp32", "*bf16"),
                {"BM": bm, "BN": bn, "BK": bk, "ITERS": 0, "PARTIAL": True, "BF16_A": True,
                 "UPCAST": False, "SB": sb, "SWAP": swap})
    # the weights widen to bf16 in integer arithmetic, not through the conversion unit
    print(f"bf16x{sb or 128}x{bm}", "wgmma" in ptx or "mma.sync" in ptx, "e4m3x2" not in ptx and "cvt.bf16.f16" not in ptx)
# decode calls of a token or two: the GEMV on the CUDA cores, widening without the
# conversion unit, and fp32 FMAs that keep subnormals (e4m3 subnormals widen to fp32 ones)
gemv = {"x": "*bf16", "w": "*fp8e4nv", "w_s": "", "c": "*fp32", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32",
        "stride_wn": "i32", "stride_sn": "i32", "stride_cm": "i32", "GROUP_N": "i32", "BLOCKS_PER_SPLIT": "i32",
        "BN": "constexpr", "BK": "constexpr", "SB": "constexpr", "ITERS": "constexpr", "PARTIAL": "constexpr",
        "E8M0": "constexpr", "UPCAST": "constexpr", "EVEN": "constexpr"}
for sb, scale in ((128, "*fp32"), (32, "*u8")):  # (masked loads with 128-blocks, unmasked with 32-blocks)
    ptx = build(kernels._fp8_gemv_kernel, {**gemv, "w_s": scale},
                {"BN": 16, "BK": 512, "SB": sb, "ITERS": 0, "PARTIAL": True, "E8M0": sb == 32, "UPCAST": False,
                 "EVEN": sb == 32})
    print(f"gemv{sb}", "fma.rn.f32" in ptx and ".ftz" not in ptx and "e4m3x2" not in ptx and "mma" not in ptx)
quant = {"x": "*bf16", "q": "*fp8e4nv", "s": "*fp32", "M": "i32", "K": "i32", "stride_xm": "i32",
         "BM": "constexpr", "BK": "constexpr", "QMAX": "constexpr", "POW2": "constexpr", "ROUNDED": "constexpr"}
for bk in (128, 32):
    ptx = build(kernels._quantize_kernel, quant, {"BM": 16, "BK": bk, "QMAX": 448.0, "POW2": bk == 32, "ROUNDED": False})
    print(f"quant{bk}", "div.rn.f32" in ptx)
# the cuBLAS path of 32-blocks: tokens rounded to bf16 values, the weight dequantized
ptx = build(kernels._quantize_kernel, {**quant, "q": "*bf16"}, {"BM": 16, "BK": 32, "QMAX": 448.0, "POW2": True,
                                                               "ROUNDED": True})
print("rounded32", "div.rn.f32" in ptx and "st.global" in ptx)
dequant = {"w": "*fp8e4nv", "w_s": "*u8", "out": "*bf16", "N": "i32", "K": "i32", "stride_wn": "i32",
           "stride_sn": "i32", "stride_on": "i32", "BR": "constexpr", "BC": "constexpr", "SB": "constexpr",
           "UPCAST": "constexpr"}
ptx = build(kernels._dequantize_kernel, dequant, {"BR": 32, "BC": 512, "SB": 32, "UPCAST": False})
print("dequant32", "e4m3x2" not in ptx and "cvt.bf16.f16" not in ptx)
# the bf16 GEMV of one token: fp32 FMAs on the CUDA cores, into fp32 and bf16 outputs
bf16_gemv = {"x": "*bf16", "w": "*bf16", "c": "*fp32", "N": "i32", "K": "i32", "stride_xk": "i32", "stride_wn": "i32",
             "BLOCKS_PER_SPLIT": "i32", "BN": "constexpr", "BK": "constexpr", "ITERS": "constexpr",
             "PARTIAL": "constexpr", "EVEN": "constexpr"}
for c in ("*fp32", "*bf16"):  # (unmasked loads into fp32, masked into bf16)
    ptx = build(kernels._bf16_gemv_kernel, {**bf16_gemv, "c": c},
                {"BN": 8, "BK": 1024, "ITERS": 0, "PARTIAL": False, "EVEN": c == "*fp32"})
    print(f"bf16gemv{c[1:]}", "fma.rn.f32" in ptx and "mma" not in ptx)
"""


def _prmt(word, selector):
    """``prmt.b32 d, word, 0, selector`` on uint32 arrays: output byte ``i`` is byte
    ``selector``'s nibble ``i`` (its low 3 bits) of ``word`` (bytes 4-7 are the zero
    register), or that byte's sign copied into all 8 bits when the nibble's bit 3 is set."""
    source = [(word >> (8 * i)) & 0xFF for i in range(4)] + [np.zeros_like(word)] * 4
    out = np.zeros_like(word)
    for i in range(4):
        nibble = (selector >> (4 * i)) & 0xF
        byte = source[nibble & 7]
        out |= (np.where(byte & 0x80, 0xFF, 0) if nibble & 8 else byte).astype(word.dtype) << (8 * i)
    return out


E4M3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()


def test_the_weight_widening_bit_rule_gives_every_e4m3_value():
    """:func:`compile_ops._triton_quant.e4m3_to_bf16_bits`'s PTX, step by step on every pair of
    bytes (Triton packs element 0 in the low byte / half): ``prmt`` builds each half as the
    byte below a copy of its sign, a shift left by 4 and the mask ``0x87F0`` leave bf16's
    bits, and each half times ``2**120`` is the e4m3 value (NaN bytes aside), subnormals and
    ``-0`` included."""
    b = np.arange(256, dtype=np.uint32)
    pair = (b[:, None] | (b[None, :] << 8)).reshape(-1)
    m = (_prmt(pair, 0x9180) << 4) & 0x87F087F0  # prmt 0x9180, shl 4, and
    halves = np.stack([m & 0xFFFF, m >> 16]).astype(np.uint16).view(np.int16)
    got = torch.from_numpy(halves).view(torch.bfloat16).double() * 2.0 ** 120  # fma.rn.bf16x2 by 2**120
    want = torch.stack([E4M3.repeat_interleave(256), E4M3.repeat(256)])  # pair i * 256 + j: bytes i, j
    finite = ~want.isnan()
    assert torch.equal(got[finite], want[finite])
    assert torch.equal(got[finite].signbit(), want[finite].signbit())


def test_the_gemv_bit_rule_gives_every_e4m3_value():
    """:func:`compile_ops._triton_quant.e4m3_to_fp32`'s PTX on every pair of bytes at both
    pair positions of a packed register: ``prmt`` builds each half as the byte below a copy
    of its sign, a shift left by 7 and the mask ``0xBF80`` leave f16's bits, and each half
    (widened to fp32, exactly) times ``2**8`` is the e4m3 value (NaN bytes aside),
    subnormals and ``-0`` included."""
    b = np.arange(256, dtype=np.uint32)
    pair = (b[:, None] | (b[None, :] << 8)).reshape(-1)
    want = torch.stack([E4M3.repeat_interleave(256), E4M3.repeat(256)])  # pair i * 256 + j: bytes i, j
    finite = ~want.isnan()
    for shift, selector in ((0, 0x9180), (16, 0xB3A2)):  # bytes 0, 1 and bytes 2, 3 of the register
        t = (_prmt(pair << shift, selector) << 7) & 0xBF80BF80  # prmt, shl 7, and
        halves = np.stack([t & 0xFFFF, t >> 16]).astype(np.uint16).view(np.float16)
        got = torch.from_numpy(halves.astype(np.float32)).double() * 2.0**8  # cvt.f32.f16
        assert torch.equal(got[finite], want[finite])
        assert torch.equal(got[finite].signbit(), want[finite].signbit())


@pytest.mark.gpu
@pytest.mark.parametrize("block", BLOCKS)
def test_gpu_decode_gemv_reads_every_e4m3_value_exactly(block):
    """Calls of ``GEMV_TOKENS`` tokens run on the CUDA cores: a one-hot token picks one
    weight column, which comes back exactly for every finite e4m3 byte (subnormals
    included: no flush to zero) times its power-of-two block scale."""
    from compile_ops.linear.triton import GEMV_TOKENS, fp8_linear_triton

    M = GEMV_TOKENS
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[~codes.view(torch.float8_e4m3fn).float().isnan()]
    N, K = 256, 512
    wq = codes.repeat(N * K // len(codes) + 1)[:N * K].view(N, K).view(torch.float8_e4m3fn).cuda()
    nb, kb = N // block, K // block
    exponents = torch.arange(nb * kb).view(nb, kb) % 7 - 3  # block scales 2**-3 .. 2**3
    ws = (2.0 ** exponents).to(LAYOUTS[block].scale_dtype).cuda()
    want = (wq.float() * ws.float().repeat_interleave(block, 0).repeat_interleave(block, 1)).t()  # [K, N]
    for k0 in range(0, K, M):
        x = torch.zeros(M, K, dtype=torch.bfloat16, device="cuda")
        x[torch.arange(M), k0 + torch.arange(M)] = 1
        got = fp8_linear_triton(x, wq, ws).float()
        assert torch.equal(got, want[k0:k0 + M]), k0


def test_kernel_builds_for_sm90():
    """The launches the GPU runs (GEMM tiles of 16 and 64 rows, both layouts, weight-only
    tiles, the quantizer, the cuBLAS path's rounding and dequantizer, the bf16 GEMV), compiled for
    sm_90 without a GPU (the weight-only tiles with no e4m3 -> f16 -> bf16 conversions): in a
    process of its own, since the interpreter (TRITON_INTERPRET=1 here) patches Triton's
    language module for the whole process."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "0"}
    run = subprocess.run([sys.executable, "-c", SM90_BUILD], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    # tensor-core MMAs, and correctly rounded divisions in the quantizer
    assert run.stdout.split() == ["16x128", "True", "64x128", "True",
                                  "bf16x128x16", "True", "True", "bf16x32x16", "True", "True", "bf16x32x64", "True", "True", "bf16x32x128", "True", "True",
                                  "gemv128", "True", "gemv32", "True", "quant128", "True", "quant32", "True",
                                  "rounded32", "True", "dequant32", "True", "bf16gemvfp32", "True",
                                  "bf16gemvbf16", "True"], run.stdout


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_triton_quantizer_equals_quantize_tokens(device, block):
    """Bit for bit, subnormals and ties included (x spans 5 decades per block)."""
    from compile_ops.linear.triton import quantize_tokens_triton

    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(300, 1300, generator=gen) * torch.logspace(-3, 2, 1300)).bfloat16().to(device)
    x[3, 128:256] = 0
    q, scale = quantize_tokens_triton(x, block)
    want_q, want_scale = quantize_tokens(x, block)
    assert scale.stride() == (1, 300)  # outer-dim-major, as scaled_mm takes it
    assert torch.equal(q.float(), want_q.float()) and torch.equal(scale, want_scale)


def test_the_cublas_backend_takes_only_the_calls_it_can_run():
    from compile_ops.linear.scaled_mm import MIN_OUTPUTS, MIN_TOKENS, available, limits

    wq, ws = quantize_blocks(torch.randn(4096, 384))
    assert limits((torch.ones(MIN_TOKENS, 384), wq, ws, 1)) is None
    assert "tokens" in limits((torch.ones(MIN_TOKENS - 1, 384), wq, ws, 1))
    narrow = quantize_blocks(torch.randn(512, 384))
    assert "values" in limits((torch.ones(MIN_OUTPUTS // 512 - 1, 384), *narrow, 1))
    assert limits((torch.ones(MIN_OUTPUTS // 512, 384), *narrow, 1)) is None
    assert "grouped" in limits((torch.ones(MIN_TOKENS, 768), wq, ws, 2))
    assert "128-blocks" in limits((torch.ones(MIN_TOKENS, 200), *quantize_blocks(torch.randn(256, 200)), 1))
    assert "CUDA" in available(torch.device("cpu"), None)
    assert compile_ops.backend_for("linear", "cpu") == "reference"


def test_the_gluon_gemm_takes_only_weight_only_calls_of_32_blocks():
    """The ``gluon`` backend runs its GEMM on these calls and the ``triton`` kernels on the rest."""
    from compile_ops.linear.gluon import gemm_unsupported

    wq, ws = quantize_blocks(torch.randn(256, 384), 32)
    for M in (2, 64, 256):
        assert gemm_unsupported((torch.ones(M, 384), wq, ws, 1)) is None
    assert "2 to 256 tokens" in gemm_unsupported((torch.ones(1, 384), wq, ws, 1))
    assert "2 to 256 tokens" in gemm_unsupported((torch.ones(257, 384), wq, ws, 1))
    assert "32-blocks" in gemm_unsupported((torch.ones(16, 384), *quantize_blocks(torch.randn(256, 384), 128), 1))
    odd = quantize_blocks(torch.randn(256, 200), 32)
    assert "multiple of 16" in gemm_unsupported((torch.ones(16, 200), *odd, 1))
    with compile_ops.use_backends(linear="gluon"), pytest.raises(ValueError, match="CUDA devices only"):
        compile_ops.backend_for("linear", "cpu")
    assert compile_ops.backends.backends("linear") == ["scaled_mm", "gluon", "triton", "reference"]


def test_weight_only_tiles_split_k_to_twice_the_target_up_to_64_tokens():
    """Up to 64 tokens one warpgroup (64 weight rows) a program, tokens in tiles of 16, 32
    or 64, K split to twice the target programs; past 64, 128 x 128 tiles."""
    from compile_ops.linear.gluon import weight_only_tile
    from compile_ops.linear.triton import TARGET_PROGRAMS

    assert weight_only_tile(2) == (1, 16, 2, 2 * TARGET_PROGRAMS)
    assert weight_only_tile(17)[:2] == (1, 32) and weight_only_tile(33)[:2] == weight_only_tile(64)[:2] == (1, 64)
    assert weight_only_tile(65) == weight_only_tile(256) == (2, 128, 3, TARGET_PROGRAMS)


FLASH_LINEARS = list(FLASH_PROJECTIONS.values())  # (N, K, groups) of V4.1-Flash's FP8 projections


@pytest.mark.gpu
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("N, K, groups", FLASH_LINEARS)
@pytest.mark.parametrize("M", [1, 2, 7, 64, 200, 256, 300, 4096])
def test_gpu_backends_equal_the_reference(M, N, K, groups, block):
    """Each CUDA backend that takes the call (Triton: all; cuBLAS: 128-blocks, one group,
    >= 128 tokens, >= 2**19 outputs; Gluon on sm_90: its GEMM for 32-blocks at 2 to 256
    tokens, the Triton kernels for the rest) at the layer's shapes; ``auto`` picks cuBLAS
    where it can, then Gluon on sm_90."""
    from compile_ops.backends import hopper_with_gluon, resolve

    gen = torch.Generator(device="cuda").manual_seed(M + N)
    x = torch.randn(M, groups * K, device="cuda", generator=gen).bfloat16()
    wq, ws = quantize_blocks(torch.randn(N, K, device="cuda", generator=gen) / K**0.5, block)
    with compile_ops.use_backends(linear="reference"):
        want = fp8_linear(x, wq, ws, groups).float()
    cublas = block == 128 and groups == 1 and M >= 128 and M * N >= 1 << 19
    gluon = hopper_with_gluon(x.device) is None  # its GEMM where it applies, else triton's kernels
    assert resolve("linear", x.device, args=(x, wq, ws, groups))[0] == (
        "scaled_mm" if cublas else "gluon" if gluon else "triton")
    for backend in ("triton", "scaled_mm") if cublas else ("triton", "gluon") if gluon else ("triton",):
        with compile_ops.use_backends(linear=backend):
            got = fp8_linear(x, wq, ws, groups).float()
        # summation order and one bf16 rounding, of the row's largest |y|
        worst = ((got - want).abs() / want.abs().amax(-1, keepdim=True)).max().item()
        assert worst <= 2**-7, f"{backend}: {worst:.3e} of the row's max |y|"


@pytest.mark.parametrize("N, K, splits", [(64, 64, 1), (40, 1300, 6), (2048, 256, 1), (3000, 512, 1)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_bf16_gemv_equals_the_float64_product(N, K, splits, out_dtype):
    """``dsv41::bf16_linear``'s one-token GEMV (the interpreter) against the float64 product
    of the bf16 operands: rows and K past whole tiles (masked), K split over programs when
    the rows give few tiles, a token that is a strided column view (``wo_b``'s input)."""
    from compile_ops.linear.triton import BF16_GEMV_ROWS, GEMV_PROGRAMS, bf16_gemv_triton, gemv_tile, k_splits

    gen = torch.Generator().manual_seed(N + K)
    x = torch.randn(K, 3, generator=gen).bfloat16().t()[1:2]  # [1, K], stride 3 along K
    w = (torch.randn(N, K, generator=gen) / K**0.5).bfloat16()
    want = x.double() @ w.double().t()
    got = bf16_gemv_triton(x, w, out_dtype)
    assert got.dtype == out_dtype and got.shape == (1, N)
    # fp32 sums; one bf16 rounding (an ulp: the interpreter's cast truncates)
    bound = (2**-20 if out_dtype == torch.float32 else 2**-7) * want.abs().max()
    assert ((got.double() - want).abs() <= bound).all()
    BN, BK = gemv_tile(N, K, BF16_GEMV_ROWS)
    assert k_splits(1, N, K, BK, BN, GEMV_PROGRAMS, 1) == splits


def test_bf16_linear_fake_kernel_schema_and_bad_inputs():
    """``dsv41::bf16_linear``: its fake kernel and schema (``opcheck``), the product off CUDA
    in fp32, and inputs it refuses with the reason."""
    x, w = torch.randn(3, 40).bfloat16(), torch.randn(24, 40).bfloat16()
    for out_dtype in (torch.bfloat16, torch.float32):
        opcheck(torch.ops.dsv41.bf16_linear.default, (x, w, out_dtype))
        got = compile_ops.bf16_linear(x, w, out_dtype)
        assert got.dtype == out_dtype and torch.equal(got, (x.float() @ w.float().t()).to(out_dtype))
    for args, says in (((x, w[:, :39]), "x must be \\[M, K\\] with K = weight.shape\\[1\\] = 39"),
                       ((x.float(), w), "x must have dtype torch.bfloat16"),
                       ((x, w.float()), "weight must have dtype torch.bfloat16"),
                       ((x, w, torch.float16), "out_dtype must be torch.bfloat16 or torch.float32")):
        with pytest.raises((ValueError, TypeError), match=says):
            compile_ops.bf16_linear(*args)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 3])
@pytest.mark.parametrize("N, K, out_dtype", [(2848, 5120, torch.float32), (36864, 1280, torch.bfloat16),
                                             (5120, 8192, torch.bfloat16), (100, 300, torch.bfloat16)],
                         ids=["x-stack", "qr-stack", "wo_b", "small"])
def test_gpu_bf16_linear_equals_the_float64_product(M, N, K, out_dtype):
    """On the GPU, the V4.1-Flash projections' shapes: one token through the GEMV, three
    through cuBLAS, each against the float64 product of the bf16 operands."""
    gen = torch.Generator(device="cuda").manual_seed(N)
    x = torch.randn(M, K, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(N, K, device="cuda", generator=gen) / K**0.5).bfloat16()
    want = x.double() @ w.double().t()
    got = compile_ops.bf16_linear(x, w, out_dtype)
    bound = (2**-16 if out_dtype == torch.float32 else 2**-8) * want.abs().max()
    assert got.dtype == out_dtype and ((got.double() - want).abs() <= bound).all()
