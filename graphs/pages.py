"""Host-side page allocation for one layer's caches: what an engine owns, outside the graph.

The layer's caches are pools of pages (``CacheConfig.swa_pages`` / ``cmp_pages``). A
:class:`PageAllocator` hands each request row the pages its steps write and read, as its
positions advance, and gives SWA pages back once they fall out of every later step's
window, so a request holds about ``(window + max_rewind) / page_size + 1`` SWA pages
between steps whatever its length, and compressed / index-key pages for the entries it
has. It works on host integers only; its block-table changes reach the device through
:meth:`graphs.StepMetadata.apply_pages` before the step runs.

It also checks each step's layout (the contract the graph cannot check without a host
sync): the tokens of one request are contiguous in the step at consecutive positions, a
step continues at the request's length or rewinds at most ``max_rewind`` positions, and
nothing passes ``max_seq_len``.

Example::

    >>> import torch
    >>> from graphs import CacheConfig, PageAllocator, TINY
    >>> pages = PageAllocator(CacheConfig(2, 8, 64, 4), ratio=2, window=TINY.window_size)
    >>> pages.plan(torch.tensor([0, 1, 2, 0], dtype=torch.int32), torch.tensor([0, 0, 0, 1], dtype=torch.int32))
    >>> pages.length, pages.swa_table[0, :2].tolist()
    ([3, 1], [0, -1])
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from graphs.config import CacheConfig
from graphs.metadata import PageChanges


class PagePool:
    """Free page ids ``0 .. num_pages - 1`` of one cache (taken in a random order when
    ``generator`` is given, so tests see non-contiguous pages)."""

    def __init__(self, num_pages: int, name: str, generator: Optional[torch.Generator] = None) -> None:
        order = torch.randperm(num_pages, generator=generator) if generator is not None else torch.arange(num_pages)
        self.num_pages, self.name = num_pages, name
        self._free = order.flip(0).tolist()  # taken from the end: page order[0] first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        if not self._free:
            raise RuntimeError(f"the {self.name} pool's {self.num_pages} pages are all in use: size it larger "
                               f"(CacheConfig.{self.name}_pages) or release finished requests")
        return self._free.pop()

    def give(self, page: int) -> None:
        self._free.append(page)


class PageAllocator:
    """Pages and positions of every request row of one layer (host side).

    Args:
        cache: the layer's geometry (pools, page sizes, ``max_rewind``).
        ratio: the layer's compress ratio (0: no compressed pages), or a stack's compressed
            ratios (a tuple: one compressed block table per ratio, shared by its layers).
        window: the layer's SWA window (``AttentionConfig.window_size``).
        rank: the layer's DCP rank (its share of the compressed entries gets pages).
        generator: hand pages out in a random order.

    Attributes:
        length: accepted tokens of each row (where its next step continues).
        high: highest position each row has written (``-1``: none).
    """

    def __init__(self, cache: CacheConfig, ratio: int | Sequence[int], window: int, *, rank: int = 0,
                 generator: Optional[torch.Generator] = None) -> None:
        R = cache.max_requests
        self.ratios = tuple(r for r in ((ratio,) if isinstance(ratio, int) else tuple(ratio)) if r)
        self.single = isinstance(ratio, int)  # take_changes / cmp_table: one table, not a dict
        self.cache, self.window, self.rank = cache, window, rank
        # host rows of the block tables, as Python lists (indexing a tensor per entry would
        # cost microseconds each on the host path of every step)
        # kind "swa" or a compressed ratio -> one list per row
        self._rows = {"swa": [[-1] * cache.swa_table_columns() for _ in range(R)],
                      **{r: [[-1] * cache.cmp_pages_per_request(r) for _ in range(R)] for r in self.ratios}}
        self._pools = {"swa": PagePool(cache.swa_num_pages(window), "swa", generator),
                       **{r: PagePool(cache.cmp_num_pages(r), "cmp", generator) for r in self.ratios}}
        self.swa_pool = self._pools["swa"]
        self.length = [0] * R
        self.high = [-1] * R
        self._swa_low = [0] * R  # lowest SWA column a row may still hold
        self._cmp_columns = {r: [0] * R for r in self.ratios}  # compressed columns given (a prefix of the row)
        # per ratio: (ratio, entries per page, columns given per row), for the per-step loop
        self._cmp = [(r, cache.block_size(r), self._cmp_columns[r]) for r in self.ratios]
        # this rank's share of global entries 0 .. n - 1 (CacheConfig.local_entries)
        self._local_entries = (lambda n: n) if cache.dcp_world == 1 else (lambda n: cache.local_entries(n, rank))
        # (row, column) -> page of the entries changed since take_changes, the last change
        # of an entry winning (one index_put_ of duplicate indices would pick either)
        self._changes: dict = {kind: {} for kind in self._rows}
        self._touched: list[int] = []

    @classmethod
    def for_layer(cls, layer, *, generator: Optional[torch.Generator] = None) -> "PageAllocator":
        """The pages of a :class:`graphs.DSV41Attention` (its ratio), or of a
        :class:`graphs.DSV41Stack` (one compressed table per ratio of its layers)."""
        geometries = layer.geometries()
        g = geometries[0]
        ratio = g.ratio if len(geometries) == 1 else tuple(x.ratio for x in geometries)
        return cls(layer.cache_cfg, ratio, g.window, rank=g.dcp[0], generator=generator)

    def runs(self, positions: Sequence[int] | Tensor, token_to_req: Sequence[int] | Tensor) -> list[tuple[int, int, int]]:
        """The step's ``(row, first position, tokens)`` per request, after checking its layout."""
        # numpy, not torch: a host step is a few dozen small array operations, and each
        # torch call costs microseconds of dispatch
        pos, req = _host_array(positions), _host_array(token_to_req)
        if pos.shape != req.shape:
            raise ValueError(f"positions and token_to_req differ in length ({pos.size} vs {req.size})")
        R, n = len(self.length), pos.size
        if n and (req.min() < 0 or req.max() >= R):
            i = int(np.flatnonzero((req < 0) | (req >= R))[0])
            raise ValueError(f"token {i}: request row {int(req[i])} is outside [0, {R})")
        first = np.flatnonzero(np.concatenate(([True], req[1:] != req[:-1]))) if n else np.zeros(0, np.int64)
        counts = np.empty_like(first)
        counts[:-1] = first[1:] - first[:-1]
        counts[-1:] = n - first[-1:]
        rows, p0 = req[first], pos[first]
        expected = np.repeat(p0 - first, counts) + np.arange(n)
        if (pos != expected).any():
            i = int(np.flatnonzero(pos != expected)[0])
            raise ValueError(f"token {i}: request {int(req[i])}'s tokens must be at consecutive positions "
                             f"({int(expected[i])} expected, got {int(pos[i])})")
        rows = rows.tolist()
        if len(set(rows)) != len(rows):
            raise ValueError("each request's tokens must be contiguous in the step (a request appears in two runs)")
        runs = list(zip(rows, p0.tolist(), counts.tolist()))
        max_seq_len, rewind, length, high = self.cache.max_seq_len, self.cache.max_rewind, self.length, self.high
        for r, p0, n in runs:
            if p0 < 0 or p0 + n > max_seq_len:
                raise ValueError(f"request {r}: positions {p0}..{p0 + n - 1} outside [0, max_seq_len="
                                 f"{max_seq_len})")
            if p0 > length[r]:
                raise ValueError(f"request {r} has {length[r]} tokens: a step cannot start at position {p0}")
            if p0 < high[r] + 1 - rewind:
                raise ValueError(f"request {r} wrote up to position {high[r]}: a step may rewind at most "
                                 f"max_rewind={rewind} positions, so start at >= {high[r] + 1 - rewind}, not {p0}")
        return runs

    def plan(self, positions: Sequence[int] | Tensor, token_to_req: Sequence[int] | Tensor) -> None:
        """Check a step (host ``[n]`` integers) and give its requests the pages it writes
        and reads; the block-table changes wait in :meth:`take_changes`. Raises
        ``ValueError`` for a bad layout (nothing changed) and ``RuntimeError`` when a pool
        runs out (the pages given so far stay given)."""
        runs = self.runs(positions, token_to_req)
        window = self.window
        for r, p0, n in runs:
            self._give_run(r, p0 - window + 1 if p0 >= window else 0, p0 + n)
        self._touched = [r for r, _, _ in runs]

    def grow(self, row: int, length: int) -> None:
        """Give ``row`` the pages of a request that already holds ``length`` tokens (SWA:
        the positions its next step may read) and set its length, as if steps had written
        them: for benchmarks and tests that fill the caches directly."""
        if not 0 <= row < len(self.length) or not 0 <= length <= self.cache.max_seq_len:
            raise ValueError(f"need a row in [0, {len(self.length)}) and a length in [0, {self.cache.max_seq_len}], "
                             f"got row {row}, length {length}")
        if self.length[row] or self.high[row] >= 0:
            raise ValueError(f"row {row} already holds a request: release() it first")
        low = max(0, length - 1 - self.cache.swa_keep(self.window))
        self._give_run(row, low, length)
        self._swa_low[row] = low // self.cache.page_size

    def _give_run(self, r: int, swa_from: int, end: int) -> None:
        ps = self.cache.page_size
        swa = self._rows["swa"][r]
        for col in range(swa_from // ps, (end - 1) // ps + 1):
            if swa[col] < 0:
                self._give(r, col, "swa")
        for ratio, block, given in self._cmp:
            entries = self._local_entries(end // ratio)  # this rank's share
            while given[r] < -(-entries // block):
                self._give(r, given[r], ratio)
                given[r] += 1
        self.length[r] = end
        if end > self.high[r]:
            self.high[r] = end - 1

    def trim(self) -> None:
        """Give back the SWA pages of the last planned step's requests that no later step
        reads (call it once that step is launched: later work reuses them in stream order)."""
        keep, ps, swa_low = self.cache.swa_keep(self.window), self.cache.page_size, self._swa_low
        for r in self._touched:
            low = max(0, self.high[r] - keep) // ps
            if low > swa_low[r]:
                for col in range(swa_low[r], low):
                    self._free(r, col, "swa")
                swa_low[r] = low
        self._touched = []

    def release(self, row: int) -> None:
        """A finished request: give back all its pages; the row starts over at position 0."""
        if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < len(self.length):
            raise ValueError(f"row must be a request row in 0..{len(self.length) - 1} (CacheConfig.max_requests), "
                             f"got {row!r}")
        for kind, rows in self._rows.items():
            for col, page in enumerate(rows[row]):
                if page >= 0:
                    self._free(row, col, kind)
        self.length[row], self.high[row], self._swa_low[row] = 0, -1, 0
        for given in self._cmp_columns.values():
            given[row] = 0

    def take_changes(self):
        """``(swa, cmp)`` block-table changes since the last call, for
        :meth:`graphs.StepMetadata.apply_pages` (``None`` where nothing changed); ``cmp`` is
        ``{ratio: changes}`` for an allocator of several ratios."""
        out = {}
        for kind, entries in self._changes.items():
            changes = [(r, c, page) for (r, c), page in entries.items()]
            out[kind] = tuple(torch.tensor(v, dtype=torch.int32) for v in zip(*changes)) if changes else None
            self._changes[kind] = {}
        cmp = {r: out[r] for r in self.ratios}
        return out["swa"], (next(iter(cmp.values()), None) if self.single else cmp)

    def pages_held(self) -> tuple[int, int]:
        """``(SWA, compressed)`` pages in use (compressed: of every ratio)."""
        held = {kind: pool.num_pages - pool.num_free for kind, pool in self._pools.items()}
        return held.pop("swa"), sum(held.values())

    @property
    def swa_table(self) -> Tensor:
        """Host copy ``[R, Bs]`` int32 of the SWA block table (``-1`` = no page)."""
        return torch.tensor(self._rows["swa"], dtype=torch.int32)

    def cmp_table_of(self, ratio: int) -> Tensor:
        """Host copy ``[R, Bc]`` int32 of ratio ``ratio``'s compressed block table (``-1`` = no page)."""
        cols = self.cache.cmp_pages_per_request(ratio)
        return torch.tensor(self._rows[ratio], dtype=torch.int32).reshape(len(self.length), cols)

    @property
    def cmp_table(self) -> Tensor:
        """Host copy ``[R, Bc]`` int32 of the compressed block table (one ratio; ``[R, 0]`` for none)."""
        if not self.ratios:
            return torch.zeros(len(self.length), 0, dtype=torch.int32)
        return self.cmp_table_of(self.ratios[0])

    def _give(self, row: int, col: int, kind) -> None:
        table = self._rows[kind][row]
        if table[col] < 0:
            table[col] = page = self._pools[kind].take()
            self._changes[kind][row, col] = page

    def _free(self, row: int, col: int, kind) -> None:
        table = self._rows[kind][row]
        if table[col] >= 0:
            self._pools[kind].give(table[col])
            table[col] = -1
            self._changes[kind][row, col] = -1


def _host_array(values: Sequence[int] | Tensor) -> np.ndarray:
    """Host integers (a CPU tensor or a sequence) as a flat int64 array."""
    if isinstance(values, Tensor):
        return values.detach().reshape(-1).numpy().astype(np.int64, copy=False)
    return np.asarray(values, dtype=np.int64).reshape(-1)
