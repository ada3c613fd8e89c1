"""A DeepSeek-V4.1 stack (``graphs.DSV41Stack``) on the CPU: 8 layers with every role of
V4.1's plan (a sliding-only layer; kv + index sources of ratios 2 and 1, the second the
candidate source; readers of each; an index source that picks inside the candidate blocks
and does not compress, and its reader), served over a mixed workload (prefill chunks,
decode, drafts with rejections, reused rows).

Checked against ``graphs.naive.naive_stack``, an oracle that runs each layer unshared from
each request's full history and feeds every layer its sources' entries, keys, ids and
candidate blocks explicitly: the final residual within the oracle's tolerance (2e-2 of max
|h|, bf16 caches) given the stack's own picks, every index layer's picks and the candidate
blocks a valid top-k of the oracle's scores. A negative control wires one reader to the
wrong index source and must fail.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from graphs import TINY_V41, CacheConfig, DSV41Stack, LayerPlan, Shared, StepRunner
from graphs.fp8 import Fp8Linear
from graphs.naive import stack_verdict
from graphs.schedule import hidden_states, mixed_workload, run_workload

pytestmark = pytest.mark.quick  # the quick subset: python -m pytest -m quick

# 0 SWA | 1 kv+index r2 | 2, 3 readers r2 | 4 kv+index r1, candidate source | 5 reader r1 |
# 6 index source inside the candidates (no compressor) | 7 reader of 4's cache and 6's ids
PLAN = LayerPlan.from_lists([0, 2, 2, 2, 1, 1, 1, 1], kv_sources=[1, 4], index_sources=[1, 4, 6],
                            candidate_source=4, candidate_topk_blocks=3, candidate_block_size=4)
CACHE = CacheConfig(4, 16, 64, 4)
INDEX_LAYERS = (1, 4, 6)


def workload():
    return mixed_workload([30, 9, 41, 4], 6, chunk=7, max_tokens=16, rows=3, arrive_every=2, drafts=2)  # a row reused


def serve(stack: DSV41Stack, compile: bool = False, xs=None, inputs: bool = False):
    runner = StepRunner(stack, (1, 4, 16), compile=compile)
    work = workload()
    xs = hidden_states(work, TINY_V41.dim, seed=1) if xs is None else xs
    watch = {l: stack.layers[l].topk_ids for l in INDEX_LAYERS}
    watch["candidates"] = stack.layers[PLAN.candidate_source].candidate_ids
    if inputs:
        watch["inputs"] = stack.recorded_inputs()
    with torch.no_grad():
        outs, seen = run_workload(runner.step, work, xs, watch=watch, release=runner.release)
    out = xs, outs, {l: seen[l] for l in INDEX_LAYERS}, seen["candidates"]
    return (*out, seen["inputs"]) if inputs else out


def test_the_stack_owns_each_shared_part_once():
    stack = DSV41Stack(TINY_V41, CACHE, PLAN)
    kinds = {i: (l.compressor is not None, l.indexer is not None, l.cmp_cache is not None, l.topk_ids is not None)
             for i, l in stack.layers.items()}
    assert kinds == {0: (False, False, False, False), 1: (True, True, True, True), 2: (False, False, False, False),
                     3: (False, False, False, False), 4: (True, True, True, True), 5: (False, False, False, False),
                     6: (False, True, False, True), 7: (False, False, False, False)}
    assert stack.layers[6].indexer.index_cache is None and stack.layers[6].indexer.wk is None
    assert stack.layers[4].candidate_ids.shape == (CACHE.max_tokens, 3)
    ptrs = [b.data_ptr() for b in stack.buffers()]
    assert len(ptrs) == len(set(ptrs))  # no cache is held twice
    from graphs.memory import stack_buffer_bytes

    want = stack_buffer_bytes(TINY_V41, CACHE, PLAN)  # the documented formula, per layer and in all
    got = {i: sum(b.numel() * b.element_size() for b in l.buffers()) for i, l in stack.layers.items()}
    assert want["per_layer"] == got and want["total"] == sum(got.values())


def test_stack_equals_the_layer_by_layer_oracle():
    stack = DSV41Stack(TINY_V41, CACHE, PLAN)
    xs, outs, topk, candidates = serve(stack)
    verdict = stack_verdict(stack, xs, outs, topk, candidates)
    assert verdict.passed, verdict.verdict()
    # the candidate blocks bind: some token of layer 6 had more visible entries than they hold
    assert max(x.shape[0] for x in xs) > 3 * 4 + TINY_V41.index_topk


def test_every_layer_equals_the_oracle_on_its_own_inputs():
    """With the stack's recorded residual inputs, each layer is judged alone (what a deep
    stack needs: the layers' rounding adds up in the residual); the miswired reader fails."""
    stack = DSV41Stack(TINY_V41, CACHE, PLAN, record_inputs=True)
    xs, outs, topk, candidates, inputs = serve(stack, inputs=True)
    verdict = stack_verdict(stack, xs, outs, topk, candidates, inputs)
    assert verdict.passed and set(verdict.layer_rel_diff) == set(range(8)), verdict.verdict()
    right = stack.shared
    stack.shared = lambda layer, T: (right(layer, T)._replace(topk=stack.layers[4].topk_ids[:T])
                                     if layer.layer_id == 7 else right(layer, T))
    stack.reset_cache()
    xs, outs, topk, candidates, inputs = serve(stack, inputs=True)
    verdict = stack_verdict(stack, xs, outs, topk, candidates, inputs)
    assert not verdict.passed and max(verdict.layer_rel_diff, key=verdict.layer_rel_diff.get) == 7


