"""The decode-context-parallel (DCP) attention step of docs/design.md, as one plain function.

Shape legend: ``T`` tokens, ``H`` this rank's query heads, ``N`` the DCP group size
(``H * N`` gathered heads), ``W`` SWA index columns, ``K`` top-k columns.

The compressed KV entries of every request are sharded over the DCP group by interleave
``I`` (global compressed id ``c`` lives on rank ``(c // I) % N`` as local id
``(c // (N * I)) * I + c % I``); the SWA cache is replicated. One step:

1. all-gather ``q`` over heads: ``[T, H, 512]`` -> ``[T, N * H, 512]`` (rank-major heads);
2. :func:`compile_ops.dcp_topk_to_slots` turns the global top-k ids into this rank's slots;
3. :func:`compile_ops.sparse_mla` over this rank's shard. Rank 0 also attends the SWA
   window and carries the sink; ranks > 0 get empty SWA rows (``lens = 0``) and no sink,
   so the window and the sink are each counted once;
4. :func:`compile_ops.dcp_combine` merges the partials by LSE and hands each rank its own
   ``H`` heads back.

The result equals DCP=1 :func:`compile_ops.sparse_mla` of the local heads over all
entries. Everything is graph-safe: shapes come from input shapes, no host syncs, and the
collectives are c10d functional ops on the group named ``group_name``, so the step traces
under ``torch.compile(fullgraph=True)`` and is captured by a CUDA graph on every rank
(run it once eagerly first, so NCCL sets up its communicator outside the capture).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from compile_ops._checks import check_dim, check_int, check_tensor
from compile_ops.combine import dcp_combine
from compile_ops.mla import sparse_mla
from compile_ops.slots import dcp_topk_to_slots


def all_gather_heads(q: Tensor, group_name: str, world: int) -> Tensor:
    """``q [T, H, D]`` of every rank -> ``[T, world * H, D]``, head ``r * H + h`` from rank ``r``."""
    if world == 1:
        return q
    T, H, D = q.shape
    c10d = torch.ops._c10d_functional
    gathered = c10d.wait_tensor(c10d.all_gather_into_tensor(q.contiguous(), world, group_name))
    return gathered.view(world, T, H, D).permute(1, 0, 2, 3).reshape(T, world * H, D)


def _check(q, swa_lens, topk, sink, rank, world, interleave):
    check_tensor("q", q, torch.bfloat16, 3)
    check_int("world", world, 1)
    check_int("rank", rank, 0)
    if rank >= world:
        raise ValueError(f"rank must be in [0, world) = [0, {world}), got {rank}")
    check_int("interleave", interleave, 1)
    check_tensor("swa_lens", swa_lens, torch.int32, 1, q.device)
    check_tensor("topk", topk, torch.int32, 2, q.device)
    check_dim("topk", topk, 0, q.shape[0], "q.shape[0], the token count T")
    if sink is not None:
        check_tensor("sink", sink, torch.float32, 1, q.device)
        check_dim("sink", sink, 0, q.shape[1] * world, "the gathered head count H * world")


def dcp_sparse_mla(
    q: Tensor,
    swa_cache: Tensor,
    swa_indices: Tensor,
    swa_lens: Tensor,
    cmp_cache: Tensor,
    topk: Tensor,
    token_to_req: Tensor,
    cmp_block_table: Tensor,
    cmp_block_size: int,
    is_valid: Tensor,
    sink: Optional[Tensor],
    sm_scale: float,
    *,
    group_name: str,
    rank: int,
    world: int,
    interleave: int = 1,
    kv_format: str = "bf16",
    kv_scale: float = 1.0,
    mode: str = "ag_rs",
) -> tuple[Tensor, Tensor]:
    """Sparse MLA of this rank's heads over KV sharded across a DCP group (docs/design.md).

    Every rank of the group calls it with the same shapes and arguments except ``q`` (its
    own heads), ``cmp_cache`` / ``cmp_block_table`` (its own shard) and ``rank``.

    Args:
        q: ``[T, H, 512]`` bf16, this rank's query heads.
        swa_cache: paged SWA cache in ``kv_format`` (replicated on every rank).
        swa_indices: ``[T, W]`` int32 SWA slots (:func:`compile_ops.swa_indices`).
        swa_lens: ``[T]`` int32; used on rank 0 only (the others attend no SWA entry).
        cmp_cache: this rank's shard of the compressed cache, in ``kv_format``.
        topk: ``[T, K]`` int32 **global** compressed ids of each token's request, ``-1`` = none.
        token_to_req: ``[T]`` int32 request row of each token in ``cmp_block_table``.
        cmp_block_table: ``[R, B]`` int32 this rank's page table of its compressed shard.
        cmp_block_size: compressed entries per page.
        is_valid: ``[T]`` bool, ``False`` for CUDA-graph padding tokens.
        sink: ``[H * world]`` fp32 sinks of the **gathered** heads (rank-major order), or
            ``None``; used on rank 0 only.
        sm_scale: softmax scale.
        group_name: the DCP group's c10d name (``group.group_name``).
        rank: this rank in the group; world: the group size; interleave: the shard
            interleave ``I``.
        kv_format, kv_scale: as :func:`compile_ops.sparse_mla`.
        mode: ``"ag_rs"`` or ``"a2a"``, as :func:`compile_ops.dcp_combine`.

    Returns:
        ``(out [T, H, 512] bf16, lse [T, H] fp32, base 2)``, equal to DCP=1 ``sparse_mla``
        of these heads over all compressed entries, the window and the sink.

    Example (inside an initialised process group of 2 ranks)::

        out, lse = dcp_sparse_mla(q, swa_cache, swa_idx, swa_lens, cmp_shard, topk,
                                  token_to_req, shard_table, 64, is_valid, sink, 512**-0.5,
                                  group_name=group.group_name, rank=group.rank(), world=2)
    """
    _check(q, swa_lens, topk, sink, rank, world, interleave)
    q_all = all_gather_heads(q, group_name, world)
    cmp_slots, cmp_lens = dcp_topk_to_slots(topk, token_to_req, cmp_block_table, cmp_block_size, is_valid, rank, world, interleave)
    if rank != 0:
        swa_lens, sink = torch.zeros_like(swa_lens), None
    out, lse = sparse_mla(q_all, swa_cache, swa_indices, swa_lens, cmp_cache, cmp_slots, cmp_lens, sink, sm_scale, kv_format, kv_scale)
    if world == 1:
        return out, lse
    return dcp_combine(out, lse, group_name, mode)
