"""DeepSeek-V4.1's layer kinds (``AttentionConfig.arch = "v4.1"``, :data:`graphs.TINY_V41`)
on the CPU: the parameters DeepSeek-V4.1's checkpoints name, a mixed workload (prefill
chunks, decode, drafts with rejections) against the full-history oracle in V4.1's
semantics, the compiled step with no graph break equal to eager, and a V4.1 config read
as V4.1. (The layers that share another's cache or top-k need the stack: not built yet.)

Tolerances: the oracle's (``graphs.naive``, 2e-2 of max |y| with bf16 caches, 4e-2 with
fp8 ones); compiled vs eager 2e-2 on the tokens that pick the same entries (fusions round
bf16 activations differently, which can swap near-tied index scores).
"""

from __future__ import annotations

import pytest
import torch

from graphs.plan import LayerPlan
from graphs import TINY_V41, AttentionConfig, CacheConfig, DSV41Attention, StepRunner
from graphs.naive import oracle_verdict
from graphs.schedule import hidden_states, mixed_workload, run_workload

pytestmark = pytest.mark.quick  # the quick subset: python -m pytest -m quick


def serve(layer: DSV41Attention, compile: bool = False):
    runner = StepRunner(layer, (1, 4, 16), compile=compile)
    work = mixed_workload([30, 9, 17, 4], 6, chunk=5, max_tokens=16, rows=4, arrive_every=2, drafts=2)
    xs = hidden_states(work, TINY_V41.dim, seed=1)
    with torch.no_grad():
        outs, topk = run_workload(runner.step, work, xs, watch=layer.topk_ids, release=runner.release)
    return xs, outs, topk


@pytest.mark.parametrize("ratio, params", [
    (1, ["compressor.norm.weight", "compressor.wkv.weight", "indexer.k_norm.weight", "indexer.weights_proj.weight",
         "indexer.wk.weight", "indexer.wq_b.weight"]),
    (2, ["compressor.norm.weight", "compressor.wgate.weight", "compressor.wkv.weight", "indexer.k_norm.weight",
         "indexer.weights_proj.weight", "indexer.wk.weight", "indexer.wq_b.weight"]),
], ids=["ratio1", "ratio2"])
def test_the_parameters_are_v41s(ratio, params):
    """No ``ape``, no indexer compressor, no Hadamard rotation; ratio 1 has no ``wgate``;
    ``indexer.wk [128, 512]`` and ``k_norm [128]`` (DeepSeek-V4.1's tensor names and shapes)."""
    layer = DSV41Attention(TINY_V41, CacheConfig(2, 4, 32, 4), ratio)
    sd = layer.state_dict()
    assert sorted(k for k in sd if k.startswith(("compressor.", "indexer."))) == params
    assert sd["indexer.wk.weight"].shape == (128, 512) and sd["indexer.k_norm.weight"].shape == (128,)
    assert layer.indexer.rotation is None and layer.cfg.norm_eps == 1e-20


@pytest.mark.parametrize("kv_format, index_format", [("bf16", "fp8"), ("fp8_dsv41", "bf16"), ("fp8_dsv41", "fp4"),
                                                     ("fp8_dsv41+fp4_dsv41", "fp4")])
@pytest.mark.parametrize("ratio", [1, 2])
def test_mixed_steps_match_the_v41_oracle(ratio, kv_format, index_format):
    """The layer against the V4.1 oracle with each cache in its format; the last case is
    DeepSeek-V4.1's own: an fp8 window, fp4 compressed entries and fp4 index keys."""
    window, _, compressed = kv_format.partition("+")
    cache = CacheConfig(4, 16, 64, 4, kv_format=window, index_format=index_format, cmp_kv_format=compressed or None)
    layer = DSV41Attention(TINY_V41, cache, ratio, seed=ratio)
    if compressed:
        assert layer.cmp_cache.shape[-1] == 288 and layer.swa_cache.shape[-1] == 528
    xs, outs, topk = serve(layer)
    verdict = oracle_verdict(layer, xs, outs, topk)
    assert verdict.passed, verdict.verdict()


def test_the_oracle_tells_v41_from_v4():
    """The comparison means something: the same outputs against the oracle of a layer with
    V4's per-head q norm (the V4.1 layer's weights, read by the V4 oracle path) fail."""
    from dataclasses import replace

    layer = DSV41Attention(TINY_V41, CacheConfig(4, 16, 64, 4), 2, seed=2)
    xs, outs, topk = serve(layer)
    object.__setattr__(layer, "cfg", replace(TINY_V41, arch="v4"))  # only the oracle reads cfg from here on
    verdict = oracle_verdict(layer, xs, outs, topk)
    assert not verdict.passed and verdict.max_rel_diff > 2 * verdict.tolerance


def test_the_compiled_v41_step_has_no_break_and_equals_eager():
    """One Dynamo graph, no break; the compiled run passes the oracle, and equals eager on
    the tokens that pick the same entries (near-tied index scores may swap between fusions:
    at least 80 % must agree; measured 96 %)."""
    from graphs.bench import pick_matched

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    layer = DSV41Attention(TINY_V41, CacheConfig(4, 16, 64, 4), 2, seed=3)
    xs, got, got_ids = serve(layer, compile=True)
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    verdict = oracle_verdict(layer, xs, got, got_ids)
    assert verdict.passed, verdict.verdict()
    _, want, want_ids = serve(DSV41Attention(TINY_V41, CacheConfig(4, 16, 64, 4), 2, seed=3))
    agree = pick_matched(got, want, got_ids, want_ids, tolerance=2e-2, min_share=0.8)
    assert agree.passed, agree.verdict("compiled vs eager")


