"""Triton sparse MLA (``compile_ops.mla.triton``, ``compile_ops.mla.gluon``) against the reference.

CPU: the ``tl`` kernel runs in Triton's interpreter (conftest sets TRITON_INTERPRET=1) on
tiny shapes (Gluon has no interpreter). GPU (``pytest -m gpu``), for both kernels (the
warp-specialized Gluon one on sm_90 only): shapes and formats across the issue's cross
product, CUDA-graph capture with new indices on replay, and FlashMLA on the same
fp8_ds_mla caches.

Tolerances (max over every element, relative to the reference's fp32 math on the same
dequantized keys): keys dequantize exactly to bf16 (e4m3 times a power of two), so the error
is the bf16 rounding of the softmax weights in ``P @ V`` plus the bf16 output rounding:
``|out - ref| <= 2**-7 |ref| + 2**-8 max|ref|`` and ``|lse - ref| <= 1e-3`` for every format.
"""

from __future__ import annotations

import math

import pytest
import torch

import compile_ops
from compile_ops import backends
from compile_ops.formats import get_format, new_cache, num_slots
from compile_ops.mla import triton as mla_triton
from compile_ops.mla.inputs import SparseMLAArgs
from compile_ops.mla.reference import sparse_mla_reference
from helpers import make_cache, make_indices

FORMATS = ["bf16", "fp8", "fp8_ds_mla", "fp8_dsv41", "fp4_dsv41"]
V41 = ("fp8_dsv41", "fp4_dsv41")  # DeepSeek-V4.1's window rows and compressed entries
CALL_FORMATS = FORMATS + [V41]  # each format for both caches, and V4.1's two
# GPU tests run each kernel through its backend's entry point, bypassing the op's dispatch
KERNELS = ["triton", "gluon"]


def kernel_of(backend):
    """The backend's kernel entry point: ``(SparseMLAArgs, out, lse)``, as the reference."""
    if backend == "gluon":
        from compile_ops.mla.gluon import sparse_mla_gluon

        return sparse_mla_gluon
    return mla_triton.sparse_mla_triton


def needs(backend):
    """Skip unless ``backend`` can run sparse_mla on this machine's GPU."""
    with compile_ops.use_backends(sparse_mla=backend):
        try:
            compile_ops.backend_for("sparse_mla", torch.device("cuda"))
        except ValueError as err:
            pytest.skip(str(err))


def make_case(kv_format, T, H, W, K, page_size, *, sink="finite", page_gap=0, device="cpu", seed=0, pool_pages=None):
    """A call's positional arguments; ``kv_format`` a pair ``(window's, compressed cache's)``
    for a call of two formats."""
    kv_format, cmp_format = kv_format if isinstance(kv_format, tuple) else (kv_format, None)
    gen = torch.Generator(device=device).manual_seed(seed)
    kv_scale = 0.37 if kv_format == "fp8" else 1.0
    swa = make_cache(kv_format, pool_pages or 3, page_size, page_gap, kv_scale, device, gen)
    swa_idx, swa_lens = make_indices(T, W, num_slots(swa), device, gen)
    cmp = (None, None, None)
    if K is not None:
        c = make_cache(cmp_format or kv_format, pool_pages or 4, page_size, 0, kv_scale, device, gen)
        cmp = (c, *make_indices(T, K, num_slots(c), device, gen))
    q = torch.randn(T, H, 512, generator=gen, device=device).to(torch.bfloat16)
    sinks = {
        "none": None,
        "-inf": torch.full((H,), -math.inf, device=device),
        "finite": torch.randn(H, generator=gen, device=device) * 2,
    }
    sm_scale = 512**-0.5
    args = (q, swa, swa_idx, swa_lens, *cmp, sinks[sink], sm_scale, kv_format, kv_scale)
    return args + (None, cmp_format) if cmp_format else args


def run_both(args, kernel="triton", **kw):
    q = args[0]
    T, H = q.shape[:2]
    ref_out = torch.empty(T, H, 512, dtype=torch.bfloat16, device=q.device)
    ref_lse = torch.empty(T, H, device=q.device)
    sparse_mla_reference(SparseMLAArgs(*args), ref_out, ref_lse)
    out = torch.full_like(ref_out, float("nan"))  # poisoned: every element must be written
    lse = torch.full_like(ref_lse, float("nan"))
    kernel_of(kernel)(SparseMLAArgs(*args), out, lse, **kw)
    return out, lse, ref_out, ref_lse


