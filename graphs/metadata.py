"""Step metadata: what one step needs besides the hidden states, in static buffers.

Shape legend: ``T`` tokens of the step, ``R`` request rows, ``Bs`` / ``Bc`` columns of the
SWA / compressed block tables (pages of ``max_seq_len`` positions / entries).

:class:`StepInputs` is what :class:`graphs.DSV41Attention` reads: plain tensors, all
derived from positions, request rows and block tables by :func:`step_inputs` with tensor
math only (no host sync), so it runs inside a compiled, captured step.
:class:`StepMetadata` owns those tensors as buffers sized for the largest step; an engine
(or :class:`graphs.StepRunner`) copies each step's values in with
:meth:`StepMetadata.update`, the page changes of its :class:`graphs.PageAllocator` with
:meth:`StepMetadata.apply_pages`, and replays.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor, nn

from compile_ops.slots.mapping import compressed_slot_mapping


class StepInputs(NamedTuple):
    """Per-step tensors of one layer (all int32 except ``is_valid``).

    Attributes:
        positions: ``[T]`` absolute position of each token, ``-1`` for padding. The tokens
            of one request are contiguous and at consecutive positions.
        token_to_req: ``[T]`` request row of each token (in the block tables and in the
            compressor state).
        is_valid: ``[T]`` bool, ``False`` for padding tokens (their writes are skipped,
            their attention rows are empty).
        swa_block_table: ``[R, Bs]`` SWA cache page of each page-sized span of positions
            (``-1`` = none held).
        cmp_block_table: ``[R, Bc]`` compressed cache pages (``Bc = 0`` for ratio 0).
        swa_slots: ``[T]`` SWA slot each token's kv is written to (``-1``: skip).
        cmp_slots: ``[T]`` compressed slot written by a token that closes a group
            (``-1``: no write).
    """

    positions: Tensor
    token_to_req: Tensor
    is_valid: Tensor
    swa_block_table: Tensor
    cmp_block_table: Tensor
    swa_slots: Tensor
    cmp_slots: Tensor


def step_inputs(
    positions: Tensor,
    token_to_req: Tensor,
    swa_block_table: Tensor,
    cmp_block_table: Tensor,
    page_size: int,
    cmp_block_size: int,
    compress_ratio: int,
    dcp_rank: int = 0,
    dcp_world: int = 1,
    dcp_interleave: int = 1,
) -> StepInputs:
    """Derive validity and both slot mappings (graph-safe tensor math); under DCP the
    compressed slots are this rank's (``-1`` for entries other ranks hold)."""
    R = swa_block_table.shape[0]
    is_valid = (positions >= 0) & (token_to_req >= 0) & (token_to_req < R)
    swa_slots = compressed_slot_mapping(positions, token_to_req, swa_block_table, page_size, 1)
    if compress_ratio:
        cmp_slots = compressed_slot_mapping(positions, token_to_req, cmp_block_table, cmp_block_size, compress_ratio,
                                            dcp_rank, dcp_world, dcp_interleave)
    else:
        cmp_slots = torch.full_like(swa_slots, -1)
    return StepInputs(positions, token_to_req, is_valid, swa_block_table, cmp_block_table, swa_slots, cmp_slots)


PageChanges = tuple[Tensor, Tensor, Tensor]
"""``(rows, columns, pages)``: int32 ``[n]`` each, block-table entries to set (``-1`` frees)."""