def test_an_fp8_stack_equals_the_oracle_with_its_dequantized_weights():
    """V4.1's FP8 weights (32 x 32 blocks; the grouped wo_a in whole 128-row blocks): steps
    of at most the layout's weight_only_tokens take the tokens in bf16, so the oracle with the
    dequantized weights is the stack's function, layer by layer."""
    cfg = replace(TINY_V41, o_lora_rank=128, weight_block=32)
    stack = DSV41Stack(cfg, CACHE, PLAN, record_inputs=True, weights="fp8")
    assert isinstance(stack.layers[1].wq_b, Fp8Linear)
    xs, outs, topk, candidates, inputs = serve(stack, inputs=True)
    verdict = stack_verdict(stack, xs, outs, topk, candidates, inputs)
    assert verdict.passed, verdict.verdict()


def test_a_reader_wired_to_the_wrong_index_source_fails_the_oracle():
    stack = DSV41Stack(TINY_V41, CACHE, PLAN)
    right = stack.shared

    def wrong(layer, T):
        shared = right(layer, T)
        return shared._replace(topk=stack.layers[4].topk_ids[:T]) if layer.layer_id == 7 else shared

    stack.shared = wrong
    xs, outs, topk, candidates = serve(stack)
    assert not stack_verdict(stack, xs, outs, topk, candidates).passed


def test_a_reader_equals_its_layer_fed_the_sources_parts_explicitly():
    """Layer 7 inside the stack, bit for bit, against a copy of it called alone with layer
    4's compressed cache and layer 6's ids of the same step passed by hand."""
    stack = DSV41Stack(TINY_V41, CACHE, PLAN)
    seen = {}
    stack.blocks[7].attn.register_forward_hook(lambda m, args, out: seen.update(x=args[0], inp=args[1], out=out))
    serve(stack)
    alone = copy.deepcopy(stack.layers[7])
    T = seen["x"].shape[0]
    shared = Shared(cmp_cache=stack.layers[4].cmp_cache, topk=stack.layers[6].topk_ids[:T])
    with torch.no_grad():
        assert torch.equal(alone(seen["x"], seen["inp"], shared), seen["out"])


def test_compiled_stack_is_one_graph_that_passes_the_oracle():
    eager = DSV41Stack(TINY_V41, CACHE, PLAN)
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    xs, want, want_ids, _ = serve(eager)
    _, got, got_ids, got_cand = serve(compiled, compile=True, xs=xs)
    counters = torch._dynamo.utils.counters
    assert sum(counters["graph_break"].values()) == 0
    assert counters["stats"]["unique_graphs"] == 1
    verdict = stack_verdict(compiled, xs, got, got_ids, got_cand)
    assert verdict.passed, verdict.verdict()
    agree = torch.cat([torch.stack([(got_ids[l][q].sort(1).values == want_ids[l][q].sort(1).values).all(1)
                                    for l in INDEX_LAYERS]).all(0) for q in range(len(xs))])
    # fusions round differently, so near-tied picks can differ, and a token's residual then
    # differs at every later layer and token: each run is held to the oracle given its picks
    print(f"compiled picks the eager ids at every index layer for {agree.float().mean():.0%} of tokens")


def test_a_slice_keeps_its_sources():
    with pytest.raises(ValueError, match="layer 7 reads layer 6"):
        DSV41Stack(TINY_V41, CACHE, PLAN, layer_ids=[0, 1, 4, 7])
    stack = DSV41Stack(TINY_V41, CACHE, PLAN, layer_ids=[0, 4, 6, 7])
    xs, outs, topk, candidates = serve_slice(stack)
    assert stack_verdict(stack, xs, outs, topk, candidates).passed


