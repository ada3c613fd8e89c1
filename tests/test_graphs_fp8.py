"""DeepSeek FP8 checkpoints in the attention layer (CPU): a synthetic state dict in each
naming loads strictly, the FP8 layer equals the bf16 layer with the dequantized weights
within the FP8-activation tolerance over a mixed multi-step workload, and compiled equals
eager.

Both weight layouts run: V4's 128 x 128 blocks with fp32 scales and V4.1's 32 x 32 blocks
with ue8m0 scales (``AttentionConfig.weight_block``).

Tolerance: the FP8 layer rounds the input of each of its five FP8 GEMMs on a token's path
(``wq_a``, ``wq_b``, ``wkv``, ``wo_a``, ``wo_b``; and the indexer's ``wq_b``) to e4m3 per block
(up to 2**-4 relative each, 2**-3 with power-of-two scales), so its outputs differ from the dequantized bf16
layer's by up to 15 % of the largest |y| (measured 4-6 %). With an indexer, the FP8
query projection moves near-tied index scores, so a token may pick another entry; those
tokens attend other rows and are left out (at least 80 % must agree; measured 92-100 %).
Compiled vs eager of the FP8 layer 5e-2 (measured 3.7e-2: an ulp of bf16 difference
before a quantization can move an e4m3 step).
"""

from dataclasses import replace

import pytest
import torch

from graphs import TINY, CacheConfig, DSV41Attention, StepRunner
from graphs.bench import pick_matched
from graphs.fp8 import FP8_LINEARS, FP8_WEIGHTS_REL_TOL as FP8_TOL, dequantized_state_dict, to_fp8_state_dict
from graphs.schedule import hidden_states, mixed_workload, run_workload

pytestmark = pytest.mark.quick  # the quick subset: python -m pytest -m quick

CFG = replace(TINY, o_lora_rank=128)  # the grouped wo_a's rows in whole 128-row scale blocks


def cache():
    return CacheConfig(4, 12, 64, 4, max_rewind=3)


def serve(layer, compile=False, picks=False):
    runner = StepRunner(layer, (1, 2, 4, 8), compile=compile)
    work = mixed_workload([20, 5, 13, 9], 8, chunk=5, max_tokens=12, rows=3, arrive_every=2, drafts=2)
    xs = hidden_states(work, CFG.dim, seed=1)
    with torch.no_grad():
        outs, ids = run_workload(runner.step, work, xs, release=runner.release,
                                 watch=layer.topk_ids if picks else None)
    return (outs, ids) if picks else outs


def rel(got, want):
    return max(((g.float() - w.float()).abs().max() / w.float().abs().max()).item() for g, w in zip(got, want))


@pytest.mark.parametrize("block, scale_dtype", [(128, torch.float32), (32, torch.float8_e8m0fnu)], ids=["128", "32"])
@pytest.mark.parametrize("naming, scale_key", [("deepseek", "scale"), ("hf", "weight_scale_inv")])
def test_an_fp8_state_dict_in_either_naming_loads_strictly(naming, scale_key, block, scale_dtype):
    cfg = replace(CFG, weight_block=block)
    bf16 = DSV41Attention(cfg, cache(), 2, seed=3)
    sd = to_fp8_state_dict(bf16.state_dict(), naming, block)
    for name in FP8_LINEARS:
        assert sd[f"{name}.weight"].dtype == torch.float8_e4m3fn and sd[f"{name}.{scale_key}"].dtype == scale_dtype
    assert sd["compressor.wkv.weight"].dtype == torch.float32 and sd["indexer.weights_proj.weight"].dtype == torch.bfloat16
    fp8 = DSV41Attention(cfg, cache(), 2, weights="fp8")
    fp8.load_state_dict(sd, strict=True)
    seeded = DSV41Attention(cfg, cache(), 2, weights="fp8", seed=3)  # the same layer as the converted one
    assert all(torch.equal(a.float(), b.float()) for a, b in zip(fp8.state_dict().values(), seeded.state_dict().values()))
    with pytest.raises(RuntimeError, match="Unexpected key"):
        DSV41Attention(cfg, cache(), 2).load_state_dict(sd, strict=True)  # a bf16 layer refuses the scales


