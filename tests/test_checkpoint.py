"""DeepSeek-V4 checkpoints by their real names (``graphs.checkpoint``): a synthetic
checkpoint folder (``config.json`` + ``*.safetensors``) in DeepSeek's naming and in Hugging
Face's, bf16 and FP8 at both block layouts, loads strictly into the layer it describes;
every missing, unexpected, misshapen or mistyped key is named; ``config.json`` in either
spelling gives the layer's config, and other FP8 layouts are refused."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import save_file

from graphs import AttentionConfig, CacheConfig, DSV41Attention, TINY
from graphs.checkpoint import hf_name, layer_prefix, layer_ratios, load_attention_weights
from graphs.fp8 import to_fp8_state_dict

pytestmark = pytest.mark.quick  # the quick subset: python -m pytest -m quick

CACHE = CacheConfig(2, 4, 256, 4)
RATIOS = [0, 4, 128, 4, 2]  # per layer of the synthetic model


def hf_config_json(block=None) -> dict:
    """A V4-Flash-shaped ``config.json`` in Hugging Face's spelling, at TINY's dims."""
    c = {"model_type": "deepseek_v4", "hidden_size": 64, "num_attention_heads": 4, "head_dim": 512,
         "qk_rope_head_dim": 64, "q_lora_rank": 32, "o_lora_rank": 128, "o_groups": 2, "sliding_window": 8,
         "index_n_heads": 2, "index_head_dim": 128, "index_topk": 8, "compress_ratios": RATIOS,
         "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
         "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                          "beta_fast": 32, "beta_slow": 1}}
    if block:
        c["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [block, block]}
    return c


def deepseek_config_json() -> dict:
    """The same model in DeepSeek's ``inference/config.json`` spelling."""
    return {"dim": 64, "n_heads": 4, "q_lora_rank": 32, "o_lora_rank": 128, "o_groups": 2, "window_size": 8,
            "index_n_heads": 2, "index_head_dim": 128, "index_topk": 8, "compress_ratios": RATIOS,
            "norm_eps": 1e-6, "rope_theta": 10000.0, "compress_rope_theta": 160000.0, "rope_factor": 16,
            "original_seq_len": 65536, "beta_fast": 32, "beta_slow": 1}


def test_both_spellings_give_the_same_config():
    hf = AttentionConfig.from_hf_config(hf_config_json(), name="m")
    ds = AttentionConfig.from_hf_config(deepseek_config_json(), name="m")
    assert hf == ds
    assert hf.compress_ratios == (0, 2, 4, 128) and hf.overlap_ratios == (4,) and hf.dense_ratios == (128,)
    assert (hf.dim, hf.window_size, hf.rope_factor, hf.original_seq_len, hf.weight_block) == (64, 8, 16.0, 65536, 128)
    assert AttentionConfig.from_hf_config(hf_config_json(32)).weight_block == 32


