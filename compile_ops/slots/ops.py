"""Slot conversion ops: ``topk_to_slots``, ``dcp_topk_to_slots``, ``swa_indices``.

Shape legend: ``T`` tokens, ``K`` top-k columns, ``R`` requests, ``B`` pages per request
row of a block table, ``W`` the SWA window. A slot is ``page * page_size + offset``; ``-1``
marks an empty entry. Outputs are int32 and their shapes come from input shapes only.
"""

from __future__ import annotations

import torch
from torch import Tensor

from compile_ops import backends
from compile_ops._checks import check_dim, check_int, check_tensor
from compile_ops.slots.reference import dcp_topk_to_slots_reference, swa_indices_reference, topk_to_slots_reference


def _check_tables(token_to_req: Tensor, block_table: Tensor, T, device) -> None:
    check_tensor("token_to_req", token_to_req, torch.int32, 1, device)
    check_dim("token_to_req", token_to_req, 0, T, "the token count T")
    check_tensor("block_table", block_table, torch.int32, 2, device)


def _check_topk_args(topk, token_to_req, block_table, block_size, is_valid) -> None:
    check_tensor("topk", topk, torch.int32, 2)
    T = topk.shape[0]
    _check_tables(token_to_req, block_table, T, topk.device)
    check_int("block_size", block_size, 1)
    check_tensor("is_valid", is_valid, torch.bool, 1, topk.device)
    check_dim("is_valid", is_valid, 0, T, "topk.shape[0], the token count T")


def _check_dcp_args(rank, world, interleave) -> None:
    check_int("world", world, 1)
    check_int("rank", rank, 0)
    if rank >= world:
        raise ValueError(f"rank must be in [0, world) = [0, {world}), got {rank}")
    check_int("interleave", interleave, 1)


def _new_slots(topk: Tensor) -> tuple[Tensor, Tensor]:
    return torch.empty_like(topk, memory_format=torch.contiguous_format), topk.new_empty(topk.shape[0])


@torch.library.custom_op("dsv41::topk_to_slots", mutates_args=())
def topk_to_slots(topk: Tensor, token_to_req: Tensor, block_table: Tensor, block_size: int, is_valid: Tensor) -> tuple[Tensor, Tensor]:
    _check_topk_args(topk, token_to_req, block_table, block_size, is_valid)
    run = backends.implementation("slots", "topk_to_slots", topk.device)
    return run(topk, token_to_req, block_table, block_size, is_valid)


@topk_to_slots.register_fake
def _(topk, token_to_req, block_table, block_size, is_valid):
    _check_topk_args(topk, token_to_req, block_table, block_size, is_valid)
    return _new_slots(topk)


@torch.library.custom_op("dsv41::dcp_topk_to_slots", mutates_args=())
def dcp_topk_to_slots(
    topk: Tensor, token_to_req: Tensor, block_table: Tensor, block_size: int, is_valid: Tensor, rank: int, world: int, interleave: int
) -> tuple[Tensor, Tensor]:
    _check_topk_args(topk, token_to_req, block_table, block_size, is_valid)
    _check_dcp_args(rank, world, interleave)
    run = backends.implementation("slots", "dcp_topk_to_slots", topk.device)
    return run(topk, token_to_req, block_table, block_size, is_valid, rank, world, interleave)


@dcp_topk_to_slots.register_fake
def _(topk, token_to_req, block_table, block_size, is_valid, rank, world, interleave):
    _check_topk_args(topk, token_to_req, block_table, block_size, is_valid)
    _check_dcp_args(rank, world, interleave)
    return _new_slots(topk)


def _check_swa_args(positions, token_to_req, block_table, page_size, window) -> None:
    check_tensor("positions", positions, torch.int32, 1)
    _check_tables(token_to_req, block_table, positions.shape[0], positions.device)
    check_int("page_size", page_size, 1)
    check_int("window", window, 1)


@torch.library.custom_op("dsv41::swa_indices", mutates_args=())
def swa_indices(positions: Tensor, token_to_req: Tensor, block_table: Tensor, page_size: int, window: int) -> tuple[Tensor, Tensor]:
    _check_swa_args(positions, token_to_req, block_table, page_size, window)
    run = backends.implementation("slots", "swa_indices", positions.device)
    return run(positions, token_to_req, block_table, page_size, window)


@swa_indices.register_fake
def _(positions, token_to_req, block_table, page_size, window):
    _check_swa_args(positions, token_to_req, block_table, page_size, window)
    return positions.new_empty((positions.shape[0], window)), positions.new_empty(positions.shape[0])


SLOT_OPS = ("topk_to_slots", "dcp_topk_to_slots", "swa_indices")
backends.register_backend("slots", "triton", backends.cuda_with_triton,
                          {op: backends.imported("compile_ops.slots.triton", f"{op}_triton") for op in SLOT_OPS})
