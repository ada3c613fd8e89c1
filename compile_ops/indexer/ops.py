"""Indexer ops: ``write_index_keys``, ``indexer_topk``, ``indexer_candidates`` and their DCP forms.

Shape legend: ``T`` tokens, ``Hi`` indexer heads, ``R`` requests, ``B`` pages per block-table
row, ``L = B * page_size`` entries a row can address, ``k`` ids per token. An entry is a
request-local compressed id; ``-1`` marks none. Outputs' shapes come from input shapes only.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from compile_ops import backends
from compile_ops._checks import check_dim, check_int, check_tensor
from compile_ops._groups import group_rank, group_size
from compile_ops.indexer.cache import INDEX_DIM, check_index_cache
from compile_ops.indexer.inputs import ORDERS, IndexerArgs, global_ids, triton_args_unsupported
from compile_ops.indexer.reference import (by_id, indexer_candidates_reference, indexer_topk_and_candidates_reference,
                                          indexer_topk_reference, topk_of_scores)


def check_index_write(cache, slots, keys, index_format):
    """``write_index_keys``' checks of its arguments; returns the cache's format."""
    fmt = check_index_cache("cache", cache, index_format)
    check_tensor("slots", slots, (torch.int32, torch.int64), 1, cache.device)
    check_tensor("keys", keys, (torch.bfloat16, torch.float16, torch.float32), 2, cache.device)
    if tuple(keys.shape) != (slots.shape[0], INDEX_DIM):
        raise ValueError(f"keys must be [len(slots), {INDEX_DIM}] = [{slots.shape[0]}, {INDEX_DIM}], got {list(keys.shape)}")
    return fmt


@torch.library.custom_op("dsv41::write_index_keys", mutates_args=("cache",))
def write_index_keys(cache: Tensor, slots: Tensor, keys: Tensor, index_format: str) -> None:
    fmt = check_index_write(cache, slots, keys, index_format)
    if cache.shape[0] * cache.shape[1] == 0 or slots.shape[0] == 0:
        return
    store = backends.implementation("kv", "write_kv", cache.device)  # the KV caches' row store
    store(cache, slots, keys, fmt)


@write_index_keys.register_fake
def _(cache, slots, keys, index_format):
    check_index_write(cache, slots, keys, index_format)


def _check_topk(q, weights, index_cache, block_table, token_to_req, n_entries, k, index_format, candidates=None,
                candidate_block=1, order="score"):
    check_tensor("q", q, torch.bfloat16, 3)
    if q.shape[2] != INDEX_DIM:
        raise ValueError(f"q must be [T, Hi, {INDEX_DIM}], got shape {tuple(q.shape)}")
    T, Hi = q.shape[:2]
    device = q.device
    check_tensor("weights", weights, torch.float32, 2, device)
    if tuple(weights.shape) != (T, Hi):
        raise ValueError(f"weights must be [T, Hi] = [{T}, {Hi}] (q.shape[:2]), got {list(weights.shape)}")
    fmt = check_index_cache("index_cache", index_cache, index_format, device)
    check_tensor("block_table", block_table, torch.int32, 2, device)
    for name, t in (("token_to_req", token_to_req), ("n_entries", n_entries)):
        check_tensor(name, t, torch.int32, 1, device)
        check_dim(name, t, 0, T, "q.shape[0], the token count T")
    check_int("k", k, 1)
    check_int("candidate_block", candidate_block, 1)
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    if candidates is not None:
        check_tensor("candidates", candidates, torch.int32, 2, device)
        check_dim("candidates", candidates, 0, T, "q.shape[0], the token count T")
    return fmt


def _args(q, weights, index_cache, block_table, token_to_req, n_entries, k, fmt, *, candidates=None,
          candidate_block=1, shard=(0, 1, 1), order="score", n_blocks=0) -> IndexerArgs:
    """The call as backends take it: the op's own tensors, nothing computed (no kernels)."""
    return IndexerArgs(q, weights, index_cache, fmt, block_table, token_to_req, n_entries, int(k), candidates,
                       candidate_block, shard, order, int(n_blocks))


def _none(args: IndexerArgs, width: int) -> tuple[Tensor, Tensor]:
    T = args.q.shape[0]
    return (args.q.new_full((T, width), -1, dtype=torch.int32),
            args.q.new_full((T, width), float("-inf"), dtype=torch.float32))


