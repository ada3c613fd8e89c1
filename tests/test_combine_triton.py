"""Triton LSE combine and DCP combine pieces (``compile_ops.combine.triton``) against the reference.

On CPU the kernels run under ``TRITON_INTERPRET=1``; the collectives of the DCP combine are
emulated with tensor ops (the real ones run in tests/test_dcp_step.py). Tolerances are on
the max error: fp32 outputs ``1e-5`` abs/rel, bf16 outputs 1 bf16 ulp (``rtol 2**-7``);
LSEs ``1e-5`` and ``-inf`` exactly where the reference has it.
"""

import pytest
import torch

from compile_ops.combine import reference
from compile_ops.combine.triton import a2a_pack, a2a_views, dcp_rescale_triton, lse_combine_triton

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INF = float("inf")
# the interpreter evaluates log2(0) and 0/0 with numpy, which warns; the kernels mask those lanes
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def tol(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-3, rtol=2**-7)


def partials(N, T, H, D, dtype, seed, special=True):
    """Random partial outputs and LSEs, with NaN / +inf (caller bugs, read as -inf), rows whose
    partials are all -inf, and a NaN output behind a -inf LSE (must weigh exactly 0)."""
    gen = torch.Generator().manual_seed(seed)
    out = torch.randn(N, T, H, D, generator=gen).to(dtype)
    lse = torch.randn(N, T, H, generator=gen) * 8
    if special and T * H > 1:
        lse[0, 0, 0] = float("nan")
        lse[N - 1, 0, 1 % H] = INF
        lse[:, T - 1, H - 1] = -INF
        lse[0, T - 1, 0] = -INF
        out[0, T - 1, 0] = float("nan")
    return out.to(DEVICE), lse.to(DEVICE)


def check(got, want, dtype):
    (out, lse), (ref_out, ref_lse) = got, want
    assert out.dtype == ref_out.dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out.float(), ref_out.float(), **tol(dtype))
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("N", range(1, 9), ids=lambda n: f"N{n}")
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=("fp32", "bf16"))
def test_lse_combine(N, dtype):
    out, lse = partials(N, 3, 2, 100, dtype, seed=N)
    check(lse_combine_triton(out, lse), reference.lse_combine_reference(out, lse), dtype)


def test_lse_combine_strided_views():
    """Partials read in place through any strides (as the a2a combine does)."""
    out, lse = partials(3, 4, 6, 64, torch.bfloat16, seed=1)
    out_t, lse_t = out.transpose(1, 2).contiguous().transpose(1, 2), lse.transpose(0, 2).contiguous().transpose(0, 2)
    check(lse_combine_triton(out_t, lse_t), reference.lse_combine_reference(out, lse), torch.bfloat16)


def test_lse_combine_wide_head_dim():
    """D = 600 > one tile for N = 8: several D chunks per program."""
    out, lse = partials(8, 1, 2, 600, torch.float32, seed=2)
    check(lse_combine_triton(out, lse), reference.lse_combine_reference(out, lse), torch.float32)


def test_lse_combine_empty():
    out, lse = partials(2, 0, 3, 16, torch.float32, seed=0, special=False)
    got = lse_combine_triton(out, lse)
    assert got[0].shape == (0, 3, 16) and got[1].shape == (0, 3)


def rank_partials(world, T, H, D, dtype, seed):
    """Partial attention of all ``world * H`` gathered heads on each rank: ``[world][T, world*H, D]``."""
    out, lse = partials(world, T, world * H, D, dtype, seed)
    return list(out), list(lse)


