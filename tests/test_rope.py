"""``graphs::rope_heads_``: the heads' rotation in place as one op, its Triton kernel against
the plain-torch rotation it replaces (``apply_rope_last``), and its fake."""

from __future__ import annotations

import pytest
import torch

from graphs.rope import apply_rope, apply_rope_last, rope_heads_, rope_tables, yarn_inv_freq


def rope_heads_triton(*args, **kwargs):
    return pytest.importorskip("graphs.rope_triton").rope_heads_triton(*args, **kwargs)

pytestmark = pytest.mark.quick  # the quick subset: python -m pytest -m quick

# the kernel runs compiled on a GPU, else in Triton's interpreter (conftest.py): CPU tensors
# reach it only there
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def tables(T: int, pairs: int, seed: int = 0):
    cos, sin = rope_tables(yarn_inv_freq(2 * pairs, 0, 10000.0, 1.0, 0, 0), 4096)
    pos = torch.randint(0, 4096, (T,), generator=torch.Generator().manual_seed(seed))
    return cos[pos], sin[pos]


def plain(x, cos, sin, head_dim, inverse):
    heads = x.float().view(x.shape[0], -1, head_dim)
    return apply_rope_last(heads, 2 * cos.shape[1], cos, sin, inverse).bfloat16().view(x.shape)


def turned(x, cos, sin, head_dim, inverse=False, triton=True):
    """``x`` turned in place by the Triton kernel (else by the op), returned."""
    (rope_heads_triton if triton else rope_heads_)(x, cos, sin, head_dim, inverse)
    return x


@pytest.mark.parametrize("inverse", [False, True])
def test_triton_kernel_equals_the_plain_rotation(inverse):
    """bf16 rows of a wider buffer (a column slice of a stacked projection), 19 heads (not
    a multiple of the kernel's 16 a program), 16 of 64 dims turned: those equal the plain
    rotation; no other byte of the buffer changes."""
    T, H, D = 5, 19, 64
    cos, sin = (t.to(DEVICE) for t in tables(T, 8))
    wide = torch.randn(T, H * D + 40, generator=torch.Generator().manual_seed(1)).bfloat16().to(DEVICE)
    before = wide.clone()
    x = wide[:, 8:8 + H * D]
    want = plain(x, cos, sin, D, inverse)
    turned(x, cos, sin, D, inverse)
    heads, want_heads = x.view(T, H, D), want.view(T, H, D)
    torch.testing.assert_close(heads[..., :48], before[:, 8:8 + H * D].view(T, H, D)[..., :48], rtol=0, atol=0)
    torch.testing.assert_close(heads.float(), want_heads.float(), rtol=2**-7, atol=1e-6)  # one bf16 step
    torch.testing.assert_close(wide[:, :8], before[:, :8], rtol=0, atol=0)
    torch.testing.assert_close(wide[:, 8 + H * D:], before[:, 8 + H * D:], rtol=0, atol=0)
    # the op's CPU path is the plain math itself
    x, cos, sin = before[:, 8:8 + H * D].cpu(), cos.cpu(), sin.cpu()
    torch.testing.assert_close(turned(x, cos, sin, D, inverse, triton=False), want.cpu(), rtol=0, atol=0)


def test_inverse_undoes_the_rotation():
    T, H, D = 3, 4, 128
    cos, sin = (t.to(DEVICE) for t in tables(T, 32, seed=2))
    x = torch.randn(T, H * D, generator=torch.Generator().manual_seed(3)).bfloat16().to(DEVICE)
    back = turned(turned(x.clone(), cos, sin, D), cos, sin, D, inverse=True)
    torch.testing.assert_close(back.float(), x.float(), rtol=2**-6, atol=2**-6)
    pairs = apply_rope(x.float().view(T, H, D)[..., 64:], cos, sin)  # the rotation itself: pair i by angle i
    got = turned(x.clone(), cos, sin, D).view(T, H, D)[..., 64:]
    torch.testing.assert_close(got.float(), pairs, rtol=2**-7, atol=1e-6)


def test_positions_look_the_angles_up_in_the_tables():
    """With ``positions`` the op reads ``cos, sin`` as tables at each token's row (the kernel
    and the CPU path): equal to turning by the rows gathered beforehand; ``-1`` (padding)
    reads row 0 and a position past the tables their last row, never memory outside them."""
    T, H, D = 6, 3, 64
    cos, sin = (t.to(DEVICE) for t in rope_tables(yarn_inv_freq(16, 0, 10000.0, 1.0, 0, 0), 40))
    positions = torch.tensor([5, -1, 39, 0, 17, 90], dtype=torch.int32, device=DEVICE)
    rows = torch.tensor([5, 0, 39, 0, 17, 39], device=DEVICE)
    x = torch.randn(T, H * D, generator=torch.Generator().manual_seed(4)).bfloat16().to(DEVICE)
    want = turned(x.clone(), cos[rows], sin[rows], D)
    for dtype in (torch.int32, torch.int64):
        got = x.clone()
        rope_heads_triton(got, cos, sin, D, positions=positions.to(dtype))
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    got = x.cpu()
    rope_heads_(got, cos.cpu(), sin.cpu(), D, positions=positions.cpu().long())
    torch.testing.assert_close(got.float(), want.cpu().float(), rtol=2**-7, atol=1e-6)
    torch.library.opcheck(torch.ops.graphs.rope_heads_.default, (x.cpu(), cos.cpu(), sin.cpu(), D, False,
                                                                positions.cpu()))


def test_no_tokens():
    cos, sin = tables(0, 8)
    assert turned(torch.empty(0, 128, dtype=torch.bfloat16), cos, sin, 64).shape == (0, 128)


def test_opcheck():
    cos, sin = tables(3, 8)
    x = torch.randn(3, 128).bfloat16()
    torch.library.opcheck(torch.ops.graphs.rope_heads_.default, (x, cos, sin, 64, True))


@pytest.mark.parametrize("bad, match", [
    (dict(x=torch.randn(3, 2, 64).bfloat16()), "x must be"),
    (dict(x=torch.randn(3, 128)), "x must be"),
    (dict(x=torch.randn(128, 3).bfloat16().t()), "unit column stride"),
    (dict(head_dim=48), "power-of-two head_dim"),
    (dict(head_dim=100), "whole heads"),
    (dict(cos=torch.zeros(2, 8)), "cos and sin"),
    (dict(cos=torch.zeros(3, 40), sin=torch.zeros(3, 40)), "2P <= head_dim"),
    (dict(cos=torch.zeros(3, 12), sin=torch.zeros(3, 12)), "power of two"),
    (dict(sin=torch.zeros(3, 8, dtype=torch.float64)), "fp32"),
    (dict(cos=torch.zeros(3, 8, device="meta"), sin=torch.zeros(3, 8, device="meta")), "device"),
    (dict(positions=torch.zeros(2, dtype=torch.int32)), "positions must be"),
    (dict(positions=torch.zeros(3)), "positions must be"),
    (dict(cos=torch.zeros(0, 8), sin=torch.zeros(0, 8), positions=torch.zeros(3, dtype=torch.int32)), "tables"),
    (dict(cos=torch.zeros(8), sin=torch.zeros(8), positions=torch.zeros(3, dtype=torch.int32)), "tables"),
])
def test_bad_input_is_refused(bad, match):
    cos, sin = tables(3, 8)
    args = dict(x=torch.randn(3, 128).bfloat16(), cos=cos, sin=sin, head_dim=64)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        rope_heads_(**args)