def _run(op: str, args: IndexerArgs):
    """The backend's ``op(args)``; all ``-1`` (``-inf``) when no token has an entry to score."""
    if args.q.shape[0] and args.block_table.shape[0] * args.block_table.shape[1] * args.cache.shape[1]:
        return backends.implementation("indexer", op, args.q.device, args.fmt.name, args)(args)
    if op == "indexer_topk_and_candidates":
        return _none(args, args.k), _none(args, args.n_blocks)
    return _none(args, args.k)


@torch.library.custom_op("dsv41::indexer_topk", mutates_args=())
def indexer_topk(q: Tensor, weights: Tensor, index_cache: Tensor, block_table: Tensor, token_to_req: Tensor,
                 n_entries: Tensor, k: int, index_format: str = "fp8", candidates: Optional[Tensor] = None,
                 candidate_block: int = 1, order: str = "score") -> Tensor:
    fmt = _check_topk(q, weights, index_cache, block_table, token_to_req, n_entries, k, index_format,
                      candidates, candidate_block, order)
    args = _args(q, weights, index_cache, block_table, token_to_req, n_entries, k, fmt,
                 candidates=candidates, candidate_block=candidate_block, order=order)
    return _run("indexer_topk", args)[0]


@indexer_topk.register_fake
def _(q, weights, index_cache, block_table, token_to_req, n_entries, k, index_format="fp8", candidates=None,
      candidate_block=1, order="score"):
    _check_topk(q, weights, index_cache, block_table, token_to_req, n_entries, k, index_format,
                candidates, candidate_block, order)
    return q.new_empty((q.shape[0], k), dtype=torch.int32)


@torch.library.custom_op("dsv41::indexer_candidates", mutates_args=())
def indexer_candidates(q: Tensor, weights: Tensor, index_cache: Tensor, block_table: Tensor, token_to_req: Tensor,
                       n_entries: Tensor, n_blocks: int, block: int, index_format: str = "fp8") -> Tensor:
    fmt = _check_topk(q, weights, index_cache, block_table, token_to_req, n_entries, n_blocks, index_format,
                      candidate_block=block)
    args = _args(q, weights, index_cache, block_table, token_to_req, n_entries, n_blocks, fmt,
                 candidate_block=block)
    return _run("indexer_candidates", args)[0]


@indexer_candidates.register_fake
def _(q, weights, index_cache, block_table, token_to_req, n_entries, n_blocks, block, index_format="fp8"):
    _check_topk(q, weights, index_cache, block_table, token_to_req, n_entries, n_blocks, index_format,
                candidate_block=block)
    return q.new_empty((q.shape[0], n_blocks), dtype=torch.int32)


@torch.library.custom_op("dsv41::indexer_topk_and_candidates", mutates_args=())
def indexer_topk_and_candidates(q: Tensor, weights: Tensor, index_cache: Tensor, block_table: Tensor,
                                token_to_req: Tensor, n_entries: Tensor, k: int, n_blocks: int, block: int,
                                index_format: str = "fp8", order: str = "score") -> tuple[Tensor, Tensor]:
    fmt = _check_topk(q, weights, index_cache, block_table, token_to_req, n_entries, k, index_format,
                      candidate_block=block, order=order)
    check_int("n_blocks", n_blocks, 1)
    args = _args(q, weights, index_cache, block_table, token_to_req, n_entries, k, fmt, candidate_block=block,
                 order=order, n_blocks=n_blocks)
    (ids, _), (blocks, _) = _run("indexer_topk_and_candidates", args)
    return ids, blocks


@indexer_topk_and_candidates.register_fake
def _(q, weights, index_cache, block_table, token_to_req, n_entries, k, n_blocks, block, index_format="fp8",
      order="score"):
    _check_topk(q, weights, index_cache, block_table, token_to_req, n_entries, k, index_format,
                candidate_block=block, order=order)
    check_int("n_blocks", n_blocks, 1)
    return q.new_empty((q.shape[0], k), dtype=torch.int32), q.new_empty((q.shape[0], n_blocks), dtype=torch.int32)


def _check_dcp(group_name, interleave):
    check_int("interleave", interleave, 1)
    return group_size(group_name)