def test_what_the_side_stream_reads_outlives_its_reads_in_the_compiled_step():
    """On CUDA the q GEMM and the turn of its heads run on a side stream after the current
    stream has gone on, and Inductor's memory planning knows no streams: a buffer the side
    stream reads must not be handed to later work before the join. In the compiled step's
    code (Inductor's wrapper): the turn's angles are graph inputs (the layer's tables, the
    step's positions) or views of them, and the GEMM's input is not reused for another
    buffer before the join (freeing it is safe: the op holds it from the allocator for the
    side stream)."""
    import re

    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    layer = DSV41Attention(TINY_V41, CacheConfig(4, 16, 64, 4), 2, seed=2)
    runner = StepRunner(layer, (1, 4, 16), compile=True, cuda_graphs=False)
    work = mixed_workload([9, 4], 3, chunk=5, max_tokens=16, rows=2)

    def serve():
        with torch.no_grad():
            run_workload(runner.step, work, hidden_states(work, TINY_V41.dim), release=runner.release)

    _, (code, *_) = run_and_get_code(serve)
    lines = code.splitlines()
    (gemm,) = [i for i, line in enumerate(lines) if "torch.ops.graphs.mm_beside.default(" in line]
    (join,) = [i for i, line in enumerate(lines) if "torch.ops.graphs.join_beside.default(" in line]
    x, _weight, _scale, cos, sin, positions = re.search(r"mm_beside\.default\((.*)\)", lines[gemm]).group(1) \
        .replace("reinterpret_tensor(", "").split(", ")[:6]
    assert all(a.startswith("arg") for a in (cos, sin, positions)), lines[gemm]
    assert gemm < join and not [line for line in lines[gemm + 1:join] if re.search(rf"\b{x}\b.*# reuse", line)]


def test_a_v41_config_is_read_as_v41():
    config = {"hidden_size": 64, "num_attention_heads": 4, "q_lora_rank": 32, "o_lora_rank": 32, "o_groups": 2,
              "sliding_window": 8, "index_n_heads": 2, "index_head_dim": 128, "index_topk": 8, "rms_norm_eps": 1e-20,
              "compress_ratios": [0, 2, 1], "kv_source_layer_ids": [1, 2], "index_source_layer_ids": [1, 2]}
    cfg = AttentionConfig.from_hf_config(config)
    assert cfg.arch == "v4.1" and cfg.compress_ratios == (0, 1, 2) and cfg.norm_eps == 1e-20
    assert AttentionConfig.from_hf_config({k: v for k, v in config.items() if "source" not in k}).arch == "v4"


def test_a_v41_fp8_checkpoint_loads_its_source_layers_strictly(tmp_path):
    """A synthetic V4.1 checkpoint (DeepSeek's names ``layers.N.attn.*``, FP8 in 32 x 32
    blocks with ue8m0 scales) loads every layer strictly: the kv + index sources of both
    ratios, and a reader, which has no compressor or indexer weights."""
    import json

    from safetensors.torch import save_file

    from graphs.checkpoint import layer_prefix
    from graphs.fp8 import to_fp8_state_dict

    config = {"hidden_size": 64, "num_attention_heads": 4, "q_lora_rank": 32, "o_lora_rank": 128, "o_groups": 2,
              "sliding_window": 8, "index_n_heads": 2, "index_head_dim": 128, "index_topk": 8, "rms_norm_eps": 1e-20,
              "compress_ratios": [0, 2, 2, 1], "kv_source_layer_ids": [1, 3], "index_source_layer_ids": [1, 3],
              "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [32, 32]}}
    cfg = AttentionConfig.from_hf_config(config)
    cache = CacheConfig(2, 4, 64, 4)
    plan = LayerPlan.from_config(config)
    tensors, sources = {}, {}
    for layer_id, ratio in ((0, 0), (1, 2), (2, 2), (3, 1)):
        src = DSV41Attention(cfg, cache, ratio, seed=layer_id, plan=plan, layer_id=layer_id)
        sd = to_fp8_state_dict(src.state_dict(), "deepseek", 32)
        tensors.update({layer_prefix(layer_id, "deepseek") + k: v.contiguous() for k, v in sd.items()})
        sources[layer_id] = sd
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config))
    for layer_id, want in sources.items():
        layer = DSV41Attention.from_checkpoint(tmp_path, layer_id, cache)
        assert layer.cfg.arch == "v4.1" and layer.weights == "fp8" and layer.wq_a.scale.dtype == torch.float8_e8m0fnu
        got = layer.state_dict()
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k].float(), want[k].float()) for k in want)
    assert not any(k.startswith(("compressor.", "indexer.")) for k in sources[2])
    assert sum(k.startswith("indexer.wk") for sd in sources.values() for k in sd) == 2  # the kv sources' keys