def errors(out, lse, ref_out, ref_lse):
    """(max |out - ref| over the tolerance, max lse error); both must be <= 1."""
    assert not out.isnan().any() and not lse.isnan().any()
    ro, o = ref_out.float(), out.float()
    tol = 2.0**-7 * ro.abs() + 2.0**-8 * ro.abs().max().clamp_min(1e-6)
    same_inf = torch.isinf(ref_lse) & (ref_lse == lse)
    lse_err = torch.where(same_inf, 0.0, (lse - ref_lse).abs())
    return ((o - ro).abs() / tol).max().item(), (lse_err.max().item() / 1e-3 if lse.numel() else 0.0)


def report(tag, out, lse, ref_out, ref_lse):
    """One line of raw error figures (shown with ``pytest -s``), then the tolerance ratios."""
    d = (out.float() - ref_out.float()).abs()
    same_inf = torch.isinf(ref_lse) & (ref_lse == lse)
    d_lse = torch.where(same_inf, 0.0, (lse - ref_lse).abs())
    e_out, e_lse = errors(out, lse, ref_out, ref_lse)
    if d.numel():
        print(f"ERR {tag} max|dout|={d.max().item():.3g} max|dout|/max|ref|={(d.max() / ref_out.float().abs().max().clamp_min(1e-9)).item():.3g} "
              f"max|dlse|={d_lse.max().item():.3g} out/tol={e_out:.3f} lse/tol={e_lse:.3f}")
    return e_out, e_lse


def check(args, **kw):
    out, lse, ref_out, ref_lse = run_both(args, **kw)
    e_out, e_lse = report(f"{args[9]} T={args[0].shape[0]} H={args[0].shape[1]}", out, lse, ref_out, ref_lse)
    assert e_out <= 1.0, f"out error {e_out:.3f} x tolerance"
    assert e_lse <= 1.0, f"lse error {e_lse:.3f} x tolerance"