def _dcp_merge(ids: Tensor, scores: Tensor, k: int, group_name: str, world: int, distinct: bool = False) -> Tensor:
    """Every rank's ``(global id, score) [T, k]`` candidates in one all-gather, then the same
    top-``k`` merge on each rank; ``distinct``: an id offered by several ranks (a block whose
    entries they share) counts once, at its highest score."""
    mine = torch.stack([ids, scores.view(torch.int32)], -1)
    c10d = torch.ops._c10d_functional
    gathered = c10d.wait_tensor(c10d.all_gather_into_tensor(mine.contiguous(), world, group_name))
    T = ids.shape[0]
    every = gathered.view(world, T, k, 2).permute(1, 0, 2, 3).reshape(T, world * k, 2)
    ids, scores = every[..., 0], every[..., 1].contiguous().view(torch.float32)
    if distinct:  # by score descending, then id: the first of each id is its best
        scores, order = torch.sort(scores, dim=1, descending=True, stable=True)
        ids = ids.gather(1, order)
        ids, by_id = torch.sort(ids, dim=1, stable=True)
        scores = scores.gather(1, by_id)
        repeat = torch.zeros_like(ids, dtype=torch.bool)
        repeat[:, 1:] = ids[:, 1:] == ids[:, :-1]
        scores = scores.masked_fill(repeat | (ids < 0), float("-inf"))
    return topk_of_scores(scores, k, ids=ids)[0]


@torch.library.custom_op("dsv41::dcp_indexer_topk", mutates_args=())
def dcp_indexer_topk(q: Tensor, weights: Tensor, index_cache: Tensor, block_table: Tensor, token_to_req: Tensor,
                     n_entries: Tensor, k: int, index_format: str, group_name: str, interleave: int,
                     candidates: Optional[Tensor] = None, candidate_block: int = 1, order: str = "score") -> Tensor:
    fmt = _check_topk(q, weights, index_cache, block_table, token_to_req, n_entries, k, index_format,
                      candidates, candidate_block, order)
    world = _check_dcp(group_name, interleave)
    rank = group_rank(group_name)
    # each rank's candidates by score: the merge takes any order, and the id order after it
    args = _args(q, weights, index_cache, block_table, token_to_req, n_entries, k, fmt, candidates=candidates,
                 candidate_block=candidate_block, shard=(rank, world, interleave))
    ids, scores = _run("indexer_topk", args)
    ids = _dcp_merge(global_ids(ids, rank, world, interleave), scores, k, group_name, world)
    return by_id(ids)[0] if order == "id" else ids


@dcp_indexer_topk.register_fake
def _(q, weights, index_cache, block_table, token_to_req, n_entries, k, index_format, group_name, interleave,
      candidates=None, candidate_block=1, order="score"):
    _check_topk(q, weights, index_cache, block_table, token_to_req, n_entries, k, index_format,
                candidates, candidate_block, order)
    _check_dcp(group_name, interleave)
    return q.new_empty((q.shape[0], k), dtype=torch.int32)


@torch.library.custom_op("dsv41::dcp_indexer_candidates", mutates_args=())
def dcp_indexer_candidates(q: Tensor, weights: Tensor, index_cache: Tensor, block_table: Tensor,
                           token_to_req: Tensor, n_entries: Tensor, n_blocks: int, block: int, index_format: str,
                           group_name: str, interleave: int) -> Tensor:
    fmt = _check_topk(q, weights, index_cache, block_table, token_to_req, n_entries, n_blocks, index_format,
                      candidate_block=block)
    world = _check_dcp(group_name, interleave)
    rank = group_rank(group_name)
    args = _args(q, weights, index_cache, block_table, token_to_req, n_entries, n_blocks, fmt,
                 candidate_block=block, shard=(rank, world, interleave))
    blocks, scores = _run("indexer_candidates", args)
    return _dcp_merge(blocks, scores, n_blocks, group_name, world, distinct=True)


@dcp_indexer_candidates.register_fake
def _(q, weights, index_cache, block_table, token_to_req, n_entries, n_blocks, block, index_format, group_name,
      interleave):
    _check_topk(q, weights, index_cache, block_table, token_to_req, n_entries, n_blocks, index_format,
                candidate_block=block)
    _check_dcp(group_name, interleave)
    return q.new_empty((q.shape[0], n_blocks), dtype=torch.int32)


