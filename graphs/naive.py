"""Plain-torch meaning of :class:`graphs.DSV41Attention` for one request, from full history.

No caches, pages, slots, state buffers or padding: every quantity is recomputed from all
of the request's hidden states in fp32, the way a prefill would see it. Tests and the main
job run the layer over any steps and compare every token's output with
:func:`naive_outputs` and the indexer's choice with :func:`naive_index_scores`;
:func:`oracle_verdict` does both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor

from compile_ops.formats import decode_rows, encode_rows, get_format
from compile_ops.linear import dequantize_blocks
from graphs.attention import DSV41Attention
from graphs.fp8 import Fp8Linear


def _weight(layer: torch.nn.Module) -> Tensor:
    """A projection's weight in fp32 (an FP8 one dequantized by its block scales)."""
    if isinstance(layer, Fp8Linear):
        return dequantize_blocks(layer.weight, layer.scale).float()
    return layer.weight.float()


def _linear(x: Tensor, layer: torch.nn.Module) -> Tensor:
    return x.float() @ _weight(layer).t()


def _rms(x: Tensor, weight: Optional[Tensor], eps: float) -> Tensor:
    y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight.float()


def _rope_freqs(layer: DSV41Attention) -> list[float]:
    """The layer's RoPE frequencies from DeepSeek-V4's formula (not the layer's tables):
    compressed layers ``compress_rope_theta`` with YaRN, sliding-only ones ``rope_theta``."""
    cfg, d = layer.cfg, layer.rope_dim
    if not layer.compress_ratio:
        return [cfg.rope_theta ** (-2 * i / d) for i in range(d // 2)]
    base = cfg.compress_rope_theta
    freqs = [base ** (-2 * i / d) for i in range(d // 2)]
    if cfg.original_seq_len <= 0:
        return freqs

    def dim_of(turns: float) -> float:  # the pair that turns ``turns`` times over original_seq_len
        return d * math.log(cfg.original_seq_len / (2 * math.pi * turns)) / (2 * math.log(base))

    lo, hi = max(math.floor(dim_of(cfg.beta_fast)), 0), min(math.ceil(dim_of(cfg.beta_slow)), d - 1)
    ramp = [min(max((i - lo) / max(hi - lo, 1e-3), 0.0), 1.0) for i in range(d // 2)]
    return [f * (1 - r) + f / cfg.rope_factor * r for f, r in zip(freqs, ramp)]


def _rope(x: Tensor, positions: Tensor, layer: DSV41Attention, inverse: bool = False) -> Tensor:
    """``x [S, ..., D]`` with its last ``rope_dim`` dims turned (pairs as complex numbers,
    float64 angles) by ``positions [S]`` times :func:`_rope_freqs`."""
    rd = layer.rope_dim
    freqs = torch.tensor(_rope_freqs(layer), dtype=torch.float64, device=x.device)
    angle = positions.double().view(-1, *([1] * (x.dim() - 2)), 1) * freqs
    turn = torch.polar(torch.ones_like(angle), -angle if inverse else angle)
    pairs = torch.view_as_complex(x[..., -rd:].double().reshape(*x.shape[:-1], rd // 2, 2).contiguous())
    rotated = torch.view_as_real(pairs * turn).reshape(*x.shape[:-1], rd).to(x.dtype)
    return torch.cat([x[..., :-rd], rotated], dim=-1)


def _stored(rows: Tensor, layer: DSV41Attention, kv_format: str) -> Tensor:
    """``rows`` as a cache of ``kv_format`` holds them: rounded and read back (fp32)."""
    return decode_rows(encode_rows(rows, kv_format, layer.kv_scale), kv_format, layer.kv_scale)


def naive_entries(compressor, layer: DSV41Attention, xs: Tensor, rope: bool = True) -> Tensor:
    """Compressed entries ``[S // ratio, head_dim]`` of a request whose hidden states at
    positions ``0 .. S-1`` are ``xs [S, dim]`` (``rope=False``: the latents, before RoPE).
    A compressor without ``wgate`` (V4.1's ratio 1) weighs its tokens equally, one without
    ``ape`` (V4.1) adds no position bias."""
    r, d = compressor.ratio, compressor.head_dim
    groups = xs.shape[0] // r
    pos = torch.arange(groups * r, device=xs.device)
    kv = _linear(xs[: groups * r], compressor.wkv)
    score = _linear(xs[: groups * r], compressor.wgate) if compressor.wgate is not None else torch.zeros_like(kv)
    if compressor.ape is not None:
        score = score + compressor.ape.float()[pos % r]
    entries = []
    for g in range(groups):
        own = slice(g * r, (g + 1) * r)
        if compressor.overlap:
            prev = slice((g - 1) * r, g * r) if g > 0 else slice(0, 0)
            window_kv = torch.cat([kv[prev, :d], kv[own, d:]])
            window_sc = torch.cat([score[prev, :d], score[own, d:]])
        else:
            window_kv, window_sc = kv[own], score[own]
        entries.append((window_kv * window_sc.softmax(dim=0)).sum(dim=0))
    if not entries:
        return xs.new_zeros(0, d, dtype=torch.float32)
    out = _rms(torch.stack(entries), compressor.norm.weight, layer.cfg.norm_eps)
    return _rope(out, torch.arange(groups, device=xs.device) * r, layer) if rope else out


def naive_index_keys(layer: DSV41Attention, xs: Tensor) -> Tensor:
    """Index keys ``[S // ratio, 128]`` fp32 of a layer that owns them, from its inputs
    ``xs [S, dim]``: V4's from the indexer's own compressor, V4.1's ``k_norm(wk(latent))``
    of the layer's latents, RoPE at each group's first position."""
    idx, cfg = layer.indexer, layer.cfg
    if idx.compressor is not None:
        return naive_entries(idx.compressor, layer, xs)
    latent = naive_entries(layer.compressor, layer, xs, rope=False)
    keys = _rms(_linear(latent, idx.wk), idx.k_norm.weight, cfg.norm_eps)
    return _rope(keys, torch.arange(keys.shape[0], device=xs.device) * layer.compress_ratio, layer)


def naive_index_scores(layer: DSV41Attention, xs: Tensor, magnitude: bool = False,
                       keys: Optional[Tensor] = None) -> Tensor:
    """Indexer scores ``[S, S // ratio]`` of each position against every entry that
    exists there (``-inf`` for entries not yet closed). ``magnitude``: instead, the scale of
    each score's rounding, ``sum_h |w_h| |q_h| |k_c|`` (2-norms, which the layer's Hadamard
    rotation keeps). ``keys``: the index keys scored against (default: the layer's own,
    :func:`naive_index_keys`; a DeepSeek-V4.1 index source that does not compress scores
    its kv source's)."""
    idx, cfg = layer.indexer, layer.cfg
    S = xs.shape[0]
    pos = torch.arange(S, device=xs.device)
    qr = _rms(_linear(xs, layer.wq_a), layer.q_norm.weight, cfg.norm_eps)
    q = _rope(_linear(qr, idx.wq_b).view(S, idx.n_heads, idx.head_dim), pos, layer)
    keys = naive_index_keys(layer, xs) if keys is None else keys
    weights = _linear(xs, idx.weights_proj) * (idx.head_dim * idx.n_heads) ** -0.5
    if magnitude:
        score = (q.norm(dim=-1).unsqueeze(-1) * keys.norm(dim=-1) * weights.abs().unsqueeze(-1)).sum(dim=1)
    else:
        score = (torch.einsum("shd,cd->shc", q, keys).relu() * weights.unsqueeze(-1)).sum(dim=1)
    exists = torch.arange(keys.shape[0], device=xs.device) < ((pos + 1) // layer.compress_ratio).unsqueeze(1)
    return score.masked_fill(~exists, float("-inf"))


def naive_outputs(layer: DSV41Attention, xs: Tensor, chosen: Optional[Sequence[Sequence[int]]] = None,
                  entries: Optional[Tensor] = None) -> Tensor:
    """Outputs ``[S, dim]`` fp32 of one request's tokens at positions ``0 .. S-1``.

    The kv rows and compressed entries attention reads are rounded to the cache's
    ``kv_format`` (as the layer stores them); everything else is fp32.

    ``chosen[p]`` lists the compressed entry ids position ``p`` attends (default: the
    indexer's top-k by :func:`naive_index_scores`, or every existing entry for a layer
    without indexer). ``entries``: the compressed entries ``[S // ratio, head_dim]`` (with
    RoPE) attended (default: the layer's own compressor's, :func:`naive_entries`; a
    DeepSeek-V4.1 reader attends its kv source's).
    """
    cfg, r = layer.cfg, layer.compress_ratio
    S, H, D = xs.shape[0], layer.n_heads, layer.head_dim
    pos = torch.arange(S, device=xs.device)
    qr = _rms(_linear(xs, layer.wq_a), layer.q_norm.weight, cfg.norm_eps)
    q = _linear(qr, layer.wq_b).view(S, H, D)
    if not cfg.v41:  # V4 normalises each head of q; V4.1 does not
        q = _rms(q, None, cfg.norm_eps)
    q = _rope(q, pos, layer)
    kv = _stored(_rope(_rms(_linear(xs, layer.wkv), layer.kv_norm.weight, cfg.norm_eps), pos, layer), layer,
                 layer.kv_format)
    if r:
        entries = _stored(naive_entries(layer.compressor, layer, xs) if entries is None else entries, layer,
                          layer.cmp_kv_format)
    if r and chosen is None:
        if layer.indexer is not None:
            scores = naive_index_scores(layer, xs)
            k = min(layer.indexer.topk, scores.shape[1])
            chosen = [[c for c in scores[p].topk(k).indices.tolist() if scores[p, c] > float("-inf")] for p in range(S)]
        else:
            chosen = [list(range((p + 1) // r)) for p in range(S)]
    sink = layer.attn_sink.float()
    outs = []
    for p in range(S):
        keys = kv[max(0, p - cfg.window_size + 1) : p + 1]
        if r and len(chosen[p]):
            keys = torch.cat([keys, entries[torch.tensor(list(chosen[p]), dtype=torch.long, device=xs.device)]])
        logits = torch.einsum("hd,nd->hn", q[p], keys) * layer.softmax_scale
        full = torch.cat([logits, sink.unsqueeze(1)], dim=1).softmax(dim=1)
        outs.append(full[:, :-1] @ keys)
    o = _rope(torch.stack(outs), pos, layer, inverse=True)
    G = cfg.o_groups
    wo_a = _weight(layer.wo_a).view(G, cfg.o_lora_rank, -1)
    o = torch.einsum("sgd,grd->sgr", o.view(S, G, -1), wo_a).reshape(S, -1)
    return o @ _weight(layer.wo_b).t()


# A layer's output may differ from the oracle's by this much of the oracle's largest |y|
# (the oracle rounds the cached rows to the cache format as the layer does): bf16
# activations; with fp8 caches an ulp of bf16 difference before quantization can move an
# e4m3 value by a step (2**-3 relative), and later tokens attend those rows, so twice that.
REL_TOL = 2e-2
FP8_CACHE_REL_TOL = 4e-2
# fp4_dsv41 caches: such a difference moves an e2m1 value by a step (a third to a half of
# it); the tiny V4.1 layers' mixed workload measured 5.6e-2 and 7.0e-2 (ratios 1 and 2)
FP4_CACHE_REL_TOL = 0.15


def cache_tolerance(*kv_formats: str) -> float:
    """The output tolerance of a layer with caches of ``kv_formats``: :data:`REL_TOL` (all
    bf16), :data:`FP4_CACHE_REL_TOL` (any fp4) or :data:`FP8_CACHE_REL_TOL` (fp8 ones)."""
    if all(f == "bf16" for f in kv_formats):
        return REL_TOL
    return FP4_CACHE_REL_TOL if any(get_format(f).fp4 for f in kv_formats) else FP8_CACHE_REL_TOL
# An index score of the layer is off by at most this much of its magnitude bound
# (naive_index_scores(magnitude=True)): e4m3 q and keys, 2**-4 each, plus the bf16
# rotation, 2**-8 each (fp8); the bf16 rotation and keys (bf16); fp4: a value is off by
# 2**-2 of itself plus 2**-2 of its block's scale (at most amax / 3), so a vector by at most
# (1/4 + sqrt(32) / 12) < 0.73 of its norm, and a product of two by 0.73 * 1.73 + 0.73 < 2
# of the product of the norms: the check keeps only gross misses there.
SCORE_ROUNDING = {"fp8": 0.15, "bf16": 2**-6, "fp4": 2.0}


@dataclass(frozen=True)
class OracleVerdict:
    """How a run of the layer agrees with the full-history oracle.

    ``tokens``: tokens compared; ``max_rel_diff``: the largest output difference relative
    to the oracle's largest ``|y|`` (given the layer's own top-k picks), passing at
    ``tolerance`` (:func:`cache_tolerance` of the layer's cache format);
    ``pick_errors``:
    tokens whose picks are not the oracle's top-k up to :data:`SCORE_ROUNDING` (a left-out
    entry scores surely higher than a picked one, or the count is wrong).
    """

    tokens: int
    max_rel_diff: float
    pick_errors: int
    tolerance: float = REL_TOL

    @property
    def passed(self) -> bool:
        return self.pick_errors == 0 and self.max_rel_diff <= self.tolerance

    def verdict(self) -> str:
        picks = f", {self.pick_errors} token(s) with top-k picks the oracle's scores rule out" if self.pick_errors else ""
        return (f"{'PASS' if self.passed else 'FAIL'}: {self.tokens} tokens against the full-history oracle, largest "
                f"difference {self.max_rel_diff:.2e} of max |y| (tolerance {self.tolerance:g}){picks}")


def oracle_verdict(layer: DSV41Attention, xs: Sequence[Tensor], outs: Sequence[Tensor],
                   topk: Optional[Sequence[Tensor]] = None) -> OracleVerdict:
    """Compare each request's outputs ``outs[q] [n_q, dim]`` (its hidden states ``xs[q]``,
    positions ``0 .. n_q - 1``) and, for a compressed layer, its top-k ids ``topk[q] [n_q,
    K]`` (``-1`` padded) with the oracle."""
    ratio, tokens, worst, errors = layer.compress_ratio, 0, 0.0, 0
    if layer.indexer is not None and topk is None:
        raise ValueError("oracle_verdict needs the layer's own top-k picks (topk[q] [n_q, K], e.g. "
                         "run_workload(..., watch=layer.topk_ids)) for a layer with an indexer: near-tied scores "
                         "pick other entries than the oracle's, and comparing outputs without them measures the ties")
    for q, x in enumerate(xs):
        chosen = [[c for c in row if c >= 0] for row in topk[q].tolist()] if ratio and topk is not None else None
        want = naive_outputs(layer, x, chosen)
        tokens += want.shape[0]
        worst = max(worst, ((outs[q].float() - want).abs().max() / want.abs().max()).item())
        if layer.indexer is None:
            continue
        scores = naive_index_scores(layer, x)
        bound = naive_index_scores(layer, x, magnitude=True) * SCORE_ROUNDING[layer.indexer.index_format]
        for p, ids in enumerate(chosen):
            existing = (p + 1) // ratio
            left_out = sorted(set(range(existing)) - set(ids))
            ok = len(ids) == min(existing, layer.indexer.topk) and len(set(ids)) == len(ids)
            if ok and left_out:
                ok = bool((scores[p, left_out] - bound[p, left_out]).max() <= (scores[p, ids] + bound[p, ids]).min())
            errors += not ok
    return OracleVerdict(tokens, worst, errors, cache_tolerance(layer.kv_format, layer.cmp_kv_format))


def _visible(S: int, ratio: int, device) -> Tensor:
    """``[S]`` entries position ``p`` may see, ``(p + 1) // ratio``."""
    return (torch.arange(S, device=device) + 1) // ratio


def naive_candidates(scores: Tensor, ratio: int, n_blocks: int, block: int) -> list[list[int]]:
    """DeepSeek-V4.1's candidate blocks of each position from its index scores ``[S, n]``
    (``-inf`` where not visible): blocks of ``block`` entries by their max score, the block
    of the newest visible entry always kept, the ``n_blocks`` best (ties to the lower
    block), blocks with no visible entry dropped."""
    S, n = scores.shape
    nb = -(-n // block)
    padded = torch.cat([scores, scores.new_full((S, nb * block - n), float("-inf"))], 1)
    best = padded.view(S, nb, block).amax(-1)
    out = []
    for p, count in enumerate(_visible(S, ratio, scores.device).tolist()):
        row = best[p].clone()
        if count:
            row[(count - 1) // block] = float("inf")
        order = sorted(range(nb), key=lambda b: (-row[b].item(), b))[:n_blocks]
        out.append([b for b in order if row[b] > float("-inf")])
    return out


@dataclass(frozen=True)
class NaiveStack:
    """The oracle's run of a stack over one request: ``out [S, dim]`` fp32 (the residual
    after the last layer); per index source ``l``: ``scores[l] [S, n]`` its index scores
    (``-inf`` where not visible, and outside its candidate blocks), ``bound[l]`` their
    rounding scale (:data:`SCORE_ROUNDING` of the magnitudes), ``picks[l]`` the ids each
    position attended; ``candidates`` the candidate source's blocks per position;
    ``layer_out[i]`` what block ``i`` adds to the residual ``[S, dim]``."""

    out: Tensor
    scores: dict
    bound: dict
    picks: dict
    candidates: Optional[list]
    layer_out: list


def naive_stack(stack, xs: Tensor, picks: Optional[dict] = None,
                candidates: Optional[Sequence[Sequence[int]]] = None, inputs: Optional[Tensor] = None) -> NaiveStack:
    """One request's run of :class:`graphs.DSV41Stack` ``stack`` from its full history
    ``xs [S, dim]`` (positions ``0 .. S-1``), in fp32, each layer unshared: every kv source
    computes its compressed entries and index keys from its own inputs, and every later
    layer is fed the most recent source's explicitly (entries, keys, top-k ids, candidate
    blocks), as DeepSeek-V4.1's reference passes them from layer to layer.

    ``picks[l]`` / ``candidates``: teacher forcing, the ids index source ``l`` attended and
    the candidate source's blocks per position (the layer's own, from a run): near-tied
    scores pick other entries than the oracle's, and later layers would then see other
    inputs; default the oracle's own top-k. ``inputs [S, layers (+ 1), dim]``: each layer's
    residual input (the stack's ``layer_inputs``, recorded step by step), teacher-forced too,
    so each layer is computed from the inputs the stack's layer had; ``layer_out[i]`` is what
    block ``i`` adds to the residual.
    """
    plan, cfg = stack.plan, stack.cfg
    S = xs.shape[0]
    h = xs.float()
    entries, keys, chosen, scores_of, bound_of = {}, {}, {}, {}, {}
    given = dict(picks or {})
    blocks = None if candidates is None else [list(b) for b in candidates]
    layer_out = []
    for i, block in enumerate(stack.blocks):
        layer = block.attn
        role, r = layer.role, layer.compress_ratio
        if inputs is not None:
            h = inputs[:, i].float()
        x = _rms(h, block.attn_norm.weight, cfg.norm_eps).to(torch.bfloat16)
        if role.compresses:
            entries[role.layer_id] = naive_entries(layer.compressor, layer, x)
            if layer.indexer is not None:
                keys[role.layer_id] = naive_index_keys(layer, x)
        if layer.indexer is not None:
            k_src = keys[role.kv_source]
            scores = naive_index_scores(layer, x, keys=k_src)
            bound = naive_index_scores(layer, x, magnitude=True, keys=k_src) * SCORE_ROUNDING[layer.indexer.index_format]
            if layer.candidate_ids is not None and blocks is None:
                blocks = naive_candidates(scores, r, layer.indexer.n_blocks, layer.indexer.block)
            if layer.uses_candidates:
                allowed = torch.zeros_like(scores, dtype=torch.bool)
                for p, bs in enumerate(blocks):
                    for b in bs:
                        allowed[p, b * layer.candidate_block : (b + 1) * layer.candidate_block] = True
                scores = scores.masked_fill(~allowed, float("-inf"))
            scores_of[role.layer_id], bound_of[role.layer_id] = scores, bound
            if role.layer_id not in given:
                k = min(layer.indexer.topk, scores.shape[1])
                given[role.layer_id] = [[c for c in scores[p].topk(k).indices.tolist() if scores[p, c] > float("-inf")]
                                        for p in range(S)]
            chosen[role.layer_id] = given[role.layer_id]
        ids = None
        if r:
            ids = (chosen[role.index_source] if role.index_source is not None
                   else [list(range(n)) for n in _visible(S, r, xs.device).tolist()])
        before = h
        h = h + naive_outputs(layer, x, ids, entries[role.kv_source] if r else None)
        if block.ffn is not None:
            h = h + block.ffn(h)
        layer_out.append(h - before)
    return NaiveStack(h, scores_of, bound_of, chosen, blocks, layer_out)


def _picks_ok(ids: list, scores: Tensor, bound: Tensor, k: int) -> bool:
    """Whether ``ids`` are a top-``k`` of one position's ``scores`` up to ``bound``."""
    visible = (scores > float("-inf")).nonzero().flatten().tolist()
    if len(ids) != min(len(visible), k) or len(set(ids)) != len(ids) or not set(ids) <= set(visible):
        return False
    left_out = sorted(set(visible) - set(ids))
    return not left_out or bool((scores[left_out] - bound[left_out]).max() <= (scores[ids] + bound[ids]).min())


@dataclass(frozen=True)
class StackVerdict:
    """How a run of a stack agrees with :func:`naive_stack`: ``tokens`` compared,
    ``max_rel_diff`` of the final residual relative to the oracle's largest ``|h|`` (given
    the stack's own picks), ``pick_errors[l]`` tokens whose picks at index source ``l`` the
    oracle's scores rule out, ``candidate_errors`` tokens whose candidate blocks they rule
    out."""

    tokens: int
    max_rel_diff: float
    pick_errors: dict
    candidate_errors: int
    tolerance: float = REL_TOL
    layer_rel_diff: Optional[dict] = None

    @property
    def passed(self) -> bool:
        if any(self.pick_errors.values()) or self.candidate_errors:
            return False
        if self.layer_rel_diff is not None:  # each layer on its own inputs
            return max(self.layer_rel_diff.values()) <= self.tolerance
        return self.max_rel_diff <= self.tolerance

    def verdict(self) -> str:
        bad = {l: n for l, n in self.pick_errors.items() if n}
        picks = f", pick errors {bad}" if bad else ""
        cands = f", {self.candidate_errors} token(s) with wrong candidate blocks" if self.candidate_errors else ""
        if self.layer_rel_diff is not None:
            worst = max(self.layer_rel_diff, key=self.layer_rel_diff.get)
            diff = (f"every layer on its own inputs within {self.layer_rel_diff[worst]:.2e} of its max |y| (layer "
                    f"{worst}; tolerance {self.tolerance:g}), the final residual within {self.max_rel_diff:.2e} of "
                    f"max |h|")
        else:
            diff = f"largest difference {self.max_rel_diff:.2e} of max |h| (tolerance {self.tolerance:g})"
        return (f"{'PASS' if self.passed else 'FAIL'}: {self.tokens} tokens through {len(self.pick_errors)} index "
                f"layers against the layer-by-layer oracle, {diff}{picks}{cands}")


def stack_verdict(stack, xs: Sequence[Tensor], outs: Sequence[Tensor], topk: dict,
                  candidates: Optional[Sequence[Tensor]] = None,
                  inputs: Optional[Sequence[Tensor]] = None) -> StackVerdict:
    """Compare each request's outputs ``outs[q] [n_q, dim]`` of a stack (its hidden states
    ``xs[q]``) with :func:`naive_stack`, teacher-forced with the stack's own picks:
    ``topk[l][q] [n_q, K]`` of each index source ``l`` and ``candidates[q]`` the candidate
    source's blocks (e.g. ``run_workload(..., watch={l: layer.topk_ids, ...})``).

    ``inputs[q] [n_q, layers + 1, dim]`` (the stack's ``layer_inputs``, watched likewise): each
    layer is then judged on its own, its output (the next layer's input minus its own) against
    the oracle's from the same inputs, within the one-layer tolerance of its max ``|y|``; the
    final residual's difference is still reported. Without them the final residual is
    judged, and the layers' rounding adds up through the stack (a deep stack needs them)."""
    plan = stack.plan
    tokens, worst, cand_errors = 0, 0.0, 0
    errors = {l: 0 for l in topk}
    per_layer = None if inputs is None else {l: 0.0 for l in stack.layer_ids}
    for q, x in enumerate(xs):
        picks = {l: [[c for c in row if c >= 0] for row in ids[q].tolist()] for l, ids in topk.items()}
        blocks = None if candidates is None else [[b for b in row if b >= 0] for row in candidates[q].tolist()]
        run = naive_stack(stack, x, picks, blocks, None if inputs is None else inputs[q])
        tokens += x.shape[0]
        worst = max(worst, ((outs[q].float() - run.out).abs().max() / run.out.abs().max()).item())
        if inputs is not None:
            got = inputs[q][:, 1:].float() - inputs[q][:, :-1].float()
            for i, l in enumerate(stack.layer_ids):
                want = run.layer_out[i]
                per_layer[l] = max(per_layer[l], ((got[:, i] - want).abs().max() / want.abs().max()).item())
        for l in topk:
            layer = stack.layers[l]
            for p, ids in enumerate(picks[l]):
                errors[l] += not _picks_ok(ids, run.scores[l][p], run.bound[l][p], layer.indexer.topk)
        if blocks is not None:
            src = stack.layers[plan.candidate_source]
            scores, bound = run.scores[plan.candidate_source], run.bound[plan.candidate_source]
            n_blocks, size = src.indexer.n_blocks, src.indexer.block
            for p, bs in enumerate(blocks):
                cand_errors += not _candidates_ok(bs, scores[p], bound[p], n_blocks, size)
    tol = cache_tolerance(stack.cache_cfg.kv_format, stack.cache_cfg.compressed_format)
    return StackVerdict(tokens, worst, errors, cand_errors, tol, per_layer)


def _candidates_ok(blocks: list, scores: Tensor, bound: Tensor, n_blocks: int, size: int) -> bool:
    """Whether ``blocks`` are a valid candidate set of one position (the newest visible
    entry's block in it, and no left-out block's max surely above a kept one's)."""
    visible = (scores > float("-inf")).nonzero().flatten()
    if not visible.numel():
        return blocks == []
    newest = int(visible.max()) // size
    have = sorted({int(c) // size for c in visible})
    if newest not in blocks or len(blocks) != min(n_blocks, len(have)) or not set(blocks) <= set(have):
        return False
    top = {b: (scores[b * size : (b + 1) * size].max(), bound[b * size : (b + 1) * size].max()) for b in have}
    kept = [top[b][0] + top[b][1] for b in blocks if b != newest]
    left = [top[b][0] - top[b][1] for b in have if b not in blocks]
    return not kept or not left or max(left) <= min(kept)