@pytest.mark.parametrize("world", (1, 2, 3, 4, 8), ids=lambda w: f"world{w}")
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=("fp32", "bf16"))
def test_ag_rs_local_steps(world, dtype):
    """all-gather (stack) -> dcp_rescale_triton on each rank -> reduce-scatter (sum of slice r)
    equals lse_combine of every rank's partials of head slice r."""
    T, H, D = 2, 1, 48
    outs, lses = rank_partials(world, T, H, D, dtype, seed=world)
    gathered = torch.stack(lses)
    weights, _ = reference.lse_weights(gathered)
    scaled, mine = zip(*(dcp_rescale_triton(outs[r], gathered, r) for r in range(world)))
    for r in range(world):
        # each rank's scaled partials: its weight times its outputs, rounded once to out's dtype
        want = torch.where(weights[r].unsqueeze(-1) > 0, outs[r].float() * weights[r].unsqueeze(-1), 0.0)
        want = want.to(dtype).view(T, world, H, D).transpose(0, 1)
        torch.testing.assert_close(scaled[r], want, **tol(dtype))
    for r in range(world):
        heads = slice(r * H, (r + 1) * H)
        reduced = torch.stack([scaled[src][r].float() for src in range(world)]).sum(0)
        want_out, want_lse = reference.lse_combine_reference(torch.stack(outs)[:, :, heads].float(), gathered[:, :, heads])
        # bf16: one rounding of each of up to 8 terms of magnitude < 8
        torch.testing.assert_close(reduced, want_out, **(tol(dtype) if dtype == torch.float32 else dict(atol=2**-4, rtol=2**-7)))
        torch.testing.assert_close(mine[r], want_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("world", (1, 2, 3, 4, 8), ids=lambda w: f"world{w}")
@pytest.mark.parametrize("D", (48, 7), ids=("D48", "D7_unaligned"))
def test_a2a_pack_views_combine(world, D):
    """pack on each rank -> all-to-all (row r of every rank to rank r) -> typed views ->
    lse_combine_triton equals lse_combine of every rank's partials of head slice r."""
    T, H, dtype = 2, 1, torch.bfloat16
    outs, lses = rank_partials(world, T, H, D, dtype, seed=world + D)
    packed = [a2a_pack(outs[r], lses[r], world).view(world, -1) for r in range(world)]
    for r in range(world):
        received = torch.cat([packed[src][r] for src in range(world)])
        part_out, part_lse = a2a_views(received, T, H, D, dtype)
        heads = slice(r * H, (r + 1) * H)
        want = reference.lse_combine_reference(torch.stack(outs)[:, :, heads], torch.stack(lses)[:, :, heads])
        check(lse_combine_triton(part_out, part_lse), want, dtype)


@pytest.mark.gpu
def test_combine_dispatch_and_large_gpu():
    import compile_ops

    assert compile_ops.backend_for("combine", DEVICE) == "triton"
    out, lse = partials(2, 512, 128, 512, torch.bfloat16, seed=3)
    check(compile_ops.lse_combine(out, lse), reference.lse_combine_reference(out, lse), torch.bfloat16)
    outs, lses = rank_partials(2, 512, 64, 512, torch.bfloat16, seed=4)
    scaled, mine = dcp_rescale_triton(outs[1], torch.stack(lses), 1)
    weights, merged = reference.lse_weights(torch.stack(lses))
    want = torch.where(weights[1].unsqueeze(-1) > 0, outs[1].float() * weights[1].unsqueeze(-1), 0.0)
    torch.testing.assert_close(scaled.float(), want.view(512, 2, 64, 512).transpose(0, 1).bfloat16().float(), atol=1e-3, rtol=2**-7)
    torch.testing.assert_close(mine, merged.view(512, 2, 64)[:, 1], atol=1e-5, rtol=1e-5)


def test_dcp_rescale_rejects_wrong_gathered_shape():
    out, lse = partials(1, 3, 8, 16, torch.float32, seed=0, special=False)
    with pytest.raises(ValueError, match="gathered_lse must be"):
        dcp_rescale_triton(out[0], torch.cat([lse[0]] * 2), 0)  # [N*T, H_all]: not all-gather's [N, T, H_all]
    with pytest.raises(ValueError, match="rank must be"):
        dcp_rescale_triton(out[0], torch.stack([lse[0]] * 2), 2)