@torch.library.custom_op("dsv41::dcp_indexer_topk_and_candidates", mutates_args=())
def dcp_indexer_topk_and_candidates(q: Tensor, weights: Tensor, index_cache: Tensor, block_table: Tensor,
                                    token_to_req: Tensor, n_entries: Tensor, k: int, n_blocks: int, block: int,
                                    index_format: str, group_name: str, interleave: int,
                                    order: str = "score") -> tuple[Tensor, Tensor]:
    fmt = _check_topk(q, weights, index_cache, block_table, token_to_req, n_entries, k, index_format,
                      candidate_block=block, order=order)
    check_int("n_blocks", n_blocks, 1)
    world = _check_dcp(group_name, interleave)
    rank = group_rank(group_name)
    args = _args(q, weights, index_cache, block_table, token_to_req, n_entries, k, fmt, candidate_block=block,
                 shard=(rank, world, interleave), n_blocks=n_blocks)  # by score: the merge orders them
    (ids, scores), (blocks, block_scores) = _run("indexer_topk_and_candidates", args)
    ids = _dcp_merge(global_ids(ids, rank, world, interleave), scores, k, group_name, world)
    blocks = _dcp_merge(blocks, block_scores, n_blocks, group_name, world, distinct=True)
    return (by_id(ids)[0], by_id(blocks)[0]) if order == "id" else (ids, blocks)


@dcp_indexer_topk_and_candidates.register_fake
def _(q, weights, index_cache, block_table, token_to_req, n_entries, k, n_blocks, block, index_format, group_name,
      interleave, order="score"):
    _check_topk(q, weights, index_cache, block_table, token_to_req, n_entries, k, index_format,
                candidate_block=block, order=order)
    check_int("n_blocks", n_blocks, 1)
    _check_dcp(group_name, interleave)
    return q.new_empty((q.shape[0], k), dtype=torch.int32), q.new_empty((q.shape[0], n_blocks), dtype=torch.int32)


GLUON_INDEX_FORMATS = ("fp4", "fp8")  # the index formats the gluon backend's scores kernel reads


def _gluon_unavailable(device, index_format):
    if index_format not in GLUON_INDEX_FORMATS:
        return (f"the Gluon scores kernel reads {' and '.join(GLUON_INDEX_FORMATS)} index keys only, "
                f"got {index_format}")
    return backends.hopper_with_gluon(device)


def _gluon_limits(args):
    from compile_ops.indexer.gluon import gluon_args_unsupported

    return gluon_args_unsupported(args)


# Gluon (sm_90, fp4 and fp8 keys) first: the triton backend's top-k over its own scores kernel
backends.register_backend("indexer", "gluon", _gluon_unavailable,
                          {op: backends.imported("compile_ops.indexer.gluon", f"{op}_gluon")
                           for op in ("indexer_topk", "indexer_candidates", "indexer_topk_and_candidates")},
                          limits=_gluon_limits)
backends.register_backend("indexer", "triton", backends.cuda_with_triton,
                          {op: backends.imported("compile_ops.indexer.triton", f"{op}_triton")
                           for op in ("indexer_topk", "indexer_candidates", "indexer_topk_and_candidates")},
                          limits=triton_args_unsupported)
backends.register_backend("indexer", "reference", backends.any_device,
                          {"indexer_topk": indexer_topk_reference, "indexer_candidates": indexer_candidates_reference,
                           "indexer_topk_and_candidates": indexer_topk_and_candidates_reference})

write_index_keys.__doc__ = """Quantize ``keys [N, 128]`` and write row ``i`` to slot ``slots[i]`` of an index-key cache.

``slots`` is ``[N]`` int32/int64 (``-1`` or out-of-range rows are skipped without a host sync,
their memory never written); ``index_format`` is ``"fp8"`` (e4m3 values and one fp32
power-of-two scale per entry, DeepGEMM's paged layout) or ``"bf16"``
(:mod:`compile_ops.indexer.cache`). Stored by the ``"kv"`` backend's row store.

Example::

    >>> import torch, compile_ops
    >>> from compile_ops.indexer.cache import new_index_cache, read_index_keys
    >>> cache = new_index_cache("fp8", num_pages=2, page_size=4)
    >>> compile_ops.write_index_keys(cache, torch.tensor([5, -1]), torch.ones(2, 128), "fp8")
    >>> read_index_keys(cache, torch.tensor([5]), "fp8").unique().tolist()
    [1.0]
"""

