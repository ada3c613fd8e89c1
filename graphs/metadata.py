"""Step metadata: what one decode step needs besides the hidden states, in static buffers.

Shape legend: ``T`` tokens of the step (one per request), ``R`` request rows, ``Bs`` /
``Bc`` pages per request row of the SWA / compressed block tables.

:class:`StepInputs` is what :class:`graphs.DSV41Attention` reads: plain tensors, all
derived from positions, request rows and block tables by :func:`step_inputs` with tensor
math only (no host sync), so it runs inside a compiled, captured step.
:class:`StepMetadata` owns those tensors as buffers sized for the largest bucket; an
engine (or :class:`graphs.DecodeRunner`) copies each step's values in with
:meth:`StepMetadata.update` and replays.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor, nn

from compile_ops.slots.mapping import compressed_slot_mapping


class StepInputs(NamedTuple):
    """Per-step tensors of one layer (all int32 except ``is_valid``).

    Attributes:
        positions: ``[T]`` absolute position of each token, ``-1`` for padding.
        token_to_req: ``[T]`` request row of each token (in the block tables and in the
            compressor state).
        seq_lens: ``[T]`` sequence length after this step (``position + 1`` in decode);
            ignored for padding tokens.
        is_valid: ``[T]`` bool, ``False`` for padding tokens (their writes are skipped,
            their attention rows are empty).
        swa_block_table: ``[R, Bs]`` SWA cache pages of each request (``-1`` = none).
        cmp_block_table: ``[R, Bc]`` compressed cache pages (``Bc = 0`` for ratio 0).
        swa_slots: ``[T]`` SWA slot each token's kv is written to (``-1``: skip).
        cmp_slots: ``[T]`` compressed slot written by a token that closes a group
            (``-1``: no write).
    """

    positions: Tensor
    token_to_req: Tensor
    seq_lens: Tensor
    is_valid: Tensor
    swa_block_table: Tensor
    cmp_block_table: Tensor
    swa_slots: Tensor
    cmp_slots: Tensor


def step_inputs(
    positions: Tensor,
    token_to_req: Tensor,
    seq_lens: Tensor,
    swa_block_table: Tensor,
    cmp_block_table: Tensor,
    page_size: int,
    cmp_block_size: int,
    compress_ratio: int,
) -> StepInputs:
    """Derive validity and both slot mappings (graph-safe tensor math)."""
    R = swa_block_table.shape[0]
    is_valid = (positions >= 0) & (token_to_req >= 0) & (token_to_req < R)
    swa_slots = compressed_slot_mapping(positions, token_to_req, swa_block_table, page_size, 1)
    if compress_ratio:
        cmp_slots = compressed_slot_mapping(positions, token_to_req, cmp_block_table, cmp_block_size, compress_ratio)
    else:
        cmp_slots = torch.full_like(swa_slots, -1)
    return StepInputs(positions, token_to_req, seq_lens, is_valid, swa_block_table, cmp_block_table, swa_slots, cmp_slots)


def default_block_tables(
    max_requests: int, pages_per_request: int, *, first_page: int = 1, device=None, generator=None,
    columns: Optional[int] = None,
) -> Tensor:
    """A block table ``[R, columns]`` int32 giving each request row its own
    ``pages_per_request`` pages, cycled through when ``columns`` is larger (a ring: column
    ``j`` holds the row's page ``j % pages_per_request``; default ``columns = pages_per_request``).

    Pages ``first_page .. first_page + R*B - 1`` are handed out in order, or in a random
    order when ``generator`` is given (tests use that to make page ids non-contiguous).
    """
    n = max_requests * pages_per_request
    order = torch.randperm(n, generator=generator) if generator is not None else torch.arange(n)
    pages = (order + first_page).to(torch.int32).view(max_requests, pages_per_request)
    if columns is not None and columns != pages_per_request:
        pages = pages[:, torch.arange(columns) % max(1, pages_per_request)]
    return pages.contiguous().to(device)


class StepMetadata(nn.Module):
    """Static step buffers of one layer, sized for ``max_tokens`` tokens and ``R`` requests.

    Buffers (non-persistent, on the layer's device): ``ints [3, max_tokens]`` int32 holding
    positions / token_to_req / seq_lens (one buffer so an engine can fill it with one
    copy), ``swa_block_table [R, Bs]``, ``cmp_block_table [R, Bc]``, and the slot mappings
    ``swa_slots`` / ``cmp_slots [max_tokens]`` that the step writes. A step of ``T`` tokens
    reads the first ``T`` columns; ``T`` comes from the hidden states' shape.

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

    def __init__(
        self, max_tokens: int, swa_block_table: Tensor, cmp_block_table: Tensor, page_size: int,
        cmp_block_size: int, compress_ratio: int,
    ) -> None:
        super().__init__()
        device = swa_block_table.device
        self.max_tokens = max_tokens
        self.page_size = page_size
        self.cmp_block_size = cmp_block_size
        self.compress_ratio = compress_ratio
        ints = torch.zeros(3, max_tokens, dtype=torch.int32, device=device)
        ints[0] = -1
        self.register_buffer("ints", ints, persistent=False)
        self.register_buffer("swa_block_table", swa_block_table.to(torch.int32).clone(), persistent=False)
        self.register_buffer("cmp_block_table", cmp_block_table.to(torch.int32).clone(), persistent=False)
        self.register_buffer("swa_slots", torch.full((max_tokens,), -1, dtype=torch.int32, device=device), persistent=False)
        self.register_buffer("cmp_slots", torch.full((max_tokens,), -1, dtype=torch.int32, device=device), persistent=False)

    @classmethod
    def for_layer(cls, layer, max_tokens: Optional[int] = None, *, generator=None) -> "StepMetadata":
        """Buffers matching ``layer``'s cache geometry, with :func:`default_block_tables`."""
        cache, ratio, device = layer.cache_cfg, layer.compress_ratio, layer.swa_cache.device
        swa = default_block_tables(cache.max_requests, cache.swa_pages_per_request(), device=device, generator=generator,
                                   columns=cache.swa_table_columns())
        cmp = default_block_tables(cache.max_requests, cache.cmp_pages_per_request(ratio), device=device, generator=generator)
        return cls(max_tokens or cache.max_tokens, swa, cmp, cache.page_size, cache.block_size(ratio), ratio)

    @property
    def positions(self) -> Tensor:
        return self.ints[0]

    @property
    def token_to_req(self) -> Tensor:
        return self.ints[1]

    @property
    def seq_lens(self) -> Tensor:
        return self.ints[2]

    def update(
        self,
        positions: Tensor,
        token_to_req: Tensor,
        seq_lens: Optional[Tensor] = None,
        *,
        swa_block_table: Optional[Tensor] = None,
        cmp_block_table: Optional[Tensor] = None,
        bucket: Optional[int] = None,
    ) -> int:
        """Copy one step's values in; columns ``n .. bucket-1`` become padding (position ``-1``).

        ``positions`` / ``token_to_req`` / ``seq_lens`` are ``[n]`` integer tensors on any
        device (``seq_lens`` defaults to ``positions + 1``); copies are ``non_blocking``,
        so pinned host tensors or device tensors keep the step free of host syncs. Block
        tables, when given, replace the stored ones (same shape). Returns ``n``.
        """
        n = positions.shape[0]
        bucket = self.max_tokens if bucket is None else bucket
        if not n <= bucket <= self.max_tokens:
            raise ValueError(f"need n <= bucket <= max_tokens, got n={n}, bucket={bucket}, max_tokens={self.max_tokens}")
        if token_to_req.shape != positions.shape:
            raise ValueError(f"token_to_req must be [n] = [{n}] like positions, got {tuple(token_to_req.shape)}")
        self.ints[0, :n].copy_(positions, non_blocking=True)
        self.ints[1, :n].copy_(token_to_req, non_blocking=True)
        if seq_lens is None:
            torch.add(self.ints[0, :n], 1, out=self.ints[2, :n])
        else:
            self.ints[2, :n].copy_(seq_lens, non_blocking=True)
        if bucket > n:
            self.ints[0, n:bucket].fill_(-1)
        for name, table in (("swa_block_table", swa_block_table), ("cmp_block_table", cmp_block_table)):
            if table is not None:
                own = getattr(self, name)
                if table.shape != own.shape:
                    raise ValueError(f"{name} must be {tuple(own.shape)}, got {tuple(table.shape)}")
                own.copy_(table, non_blocking=True)
        return n

    def inputs(self, num_tokens: int) -> StepInputs:
        """:class:`StepInputs` of the first ``num_tokens`` columns; writes the slot mappings
        into ``swa_slots`` / ``cmp_slots`` (runs inside the compiled step)."""
        T = num_tokens
        # Tell the compiler the slices below are exactly T long (not min(T, max_tokens)),
        # so a dynamic T needs no guards relating the two.
        torch._check(T <= self.max_tokens)
        inp = step_inputs(
            self.ints[0, :T], self.ints[1, :T], self.ints[2, :T], self.swa_block_table, self.cmp_block_table,
            self.page_size, self.cmp_block_size, self.compress_ratio,
        )
        self.swa_slots[:T].copy_(inp.swa_slots)
        self.cmp_slots[:T].copy_(inp.cmp_slots)
        return inp._replace(swa_slots=self.swa_slots[:T], cmp_slots=self.cmp_slots[:T])
