"""The layer's stacked projections (``graphs.fused``): the projections of one input are row
blocks of one weight, so a decode step reads them in one GEMM. What a user relies on: the
modules keep their own weights (views of the stack, no second copy), loading a state dict
in place or by assignment and moving the layer keep the stack equal to the weights, each
stacked output equals its module's own product, and a state dict still saves on its own.
"""

from dataclasses import replace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from graphs import TINY, TINY_V41, DSV41Attention
from compile_ops.linear import fp8_linear
from graphs.fused import TurnedHeads, columns, join_beside, project, project_beside
from graphs.rope import rope_heads_
from test_graphs_fp8 import cache, serve
from test_opcheck import opcheck

pytestmark = pytest.mark.quick

CACHE = cache()
V4 = replace(TINY, o_lora_rank=128)  # wo_a's rows in whole 128-row FP8 scale blocks
V41 = replace(TINY_V41, o_lora_rank=128)


def members(layer):
    """``{stack weight name: [(name, module weight), ...]}`` of every stack."""
    out = {}
    for side, stacks in layer.stacks.items():
        by_name = {name: w for name, _, w in layer._projections()[side]}
        for s in stacks:
            out[s.weight] = [(name, by_name[name]) for name in s.names]
    return out


def assert_stacked(layer):
    """Every stacked projection's weight is a view of its stack, at its rows."""
    for stack_name, group in members(layer).items():
        stack, start = getattr(layer, stack_name), 0
        for name, w in group:
            assert w.untyped_storage().data_ptr() == stack.untyped_storage().data_ptr(), name
            assert torch.equal(stack[start:start + w.shape[0]].float(), w.float()), name
            start += w.shape[0]
        assert start == stack.shape[0]


def layers():
    # V4's indexers have their own compressor (ratio 4's overlapping, twice as wide)
    yield DSV41Attention(V4, CACHE, 2, seed=1), ("wq_a", "wkv", "compressor", "indexer.compressor",
                                                 "indexer.weights_proj")
    yield DSV41Attention(V4, CACHE, 4, seed=1), ("wq_a", "wkv", "compressor", "indexer.compressor",
                                                 "indexer.weights_proj")
    yield DSV41Attention(V41, CACHE, 2, seed=1), ("wq_a", "wkv", "compressor", "indexer.weights_proj")
    yield DSV41Attention(V41, CACHE, 0, seed=1), ("wq_a", "wkv")


@pytest.mark.parametrize("index", range(4), ids=["v4-r2", "v4-r4", "v41-r2", "v41-swa"])
def test_each_input_is_one_gemm_over_views_of_its_weights(index):
    layer, x_names = list(layers())[index]
    assert [s.names for s in layer.stacks["x"]] == [x_names]
    assert layer.stacks["x"][0].fp32 == ("compressor" in x_names)
    assert_stacked(layer)
    x = torch.randn(3, layer.cfg.dim).to(torch.bfloat16)
    got = project(layer, layer.stacks["x"], x)
    for name, w in members(layer)["x_proj_0"]:
        torch.testing.assert_close(got[name].float(), x.float() @ w.float().t(), rtol=1e-2, atol=1e-2)


def test_fp8_weights_stack_where_their_scale_blocks_align():
    """V4.1's 32 x 32 blocks: ``wq_a`` (32 rows) and ``wkv`` stack into one FP8 GEMM; V4's
    128 x 128 blocks: 32 rows share a scale row with the next weight, so each stays its own."""
    for block, fp8_stacks in ((32, [("wq_a", "wkv")]), (128, [("wq_a",), ("wkv",)])):
        layer = DSV41Attention(replace(V4, weight_block=block), CACHE, 2, weights="fp8", seed=2)
        stacks = layer.stacks["x"]
        assert [s.names for s in stacks] == [("compressor", "indexer.compressor", "indexer.weights_proj")] + fp8_stacks
        assert [s.scale is not None for s in stacks] == [False] + [True] * len(fp8_stacks)
        assert_stacked(layer)


@pytest.mark.parametrize("weights", ["bf16", "fp8"])
def test_the_q_projection_beside_equals_the_plain_one(weights):
    """``project_beside`` (the q stack's GEMM, on a side stream on CUDA), joined, gives
    ``project``'s columns; its ops' fake kernels match (``opcheck``)."""
    layer = DSV41Attention(V41, CACHE, 2, weights=weights, seed=3)
    qr = torch.randn(3, layer.cfg.q_lora_rank).to(torch.bfloat16)
    stacks = layer.stacks["q"]
    ys = project_beside(layer, stacks, qr)
    join_beside(ys)
    want = project(layer, stacks, qr)
    got = columns(stacks, ys)
    assert got.keys() == want.keys() == {"wq_b", "indexer.wq_b"}
    for name in want:
        assert torch.equal(got[name], want[name]), name
    for s, y in zip(stacks, ys):
        scale = None if s.scale is None else getattr(layer, s.scale)
        opcheck(torch.ops.graphs.mm_beside.default, (qr, getattr(layer, s.weight), scale))
        opcheck(torch.ops.graphs.join_beside.default, (y,))


