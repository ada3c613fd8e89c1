"""Plain-torch LSE combine and the DCP combine over c10d functional collectives."""

from __future__ import annotations

import torch

from compile_ops._groups import group_rank


def lse_weights(partial_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised weights ``2**(L_r - L)`` ``[N, ...]`` and the merged base-2 LSE ``L``.

    NaN and ``+inf`` entries count as ``-inf`` (weight 0). All ``-inf`` gives zero weights
    and ``L = -inf``.
    """
    lse = partial_lse.float()
    lse = torch.where(torch.isnan(lse) | (lse == float("inf")), float("-inf"), lse)
    top = lse.amax(0) if lse.shape[0] else torch.full(lse.shape[1:], float("-inf"), device=lse.device)
    top = torch.where(torch.isfinite(top), top, 0.0)
    weights = torch.exp2(lse - top)
    total = weights.sum(0)
    return torch.where(total > 0, weights / total, 0.0), top + torch.log2(total)


def lse_combine_reference(partial_out: torch.Tensor, partial_lse: torch.Tensor):
    weights, lse = lse_weights(partial_lse)
    terms = torch.where(weights.unsqueeze(-1) > 0, partial_out.float() * weights.unsqueeze(-1), 0.0)
    return terms.sum(0).to(partial_out.dtype), lse


def _c10d():
    return torch.ops._c10d_functional


def _pack(out: torch.Tensor, lse: torch.Tensor, world: int) -> torch.Tensor:
    """``[world, bytes]`` uint8: row ``r`` holds head slice ``r``'s out then its fp32 LSE."""
    T, H_all, D = out.shape
    H = H_all // world
    out_bytes = out.reshape(T, world, H, D).transpose(0, 1).contiguous().view(torch.uint8).view(world, -1)
    lse_bytes = lse.float().reshape(T, world, H).transpose(0, 1).contiguous().view(torch.uint8).view(world, -1)
    return torch.cat([out_bytes, lse_bytes], 1)


def _unpack(packed: torch.Tensor, T: int, H: int, D: int, dtype: torch.dtype):
    world = packed.shape[0]
    out_nbytes = T * H * D * torch.empty((), dtype=dtype).element_size()
    part_out = packed[:, :out_nbytes].contiguous().view(dtype).view(world, T, H, D)
    part_lse = packed[:, out_nbytes:].contiguous().view(torch.float32).view(world, T, H)
    return part_out, part_lse


def dcp_combine_ag_rs(out: torch.Tensor, lse: torch.Tensor, group_name: str, world: int):
    """All-gather the LSEs, rescale locally, reduce-scatter the outputs over heads."""
    T, H_all, D = out.shape
    H = H_all // world
    c10d = _c10d()
    gathered = c10d.wait_tensor(c10d.all_gather_into_tensor(lse.contiguous(), world, group_name))
    weights, merged = lse_weights(gathered.view(world, T, H_all))
    rank = group_rank(group_name)
    rank_weight = weights[rank]
    scaled = torch.where(rank_weight.unsqueeze(-1) > 0, out.float() * rank_weight.unsqueeze(-1), 0.0)
    by_slice = scaled.to(out.dtype).view(T, world, H, D).transpose(0, 1).contiguous()
    reduced = c10d.wait_tensor(c10d.reduce_scatter_tensor(by_slice, "sum", world, group_name))
    mine = merged.view(T, world, H)[:, rank]
    return reduced.view(T, H, D), mine.contiguous()


def dcp_combine_a2a(out: torch.Tensor, lse: torch.Tensor, group_name: str, world: int):
    """One all-to-all of each head slice's (out, lse), then :func:`lse_combine_reference`."""
    T, H_all, D = out.shape
    c10d = _c10d()
    packed = _pack(out, lse, world)
    splits = [packed.shape[1]] * world
    received = c10d.wait_tensor(c10d.all_to_all_single(packed.view(-1), splits, splits, group_name))
    part_out, part_lse = _unpack(received.view(world, -1), T, H_all // world, D, out.dtype)
    return lse_combine_reference(part_out, part_lse)


def dcp_combine_reference(out: torch.Tensor, lse: torch.Tensor, group_name: str, world: int, mode: str):
    """``dcp_combine`` through the plain c10d collectives of ``mode`` (``"ag_rs"`` or ``"a2a"``)."""
    combine = dcp_combine_ag_rs if mode == "ag_rs" else dcp_combine_a2a
    return combine(out, lse, group_name, world)
