"""The V4 layer against an implementation nobody here wrote: Hugging Face transformers'
``DeepseekV4Attention`` (``transformers.models.deepseek_v4``), on the same weights.

One small V4-shaped layer per type, the peer built from a ``DeepseekV4Config`` (its
``to_dict()`` read by :meth:`AttentionConfig.from_hf_config`), its random weights copied
into :class:`DSV41Attention` through :func:`graphs.checkpoint.load_attention_weights`
under their Hugging Face names: sliding-only; CSA (ratio 4, overlapping pools, 16 index
heads, a top-k of 8 far below its 520 entries); HCA (ratio 128, 16 entries). Both sides
prefill a ~2K-token prompt in chunks of 255 and decode 32 tokens one by one; the peer runs
in fp32 with its own caches, our layer on its paged caches (bf16 activations and rows, fp8
or bf16 index keys).

* **Top-k**: every token's picks are a valid top-k of the peer's index scores (the
  ``DeepseekV4IndexerScorer`` output): the right count of distinct visible ids, and no
  left-out entry above a picked one by more than ``SCORE_ROUNDING[index_format]`` of the
  scores' magnitude ``sum_h |w_h| |q_h| |k_c| / sqrt(D)`` (the rounding of q and keys in
  the index-key cache: 0.15 for e4m3, 2**-6 for bf16). Near-tied entries make either
  choice right, and the two sides' picks differ there (shares measured in
  ``docs/graphs.md``).
* **Output**: the peer's attention is then run on the entries ours picked (its indexer's
  result replaced by ours), so every token's output is compared, within :data:`REL_TOL`
  of the peer's largest |y|.

A negative control puts DeepSeek-V3's RoPE rule (YaRN only past ``original_seq_len``) in
our layer's tables: the comparison must fail.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch
from transformers import DeepseekV4Config, DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4Attention, DeepseekV4CSACache, DeepseekV4HCACache, DeepseekV4RotaryEmbedding)

from graphs import AttentionConfig, CacheConfig, DSV41Attention, StepRunner
from graphs.checkpoint import layer_prefix, load_attention_weights
from graphs.naive import SCORE_ROUNDING
from graphs.rope import layer_inv_freq

pytestmark = pytest.mark.quick  # the quick subset: python -m pytest -m quick

REL_TOL = 2e-2
TYPES = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
RATIO = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
BF16_PARAMS = ("q_a_proj.weight", "q_b_proj.weight", "kv_proj.weight", "o_a_proj.weight", "o_b_proj.weight",
               "indexer.q_b_proj.weight", "weights_proj.weight")


def hf_config() -> DeepseekV4Config:
    """DeepSeek-V4's attention at small dims (head 512 = 448 + 64 RoPE, YaRN on the
    compressed layers as V4-Flash ships it, a context far below its 64K original)."""
    cfg = DeepseekV4Config(
        vocab_size=32, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, head_dim=512, q_lora_rank=32,
        o_lora_rank=32, o_groups=2, sliding_window=8, index_n_heads=16, index_head_dim=128, index_topk=8,
        layer_types=TYPES, mlp_layer_types=["moe"] * 3, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, max_position_embeddings=1 << 20, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1})
    cfg._attn_implementation = "eager"
    return cfg


def peer_layer(cfg: DeepseekV4Config, layer_id: int, seed: int) -> DeepseekV4Attention:
    """The peer with random weights: linears N(0, 1/in) (rounded to bf16, which our layer
    holds them in), norms 1 + N(0, 0.1^2), sinks and position biases N(0, 0.5^2)."""
    layer = DeepseekV4Attention(cfg, layer_id).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(layer.named_parameters()):
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith(("sinks", "position_bias")):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:
                w = torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5
                p.copy_(w.bfloat16().float() if name.endswith(BF16_PARAMS) else w)
    return layer


def peer_cache(cfg: DeepseekV4Config) -> DynamicCache:
    cache = DynamicCache()
    cache.layers = [DynamicSlidingWindowLayer(sliding_window=cfg.sliding_window), DeepseekV4CSACache(cfg),
                    DeepseekV4HCACache(cfg)]
    return cache


def window_mask(start: int, n: int, window: int) -> torch.Tensor:
    """``[1, 1, n, kept + n]`` additive mask of a chunk at positions ``start ..``: the peer's
    sliding cache holds the ``window - 1`` positions before it, then the chunk."""
    kept = min(start, window - 1)
    q = torch.arange(start, start + n).unsqueeze(1)
    k = torch.arange(start - kept, start + n).unsqueeze(0)
    visible = (k <= q) & (k > q - window)
    return torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))[None, None]


def run_peer(layer: DeepseekV4Attention, cfg: DeepseekV4Config, x: torch.Tensor, chunks: list[int],
             forced_ids: Optional[torch.Tensor] = None):
    """Outputs ``[S, dim]`` and, with an indexer, each token's index scores ``[S, E]`` and
    their magnitudes (``-inf`` / ``0`` past the entries that exist when the token runs).
    ``forced_ids [S, K]`` (``-1`` padded) replace the peer indexer's picks, so its attention
    reads the entries ours chose."""
    rotary, cache = DeepseekV4RotaryEmbedding(cfg), peer_cache(cfg)
    seen, at = {}, [0, 0]
    indexer = getattr(layer.compressor, "indexer", None)
    hooks = []
    if indexer is not None:
        def keep(module, args, out):
            q, keys, hidden = args
            w = (module.weights_proj(hidden).float() * module.weights_scaling).abs()
            mag = (w.unsqueeze(-1) * q.float().norm(dim=-1).unsqueeze(-1) * keys.float().norm(dim=-1)[:, None, None]
                   ).sum(dim=2) * module.softmax_scale
            seen["scores"], seen["magnitude"] = out[0], mag[0]
        hooks.append(indexer.scorer.register_forward_hook(keep))
        if forced_ids is not None:
            def force(module, args, out):
                start, n = at
                return forced_ids[start:start + n, : out.shape[-1]].unsqueeze(0).to(out.dtype)
            hooks.append(indexer.register_forward_hook(force))
    outs, scores, magnitude, start = [], [], [], 0
    for n in chunks:
        at[:] = start, n
        pos = torch.arange(start, start + n).unsqueeze(0)
        h = x[start:start + n].float().unsqueeze(0)
        emb = {t: rotary(h, pos, layer_type=t) for t in ("main", "compress")}
        with torch.no_grad():
            y, _ = layer(h, emb, pos, window_mask(start, n, cfg.sliding_window), past_key_values=cache)
        outs.append(y[0])
        if indexer is not None:
            scores.append(seen["scores"])
            magnitude.append(seen["magnitude"])
        start += n
    for h in hooks:
        h.remove()
    if indexer is None:
        return torch.cat(outs), None, None
    E = scores[-1].shape[-1]
    pad = lambda rows, v: torch.cat([torch.nn.functional.pad(r, (0, E - r.shape[-1]), value=v) for r in rows])  # noqa: E731
    return torch.cat(outs), pad(scores, float("-inf")), pad(magnitude, 0.0)


def run_ours(layer: DSV41Attention, x: torch.Tensor, chunks: list[int]):
    runner = StepRunner(layer, buckets=(1, max(chunks)), compile=False)
    outs, ids, start = [], [], 0
    for n in chunks:
        pos = torch.arange(start, start + n, dtype=torch.int32)
        with torch.no_grad():
            outs.append(runner.step(x[start:start + n], pos, torch.zeros(n, dtype=torch.int32)).float().clone())
        if layer.indexer is not None:
            ids.append(layer.topk_ids[:n].clone())
        start += n
    return torch.cat(outs), (torch.cat(ids) if ids else None)


def pick_errors(ids: torch.Tensor, scores: torch.Tensor, magnitude: torch.Tensor, ratio: int, topk: int,
                rounding: float) -> list[int]:
    """Positions whose picks are not a top-k of ``scores`` up to ``rounding * magnitude``."""
    bound = rounding * magnitude
    bad = []
    for p, row in enumerate(ids.tolist()):
        picked = [c for c in row if c >= 0]
        visible = (p + 1) // ratio
        left_out = sorted(set(range(visible)) - set(picked))
        ok = len(picked) == min(topk, visible) == len(set(picked)) and all(c < visible for c in picked)
        if ok and left_out and picked:
            ok = bool((scores[p, left_out] - bound[p, left_out]).max() <= (scores[p, picked] + bound[p, picked]).min())
        if not ok:
            bad.append(p)
    return bad


def compare(layer_type: str, prompt: list[int], decode: int, index_format: str = "fp8", ours_rope=None):
    """Run both layers on one request; returns (output error of max |y|, pick errors, share of
    tokens whose picks equal the peer's own)."""
    cfg = hf_config()
    layer_id = TYPES.index(layer_type)
    peer = peer_layer(cfg, layer_id, seed=layer_id)
    ours = DSV41Attention(AttentionConfig.from_hf_config(cfg.to_dict()),
                          CacheConfig(1, max(prompt), 4096, 16, index_format=index_format), RATIO[layer_type])
    ckpt = {layer_prefix(layer_id, "hf") + k: v for k, v in peer.state_dict().items()}
    assert load_attention_weights(ours, ckpt, layer_id) == "hf"
    if ours_rope is not None:
        ours.rope_cos.copy_(ours_rope[0])
        ours.rope_sin.copy_(ours_rope[1])
    chunks = prompt + [1] * decode
    x = torch.randn(sum(chunks), cfg.hidden_size, generator=torch.Generator().manual_seed(7)).bfloat16()
    got, ids = run_ours(ours, x, chunks)
    bad, same = [], 1.0
    if ids is not None:
        peer_ids = []
        hook = peer.compressor.indexer.register_forward_hook(lambda m, a, out: peer_ids.append(out[0]))
        _, scores, magnitude = run_peer(peer, cfg, x, chunks)
        hook.remove()
        bad = pick_errors(ids, scores, magnitude, RATIO[layer_type], ours.indexer.topk, SCORE_ROUNDING[index_format])
        theirs = [torch.nn.functional.pad(r, (0, ids.shape[1] - r.shape[1]), value=-1) for r in peer_ids]
        same = sum(set(a) - {-1} == set(b) - {-1} for a, b in zip(ids.tolist(), torch.cat(theirs).tolist())) / len(ids)
    want, _, _ = run_peer(peer, cfg, x, chunks, forced_ids=ids)
    err = ((got - want).abs().max() / want.abs().max()).item()
    return err, bad, same


# (layer type, prompt chunks, decoded tokens): past 2K tokens (where V3's RoPE rule was
# off by 4e-2); CSA holds 520 entries for a top-k of 8, HCA 16, the last closed while decoding
LONG = [255] * 8
CASES = [
    pytest.param("sliding_attention", [64, 64], 16, id="sliding"),
    pytest.param("compressed_sparse_attention", LONG, 32, id="csa-ratio4"),
    pytest.param("heavily_compressed_attention", LONG, 32, id="hca-ratio128"),
]


@pytest.mark.parametrize("layer_type, prompt, decode", CASES)
def test_the_layer_equals_transformers_deepseek_v4_attention(layer_type, prompt, decode):
    """Outputs equal the peer's when the peer attends the entries ours picked, and ours
    picked a top-k of the peer's own index scores (fp8 index keys: the layer's default)."""
    err, bad, _ = compare(layer_type, prompt, decode)
    assert err <= REL_TOL, f"{layer_type}: {err:.2e} of max |y|"
    assert not bad, f"positions {bad[:10]} pick entries the peer's scores rule out"


def test_with_bf16_index_keys_the_picks_are_the_peers_up_to_bf16_rounding():
    err, bad, same = compare("compressed_sparse_attention", LONG, 32, index_format="bf16")
    assert err <= REL_TOL and not bad
    assert same >= 0.9, f"only {same:.1%} of tokens pick the peer's own entries"


@pytest.mark.parametrize("layer_type", ["compressed_sparse_attention", "heavily_compressed_attention"])
def test_the_comparison_catches_v3s_rope_rule(layer_type):
    """The bug this comparison found: YaRN only past ``original_seq_len`` (DeepSeek-V3's
    rule) leaves compressed layers sized below 64K with plain compress-theta frequencies."""
    from graphs.rope import rope_tables, yarn_inv_freq

    ours = AttentionConfig.from_hf_config(hf_config().to_dict())
    v3 = rope_tables(yarn_inv_freq(ours.rope_head_dim, 0, ours.compress_rope_theta, 1.0, 0, 0), 4096)
    err, bad, _ = compare(layer_type, LONG, 32, ours_rope=v3)
    assert err > REL_TOL or bad, (err, bad)


def test_rope_frequencies_are_transformers_per_layer_type():
    """Sliding layers plain ``rope_theta``, compressed layers the YaRN-scaled compress theta,
    whatever context the cache is sized for (DeepSeek-V4's rule)."""
    cfg = hf_config()
    rotary = DeepseekV4RotaryEmbedding(cfg)
    ours = AttentionConfig.from_hf_config(cfg.to_dict())
    torch.testing.assert_close(layer_inv_freq(ours, 0), rotary.main_inv_freq, rtol=1e-6, atol=0)
    for ratio in (4, 128):
        torch.testing.assert_close(layer_inv_freq(ours, ratio), rotary.compress_inv_freq, rtol=1e-6, atol=0)
    assert not torch.allclose(rotary.main_inv_freq, rotary.compress_inv_freq)