def check_every_byte(kv_format, H, device, kernel="triton"):
    """Every value byte under a range of scales dequantizes exactly: with q = 0 and one entry
    per token, each token's output is its key row, bit for bit (64 tokens, one page of 64
    rows). e4m3 formats: every byte but the two NaNs (subnormals included) under UE8M0
    scales from 2^-117 to 2^118; ``fp4_dsv41``: every byte (two e2m1 codes, both signs)
    under e4m3 scales from the smallest subnormal to 448."""
    fmt, page = get_format(kv_format), 64
    cache = new_cache(kv_format, 1, page, device=device)
    raw = cache.view(torch.uint8).view(-1)
    r = torch.arange(page, device=device)[:, None]
    values = (torch.arange(fmt.nope // 2 if fmt.fp4 else fmt.nope, device=device) + 32 * (r % 8)) % 256  # 8 rows: all 256 in every column
    if not fmt.fp4:
        values[(values == 0x7F) | (values == 0xFF)] = 0
    data = raw[: page * fmt.data_bytes].view(page, fmt.data_bytes)
    data[:, : values.shape[1]] = values.to(torch.uint8)
    if fmt.bf16_rope:  # fp8_ds_mla's bf16 RoPE columns
        rope = torch.randn(page, 512 - fmt.nope, device=device).to(torch.bfloat16)
        data[:, fmt.nope :] = rope.view(torch.uint8)
    if fmt.scale_bytes:
        if fmt.fp4:  # e4m3: 2^-9 (subnormal), 2^-7 * 1.5, 2^-6 (smallest normal), 1, 1.125, 13, 240, 448
            scale = [0x01, 0x0C, 0x08, 0x38, 0x39, 0x55, 0x77, 0x7E]
        else:
            scale = [10, 64, 120, 127, 134, 135, 180, 245]
        scale = torch.tensor(scale, device=device).repeat_interleave(8)
        scales = raw[page * fmt.data_bytes :].view(page, fmt.scale_bytes)
        scales[:, : fmt.nope // fmt.block] = scale[:, None].to(torch.uint8)
    q = torch.zeros(page, H, 512, dtype=torch.bfloat16, device=device)
    idx = r.to(torch.int32)
    lens = torch.ones(page, dtype=torch.int32, device=device)
    args = (q, cache, idx, lens, None, None, None, None, 512**-0.5, kv_format, 1.0)
    out, lse, ref_out, ref_lse = run_both(args, kernel=kernel)
    assert ref_out.isfinite().all() and (ref_out != 0).any()
    assert torch.equal(out, ref_out)
    assert torch.equal(lse, ref_lse)


# ---------------------------------------------------------------------------------- CPU

SPLIT2 = mla_triton.Config(bn=32, dsplit=2, num_warps=4, num_stages=2)

CPU_CASES = [
    # kv_format, T, H, W, K, page_size, sink, page_gap, n_split, config
    ("bf16", 3, 5, 70, 40, 16, "finite", 0, None, None),
    ("fp8", 2, 8, 9, 33, 64, "none", 0, None, None),
    ("fp8_ds_mla", 2, 70, 10, 100, 3, "-inf", 5, 3, None),  # odd page stride, 2 head blocks
    ("fp8_dsv41", 4, 3, 8, 130, 64, "finite", 3, 4, None),
    ("bf16", 2, 9, 0, None, 1, "none", 0, 2, None),  # no SWA columns, no compressed segment
    ("fp8_ds_mla", 3, 4, 20, 70, 256, "finite", 0, None, SPLIT2),
    ("fp8_dsv41", 2, 16, 33, None, 2, "none", 0, 1, SPLIT2),
    ("fp8", 1, 1, 5, 5, 1, "finite", 0, 1, SPLIT2),
    ("bf16", 1, 2, 8, 200, 16, "finite", 0, 40, None),  # 40 partials, most empty: the merge sums four chunks of 16
    ("fp4_dsv41", 2, 5, 20, 90, 16, "finite", 3, None, None),
    ("fp4_dsv41", 3, 4, 9, 40, 64, "none", 0, 2, SPLIT2),
    (V41, 3, 6, 70, 100, 64, "finite", 5, None, None),  # window and entries in their own formats
    (V41, 2, 4, 40, 70, 16, "-inf", 0, 3, SPLIT2),  # splits that straddle the two segments
    (("fp8_ds_mla", "fp4_dsv41"), 2, 3, 10, 40, 4, "finite", 0, 2, None),
]


@pytest.mark.parametrize(
    "kv_format,T,H,W,K,page_size,sink,page_gap,n_split,config",
    CPU_CASES,
    ids=[f"{'+'.join(c[0]) if isinstance(c[0], tuple) else c[0]}-T{c[1]}-H{c[2]}-W{c[3]}-K{c[4]}-p{c[5]}-{c[6]}-gap{c[7]}-s{c[8]}-{'ds2' if c[9] else 'ds1'}" for c in CPU_CASES],
)
def test_interpreter_matches_reference(kv_format, T, H, W, K, page_size, sink, page_gap, n_split, config):
    args = make_case(kv_format, T, H, W, K, page_size, sink=sink, page_gap=page_gap, seed=T * 7 + H)
    check(args, n_split=n_split, config=config)


def test_interpreter_empty_rows():
    """All-invalid rows: out = 0 and lse = sink * log2(e) (or -inf), never NaN."""
    args = list(make_case("fp8_dsv41", 2, 3, 6, 6, 4, sink="finite"))
    args[2] = torch.full_like(args[2], -1)  # SWA: all holes
    args[6] = torch.zeros_like(args[6])  # compressed: lens 0
    out, lse, _, _ = run_both(tuple(args), n_split=2)
    assert (out == 0).all()
    torch.testing.assert_close(lse, (args[7] / math.log(2)).expand(2, 3), rtol=0, atol=1e-6)
    args[7] = None
    out, lse, _, _ = run_both(tuple(args))
    assert (out == 0).all() and torch.isneginf(lse).all()


@pytest.mark.parametrize("kv_format", ["fp8", "fp8_ds_mla", "fp8_dsv41", "fp4_dsv41"])
def test_interpreter_dequantizes_every_byte_exactly(kv_format):
    check_every_byte(kv_format, 1, "cpu")


@pytest.mark.parametrize("rows", [None, 3, 0], ids=["full", "3rows", "empty"])
def test_interpreter_caller_workspace(rows):
    """A caller's workspace holds the split-K partials: any size gives the reference's result
    (a small one only caps the split), and the per-device default is never made."""
    from compile_ops.mla import plan

    args = make_case("fp8_dsv41", 2, 3, 8, 130, 4, seed=5)
    size = plan.workspace_bytes(torch.device("cpu")) if rows is None else rows * plan.PART_BYTES
    plan._DEFAULT.clear()
    out, lse, ref_out, ref_lse = run_both((*args, torch.zeros(size, dtype=torch.uint8)), n_split=4)
    assert not plan._DEFAULT
    e_out, e_lse = errors(out, lse, ref_out, ref_lse)
    assert e_out <= 1.0 and e_lse <= 1.0, (e_out, e_lse)


@pytest.mark.parametrize("workspace,error,match", [
    (torch.zeros(64, dtype=torch.float32), TypeError, "workspace must have dtype torch.uint8"),
    (torch.zeros(4, 64, dtype=torch.uint8), ValueError, "workspace must have 1 dims"),
    (torch.zeros(80, dtype=torch.uint8)[4:], ValueError, "offset a multiple of 16"),
    (torch.zeros(80, dtype=torch.uint8)[::2], ValueError, "workspace must be contiguous"),
], ids=["fp32", "2d", "offset", "strided"])
def test_bad_workspace_is_a_clear_error(workspace, error, match):
    args = make_case("bf16", 1, 2, 4, None, 4)
    out, lse = torch.empty(1, 2, 512, dtype=torch.bfloat16), torch.empty(1, 2)
    with pytest.raises(error, match=match):
        compile_ops.sparse_mla_out(*args, out, lse, workspace)


def test_gluon_kernel_refuses_the_interpreter():
    """The Gluon kernel has no interpreter: asking for it there is an error, not a silent
    fallback (the ``gluon`` backend's predicate keeps ``auto`` away from it off sm_90)."""
    args = make_case("bf16", 2, 4, 8, 8, 4, seed=0)
    out = torch.empty(2, 4, 512, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="Gluon kernel runs eagerly on sm_90 only"):
        kernel_of("gluon")(SparseMLAArgs(*args), out, torch.empty(2, 4))


# ---------------------------------------------------------------------------------- GPU

# A representative cross product: every H, K, T, format and page size appears; the full one
# (6 x 5 x 5 x 4 x 2) does not fit the device budget.
GPU_SHAPES = [
    # H, K, T, page_size
    (8, 0, 1, 64),
    (16, 128, 3, 256),
    (32, 512, 64, 64),
    (48, 1024, 3, 256),
    (64, 512, 512, 64),
    (64, 2048, 1, 256),
    (128, 1024, 64, 64),
    (128, 0, 4096, 256),
    (16, 2048, 512, 64),
    (128, 128, 1, 256),
    (8, 1024, 4096, 64),
    (64, 0, 64, 256),
]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("kv_format", CALL_FORMATS, ids=str)
@pytest.mark.parametrize("H,K,T,page_size", GPU_SHAPES, ids=[f"H{h}-K{k}-T{t}-p{p}" for h, k, t, p in GPU_SHAPES])
def test_gpu_matches_reference(kv_format, H, K, T, page_size, backend):
    needs(backend)
    args = make_case(kv_format, T, H, 128, K, page_size, device="cuda", seed=H + K + T, pool_pages=4096 // page_size + 3)
    check(args, kernel=backend)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_format", FORMATS)
def test_gpu_auto_is_gluon_on_sm90(kv_format):
    """On Hopper the warp-specialized kernel is every format's default."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs sm_90")
    assert compile_ops.backend_for("sparse_mla", "cuda", kv_format) == "gluon"


@pytest.mark.gpu
@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("kv_format", CALL_FORMATS, ids=str)
def test_gpu_odd_pages_and_forced_splits(kv_format, backend):
    """Non-power-of-two pages, an odd page stride (fp8_ds_mla's unaligned RoPE), H = 70
    (a partial head block) and split-K forced to 1, 3 and 7 with empty rows among them. The
    Gluon kernel reads pages 16 bytes at a time: it refuses the odd stride (a direct call
    and the op alike) and runs the rest on aligned pages."""
    needs(backend)
    odd = list(make_case(kv_format, 9, 70, 128, 300, 48, page_gap=5, device="cuda", seed=3, pool_pages=40))
    if backend == "gluon":
        out, lse = torch.empty(9, 70, 512, dtype=torch.bfloat16, device="cuda"), torch.empty(9, 70, device="cuda")
        with pytest.raises(ValueError, match="16-byte aligned"):
            kernel_of("gluon")(SparseMLAArgs(*odd), out, lse)
        with compile_ops.use_backends(sparse_mla="gluon"), pytest.raises(ValueError, match="16-byte aligned"):
            compile_ops.sparse_mla_out(*odd[:11], out, lse, *odd[11:])
        assert backends.resolve("sparse_mla", torch.device("cuda"), odd[9], SparseMLAArgs(*odd))[0] == "triton"
    gap = 0 if backend == "gluon" else 5
    args = list(make_case(kv_format, 9, 70, 128, 300, 48, page_gap=gap, device="cuda", seed=3, pool_pages=40))
    args[3][2] = 0  # a token with no SWA entries
    args[6][4] = 0  # and one with no compressed entries
    for n_split in (1, 3, 7):
        check(tuple(args), n_split=n_split, kernel=backend)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("kv_format", CALL_FORMATS, ids=str)
def test_gpu_full_segments(kv_format, backend):
    """Tokens with a full window and a full top-k (the steady decode state) next to tokens
    with a short window or no compressed entries; default, one and five splits."""
    needs(backend)
    args = list(make_case(kv_format, 6, 64, 128, 512, 64, device="cuda", seed=4, pool_pages=64))
    args[3].fill_(128)
    args[6].fill_(512)
    args[3][1] = 100  # a short window
    args[6][4] = 0  # no compressed entries
    for n_split in (None, 1, 5):
        check(tuple(args), n_split=n_split, kernel=backend)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("kv_format", ["fp8", "fp8_ds_mla", "fp8_dsv41", "fp4_dsv41"])
def test_gpu_dequantizes_every_byte_exactly(kv_format, backend):
    """:func:`check_every_byte` on the GPU, 64 heads, both kernels."""
    needs(backend)
    check_every_byte(kv_format, 64, "cuda", backend)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("kv_format", FORMATS)
def test_gpu_graph_capture_new_indices(kv_format, backend):
    """Capture sparse_mla_out with a caller's workspace once, then replay with new indices
    and lens copied in."""
    needs(backend)
    T, H, W, K = 5, 64, 128, 512
    args = list(make_case(kv_format, T, H, W, K, 64, device="cuda", seed=1, pool_pages=64))
    out = torch.empty(T, H, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(T, H, device="cuda")
    from compile_ops.mla import plan

    plan._DEFAULT.clear()
    with compile_ops.use_backends(sparse_mla=backend):
        # warm-up: compiles the kernels; capture then writes a workspace no call has touched
        compile_ops.sparse_mla_out(*args, out, lse, compile_ops.sparse_mla_workspace("cuda", kv_format))
        torch.cuda.synchronize()
        workspace = compile_ops.sparse_mla_workspace("cuda", kv_format)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            compile_ops.sparse_mla_out(*args, out, lse, workspace)
    assert not plan._DEFAULT  # no call made the per-device default
    gen = torch.Generator(device="cuda").manual_seed(2)
    for _ in range(2):
        for i in (2, 5):
            new_idx, new_lens = make_indices(T, args[i].shape[1], num_slots(args[i - 1]), "cuda", gen)
            args[i].copy_(new_idx)
            args[i + 1].copy_(new_lens)
        out.fill_(float("nan"))
        graph.replay()
        ref_out = torch.empty_like(out)
        ref_lse = torch.empty_like(lse)
        sparse_mla_reference(SparseMLAArgs(*args), ref_out, ref_lse)
        e_out, e_lse = errors(out, lse, ref_out, ref_lse)
        assert e_out <= 1.0 and e_lse <= 1.0, (e_out, e_lse)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", KERNELS)
def test_gpu_graph_back_to_back_calls(backend):
    """Eight calls captured in one graph, each with its own inputs and outputs, so that every
    call's kernels overwrite the split-K scratch that the previous call's merge reads (the
    Gluon kernel is a programmatic dependent launch and may start during that merge).
    Splits with one program per column half (T = 1), with one block per program (T = 2),
    with several blocks (T = 6) and none (T = 160), in an order where each follows another."""
    needs(backend)
    shapes = [(1, 128, 1024), (2, 128, 1024), (1, 64, 512), (160, 64, 512), (6, 128, 1024), (1, 128, 1024),
              (2, 64, 512), (1, 128, 1024)]
    cases = [make_case("fp8_ds_mla", T, H, 128, K, 64, device="cuda", seed=10 + i, pool_pages=64)
             for i, (T, H, K) in enumerate(shapes)]
    for args in cases:  # the last token attends to both full segments: every split has work
        args[3][-1], args[6][-1] = args[2].shape[1], args[5].shape[1]
    outs = [(torch.empty(T, H, 512, dtype=torch.bfloat16, device="cuda"), torch.empty(T, H, device="cuda"))
            for T, H, _ in shapes]
    with compile_ops.use_backends(sparse_mla=backend):
        for args, (out, lse) in zip(cases, outs):
            compile_ops.sparse_mla_out(*args, out, lse)  # warm-up: compiles, allocates the scratch
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for args, (out, lse) in zip(cases, outs):
                compile_ops.sparse_mla_out(*args, out, lse)
    for out, lse in outs:
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
    for _ in range(3):
        graph.replay()
    for args, (out, lse) in zip(cases, outs):
        ref_out, ref_lse = torch.empty_like(out), torch.empty_like(lse)
        sparse_mla_reference(SparseMLAArgs(*args), ref_out, ref_lse)
        e_out, e_lse = errors(out, lse, ref_out, ref_lse)
        assert e_out <= 1.0 and e_lse <= 1.0, (args[0].shape, e_out, e_lse)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("H,K,T", [(64, 512, 1), (64, 512, 128), (128, 1024, 64)])
def test_gpu_matches_flashmla(H, K, T, backend):
    """Same fp8_ds_mla caches through FlashMLA's SM90 sparse decode (natural-log LSE, no sink)."""
    needs(backend)
    flash_mla = pytest.importorskip("flash_mla")
    gen = torch.Generator(device="cuda").manual_seed(H + K + T)
    page, W = 64, 128
    pages = (4 * K + W * T) // page + 2
    gap = -(page * 584) % 576  # FlashMLA pads pages to multiples of 576 bytes
    swa = make_cache("fp8_ds_mla", pages, page, gap, device="cuda", gen=gen)
    cmp = make_cache("fp8_ds_mla", pages, page, gap, device="cuda", gen=gen)
    swa_idx = torch.randint(0, num_slots(swa), (T, W), generator=gen, device="cuda", dtype=torch.int32)
    cmp_idx = torch.randint(0, num_slots(cmp), (T, K), generator=gen, device="cuda", dtype=torch.int32)
    swa_lens = torch.randint(1, W + 1, (T,), generator=gen, device="cuda", dtype=torch.int32)
    cmp_lens = torch.randint(1, K + 1, (T,), generator=gen, device="cuda", dtype=torch.int32)
    q = torch.randn(T, H, 512, generator=gen, device="cuda").to(torch.bfloat16)
    sink = torch.randn(H, generator=gen, device="cuda")
    sm_scale = 512**-0.5
    args = (q, swa, swa_idx, swa_lens, cmp, cmp_idx, cmp_lens, sink, sm_scale, "fp8_ds_mla", 1.0)
    out, lse, ref_out, ref_lse = run_both(args, kernel=backend)
    sched, _ = flash_mla.get_mla_metadata()
    fm_out, fm_lse = flash_mla.flash_mla_with_kvcache(
        q.view(T, 1, H, 512), cmp.unsqueeze(2), None, None, 512, sched,
        softmax_scale=sm_scale, is_fp8_kvcache=True, indices=cmp_idx.view(T, 1, K), attn_sink=sink,
        extra_k_cache=swa.unsqueeze(2), extra_indices_in_kvcache=swa_idx.view(T, 1, W),
        topk_length=cmp_lens, extra_topk_length=swa_lens, use_legacy=True,
    )
    fm_lse2 = torch.logaddexp(fm_lse.view(T, H), sink.view(1, H)) / math.log(2)  # + sink, base 2
    report(f"fp8_ds_mla-vs-reference T={T} H={H}", out, lse, ref_out, ref_lse)
    report(f"flashmla-vs-reference T={T} H={H}", fm_out.view(T, H, 512), fm_lse2, ref_out, ref_lse)
    e_out, e_lse = report(f"fp8_ds_mla-vs-flashmla T={T} H={H}", out, lse, fm_out.view(T, H, 512), fm_lse2)
    assert e_out <= 2.0 and e_lse <= 2.0, (e_out, e_lse)  # two bf16 roundings of P, one on each side
