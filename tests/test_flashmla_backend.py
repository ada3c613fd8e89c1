"""The FlashMLA backend of sparse_mla: argument translation on CPU, the kernel on an H200.

GPU tolerance: FlashMLA and the reference read the same dequantized keys; the difference
is the bf16 rounding of the softmax weights inside FlashMLA plus the bf16 output rounding,
the same budget as the Triton kernel's (``errors`` in test_mla_triton):
``|out - ref| <= 2**-7 |ref| + 2**-8 max|ref|``, ``|lse - ref| <= 1e-3``.
"""

import math

import pytest
import torch

import compile_ops
from compile_ops import write_kv
from compile_ops.formats import new_cache, num_slots
import torch.nn.functional as F

from compile_ops.mla.flashmla import bound_indices, flashmla_unavailable, padded_heads, write_outputs

from test_mla_triton import errors, make_indices

i32 = torch.int32


def spec_indices(indices, lens, n_slots):
    """The index translation in plain torch: out of range -> -1, width padded to 64, lens clamped."""
    width = indices.shape[1]
    safe = torch.where((indices >= 0) & (indices < n_slots), indices, -1)
    padded = F.pad(safe, (0, max(64, -(-width // 64) * 64) - width), value=-1)
    return padded, lens.clamp(0, width)


def spec_lse(lse_natural, sink):
    """FlashMLA's natural-log LSE without sink -> (base-2 LSE with sink, non-empty mask)."""
    non_empty = torch.isfinite(lse_natural)
    natural = torch.where(non_empty, lse_natural, -math.inf)
    if sink is not None:
        natural = torch.logaddexp(natural, sink.view(1, -1))
    return natural / math.log(2.0), non_empty


def test_unavailable_reasons():
    assert "CUDA devices only" in flashmla_unavailable(torch.device("cpu"), "fp8_ds_mla")
    assert "fp8_ds_mla caches only" in flashmla_unavailable(torch.device("cuda"), "fp8_dsv41")
    assert "needs SM90" in flashmla_unavailable(torch.device("cuda"), "fp8_ds_mla", capability=(10, 0))


@pytest.mark.parametrize("heads,want", [(1, 64), (64, 64), (65, 128), (100, 128), (128, 128)])
def test_head_padding(heads, want):
    assert padded_heads(heads) == want


def test_indices_are_bounded_padded_and_lens_clamped():
    idx = torch.tensor([[5, -1, 40, 39, -7], [0, 1, 2, 3, 4]], dtype=i32)
    got, lens = bound_indices(idx, torch.tensor([9, -2], dtype=i32), n_slots=40)
    assert got.shape == (2, 64) and got.dtype == i32 and got.is_contiguous()
    assert got[0, :5].tolist() == [5, -1, -1, 39, -1] and got[:, 5:].eq(-1).all()
    assert lens.tolist() == [5, 0]
    empty, empty_lens = bound_indices(torch.zeros(2, 0, dtype=i32), torch.zeros(2, dtype=i32), 40)
    assert empty.shape == (2, 64) and empty.eq(-1).all() and empty_lens.tolist() == [0, 0]


@pytest.mark.parametrize("sink", [None, -math.inf, 1.5], ids=["no-sink", "sink=-inf", "sink=1.5"])
def test_lse_conversion(sink):
    natural = torch.tensor([0.0, 2.0, math.inf, -math.inf]).view(1, 4, 1)
    sink_t = None if sink is None else torch.full((4,), sink)
    fm_out = torch.ones(1, 1, 4, 512, dtype=torch.bfloat16)
    out, lse = torch.empty(1, 4, 512, dtype=torch.bfloat16), torch.empty(1, 4)
    write_outputs(fm_out, natural, sink_t, out, lse, 0, 4)
    assert out[0, :, 0].tolist() == [1.0, 1.0, 0.0, 0.0]  # empty rows zeroed
    s = -math.inf if sink is None else sink
    for got, nat in zip(lse[0].tolist(), [0.0, 2.0, -math.inf, -math.inf]):
        want = math.log2(math.exp(nat) + math.exp(s)) if max(nat, s) > -math.inf else -math.inf
        assert got == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("width", [0, 5, 64, 130])
def test_bound_indices_kernel_matches_the_spec(width):
    gen = torch.Generator().manual_seed(width)
    idx = torch.randint(-3, 50, (4, width + 3), generator=gen, dtype=i32)[:, :width]  # strided rows
    lens = torch.tensor([-1, 0, width, width + 7], dtype=i32)
    got, got_lens = bound_indices(idx, lens, n_slots=40)
    want, want_lens = spec_indices(idx, lens, n_slots=40)
    assert torch.equal(got, want) and torch.equal(got_lens, want_lens)


@pytest.mark.parametrize("sink", [None, "finite", "-inf"])
def test_write_outputs_kernel_matches_the_spec(sink):
    gen = torch.Generator().manual_seed(7)
    T, H_pad, n, h0, H = 3, 64, 37, 5, 50
    fm_out = torch.randn(T, 1, H_pad, 512, generator=gen).bfloat16()
    fm_lse = torch.randn(T, H_pad, 1, generator=gen) * 3
    fm_lse[0, :4] = math.inf  # FlashMLA's empty rows
    fm_lse[1, 2] = -math.inf
    fm_lse[2, 3] = math.nan
    sink_t = {None: None, "finite": torch.randn(H, generator=gen), "-inf": torch.full((H,), -math.inf)}[sink]
    out = torch.full((T, H, 512), 7.0, dtype=torch.bfloat16)
    lse = torch.full((T, H), 7.0)
    write_outputs(fm_out, fm_lse, sink_t, out, lse, h0, n)
    want_lse, non_empty = spec_lse(fm_lse.view(T, H_pad)[:, :n], None if sink_t is None else sink_t[h0 : h0 + n])
    torch.testing.assert_close(lse[:, h0 : h0 + n], want_lse, rtol=1e-6, atol=1e-6)
    want_out = torch.where(non_empty.unsqueeze(-1), fm_out[:, 0, :n], 0)
    assert torch.equal(out[:, h0 : h0 + n], want_out)
    assert out[:, :h0].eq(7).all() and out[:, h0 + n :].eq(7).all() and lse[:, :h0].eq(7).all()


def flashmla_case(T, H, K, seed, page=64, W=128):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    caches = []
    for pages in (W * T // page + 2, max(1, 2 * K // page) + 2):
        cache = new_cache("fp8_ds_mla", pages, page, device="cuda")
        n = num_slots(cache)
        write_kv(cache, torch.arange(n, dtype=i32, device="cuda"), torch.randn(n, 512, device="cuda", generator=gen), "fp8_ds_mla")
        caches.append(cache)
    swa_idx, swa_lens = make_indices(T, W, num_slots(caches[0]), "cuda", gen)
    cmp_idx, cmp_lens = make_indices(T, K, num_slots(caches[1]), "cuda", gen)
    q = torch.randn(T, H, 512, device="cuda", generator=gen).bfloat16()
    sink = torch.randn(H, device="cuda", generator=gen)
    return [q, caches[0], swa_idx, swa_lens, caches[1], cmp_idx, cmp_lens, sink, 512**-0.5, "fp8_ds_mla", 1.0]


def run(backend, args):
    T, H = args[0].shape[:2]
    out = torch.full((T, H, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((T, H), float("nan"), device="cuda")
    with compile_ops.use_backends(sparse_mla=backend):
        compile_ops.sparse_mla_out(*args, out, lse)
    return out, lse


@pytest.mark.gpu
@pytest.mark.parametrize("K", [0, 512, 1024])
@pytest.mark.parametrize("H", [8, 64, 100, 128, 200])
def test_flashmla_matches_reference_and_triton(H, K):
    pytest.importorskip("flash_mla")
    with compile_ops.use_backends(sparse_mla="flashmla"):  # can run here (else ValueError)
        assert compile_ops.backend_for("sparse_mla", "cuda", "fp8_ds_mla") == "flashmla"
    args = flashmla_case(T=9, H=H, K=K, seed=H + K)
    out, lse = run("flashmla", args)
    ref_out, ref_lse = run("reference", args)
    tri_out, tri_lse = run("triton", args)
    # against the reference: one budget; against Triton, which also rounds its softmax
    # weights to bf16: two budgets
    for (other_out, other_lse), budget in (((ref_out, ref_lse), 1.0), ((tri_out, tri_lse), 2.0)):
        e_out, e_lse = errors(out, lse, other_out, other_lse)
        assert e_out <= budget and e_lse <= budget, (e_out, e_lse)
    assert out[0].eq(0).all()  # make_indices gives token 0 empty rows
    torch.testing.assert_close(lse[0], args[7] * math.log2(math.e))


@pytest.mark.gpu
def test_flashmla_replays_from_a_cuda_graph_with_new_indices_and_lengths():
    pytest.importorskip("flash_mla")
    static = flashmla_case(T=16, H=64, K=512, seed=1)
    out = torch.empty(16, 64, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(16, 64, device="cuda")
    with compile_ops.use_backends(sparse_mla="flashmla"):
        compile_ops.sparse_mla_out(*static, out, lse)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            compile_ops.sparse_mla_out(*static, out, lse)
    for seed in (2, 3):
        fresh = flashmla_case(T=16, H=64, K=512, seed=seed)
        for i in (0, 2, 3, 5, 6, 7):  # q, indices, lengths and sink change; caches stay
            static[i].copy_(fresh[i])
        graph.replay()
        ref_out, ref_lse = run("reference", static)
        e_out, e_lse = errors(out, lse, ref_out, ref_lse)
        assert e_out <= 1.0 and e_lse <= 1.0, (seed, e_out, e_lse)
