"""Triton slot conversion (``compile_ops.slots.triton``) against the plain-torch reference.

On CPU the kernels run under ``TRITON_INTERPRET=1`` (set by conftest.py); on a GPU the
same cases run compiled, plus large shapes, the op dispatch and a CUDA-graph capture.
Slots are integers: every case must match the reference exactly.
"""

import pytest
import torch

from compile_ops.slots import reference
from compile_ops.slots.triton import (
    dcp_topk_to_slots_triton,
    swa_indices_triton,
    topk_to_slots_triton,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
I32 = torch.int32

# id: (T, K, R, B, block_size, block, what)
TOPK_CASES = {
    "K1": (4, 1, 3, 4, 4, None, ""),
    "K63": (5, 63, 3, 5, 4, None, ""),
    "chunked": (3, 40, 2, 6, 8, 16, ""),  # three 16-wide chunks; the count carries over
    "strided": (4, 24, 2, 4, 4, None, "strided"),
    "rows_invalid": (4, 16, 3, 4, 4, None, "invalid"),
    "no_pages": (3, 8, 2, 0, 4, None, ""),
    "no_requests": (3, 8, 0, 4, 4, None, ""),
    "T0": (0, 8, 2, 4, 4, None, ""),
    "K0": (3, 0, 2, 4, 4, None, ""),
    "block1": (4, 12, 2, 9, 1, None, ""),
}


def make_topk_problem(T, K, R, B, block_size, what, seed):
    """Ids in ``[-3, B * block_size + 6)`` (negative and beyond the table), ~20% negative
    table entries, requests outside ``[0, R)``, some ``is_valid`` False; ``"strided"``: ids
    and the token mask as strided views."""
    gen = torch.Generator().manual_seed(seed)
    hi = max(B * block_size, 1) + 6
    if what == "strided":
        topk = torch.randint(-3, hi, (K, T), generator=gen, dtype=I32).t()
    else:
        topk = torch.randint(-3, hi, (T, K), generator=gen, dtype=I32)
    table = torch.randint(0, 1000, (R, B), generator=gen, dtype=I32)
    table = torch.where(torch.rand(R, B, generator=gen) < 0.2, -1, table)
    token_to_req = torch.randint(-1, R + 1, (T,), generator=gen, dtype=I32)
    is_valid = torch.rand(T, generator=gen) > 0.2
    if what == "strided":  # the token mask a strided view too (every other bool of a pair)
        is_valid = torch.stack([is_valid, ~is_valid], 1)[:, 0]
    if what == "invalid":
        is_valid[:] = False
    on = lambda t: t.to(DEVICE)  # noqa: E731
    return on(topk), on(token_to_req), on(table), on(is_valid)


def assert_same(got, want):
    for name, g, w in zip(("slots", "lens"), got, want):
        assert g.dtype == torch.int32 and g.shape == w.shape, (name, g.dtype, g.shape, w.shape)
        assert torch.equal(g.cpu(), w.cpu()), f"{name} differs:\n{g}\n{w}"


@pytest.mark.parametrize("case", TOPK_CASES.values(), ids=TOPK_CASES.keys())
def test_topk_to_slots(case):
    T, K, R, B, block_size, block, what = case
    args = make_topk_problem(T, K, R, B, block_size, what, seed=0)
    got = topk_to_slots_triton(args[0], args[1], args[2], block_size, args[3], block=block)
    assert_same(got, reference.topk_to_slots_reference(args[0], args[1], args[2], block_size, args[3]))


@pytest.mark.parametrize("world", range(1, 9), ids=lambda w: f"world{w}")
@pytest.mark.parametrize("interleave", (1, 4), ids=lambda i: f"I{i}")
def test_dcp_topk_to_slots(world, interleave):
    T, K, R, B, block_size = 5, 24, 2, 5, 4
    topk, token_to_req, table, is_valid = make_topk_problem(T, K, R, B, block_size, "", seed=world)
    gen = torch.Generator().manual_seed(world * 10 + interleave)
    topk = torch.randint(-2, world * interleave * B * block_size + 3, (T, K), generator=gen, dtype=I32).to(DEVICE)
    for rank in range(world):
        got = dcp_topk_to_slots_triton(topk, token_to_req, table, block_size, is_valid, rank, world, interleave, block=16)
        want = reference.dcp_topk_to_slots_reference(topk, token_to_req, table, block_size, is_valid, rank, world, interleave)
        assert_same(got, want)


# id: (window, page_size, B, block)
SWA_CASES = {
    "W1": (1, 4, 3, None),
    "W5_page1": (5, 1, 12, None),
    "W16_chunked": (16, 4, 4, 4),
    "W13": (13, 3, 4, None),
    "no_pages": (4, 4, 0, None),
}


@pytest.mark.parametrize("case", SWA_CASES.values(), ids=SWA_CASES.keys())
def test_swa_indices(case):
    window, page_size, B, block = case
    gen = torch.Generator().manual_seed(window)
    T, R = 7, 3
    positions = torch.tensor([-1, 0, 1, window - 1, window + 2, B * page_size + 3, 2 * window + 5], dtype=I32)
    token_to_req = torch.randint(-1, R + 1, (T,), generator=gen, dtype=I32)
    token_to_req[1:4] = 0  # in range for the short windows
    table = torch.randint(0, 100, (R, B), generator=gen, dtype=I32)
    table = torch.where(torch.rand(R, B, generator=gen) < 0.2, -1, table)
    args = [t.to(DEVICE) for t in (positions, token_to_req, table)]
    got = swa_indices_triton(args[0], args[1], args[2], page_size, window, block=block)
    assert_same(got, reference.swa_indices_reference(args[0], args[1], args[2], page_size, window))


def test_launchers_keep_triton_out_of_import():
    import subprocess
    import sys

    code = "import sys, compile_ops; sys.exit('triton' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.mark.gpu
@pytest.mark.parametrize("K", (512, 2048, 3000))
def test_large_shapes_gpu(K):
    T, R, B, block_size = 4096, 64, 64, 64
    topk, token_to_req, table, is_valid = make_topk_problem(T, K, R, B, block_size, "", seed=K)
    assert_same(
        topk_to_slots_triton(topk, token_to_req, table, block_size, is_valid),
        reference.topk_to_slots_reference(topk, token_to_req, table, block_size, is_valid),
    )
    for rank in range(2):
        assert_same(
            dcp_topk_to_slots_triton(topk, token_to_req, table, block_size, is_valid, rank, 2, 4),
            reference.dcp_topk_to_slots_reference(topk, token_to_req, table, block_size, is_valid, rank, 2, 4),
        )
    positions = torch.randint(-1, B * block_size, (T,), dtype=I32, device=DEVICE)
    assert_same(
        swa_indices_triton(positions, token_to_req, table, block_size, 128),
        reference.swa_indices_reference(positions, token_to_req, table, block_size, 128),
    )


@pytest.mark.gpu
def test_ops_dispatch_to_triton_and_capture_gpu():
    import compile_ops

    assert compile_ops.backend_for("slots", DEVICE) == "triton"
    topk, token_to_req, table, is_valid = make_topk_problem(64, 512, 4, 16, 64, "", seed=1)
    static = topk.clone()
    compile_ops.dcp_topk_to_slots(static, token_to_req, table, 64, is_valid, 1, 2, 4)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        slots, lens = compile_ops.dcp_topk_to_slots(static, token_to_req, table, 64, is_valid, 1, 2, 4)
    for seed in range(3):
        static.copy_(make_topk_problem(64, 512, 4, 16, 64, "", seed=seed + 10)[0])
        graph.replay()
        assert_same((slots, lens), reference.dcp_topk_to_slots_reference(static, token_to_req, table, 64, is_valid, 1, 2, 4))
    torch.library.opcheck(torch.ops.dsv41.topk_to_slots.default, (topk, token_to_req, table, 64, is_valid))