def serve_slice(stack):
    runner = StepRunner(stack, (1, 4, 16), compile=False)
    work = workload()
    xs = hidden_states(work, TINY_V41.dim, seed=3)
    watch = {l: stack.layers[l].topk_ids for l in (4, 6)}
    watch["candidates"] = stack.layers[4].candidate_ids
    with torch.no_grad():
        outs, seen = run_workload(runner.step, work, xs, watch=watch, release=runner.release)
    return xs, outs, {l: seen[l] for l in (4, 6)}, seen["candidates"]


def test_a_v41_checkpoint_loads_into_the_stack_strictly(tmp_path):
    """A synthetic V4.1 checkpoint (DeepSeek's names, FP8 in 32 x 32 blocks with ue8m0
    scales, ``layers.N.attn_norm``) loads layer by layer; a missing norm is named."""
    import json

    from safetensors.torch import save_file

    from graphs.checkpoint import layer_prefix
    from graphs.fp8 import to_fp8_state_dict

    config = {"hidden_size": 64, "num_attention_heads": 4, "q_lora_rank": 32, "o_lora_rank": 128, "o_groups": 2,
              "sliding_window": 8, "index_n_heads": 2, "index_head_dim": 128, "index_topk": 8, "rms_norm_eps": 1e-20,
              "compress_ratios": [0, 2, 2, 1, 1], "kv_source_layer_ids": [1, 3], "index_source_layer_ids": [1, 3, 4],
              "candidate_source_layer_id": 3, "candidate_topk_blocks": 2, "candidate_block_size": 4,
              "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [32, 32]}}
    from graphs import AttentionConfig

    cfg, plan = AttentionConfig.from_hf_config(config), LayerPlan.from_config(config)
    src = DSV41Stack(cfg, CACHE, plan, seed=5)
    tensors = {}
    for i, block in zip(src.layer_ids, src.blocks):
        sd = to_fp8_state_dict(block.attn.state_dict(), "deepseek", 32)
        tensors.update({layer_prefix(i, "deepseek") + k: v.contiguous() for k, v in sd.items()})
        tensors[f"layers.{i}.attn_norm.weight"] = torch.full((64,), 1.0 + i)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config))
    stack = DSV41Stack.from_checkpoint(tmp_path, CACHE)
    assert stack.plan == plan and stack.layers[4].uses_candidates and stack.layers[3].candidate_ids is not None
    for i, block in zip(stack.layer_ids, stack.blocks):
        assert block.attn.weights == "fp8" and torch.equal(block.attn_norm.weight, torch.full((64,), 1.0 + i))
    del tensors["layers.2.attn_norm.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(KeyError, match="layers.2.attn_norm.weight"):
        DSV41Stack.from_checkpoint(tmp_path, CACHE)


def test_v41_cache_formats_hold_890_bytes_per_token():
    """DeepSeek-V4.1's formats (fp8_dsv41 window, fp4_dsv41 compressed entries, fp4 index
    keys): the tiny stack's buffers are the formula's, and by it the V4.1-Flash stack holds
    890 bytes of global cache per token of context (3 ratio-2 sources at (288 + 68) / 2,
    layer 20's ratio 1 at 288 + 68), the window's pool the same at any context."""
    from graphs import V41_FLASH, V41_FLASH_PLAN
    from graphs.memory import stack_buffer_bytes

    v41 = dict(kv_format="fp8_dsv41", cmp_kv_format="fp4_dsv41", index_format="fp4")
    stack = DSV41Stack(TINY_V41, replace(CACHE, **v41), PLAN)
    want = stack_buffer_bytes(TINY_V41, replace(CACHE, **v41), PLAN)
    assert want["per_layer"] == {i: sum(b.numel() * b.element_size() for b in l.buffers()) for i, l in stack.layers.items()}
    assert stack.layers[1].cmp_cache.shape[-1] == 288 and stack.layers[1].indexer.index_cache.shape[-1] == 68
    a, b = (stack_buffer_bytes(V41_FLASH, CacheConfig(1, 64, seq, 64, **v41), V41_FLASH_PLAN) for seq in (1 << 16, 1 << 17))
    assert (b["cmp_cache"] + b["index_cache"] - a["cmp_cache"] - a["index_cache"]) / (1 << 16) == 890
    assert a["swa_cache"] == b["swa_cache"]
