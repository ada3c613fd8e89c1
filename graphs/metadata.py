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

from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence, Union

import numpy as np
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
        rows: the step's :class:`StepRows` (request rows, validity, entry counts).
        swa_idx / swa_lens: ``[T, window]`` SWA slots each token attends (``-1``
            padded) and ``[T]`` their counts (``dsv41::swa_indices``).

    The last three are derived once per step for every layer of the geometry
    (:meth:`StepMetadata.inputs`); ``None`` (as :func:`step_inputs` leaves them without
    ``geometry``) lets the layer derive them itself.
    """

    positions: Tensor
    token_to_req: Tensor
    is_valid: Tensor
    swa_block_table: Tensor
    cmp_block_table: Tensor
    swa_slots: Tensor
    cmp_slots: Tensor
    rows: Optional["StepRows"] = None
    swa_idx: Optional[Tensor] = None
    swa_lens: Optional[Tensor] = None


@dataclass(frozen=True)
class Geometry:
    """What a layer's step inputs depend on besides the step itself: its compress ratio,
    window, page sizes, DCP shard and table widths. Layers of one geometry (in a stack: of
    one ratio) read the same block tables and the same derived step inputs, computed once
    per step (:meth:`StepMetadata.inputs`).
    """

    ratio: int
    window: int
    page_size: int
    block_size: int  # compressed entries per page
    max_requests: int
    max_seq_len: int
    swa_columns: int
    cmp_columns: int
    dcp: tuple[int, int, int] = (0, 1, 1)  # (rank, world, interleave) of the compressed shards

    @classmethod
    def of(cls, window: int, cache, ratio: int, rank: int = 0) -> "Geometry":
        """The geometry of a layer of ``ratio`` with SWA ``window`` in ``cache`` (a
        :class:`graphs.CacheConfig`) on DCP rank ``rank``."""
        return cls(ratio, window, cache.page_size, cache.block_size(ratio), cache.max_requests, cache.max_seq_len,
                   cache.swa_table_columns(), cache.cmp_pages_per_request(ratio),
                   (rank, cache.dcp_world, cache.dcp_interleave))


class StepRows(NamedTuple):
    """Per-token views of a step that the layer's parts share (all ``[T]``).

    Attributes:
        pos: int64 position, clamped to ``>= 0`` (padding tokens read position 0).
        row: int64 request row; ``R`` (the spare state row) for padding tokens.
        valid: bool, ``False`` for padding tokens.
        first / last: int64 first and last position of the token's request in this step.
        n_entries: int32 compressed entries closed at or before the token's position,
            ``(pos + 1) // ratio`` (``0`` for padding): what the token may attend.
    """

    pos: Tensor
    row: Tensor
    valid: Tensor
    first: Tensor
    last: Tensor
    n_entries: Tensor


def step_rows(inp: StepInputs, max_requests: int, ratio: int) -> StepRows:
    """:class:`StepRows` of a step (graph-safe). A request's ``n`` tokens are contiguous in
    the step from index ``s`` at consecutive positions, so two sums over its row give both
    ends: ``n`` and the sum of its token indices, ``n * s + n * (n - 1) / 2``. They are int32
    scatter-adds, which Inductor compiles into its own kernels (it runs min / max and int64
    scatters as ATen's)."""
    valid = inp.is_valid
    pos = inp.positions.long().clamp(min=0)
    row = torch.where(valid, inp.token_to_req.long(), max_requests)
    t = torch.arange(pos.shape[0], dtype=torch.int32, device=pos.device)
    sums = torch.zeros(2, max_requests + 1, dtype=torch.int32, device=pos.device)
    sums = sums.scatter_add(1, row.expand(2, -1), torch.stack([torch.ones_like(t), t]))[:, row].long()
    n = sums[0]
    start = (sums[1] - n * (n - 1) // 2) // n  # the request's first token in the step
    first = torch.where(valid, pos - (t - start), pos)
    last = torch.where(valid, first + n - 1, pos)
    return StepRows(pos, row, valid, first, last, entry_counts(valid, pos, ratio))


def entry_counts(valid: Tensor, pos: Tensor, ratio: int) -> Tensor:
    """``[T]`` int32 compressed entries closed at or before each token, ``(pos + 1) // ratio``
    (``0`` for padding and for ratio 0)."""
    if not ratio:
        return torch.zeros_like(pos, dtype=torch.int32)
    return torch.where(valid, (pos + 1) // ratio, 0).to(torch.int32)


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
    compressed slots are this rank's (``-1`` for entries other ranks hold). The rows and
    SWA indices are left ``None`` (:func:`derive` adds them)."""
    R = swa_block_table.shape[0]
    is_valid = (positions >= 0) & (token_to_req >= 0) & (token_to_req < R)
    swa_slots = compressed_slot_mapping(positions, token_to_req, swa_block_table, page_size, 1)
    cmp_slots = cmp_slot_mapping(positions, token_to_req, cmp_block_table, cmp_block_size, compress_ratio,
                                 (dcp_rank, dcp_world, dcp_interleave))
    return StepInputs(positions, token_to_req, is_valid, swa_block_table, cmp_block_table, swa_slots, cmp_slots)


def cmp_slot_mapping(positions: Tensor, token_to_req: Tensor, cmp_block_table: Tensor, cmp_block_size: int,
                     compress_ratio: int, dcp: tuple[int, int, int] = (0, 1, 1)) -> Tensor:
    """``[T]`` int32 compressed slot each group-closing token writes (``-1``: none; all
    ``-1`` for ratio 0); under DCP this rank's (``dcp = (rank, world, interleave)``)."""
    if not compress_ratio:
        return torch.full_like(positions, -1)
    return compressed_slot_mapping(positions, token_to_req, cmp_block_table, cmp_block_size, compress_ratio, *dcp)


def derive(inp: StepInputs, geometry: Geometry) -> StepInputs:
    """``inp`` with its :class:`StepRows` and SWA indices (graph-safe)."""
    rows = step_rows(inp, geometry.max_requests, geometry.ratio)
    swa_idx, swa_lens = torch.ops.dsv41.swa_indices(inp.positions, inp.token_to_req, inp.swa_block_table,
                                                    geometry.page_size, geometry.window)
    return inp._replace(rows=rows, swa_idx=swa_idx, swa_lens=swa_lens)


TableLayout = tuple[tuple[Union[str, int], int, int], ...]
"""The block tables of a step, as one flat int32 store: ``(kind, rows, columns)`` per table,
one after another, each row-major: ``("swa", R, Bs)`` first, then ``(ratio, R, Bc)`` per
compressed ratio, ascending (:func:`table_layout`)."""


def table_layout(requests: int, swa_columns: int, cmp_columns: dict[int, int]) -> TableLayout:
    """The :data:`TableLayout` of an SWA table of ``swa_columns`` and a compressed table of
    ``cmp_columns[ratio]`` columns per (nonzero) ratio, ``requests`` rows each."""
    return (("swa", requests, swa_columns), *((r, requests, cmp_columns[r]) for r in sorted(cmp_columns)))


def table_offsets(tables: TableLayout) -> tuple[dict[Union[str, int], int], int]:
    """``({kind: offset of its first entry in the store}, entries of the store)`` of ``tables``."""
    offsets, at = {}, 0
    for kind, rows, cols in tables:
        offsets[kind] = at
        at += rows * cols
    return offsets, at


class PageChanges(NamedTuple):
    """Block-table entries to set: what :meth:`graphs.PageAllocator.take_changes` gives and
    :meth:`StepMetadata.apply_pages` takes.

    Attributes:
        index: ``[n]`` int64 flat index of each entry in the tables laid out as ``tables``
            (``offset of its table + row * columns + column``); each entry at most once.
        pages: ``[n]`` int32 page of each entry (``-1`` frees it).
        tables: the :data:`TableLayout` ``index`` counts in (a metadata refuses changes of
            another layout).
    """

    index: Tensor
    pages: Tensor
    tables: TableLayout


class StepMetadata(nn.Module):
    """Static step buffers of one layer, or of a stack's geometries, sized for
    ``max_tokens`` tokens and ``R`` requests.

    Buffers (non-persistent, on the layer's device): ``ints [2, max_tokens]`` int32 holding
    positions / token_to_req (one buffer so an engine can fill it with one copy),
    ``block_tables``: every block table in one int32 store laid out as :attr:`tables`
    (``-1`` until pages are given; :attr:`swa_block_table` ``[R, Bs]`` and
    :meth:`cmp_table_of` ``(r)`` ``[R, Bc]`` are views of it), the SWA slot mapping
    ``swa_slots [max_tokens]`` and per compressed ratio ``r`` of the geometries
    ``cmp_slots_{r} [max_tokens]``, and ``valid [max_tokens]`` bool (the step's tokens that
    are not padding).
    :attr:`cmp_block_table` / :attr:`cmp_slots` are those of a one-geometry (one-layer)
    metadata. A step of ``T`` tokens reads the first ``T`` columns; ``T`` comes from the
    hidden states' shape. Every geometry's step inputs are derived once per step
    (:meth:`inputs`), for all the layers that share it.

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

    def __init__(self, max_tokens: int, geometries: Sequence[Geometry], device=None) -> None:
        super().__init__()
        self.max_tokens = max_tokens
        self.geometries = {g.ratio: g for g in geometries}
        if len(self.geometries) != len(geometries) or not geometries:
            raise ValueError(f"need one geometry per ratio, got ratios {[g.ratio for g in geometries]}")
        first = geometries[0]
        shared = {(g.window, g.page_size, g.max_requests, g.max_seq_len, g.swa_columns, g.dcp) for g in geometries}
        if len(shared) != 1:
            raise ValueError("the geometries of one metadata must share the window, SWA pages, requests and DCP shard")
        ints = torch.zeros(2, max_tokens, dtype=torch.int32, device=device)
        ints[0] = -1
        self.register_buffer("ints", ints, persistent=False)
        R = first.max_requests

        # every block table in one store: a step's changes to all of them are one put_
        self.tables = table_layout(R, first.swa_columns, {g.ratio: g.cmp_columns for g in geometries if g.ratio})
        self._table_at, size = table_offsets(self.tables)
        self.register_buffer("block_tables", torch.full((size,), -1, dtype=torch.int32, device=device), persistent=False)

        def slots():
            return torch.full((max_tokens,), -1, dtype=torch.int32, device=device)

        self.register_buffer("swa_slots", slots(), persistent=False)
        self.register_buffer("valid", torch.zeros(max_tokens, dtype=torch.bool, device=device), persistent=False)
        for g in geometries:
            if g.ratio:
                self.register_buffer(f"cmp_slots_{g.ratio}", slots(), persistent=False)

    @classmethod
    def for_layer(cls, layer, max_tokens: Optional[int] = None) -> "StepMetadata":
        """Buffers matching ``layer``'s cache geometry (a :class:`graphs.DSV41Attention`, or
        a :class:`graphs.DSV41Stack`: one geometry per ratio), block tables empty (``-1``)."""
        return cls(max_tokens or layer.cache_cfg.max_tokens, layer.geometries(), layer.device)

    def _table(self, kind: Union[str, int]) -> Tensor:
        """Table ``kind`` of :attr:`tables`: a view ``[R, columns]`` of :attr:`block_tables`."""
        _, R, cols = next(table for table in self.tables if table[0] == kind)
        at = self._table_at[kind]
        return self.block_tables[at:at + R * cols].view(R, cols)

    @property
    def swa_block_table(self) -> Tensor:
        """The SWA block table ``[R, Bs]`` (a view of :attr:`block_tables`)."""
        return self._table("swa")

    def cmp_table_of(self, ratio: int) -> Tensor:
        """Ratio ``ratio``'s compressed block table ``[R, Bc]`` (a view of
        :attr:`block_tables`; ``[R, 0]`` for ratio 0)."""
        if not ratio:
            return self.block_tables[:0].view(self.tables[0][1], 0)
        return self._table(ratio)

    @property
    def only(self) -> Geometry:
        if len(self.geometries) != 1:
            raise AttributeError(f"this metadata has geometries of ratios {list(self.geometries)}: name one")
        return next(iter(self.geometries.values()))

    @property
    def cmp_block_table(self) -> Tensor:
        """The compressed block table of a one-geometry metadata."""
        return self.cmp_table_of(self.only.ratio)

    @property
    def cmp_slots(self) -> Tensor:
        """The compressed slot mapping of a one-geometry metadata (all ``-1`` for ratio 0)."""
        ratio = self.only.ratio
        return getattr(self, f"cmp_slots_{ratio}") if ratio else torch.full_like(self.swa_slots, -1)

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

    def update_padded(self, staged: Tensor) -> None:
        """:meth:`update` from a staged host block ``[2, max_tokens]`` int32 (pinned, for an
        asynchronous copy) whose first ``b`` columns hold a ``b``-token step, padding
        included: row 0 the positions (``-1`` past the step's tokens), row 1 the request
        rows (``0`` there), as :class:`graphs.StepRunner` stages them. The whole block is one
        contiguous copy (``non_blocking``); its columns past ``b``, which nothing of a
        ``b``-token step reads, come along (slicing the two rows would cost host time per
        step, a strided copy a device temporary and a copy kernel)."""
        if staged.shape != self.ints.shape or staged.dtype != torch.int32:
            raise ValueError(f"staged must be int32 {list(self.ints.shape)} (2 x max_tokens), got "
                             f"{staged.dtype} {list(staged.shape)}")
        self.ints.copy_(staged, non_blocking=True)

    def apply_pages(self, changes: Optional[PageChanges], *, staging: Optional[Tensor] = None) -> None:
        """Set the block-table entries of ``changes`` (host :class:`PageChanges`, as
        :meth:`graphs.PageAllocator.take_changes` gives them; ``None``: nothing to set).

        The flat indices (int64) and pages travel packed in one host buffer, in one
        ``non_blocking`` copy, and :attr:`block_tables` takes one ``put_``: a step's
        changes to every table cost a few host calls. ``staging``: a 1-D int32 host buffer
        (pinned, for a CUDA layer) that no pending copy still reads, to pack the changes
        into when they fit (:class:`graphs.StepRunner` passes one of its staging ring's);
        else they go in a new buffer (a new pinned buffer costs about 100 us of host
        time). Raises ``ValueError`` for changes of another table layout, off the host,
        of other dtypes or indices outside the tables (which the device would write out of
        bounds)."""
        if changes is None:  # most decode steps change no table
            return
        if not isinstance(changes, PageChanges):
            raise TypeError(f"apply_pages takes PageChanges (PageAllocator.take_changes), got {type(changes).__name__}")
        index, pages, tables = changes
        if tables != self.tables:
            raise ValueError(f"these page changes index block tables laid out as {tables}, this metadata's are "
                             f"{self.tables}: plan with PageAllocator.for_layer of the same layer")
        if not (isinstance(index, Tensor) and isinstance(pages, Tensor) and index.is_cpu and pages.is_cpu
                and index.dtype == torch.int64 and pages.dtype == torch.int32 and index.dim() == 1
                and pages.shape == index.shape):
            raise ValueError("apply_pages takes host (CPU) changes, [n] int64 indices and [n] int32 pages, "
                             "as PageAllocator.take_changes gives them")
        k = index.shape[0]
        if not k:
            return
        flat = index.numpy()
        if np.count_nonzero(flat.view(np.uint64) >= self.block_tables.shape[0]):  # a negative one reads as huge
            bad = int(flat[(flat < 0) | (flat >= self.block_tables.shape[0])][0])
            raise ValueError(f"page change index {bad} is outside the block tables' {self.block_tables.shape[0]} entries")
        if staging is not None and (not isinstance(staging, Tensor) or not staging.is_cpu or staging.dim() != 1
                                    or staging.dtype != torch.int32):
            raise ValueError("staging must be a 1-D int32 host (CPU) tensor")
        device = self.block_tables.device
        # the indices as int64 words (two int32 each, native byte order, as the device reads
        # them: an int32 index costs a conversion kernel), then the pages
        if staging is not None and staging.shape[0] >= 3 * k:
            host = staging[:3 * k]
        else:
            host = torch.empty(3 * k, dtype=torch.int32, pin_memory=device.type == "cuda")
        packed = host.numpy()
        packed[:2 * k].view(np.int64)[:] = flat
        packed[2 * k:] = pages.numpy()
        moved = host.to(device, non_blocking=True)
        self.block_tables.put_(moved[:2 * k].view(torch.int64), moved[2 * k:])

    def inputs(self, num_tokens: int, ratio: Optional[int] = None) -> StepInputs:
        """:class:`StepInputs` of the first ``num_tokens`` columns for geometry ``ratio``
        (default: the only one), rows and SWA indices included; writes the slot mappings
        into the buffers (runs inside the compiled step)."""
        return self.all_inputs(num_tokens, () if ratio is None and len(self.geometries) == 1 else (ratio,))[
            self.only.ratio if ratio is None else ratio]

    def all_inputs(self, num_tokens: int, ratios: Sequence[int] = ()) -> dict[int, StepInputs]:
        """``{ratio: StepInputs}`` of every geometry (or of ``ratios``), each derived once:
        the SWA slots and indices, shared by all, once for the step."""
        T = num_tokens
        # Tell the compiler the slices below are exactly T long (not min(T, max_tokens)),
        # so a dynamic T needs no guards relating the two.
        torch._check(T <= self.max_tokens)
        positions, token_to_req = self.ints[0, :T], self.ints[1, :T]
        ratios = list(ratios or self.geometries)
        first = self.geometries[ratios[0]]
        # validity, SWA slots and indices and the rows once; then each geometry's compressed slots
        base = step_inputs(positions, token_to_req, self.swa_block_table, self.cmp_table_of(first.ratio),
                           first.page_size, first.block_size, first.ratio, *first.dcp)
        self.swa_slots[:T].copy_(base.swa_slots)
        # validity stored once, beside the slots: an op that takes it (the slot conversion)
        # reads this buffer, where Inductor would launch a kernel of its own to compute it
        # just before the op
        self.valid[:T].copy_(base.is_valid)
        base = derive(base._replace(swa_slots=self.swa_slots[:T], is_valid=self.valid[:T]), first)
        out: dict[int, StepInputs] = {}
        for ratio in ratios:
            g = self.geometries[ratio]
            table, cmp_slots, rows = self.cmp_table_of(ratio), base.cmp_slots, base.rows
            if ratio != first.ratio:
                cmp_slots = cmp_slot_mapping(positions, token_to_req, table, g.block_size, ratio, g.dcp)
                rows = rows._replace(n_entries=entry_counts(rows.valid, rows.pos, ratio))
            if ratio:
                buf = getattr(self, f"cmp_slots_{ratio}")
                buf[:T].copy_(cmp_slots)
                cmp_slots = buf[:T]
            out[ratio] = base._replace(cmp_block_table=table, cmp_slots=cmp_slots, rows=rows)
        return out
