"""Rounding helpers the Triton quantizers share (the KV and index-key row store, the
indexer's query quantizer, the FP8 linear's token quantizer), the e4m3 -> bf16 widening
of the weight-only FP8 GEMM and the e2m1 -> e4m3 bytes of the indexer's fp4 products.

Each rounds in fp32 integer or exact-step arithmetic before any cast, so the cast that
follows is exact and the bytes equal torch's on the GPU and under Triton's interpreter
alike (the interpreter truncates in casts and does not carry a mantissa that rounds up into
the exponent; the GPU's fp32 -> e4m3 cast may round twice, through fp16).
"""

from __future__ import annotations

import triton
import triton.language as tl

from compile_ops.formats import AMAX_FLOOR, E2M1_MAX, E4M3_MAX, FP4_E4M3_AMAX_FLOOR, FP4_UE8M0_AMAX_FLOOR

_E4M3_MAX = tl.constexpr(E4M3_MAX)
_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)
_E2M1_MAX = tl.constexpr(E2M1_MAX)
_FP4_E4M3_AMAX_FLOOR = tl.constexpr(FP4_E4M3_AMAX_FLOOR)
_FP4_UE8M0_AMAX_FLOOR = tl.constexpr(FP4_UE8M0_AMAX_FLOOR)
_ONE_SIXTH = tl.constexpr(1 / E2M1_MAX)  # fl32(1/6) in the kernels, as torch's fp32 product takes it


