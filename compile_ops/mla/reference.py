"""Plain-torch sparse MLA: the meaning of ``dsv41::sparse_mla`` (fp32 math, CPU and CUDA)."""

from __future__ import annotations


import torch

from compile_ops.formats import LOG2E, num_slots, read_kv
from compile_ops.mla.inputs import SparseMLAArgs

TOKEN_CHUNK = 32


def _segment_keys(cache, indices, lens, kv_format, kv_scale):
    """Dequantized keys ``[t, n, 512]`` and validity ``[t, n]`` of one index segment."""
    columns = torch.arange(indices.shape[1], device=indices.device)
    valid = (columns < lens.unsqueeze(1)) & (indices >= 0) & (indices < num_slots(cache))
    return read_kv(cache, indices, kv_format, kv_scale), valid


def _row_max(scores: torch.Tensor) -> torch.Tensor:
    if scores.shape[-1] == 0:
        return scores.new_full((*scores.shape[:-1], 1), float("-inf"))
    return scores.amax(-1, keepdim=True)


def sparse_mla_reference(args: SparseMLAArgs, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Fill ``out [T, H, 512]`` and ``lse [T, H]`` (base 2, sink folded in); see ``ops.sparse_mla``.

    Tokens are processed in chunks of ``TOKEN_CHUNK`` so the gathered keys stay small;
    chunk bounds come from shapes, so no host sync happens.
    """
    q, swa_cache, swa_indices, swa_lens, cmp_cache, cmp_indices, cmp_lens, sink, sm_scale, kv_format, kv_scale = args[:11]
    for start in range(0, q.shape[0], TOKEN_CHUNK):
        rows = slice(start, start + TOKEN_CHUNK)
        keys, valid = _segment_keys(swa_cache, swa_indices[rows], swa_lens[rows], kv_format, kv_scale)
        if cmp_cache is not None:
            cmp_keys, cmp_valid = _segment_keys(cmp_cache, cmp_indices[rows], cmp_lens[rows], args.cmp_format, kv_scale)
            keys, valid = torch.cat([keys, cmp_keys], 1), torch.cat([valid, cmp_valid], 1)
        qf = q[rows].float()
        scores = torch.einsum("thd,tnd->thn", qf, keys) * sm_scale
        scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
        row_max = _row_max(scores)
        if sink is not None:
            row_max = torch.maximum(row_max, sink.float().view(1, -1, 1))
        row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)
        weights = torch.exp(scores - row_max)
        denom = weights.sum(-1)
        if sink is not None:
            denom = denom + torch.exp(sink.float().view(1, -1) - row_max.squeeze(-1))
        numer = torch.einsum("thn,tnd->thd", weights, keys)
        out[rows] = torch.where(denom.unsqueeze(-1) > 0, numer / denom.unsqueeze(-1), 0.0).to(out.dtype)
        lse[rows] = (row_max.squeeze(-1) + torch.log(denom)) * LOG2E