def test_config_errors_name_what_is_wrong():
    with pytest.raises(ValueError, match="lacks hidden_size / dim, index_topk"):
        AttentionConfig.from_hf_config({k: v for k, v in hf_config_json().items() if k not in ("hidden_size", "index_topk")})
    with pytest.raises(ValueError, match="128 x 128 with fp32 scales .* or 32 x 32 with ue8m0 .* got block 64"):
        AttentionConfig.from_hf_config(hf_config_json(64))
    bad = {**hf_config_json(), "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 64]}}
    with pytest.raises(ValueError, match="must be square"):
        AttentionConfig.from_hf_config(bad)
    with pytest.raises(ValueError, match="neither compress_ratios nor layer_types"):
        layer_ratios({"hidden_size": 64})


def write_checkpoint(folder, naming: str, block=None, layers=(1, 2)) -> dict[int, DSV41Attention]:
    """A checkpoint of ``layers`` (random layers of the config, in ``naming``), split over two
    safetensors shards, beside its ``config.json``; returns the source layers."""
    cfg = AttentionConfig.from_hf_config(hf_config_json(block))
    tensors, sources = {}, {}
    for layer_id in layers:
        src = DSV41Attention(cfg, CACHE, RATIOS[layer_id], seed=layer_id)
        sd = to_fp8_state_dict(src.state_dict(), "deepseek", block) if block else src.state_dict()
        for k, v in sd.items():
            tensors[layer_prefix(layer_id, naming) + (k if naming == "deepseek" else hf_name(k))] = v.contiguous()
        sources[layer_id] = src
    tensors["embed.weight"] = torch.zeros(4, 64)  # not attention: never read
    keys = sorted(tensors)
    save_file({k: tensors[k] for k in keys[::2]}, str(folder / "model-00001-of-00002.safetensors"))
    save_file({k: tensors[k] for k in keys[1::2]}, str(folder / "model-00002-of-00002.safetensors"))
    (folder / "config.json").write_text(json.dumps(hf_config_json(block)))
    return sources


@pytest.mark.parametrize("block", [None, 128, 32], ids=["bf16", "fp8-128", "fp8-32"])
@pytest.mark.parametrize("naming", ["deepseek", "hf"])
def test_a_checkpoint_folder_loads_strictly_by_layer(tmp_path, naming, block):
    sources = write_checkpoint(tmp_path, naming, block)
    for layer_id, src in sources.items():
        layer = DSV41Attention.from_checkpoint(tmp_path, layer_id, CACHE)
        assert layer.compress_ratio == RATIOS[layer_id] and layer.weights == ("fp8" if block else "bf16")
        want = to_fp8_state_dict(src.state_dict(), "deepseek", block) if block else src.state_dict()
        got = layer.state_dict()
        assert got.keys() == want.keys()
        for k in want:
            assert got[k].dtype == want[k].dtype and torch.equal(got[k].float(), want[k].float()), k
    fp8_scale = {128: torch.float32, 32: torch.float8_e8m0fnu}
    if block:
        assert layer.wq_a.scale.dtype == fp8_scale[block] and layer.wq_a.scale.shape == (-(-32 // block), -(-64 // block))


def test_missing_unexpected_and_misshapen_keys_are_named():
    cfg = AttentionConfig.from_hf_config(hf_config_json())
    src = DSV41Attention(cfg, CACHE, 4).state_dict()
    ckpt = {layer_prefix(3, "deepseek") + k: v for k, v in src.items()}
    del ckpt["layers.3.attn.indexer.wq_b.weight"]
    ckpt["layers.3.attn.wq_a.weight"] = torch.zeros(32, 65)
    ckpt["layers.3.attn.wq_a.scale"] = torch.ones(1, 1)
    layer = DSV41Attention(cfg, CACHE, 4)
    with pytest.raises(ValueError) as e:
        load_attention_weights(layer, ckpt, 3)
    msg = str(e.value)
    assert "missing: layers.3.attn.indexer.wq_b.weight" in msg and "unexpected: layers.3.attn.wq_a.scale" in msg
    assert "layers.3.attn.wq_a.weight: shape [32, 65], the config gives [32, 64]" in msg
    with pytest.raises(ValueError, match="no attention keys of layer 5"):
        load_attention_weights(layer, ckpt, 5)
    with pytest.raises(ValueError, match="naming must be one of"):
        load_attention_weights(layer, ckpt, 3, naming="vllm")


def test_an_fp8_checkpoint_into_a_bf16_layer_or_the_other_layout_is_refused():
    cfg = AttentionConfig.from_hf_config(hf_config_json())
    sd = to_fp8_state_dict(DSV41Attention(cfg, CACHE, 2).state_dict(), "deepseek", 32)
    ckpt = {layer_prefix(0, "deepseek") + k: v for k, v in sd.items()}
    with pytest.raises(ValueError, match="wq_a.weight: dtype torch.float8_e4m3fn, the layer holds torch.bfloat16 "
                                         "\\(an FP8 checkpoint: build the layer with weights='fp8'"):
        load_attention_weights(DSV41Attention(replace(cfg, weight_block=32), CACHE, 2), ckpt, 0)
    with pytest.raises(ValueError, match="wq_a.scale: shape \\[1, 2\\], the config gives \\[1, 1\\]"):
        load_attention_weights(DSV41Attention(cfg, CACHE, 2, weights="fp8"), ckpt, 0)  # 128-blocks expected
    load_attention_weights(DSV41Attention(replace(cfg, weight_block=32), CACHE, 2, weights="fp8"), ckpt, 0)


def test_from_checkpoint_refuses_a_layer_the_config_does_not_have(tmp_path):
    write_checkpoint(tmp_path, "deepseek")
    with pytest.raises(ValueError, match="layer_id must be in 0..4"):
        DSV41Attention.from_checkpoint(tmp_path, 7, CACHE)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        DSV41Attention.from_checkpoint(tmp_path / "nowhere", 1, CACHE)


def test_hf_names_follow_transformers_conversion_mapping():
    layer = DSV41Attention(replace(TINY, o_lora_rank=128), CacheConfig(2, 4, 32, 4), 4, weights="fp8")
    names = {k: hf_name(k) for k in layer.state_dict()}
    assert names["attn_sink"] == "sinks" and names["q_norm.weight"] == "q_a_norm.weight"
    assert names["wq_b.scale"] == "q_b_proj.weight_scale_inv" and names["wo_a.weight"] == "o_a_proj.weight"
    assert names["compressor.ape"] == "compressor.position_bias"
    assert names["compressor.norm.weight"] == "compressor.kv_norm.weight"
    assert names["indexer.compressor.wgate.weight"] == "compressor.indexer.gate_proj.weight"
    assert names["indexer.wq_b.weight"] == "compressor.indexer.q_b_proj.weight"
    assert names["indexer.weights_proj.weight"] == "compressor.indexer.scorer.weights_proj.weight"
    assert len(set(names.values())) == len(names)