@pytest.mark.parametrize("ratio, block", [(0, 128), (1, 128), (2, 128), (4, 128), (128, 128), (1, 32), (2, 32)])
def test_the_fp8_layer_equals_the_bf16_layer_with_dequantized_weights(ratio, block):
    c = replace(cache(), max_seq_len=256) if ratio == 128 else cache()
    cfg = replace(CFG, weight_block=block)
    fp8 = DSV41Attention(cfg, c, ratio, weights="fp8", seed=4)
    bf16 = DSV41Attention(cfg, c, ratio)
    bf16.load_state_dict(dequantized_state_dict(fp8.state_dict()), strict=True)
    (got, got_ids), (want, want_ids) = serve(fp8, picks=True), serve(bf16, picks=True)
    if fp8.indexer is None:
        err = rel(got, want)
        assert err < FP8_TOL, err
    else:  # the indexer's FP8 query projection moves near-tied scores
        agree = pick_matched(got, want, got_ids, want_ids, tolerance=FP8_TOL, min_share=0.8)
        assert agree.passed, agree.verdict("fp8 vs bf16")


def test_compiled_fp8_layer_equals_eager_with_no_graph_break():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    got, got_ids = serve(DSV41Attention(CFG, cache(), 2, weights="fp8", seed=4), compile=True, picks=True)
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    want, want_ids = serve(DSV41Attention(CFG, cache(), 2, weights="fp8", seed=4), picks=True)
    # Inductor's fused fp32 math rounds the index scores otherwise: a near-tied pick may flip
    agree = pick_matched(got, want, got_ids, want_ids, tolerance=5e-2, min_share=0.8)
    assert agree.passed, agree.verdict("compiled vs eager")


def test_fp8_weights_need_whole_scale_blocks_per_group():
    with pytest.raises(ValueError, match="o_lora_rank \\(32\\) to be a multiple of 128"):
        DSV41Attention(TINY, cache(), 2, weights="fp8")  # o_lora_rank 32
    with pytest.raises(ValueError, match="FP8 weight blocks must be 128 x 128 .* or 32 x 32"):
        replace(CFG, weight_block=64)
    with pytest.raises(ValueError, match="weights must be 'bf16' or 'fp8'"):
        DSV41Attention(CFG, cache(), 2, weights="int8")


@pytest.mark.gpu
def test_fp8_flash_layer_captured_on_the_gpu_equals_the_dequantized_bf16_layer():
    """V4.1-Flash (32 x 32 ue8m0 blocks), ratio 2, on the GPU kernels: one Dynamo graph with no break, one CUDA
    graph per bucket, and a mixed workload replayed (no host sync) equal to the eager bf16
    layer with the dequantized weights within the FP8 tolerance."""
    from graphs.bench import flash_layer

    from torch._dynamo.utils import counters

    device = torch.device("cuda")
    fp8 = flash_layer(2, device, weights="fp8", max_requests=16, max_seq_len=4096)
    bf16 = flash_layer(2, device, max_requests=16, max_seq_len=4096)
    bf16.load_state_dict(dequantized_state_dict(fp8.state_dict()), strict=True)
    torch._dynamo.reset()
    counters.clear()
    runner = StepRunner(fp8, (1, 2, 4, 8, 16, 64, 256, 512))
    runner.capture()
    assert sum(counters["graph_break"].values()) == 0 and counters["stats"]["unique_graphs"] == 1
    assert sorted(runner.graphs) == [1, 2, 4, 8, 16, 64, 256, 512]
    twin = StepRunner(bf16, (1, 2, 4, 8, 16, 64, 256, 512), compile=False, cuda_graphs=False)
    work = mixed_workload([300, 40, 700, 5, 130, 1000], 24, chunk=256, max_tokens=512, rows=6, arrive_every=2, drafts=3)
    xs = hidden_states(work, fp8.cfg.dim, seed=2, device=device)
    with torch.no_grad():
        got, got_ids = run_workload(runner.step, work, xs, watch=fp8.topk_ids, release=runner.release,
                                    sync_debug="error")
        want, want_ids = run_workload(twin.step, work, xs, watch=bf16.topk_ids, release=twin.release)
    agree = pick_matched(got, want, got_ids, want_ids, tolerance=FP8_TOL, min_share=0.8)
    assert agree.passed, agree.verdict("fp8 replayed vs dequantized bf16 eager")