@triton.jit
def round_to_e4m3(x):
    """fp32 ``x`` (within +-448) rounded to the nearest e4m3 value, ties to even, as fp32: 3
    mantissa bits for normals (integer arithmetic on the bits), steps of ``2**-9`` below
    ``2**-6`` (adding and subtracting ``1.5 * 2**14``, whose ulp is ``2**-9``); a zero keeps
    its sign."""
    bits = x.to(tl.int32, bitcast=True)
    normal = ((bits + 524287 + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    subnormal = (x + 24576.0) - 24576.0
    subnormal = tl.where(subnormal == 0.0, x * 0.0, subnormal)
    return tl.where(tl.abs(x) < 0.015625, subnormal, normal)


@triton.jit
def to_e4m3(x):
    """fp32 ``x`` as e4m3: clamped to +-448, rounded to nearest even (:func:`round_to_e4m3`)."""
    return round_to_e4m3(tl.clamp(x, -_E4M3_MAX, _E4M3_MAX)).to(tl.float8e4nv)


@triton.jit
def to_bf16(x):
    """fp32 ``x`` as bf16, rounded to nearest even in the bits first."""
    bits = x.to(tl.int32, bitcast=True)
    return ((bits + 32767 + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True).to(tl.bfloat16)


@triton.jit
def ue8m0_exponent(amax):
    """``ceil(log2(max(amax, AMAX_FLOOR) / 448)) + 127`` of fp32 ``amax``, exactly (from the
    bits of the correctly rounded quotient, as :func:`compile_ops.formats.ue8m0_exponent`)."""
    bits = tl.math.div_rn(tl.maximum(amax, _AMAX_FLOOR), _E4M3_MAX).to(tl.int32, bitcast=True)
    return ((bits >> 23) & 255) + ((bits & 8388607) != 0).to(tl.int32)


@triton.jit
def _rint(x):
    """fp32 ``x`` in ``[0, 2**22]`` rounded to an integer, ties to even (the fp32 sum with
    ``2**23``, whose ulp is 1)."""
    return (x + 8388608.0) - 8388608.0


@triton.jit
def e2m1_code(y):
    """fp32 ``y`` (within +-6) as its int32 e2m1 code ``s mmm``, rounded to nearest, ties to
    the even code (:func:`compile_ops.formats.e2m1_codes`)."""
    mag = tl.abs(y)
    code = tl.where(mag < 2.0, _rint(mag * 2.0), tl.where(mag < 4.0, 2.0 + _rint(mag), 4.0 + _rint(mag * 0.5)))
    return code.to(tl.int32) | ((y.to(tl.int32, bitcast=True) >> 28) & 8)


@triton.jit
def e2m1_value(code):
    """fp32 value of int32 e2m1 codes ``s mmm`` (0..15), from the bits: ``mmm >= 2`` is the
    normal ``(mmm + 252) << 22`` (exponent ``mmm >> 1``, bias 1, one mantissa bit), 1 is 0.5."""
    m = code & 7
    bits = tl.where(m >= 2, (m + 252) << 22, tl.where(m == 1, 1056964608, 0))  # 1056964608: 0.5's bits
    return (bits | ((code & 8) << 28)).to(tl.float32, bitcast=True)


# e2m1_as_e4m3's PTX: four bytes ($2) of two e2m1 codes each into the e4m3 bytes of their low
# ($0) and high ($1) nibbles: a code s mmm moves to s 00 mmm 00, its value times 2**-6
_E2M1X8_TO_E4M3 = tl.constexpr("""{
.reg .b32 a, b;
shl.b32 a, $2, 4;
and.b32 a, a, 0x80808080;
shl.b32 b, $2, 2;
and.b32 b, b, 0x1C1C1C1C;
or.b32 $0, a, b;
shr.b32 b, $2, 2;
and.b32 b, b, 0x1C1C1C1C;
and.b32 a, $2, 0x80808080;
or.b32 $1, a, b;
}""")


@triton.jit
def e2m1_as_e4m3(packed, UPCAST: tl.constexpr):
    """e4m3 ``[N, 2 * n]`` of uint8 ``packed [N, n]`` (two e2m1 codes a byte, the low nibble
    the even-numbered value), in value order: each code's value times ``2**-6``, exactly.
    e2m1 ``s e e m`` (exponent bias 1) placed as e4m3 ``s 0 0 e e m 0 0`` keeps its sign,
    mantissa and subnormal, and e4m3's exponent bias is 6 larger: two byte masks and shifts
    per four values, where widening to bf16 takes four byte permutes per two (the tensor
    cores take e4m3, not e2m1)."""
    if UPCAST:  # the interpreter runs no PTX: the same bits in byte arithmetic
        lo = ((packed & 8) << 4) | ((packed & 7) << 2)
        hi = (packed & 128) | ((packed >> 2) & 28)
    else:
        lo, hi = tl.inline_asm_elementwise(_E2M1X8_TO_E4M3, "=r,=r,r", [packed], dtype=(tl.uint8, tl.uint8),
                                           is_pure=True, pack=4)
    n: tl.constexpr = packed.shape[-1]
    return tl.reshape(tl.join(lo, hi), [packed.shape[0], 2 * n]).to(tl.float8e4nv, bitcast=True)


@triton.jit
def e2m1_code_as_e4m3(code):
    """int32 e2m1 codes ``s mmm`` as e4m3 (their values times ``2**-6``, :func:`e2m1_as_e4m3`)."""
    return (((code & 8) << 4) | ((code & 7) << 2)).to(tl.uint8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def fp4_e4m3_scale(amax):
    """The e4m3 scale of fp4 blocks with max magnitudes ``amax``, as fp32
    (:func:`compile_ops.formats.fp4_e4m3_scale`)."""
    return round_to_e4m3(tl.minimum(tl.math.div_rn(tl.maximum(amax, _FP4_E4M3_AMAX_FLOOR), _E2M1_MAX), _E4M3_MAX))


@triton.jit
def fp4_exponent(amax):
    """The ue8m0 exponent (int32) of fp4 blocks with max magnitudes ``amax``
    (:func:`compile_ops.indexer.cache.fp4_exponent`)."""
    bits = (tl.maximum(amax, _FP4_UE8M0_AMAX_FLOOR) * _ONE_SIXTH).to(tl.int32, bitcast=True)
    return ((bits >> 23) & 255) + ((bits & 8388607) != 0).to(tl.int32)


@triton.jit
def e2m1_rows(x):
    """fp32 rows ``x [N, 32]`` quantized as DeepSeek's ``fp4_act_quant`` (one power-of-two
    scale per row, :func:`compile_ops.indexer.cache.quantize_e2m1`): ``(e2m1 codes [N, 32]
    int32, ue8m0 exponents [N] int32)``."""
    exponent = fp4_exponent(tl.max(tl.abs(x), 1))
    return e2m1_code(tl.clamp(tl.math.div_rn(x, power_of_two(exponent)[:, None]), -6.0, 6.0)), exponent


@triton.jit
def power_of_two(exponent):
    """``2 ** (exponent - 127)`` as fp32, from its bits."""
    return (exponent << 23).to(tl.float32, bitcast=True)


# e4m3_to_bf16_bits's PTX: two e4m3 bytes ($1, 16 bits) -> two bf16 ($0, 32 bits)
E4M3X2_TO_BF16X2 = tl.constexpr("""{
.reg .b32 a;
cvt.u32.u16 a, $1;
prmt.b32 a, a, 0, 0x9180;
shl.b32 a, a, 4;
and.b32 $0, a, 0x87F087F0;
}""")


@triton.jit
def e4m3_to_bf16_bits(x):
    """e4m3 ``x`` as bf16 times ``2**-120``, exactly, in two integer instructions and one
    shift per two elements (CUDA only: inline PTX, which Triton's interpreter cannot run).

    Triton's own cast goes e4m3 -> f16 -> bf16, one conversion instruction per element
    and one per pair, and Hopper's conversion unit retires 16 per clock per SM: a kernel
    that widens every weight byte it streams is held at about half the HBM bandwidth by
    it. Here a byte ``s eeee mmm`` moves to bf16's bits as ``s 0000 eeee mmm 0000``, two
    elements per 32-bit register: a byte permute builds each half as ``S..S s eeee mmm``
    (the byte below a copy of its sign), a shift left by 4 (a multiply, on the FMA pipe)
    puts the sign in bit 15, and a mask clears the rest. That is the e4m3 value times
    ``2**-120`` for normals and subnormals alike (bf16 has 4 more exponent bits, an
    exponent bias 120 larger and subnormals of its own); the caller folds the ``2**120``
    into its other factors. The e4m3 NaN byte comes out as ``480 * 2**-120``: weights hold
    none.
    """
    return tl.inline_asm_elementwise(
        E4M3X2_TO_BF16X2,
        "=r,h",
        [x.to(tl.uint8, bitcast=True)],
        dtype=tl.bfloat16,
        is_pure=True,
        pack=2,
    )


@triton.jit
def e4m3_to_bf16(x):
    """e4m3 ``x`` widened to bf16, exactly (:func:`e4m3_to_bf16_bits` times ``2**120``, a
    bf16 product that keeps signed zeros; CUDA only)."""
    return e4m3_to_bf16_bits(x) * 1.329227995784916e36  # 2 ** 120


# e4m3_to_fp32's PTX: bytes 2i and 2i + 1 of the packed register $4 into outputs $2i and
# $2i+1, through an f16 pair (prmt selectors: each byte, then its sign copied into a byte)
_E4M3X4_TO_FP32 = tl.constexpr("{\n.reg .b32 t;\n.reg .b16 lo, hi;\n" + "".join(
    f"prmt.b32 t, $4, 0, {selector};\nshl.b32 t, t, 7;\nand.b32 t, t, 0xBF80BF80;\nmov.b32 {{lo, hi}}, t;\n"
    f"cvt.f32.f16 ${2 * i}, lo;\ncvt.f32.f16 ${2 * i + 1}, hi;\n" for i, selector in enumerate(("0x9180", "0xB3A2")))
    + "}")


@triton.jit
def e4m3_to_fp32(x):
    """e4m3 ``x`` as fp32 times ``2**-8``, exactly, in one byte permute, one shift and one
    mask per two elements and one f16 -> fp32 widening per element (CUDA only: inline PTX).

    ``prmt`` builds each 16-bit half as ``S..S s eeee mmm`` (the byte below a copy of its
    sign), a shift left by 7 puts the sign in bit 15 and ``eeee mmm`` in bits 13:7, and the
    mask ``0xBF80`` clears the rest: f16's bits ``s 0eeee mmm0000000``, the e4m3 value times
    ``2**-8`` for normals and subnormals alike (f16's exponent bias is 8 larger, its
    subnormals are e4m3's times ``2**-8``). f16 -> fp32 is exact and runs on the FMA pipe,
    as does the shift (a multiply), so the integer pipe, which retires half as many
    instructions per clock, does one per element, where moving each byte into fp32's bits
    directly takes three. The caller folds the ``2**8`` into the other factor. The e4m3 NaN
    byte comes out as ``480 * 2**-8``: weights hold none.
    """
    return tl.inline_asm_elementwise(_E4M3X4_TO_FP32, "=r,=r,=r,=r,r", [x.to(tl.uint8, bitcast=True)],
                                     dtype=tl.float32, is_pure=True, pack=4)