@pytest.mark.parametrize("weights", ["bf16", "fp8"])
def test_the_q_projection_beside_turns_its_heads(weights):
    """``project_beside`` given ``TurnedHeads("wq_b", ...)`` (V4.1's q heads, turned after
    the GEMM on the side stream on CUDA, their angles looked up by position there) gives
    ``project``'s columns with ``wq_b``'s heads turned by ``rope_heads_`` and the other
    columns untouched; the op's fake kernel matches
    (``opcheck``); a projection that is not first in its stack, or turned columns past the
    weight's rows or without angles, are refused."""
    layer = DSV41Attention(V41, CACHE, 2, weights=weights, seed=3)
    T, D, P = 3, layer.head_dim, layer.rope_dim // 2
    qr = torch.randn(T, layer.cfg.q_lora_rank).to(torch.bfloat16)
    tables, positions = (layer.rope_cos, layer.rope_sin), torch.tensor([5, 9, -1], dtype=torch.int32)
    cos, sin = (t[positions.long().clamp(min=0)] for t in tables)
    stacks = layer.stacks["q"]
    ys = project_beside(layer, stacks, qr, TurnedHeads("wq_b", *tables, positions, D))
    join_beside(ys)
    got, want = columns(stacks, ys), project(layer, stacks, qr)
    assert not torch.equal(got["wq_b"], want["wq_b"])
    rope_heads_(want["wq_b"], cos, sin, D)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    s = stacks[0]
    weight, scale = getattr(layer, s.weight), None if s.scale is None else getattr(layer, s.scale)
    opcheck(torch.ops.graphs.mm_beside.default, (qr, weight, scale, *tables, positions, s.widths[0], D))
    with pytest.raises(ValueError, match="first projection of a stack"):
        project_beside(layer, stacks, qr, TurnedHeads("indexer.wq_b", *tables, positions, D))
    with pytest.raises(ValueError, match="turned must be"):
        torch.ops.graphs.mm_beside(qr, weight, scale, *tables, positions, weight.shape[0] + D, D)
    with pytest.raises(ValueError, match="need the tables"):
        torch.ops.graphs.mm_beside(qr, weight, scale, *tables, None, D, D)
    with FakeTensorMode() as mode:  # the fake kernel refuses a turn the op's rope refuses
        fake = [mode.from_tensor(t) for t in (qr, weight, *tables, positions)]
        with pytest.raises(ValueError, match="whole heads"):
            torch.ops.graphs.mm_beside(fake[0], fake[1], None if scale is None else mode.from_tensor(scale),
                                       fake[2], fake[3], fake[4], D + 1, D)
    with pytest.raises(ValueError, match="whole heads"):
        torch.ops.graphs.mm_beside(qr, weight, scale, *tables, positions, D + 1, D)
    with pytest.raises(ValueError, match="positions must be"):
        torch.ops.graphs.mm_beside(qr, weight, scale, *tables, positions[:2], s.widths[0], D)
    assert P == cos.shape[1]


def test_an_fp8_layers_x_stacks_run_side_by_side():
    """An FP8 layer's ``x`` projections are a bf16 stack (the compressor's, fp32) and FP8
    ones: ``project`` runs them in one op (``graphs::mm_side_by_side``, the last on the
    current stream, the others beside it on CUDA), whose products equal each stack's own
    GEMM; its fake kernel matches (``opcheck``)."""
    layer = DSV41Attention(V41, CACHE, 2, weights="fp8", seed=3)
    stacks = layer.stacks["x"]
    assert len(stacks) > 1 and stacks[0].scale is None and stacks[0].fp32
    x = torch.randn(3, layer.cfg.dim).to(torch.bfloat16)
    got = project(layer, stacks, x)
    assert got.keys() == {"wq_a", "wkv", "compressor", "indexer.weights_proj"}
    args = (x, [getattr(layer, s.weight) for s in stacks],
            [None if s.scale is None else getattr(layer, s.scale) for s in stacks], [s.fp32 for s in stacks])
    ys = torch.ops.graphs.mm_side_by_side(*args)
    assert [y.dtype for y in ys] == [torch.float32] + [torch.bfloat16] * (len(stacks) - 1)
    for s, y, w, scale in zip(stacks, ys, args[1], args[2]):
        alone = (x.float() @ w.float().t() if scale is None
                 else fp8_linear(x, w, scale))
        assert torch.equal(y, alone), s.names
    assert torch.equal(got["compressor"], ys[0][:, :stacks[0].widths[0]])
    opcheck(torch.ops.graphs.mm_side_by_side.default, args)


@pytest.mark.parametrize("assign", [False, True], ids=["in-place", "assign"])
def test_a_loaded_state_dict_reaches_the_stacked_gemm(assign):
    src = DSV41Attention(V41, CACHE, 2, seed=5)
    dst = DSV41Attention(V41, CACHE, 2, seed=6)
    dst.load_state_dict(src.state_dict(), strict=True, assign=assign)
    assert_stacked(dst)
    for got, want in zip(serve(dst), serve(src)):
        assert torch.equal(got, want)


def test_a_moved_layer_stacks_its_weights_again():
    """``.to(device)`` gives each weight a new tensor of its own (stood for on the CPU by a
    clone of every tensor); the layer stacks them again, so its output is unchanged."""
    layer, want = DSV41Attention(V41, CACHE, 2, seed=7), DSV41Attention(V41, CACHE, 2, seed=7)
    layer._apply(torch.clone)
    assert_stacked(layer)
    for got, ref in zip(serve(layer), serve(want)):
        assert torch.equal(got, ref)


def test_a_state_dict_holds_each_weight_on_its_own(tmp_path):
    from safetensors.torch import load_file, save_file

    layer = DSV41Attention(V41, CACHE, 2, seed=8)
    sd = layer.state_dict()
    storages = [v.untyped_storage().data_ptr() for v in sd.values()]
    assert len(set(storages)) == len(storages)
    save_file(sd, str(tmp_path / "layer.safetensors"))
    back = load_file(str(tmp_path / "layer.safetensors"))
    assert all(torch.equal(back[k], v) for k, v in sd.items())