class StepMetadata(nn.Module):
    """Static step buffers of one layer, sized for ``max_tokens`` tokens and ``R`` requests.

    Buffers (non-persistent, on the layer's device): ``ints [2, max_tokens]`` int32 holding
    positions / token_to_req (one buffer so an engine can fill it with one copy),
    ``swa_block_table [R, Bs]`` and ``cmp_block_table [R, Bc]`` (``-1`` until pages are
    given), and the slot mappings ``swa_slots`` / ``cmp_slots [max_tokens]`` that the step
    writes. A step of ``T`` tokens reads the first ``T`` columns; ``T`` comes from the
    hidden states' shape.

    Example::

        >>> import torch
        >>> from graphs import CacheConfig, DSV41Attention, StepMetadata, TINY
        >>> layer = DSV41Attention(TINY, CacheConfig(4, 4, 32, 4), compress_ratio=2)
        >>> meta = StepMetadata.for_layer(layer)
        >>> meta.update(torch.tensor([5, 0], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), bucket=4)
        2
        >>> meta.positions.tolist()
        [5, 0, -1, -1]
    """

    def __init__(self, max_tokens: int, swa_columns: int, cmp_columns: int, max_requests: int, page_size: int,
                 cmp_block_size: int, compress_ratio: int, device=None, dcp: tuple[int, int, int] = (0, 1, 1)) -> None:
        super().__init__()
        self.max_tokens = max_tokens
        self.dcp = dcp  # (rank, world, interleave) of the compressed caches' shards
        self.page_size = page_size
        self.cmp_block_size = cmp_block_size
        self.compress_ratio = compress_ratio
        ints = torch.zeros(2, max_tokens, dtype=torch.int32, device=device)
        ints[0] = -1
        self.register_buffer("ints", ints, persistent=False)
        for name, cols in (("swa_block_table", swa_columns), ("cmp_block_table", cmp_columns)):
            table = torch.full((max_requests, cols), -1, dtype=torch.int32, device=device)
            self.register_buffer(name, table, persistent=False)
        self.register_buffer("swa_slots", torch.full((max_tokens,), -1, dtype=torch.int32, device=device), persistent=False)
        self.register_buffer("cmp_slots", torch.full((max_tokens,), -1, dtype=torch.int32, device=device), persistent=False)

    @classmethod
    def for_layer(cls, layer, max_tokens: Optional[int] = None) -> "StepMetadata":
        """Buffers matching ``layer``'s cache geometry, block tables empty (``-1``)."""
        cache, ratio = layer.cache_cfg, layer.compress_ratio
        return cls(max_tokens or cache.max_tokens, cache.swa_table_columns(), cache.cmp_pages_per_request(ratio),
                   cache.max_requests, cache.page_size, cache.block_size(ratio), ratio, layer.swa_cache.device,
                   (layer.dcp_rank, cache.dcp_world, cache.dcp_interleave))

    @property
    def positions(self) -> Tensor:
        return self.ints[0]

    @property
    def token_to_req(self) -> Tensor:
        return self.ints[1]

    def update(self, positions: Tensor, token_to_req: Tensor, *, bucket: Optional[int] = None) -> int:
        """Copy one step's values in; columns ``n .. bucket-1`` become padding (position ``-1``).

        ``positions`` / ``token_to_req`` are ``[n]`` integer tensors on any device; copies
        are ``non_blocking``, so host tensors (the runner's) or device tensors keep the
        step free of host syncs. Returns ``n``.
        """
        for name, t in (("positions", positions), ("token_to_req", token_to_req)):
            if not isinstance(t, Tensor) or t.dim() != 1 or t.is_floating_point() or t.dtype == torch.bool:
                got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, Tensor) else type(t).__name__
                raise TypeError(f"{name} must be a 1-D integer tensor (int32 or int64), got {got}")
        n = positions.shape[0]
        bucket = self.max_tokens if bucket is None else bucket
        if not n <= bucket <= self.max_tokens:
            raise ValueError(f"need n <= bucket <= max_tokens, got n={n}, bucket={bucket}, max_tokens={self.max_tokens}")
        if token_to_req.shape != positions.shape:
            raise ValueError(f"token_to_req must be [n] = [{n}] like positions, got {tuple(token_to_req.shape)}")
        self.ints[0, :n].copy_(positions, non_blocking=True)
        self.ints[1, :n].copy_(token_to_req, non_blocking=True)
        if bucket > n:
            self.ints[0, n:bucket].fill_(-1)
        return n

    def apply_pages(self, swa: Optional[PageChanges] = None, cmp: Optional[PageChanges] = None) -> None:
        """Set block-table entries (``PageChanges`` of :meth:`graphs.PageAllocator.take_changes`;
        host tensors are copied ``non_blocking``)."""
        for table, changes in ((self.swa_block_table, swa), (self.cmp_block_table, cmp)):
            if changes is not None and changes[0].numel():
                rows, cols, pages = (c.to(table.device, non_blocking=True) for c in changes)
                table.index_put_((rows.long(), cols.long()), pages.to(table.dtype))

    def inputs(self, num_tokens: int) -> StepInputs:
        """:class:`StepInputs` of the first ``num_tokens`` columns; writes the slot mappings
        into ``swa_slots`` / ``cmp_slots`` (runs inside the compiled step)."""
        T = num_tokens
        # Tell the compiler the slices below are exactly T long (not min(T, max_tokens)),
        # so a dynamic T needs no guards relating the two.
        torch._check(T <= self.max_tokens)
        inp = step_inputs(
            self.ints[0, :T], self.ints[1, :T], self.swa_block_table, self.cmp_block_table,
            self.page_size, self.cmp_block_size, self.compress_ratio, *self.dcp,
        )
        self.swa_slots[:T].copy_(inp.swa_slots)
        self.cmp_slots[:T].copy_(inp.cmp_slots)
        return inp._replace(swa_slots=self.swa_slots[:T], cmp_slots=self.cmp_slots[:T])