indexer_topk.__doc__ = """The ``k`` compressed entries each token's indexer scores highest.

``score[t, c] = sum_h weights[t, h] * relu(<q[t, h], key_c>)`` over the entries
``c < n_entries[t]`` of request ``r = token_to_req[t]`` (entry ``c`` at slot
``block_table[r, c // page_size] * page_size + c % page_size``, ``page_size =
index_cache.shape[1]``: the same number as the ``block_size`` given to ``topk_to_slots``
and the compressed cache's pages, which this op cannot check). ``ids[t]`` holds the ``k``
highest in descending score, equal scores by the lower id (``order="score"``), or the same
ids in ascending id order (``order="id"``: the order DeepSeek-V4.1's reference attends
them in, and no sort), then ``-1`` after the first ``min(k, valid entries)``. Entries
whose table entry is ``-1`` or outside the cache are skipped (never read); ``n_entries``
above ``L = B * page_size`` counts as ``L``. Rows with ``r`` outside ``[0, R)`` or
``n_entries[t] <= 0`` are all ``-1``.

Products: with an ``"fp8"`` cache, q is quantized like the keys (per (token, head) row,
power-of-two scale folded into the weights) and multiplied in e4m3 with fp32 accumulation;
with ``"bf16"``, in bf16. Near-ties closer than that rounding may come out in either order.

Args:
    q: ``[T, Hi, 128]`` bf16 indexer queries.
    weights: ``[T, Hi]`` fp32 per-head weights.
    index_cache: ``[pages, page_size, 132]`` uint8 (``"fp8"``) or ``[pages, page_size, 128]``
        bf16 (:mod:`compile_ops.indexer.cache`).
    block_table: ``[R, B]`` int32 pages of each request row (``-1`` = none).
    token_to_req: ``[T]`` int32 request row of each token.
    n_entries: ``[T]`` int32 entries token ``t`` may see (its own causal count).
    k: ids per token (``>= 1``).
    index_format: ``"fp8"`` or ``"bf16"``.
    candidates: ``[T, C]`` int32 block ids (``-1`` = none), e.g. :func:`indexer_candidates`'
        output, or ``None``: token ``t`` picks only among entries ``c`` with ``c //
        candidate_block`` in ``candidates[t]`` (DeepSeek-V4.1's two-level selection: the
        index layers after the candidate source pick inside its candidate blocks).
    candidate_block: entries per candidate block (``>= 1``).
    order: ``"score"`` (descending score) or ``"id"`` (ascending id).

Returns:
    ``ids [T, k]`` int32 request-local entry ids.

Example::

    >>> import torch, compile_ops
    >>> from compile_ops.indexer.cache import new_index_cache
    >>> cache = new_index_cache("bf16", num_pages=1, page_size=4)
    >>> keys = torch.zeros(4, 128); keys[:, 0] = torch.tensor([1.0, 3.0, 2.0, 3.0])
    >>> compile_ops.write_index_keys(cache, torch.arange(4), keys, "bf16")
    >>> q = torch.zeros(1, 1, 128, dtype=torch.bfloat16); q[..., 0] = 1
    >>> i32 = lambda *v: torch.tensor(v, dtype=torch.int32)
    >>> compile_ops.indexer_topk(q, torch.ones(1, 1), cache, i32(0).view(1, 1), i32(0), i32(4), 3, "bf16").tolist()
    [[1, 3, 2]]
    >>> compile_ops.indexer_topk(q, torch.ones(1, 1), cache, i32(0).view(1, 1), i32(0), i32(4), 3, "bf16",
    ...                          order="id").tolist()
    [[1, 2, 3]]
"""

indexer_candidates.__doc__ = """The ``n_blocks`` best blocks of ``block`` consecutive entries for each token.

The first level of DeepSeek-V4.1's two-level selection (its candidate source layer): the
scores of :func:`indexer_topk` over each token's ``n_entries`` visible entries, padded with
``-inf`` to whole blocks; a block scores the **max** of its entries; the block of the
token's newest visible entry, ``(n_entries[t] - 1) // block``, scores ``+inf`` (always
kept); the ``n_blocks`` highest come back in descending score, equal scores by the lower
block, then ``-1`` for blocks with no visible entry. Pass the result to
:func:`indexer_topk` as ``candidates`` with ``candidate_block = block``.

Args:
    q, weights, index_cache, block_table, token_to_req, n_entries, index_format: as
        :func:`indexer_topk`.
    n_blocks: blocks per token (``>= 1``; DeepSeek-V4.1-Flash: 2048).
    block: entries per block (``>= 1``; DeepSeek-V4.1-Flash: 8).

Returns:
    ``blocks [T, n_blocks]`` int32 request-local block ids.

Example::

    >>> import torch, compile_ops
    >>> from compile_ops.indexer.cache import new_index_cache
    >>> cache = new_index_cache("bf16", num_pages=1, page_size=8)
    >>> keys = torch.zeros(8, 128); keys[:, 0] = torch.tensor([5.0, 0, 1, 1, 0, 2, 0, 0])
    >>> compile_ops.write_index_keys(cache, torch.arange(8), keys, "bf16")
    >>> q = torch.zeros(1, 1, 128, dtype=torch.bfloat16); q[..., 0] = 1
    >>> i32 = lambda *v: torch.tensor(v, dtype=torch.int32)
    >>> compile_ops.indexer_candidates(q, torch.ones(1, 1), cache, i32(0).view(1, 1), i32(0), i32(7), 2, 2, "bf16").tolist()
    [[3, 0]]
"""