backends.register_backend("slots", "reference", backends.any_device, {
    "topk_to_slots": topk_to_slots_reference, "dcp_topk_to_slots": dcp_topk_to_slots_reference,
    "swa_indices": swa_indices_reference,
})

topk_to_slots.__doc__ = """Convert request-local compressed top-k ids to compacted cache slots (DCP world 1).

Each id ``c >= 0`` of token ``t`` (request ``r = token_to_req[t]``) becomes
``block_table[r, c // block_size] * block_size + c % block_size``. Ids that are negative,
whose page index is ``>= B``, or whose block-table entry is negative are invalid. Valid
slots are moved to the front of the row in their input order, the rest is ``-1``.
Rows with ``is_valid[t] == False`` (CUDA-graph padding) or ``r`` outside ``[0, R)`` are
all ``-1`` with ``lens[t] = 0``.

Args:
    topk: ``[T, K]`` int32 request-local compressed ids, ``-1`` = none.
    token_to_req: ``[T]`` int32 request row of each token in ``block_table``.
    block_table: ``[R, B]`` int32 page ids of the compressed cache.
    block_size: compressed entries per page (``>= 1``): the compressed cache's page size,
        and the index-key cache's (``indexer_topk`` reads it from that cache's shape). The
        ops cannot see each other, so a different number here gives other slots, not an
        error: build all of them from one value.
    is_valid: ``[T]`` bool, ``False`` for padding tokens.

Returns:
    ``(slots [T, K] int32, lens [T] int32)``.

Example::

    >>> import torch, compile_ops
    >>> i32 = lambda *v: torch.tensor(v, dtype=torch.int32)
    >>> slots, lens = compile_ops.topk_to_slots(i32([5, -1, 0]).view(1, 3), i32(0),
    ...     i32([7, 3]).view(1, 2), 4, torch.tensor([True]))
    >>> slots.tolist(), lens.tolist()
    ([[13, 28, -1]], [2])
"""

dcp_topk_to_slots.__doc__ = """:func:`topk_to_slots` for DCP rank ``rank`` of ``world``, with global ids.

The compressed entries are sharded over ranks by ``interleave = I``: global id ``c``
belongs to rank ``(c // I) % world`` and has local id ``(c // (world * I)) * I + c % I``
there. Ids owned by other ranks are dropped; the local ids are converted through this
rank's ``block_table`` and compacted as in :func:`topk_to_slots`.

Args:
    topk, token_to_req, block_table, block_size, is_valid: as :func:`topk_to_slots`, with
        ``topk`` holding global ids and ``block_table`` this rank's page table.
    rank: this rank, ``0 <= rank < world``.
    world: DCP group size (``>= 1``).
    interleave: consecutive ids per rank before moving to the next (``>= 1``).

Returns:
    ``(slots [T, K] int32, lens [T] int32)``.

Example::

    >>> import torch, compile_ops
    >>> i32 = lambda *v: torch.tensor(v, dtype=torch.int32)
    >>> slots, lens = compile_ops.dcp_topk_to_slots(i32(0, 1, 2, 3).view(1, 4), i32(0),
    ...     i32(2).view(1, 1), 16, torch.tensor([True]), 1, 2, 1)
    >>> slots.tolist(), lens.tolist()
    ([[32, 33, -1, -1]], [2])
"""

swa_indices.__doc__ = """Slots of each token's sliding window, oldest first.

Position ``x`` of request ``r`` lives in slot
``block_table[r, x // page_size] * page_size + x % page_size``. Row ``t`` (position
``p = positions[t]``) holds positions ``max(0, p - window + 1) .. p`` and
``lens[t] = min(p + 1, window)``; columns past ``lens[t]`` are ``-1``. Tokens with
``p < 0`` or a request outside ``[0, R)`` get ``lens = 0``. A position whose page lies
outside the table row, or whose table entry is negative, is ``-1`` (a hole that
:func:`sparse_mla` skips) but still counts in ``lens``.

Args:
    positions: ``[T]`` int32 absolute positions, ``-1`` for padding tokens.
    token_to_req: ``[T]`` int32 request row in ``block_table``.
    block_table: ``[R, B]`` int32 page ids of the SWA cache.
    page_size: tokens per page (``>= 1``).
    window: window length ``W >= 1``.

Returns:
    ``(indices [T, W] int32, lens [T] int32)``.

Example::

    >>> import torch, compile_ops
    >>> i32 = lambda *v: torch.tensor(v, dtype=torch.int32)
    >>> idx, lens = compile_ops.swa_indices(i32(5), i32(0), i32([4, 9]).view(1, 2), 4, 3)
    >>> idx.tolist(), lens.tolist()
    ([[19, 36, 37]], [3])
"""