dcp_indexer_topk.__doc__ = """:func:`indexer_topk` over a DCP group whose entries are sharded by ``interleave``.

Global entry ``c`` lives on rank ``(c // interleave) % world`` as local entry
``(c // (world * interleave)) * interleave + c % interleave`` (the rule of
:func:`dcp_topk_to_slots`); ``index_cache`` and ``block_table`` are this rank's shard,
``n_entries`` the global counts. Each rank scores its own entries and takes its top-``k``;
the candidates (global id, score) are all-gathered over the group (c10d functional
collectives) and merged with the same order and tie rule, so every rank returns the same
global ids, equal to :func:`indexer_topk` over the unsharded cache. A collective: every rank
calls it with the same shapes, ``k`` and ``interleave``.

Args:
    q, weights, index_cache, block_table, token_to_req, n_entries, k, index_format,
        candidates, candidate_block, order: as :func:`indexer_topk`, with this rank's cache
        and table, global ``n_entries`` and global block ids.
    group_name: the c10d group's name (``group.group_name``).
    interleave: consecutive ids per rank before the next (``>= 1``).

Returns:
    ``ids [T, k]`` int32 global entry ids, the same on every rank.
"""

dcp_indexer_candidates.__doc__ = """:func:`indexer_candidates` over a DCP group whose entries are sharded by ``interleave``.

As :func:`dcp_indexer_topk`: each rank scores its own entries, takes the best
``n_blocks`` blocks of global ids by the max of its entries in them, and the candidates
are all-gathered and merged (a block whose entries several ranks hold counts once, at its
highest max), so every rank returns the same global block ids, equal to
:func:`indexer_candidates` over the unsharded cache. A collective.
"""

indexer_topk_and_candidates.__doc__ = """:func:`indexer_topk` and :func:`indexer_candidates` from one scoring.

DeepSeek-V4.1's candidate source layer takes its own top-k (unrestricted) and the candidate
blocks of the index layers after it from the same scores: this op scores each token's
entries once and returns both, each exactly what the two ops return, so the layer reads its
index keys once. ``order`` orders both: ``"score"`` as the two ops do, ``"id"`` the same ids
and blocks in ascending order (``-1`` last; the attention layer's call, which turns the
blocks into a mask, so no sort of them runs).

Args:
    q, weights, index_cache, block_table, token_to_req, n_entries, k, index_format: as
        :func:`indexer_topk` (no ``candidates``).
    n_blocks, block: as :func:`indexer_candidates`.
    order: ``"score"`` or ``"id"``, of the ids and the blocks.

Returns:
    ``(ids [T, k], blocks [T, n_blocks])`` int32.

Example::

    >>> import torch, compile_ops
    >>> from compile_ops.indexer.cache import new_index_cache
    >>> cache = new_index_cache("bf16", num_pages=1, page_size=8)
    >>> keys = torch.zeros(8, 128); keys[:, 0] = torch.tensor([5.0, 0, 1, 1, 0, 2, 0, 0])
    >>> compile_ops.write_index_keys(cache, torch.arange(8), keys, "bf16")
    >>> q = torch.zeros(1, 1, 128, dtype=torch.bfloat16); q[..., 0] = 1
    >>> i32 = lambda *v: torch.tensor(v, dtype=torch.int32)
    >>> ids, blocks = compile_ops.indexer_topk_and_candidates(q, torch.ones(1, 1), cache, i32(0).view(1, 1), i32(0),
    ...                                                       i32(7), 3, 2, 2, "bf16")
    >>> ids.tolist(), blocks.tolist()
    ([[0, 5, 2]], [[3, 0]])
"""

dcp_indexer_topk_and_candidates.__doc__ = """:func:`indexer_topk_and_candidates` over a DCP group.

Each rank scores its own entries once; the ids merge as :func:`dcp_indexer_topk`'s and the
blocks as :func:`dcp_indexer_candidates`', so every rank returns the same ``(ids, blocks)``,
equal to :func:`indexer_topk_and_candidates` over the unsharded cache. A collective.
"""
