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
from graphs.metadata import PageChanges, table_layout, table_offsets

# Steps of at most this many tokens are planned on Python ints, token by token: the array
# path's few dozen numpy calls cost a microsecond or more each, and a loop over this many
# tokens costs about as much in all (the two paths cross near it for decode steps).
FEW_TOKENS = 12


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
        return self.take_many(1)[0]

    def take_many(self, k: int) -> list[int]:
        """``k`` pages, in the order ``k`` calls of :meth:`take` would give them."""
        if k > len(self._free):
            raise RuntimeError(f"the {self.name} pool's {self.num_pages} pages are all in use: size it larger "
                               f"(CacheConfig.{self.name}_pages) or release finished requests")
        taken = self._free[len(self._free) - k:][::-1]
        del self._free[len(self._free) - k:]
        return taken

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
    """

    def __init__(self, cache: CacheConfig, ratio: int | Sequence[int], window: int, *, rank: int = 0,
                 generator: Optional[torch.Generator] = None) -> None:
        R = cache.max_requests
        self.ratios = tuple(r for r in ((ratio,) if isinstance(ratio, int) else tuple(ratio)) if r)
        self.cache, self.window, self.rank = cache, window, rank
        # host block tables and per-row state as numpy arrays: a step updates all its
        # requests in a few array operations (a Python loop per request cost microseconds
        # each on the host path of every step); kind "swa" or a compressed ratio -> table
        self.tables = table_layout(R, cache.swa_table_columns(), {r: cache.cmp_pages_per_request(r) for r in self.ratios})
        """The :data:`graphs.metadata.TableLayout` of the block tables: as a
        :class:`graphs.StepMetadata` of the same layer lays them out."""
        self._table_at, size = table_offsets(self.tables)
        self._store = np.full(size, -1, np.int32)
        self._tables = {kind: self._store[self._table_at[kind]:self._table_at[kind] + rows * cols].reshape(rows, cols)
                        for kind, rows, cols in self.tables}  # kind -> view [R, columns] of the store
        self._pools = {"swa": PagePool(cache.swa_num_pages(window), "swa", generator),
                       **{r: PagePool(cache.cmp_num_pages(r), "cmp", generator) for r in self.ratios}}
        self.swa_pool = self._pools["swa"]
        self._length = np.zeros(R, np.int64)
        self._high = np.full(R, -1, np.int64)
        self._swa_low = np.zeros(R, np.int64)  # lowest SWA column a row may still hold
        self._given = {r: np.zeros(R, np.int64) for r in self.ratios}  # compressed columns given (a prefix)
        self._block_size = {r: cache.block_size(r) for r in self.ratios}
        # flat store index -> page of the entries changed since take_changes, the last
        # change of an entry winning (one put_ of duplicate indices would pick either)
        self._changes: dict[int, int] = {}
        # the end (exclusive) up to which a row's runs take and give back no page: before
        # its next SWA page, its next compressed page and the next SWA page a trim gives
        # back, set when the row last took pages (as trim() leaves it). A run that ends
        # there only moves the row's length; 0: the row's next run searches
        self._settled_to = np.zeros(R, np.int64)
        self._touched: list[int] | np.ndarray = []  # the last planned step's rows that moved a page, for trim()

    @property
    def length(self) -> list[int]:
        """Accepted tokens of each row (where its next step continues)."""
        return self._length.tolist()

    @property
    def high(self) -> list[int]:
        """Highest position each row has written (``-1``: none)."""
        return self._high.tolist()

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
        return list(zip(*(a.tolist() for a in self._runs(positions, token_to_req))))

    def _runs(self, positions, token_to_req) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`runs` as arrays ``(rows, first positions, tokens)``."""
        # numpy, not torch: a host step is a few dozen small array operations, and each
        # torch call costs microseconds of dispatch
        pos, req = _host_array(positions), _host_array(token_to_req)
        if pos.shape != req.shape:
            raise ValueError(f"positions and token_to_req differ in length ({pos.size} vs {req.size})")
        R, n = len(self._length), pos.size
        if np.count_nonzero(req.view(np.uint64) >= R):  # a negative row reads as a huge unsigned one
            i = int(np.flatnonzero((req < 0) | (req >= R))[0])
            raise ValueError(f"token {i}: request row {int(req[i])} is outside [0, {R})")
        starts = req[1:] != req[:-1] if n > 1 else None
        if n <= 1 or np.count_nonzero(starts) == n - 1:  # one token per run (decode): the runs are the tokens
            rows, p0, counts = req, pos, np.ones(n, np.int64)
        else:
            first = np.flatnonzero(np.concatenate(([True], starts)))
            counts = np.concatenate((first[1:], [n])) - first
            rows, p0 = req[first], pos[first]
        if rows.size < n:  # some request has several tokens: at consecutive positions?
            expected = np.repeat(p0 - first, counts) + np.arange(n)
            if np.count_nonzero(pos != expected):
                i = int(np.flatnonzero(pos != expected)[0])
                raise ValueError(_not_consecutive(i, int(req[i]), int(expected[i]), int(pos[i])))
        if rows.size > 1 and np.bincount(rows).max() > 1:
            raise ValueError(_NOT_CONTIGUOUS)
        max_seq_len, rewind = self.cache.max_seq_len, self.cache.max_rewind
        length = self._length[rows]
        if np.count_nonzero(p0 != length):  # a rewind (or a bad start) among the runs
            high = self._high[rows]
            bad = (p0 < np.maximum(high + (1 - rewind), 0)) | (p0 > length) | (p0 + counts > max_seq_len)
        else:  # every run continues its row: a length is never under high + 1 - max_rewind
            bad = p0 + counts > max_seq_len
        if np.count_nonzero(bad):
            for r, p, c in zip(rows.tolist(), p0.tolist(), counts.tolist()):
                self._check_run(r, p, c)
        return rows, p0, counts

    def _check_run(self, r: int, p: int, c: int) -> None:
        """Raise ``ValueError`` unless request row ``r`` may write positions ``p .. p + c - 1``."""
        max_seq_len, rewind = self.cache.max_seq_len, self.cache.max_rewind
        have, top = int(self._length[r]), int(self._high[r])
        if p < 0 or p + c > max_seq_len:
            raise ValueError(f"request {r}: positions {p}..{p + c - 1} outside [0, max_seq_len={max_seq_len})")
        if p > have:
            raise ValueError(f"request {r} has {have} tokens: a step cannot start at position {p}")
        if p < top + 1 - rewind:
            raise ValueError(f"request {r} wrote up to position {top}: a step may rewind at most "
                             f"max_rewind={rewind} positions, so start at >= {top + 1 - rewind}, not {p}")

    def _few_runs(self, pos: list[int], req: list[int]) -> list[tuple[int, int, int]]:
        """:meth:`runs` of a step of few tokens, on Python ints, with :meth:`_runs`' checks."""
        R = len(self._length)
        for i, r in enumerate(req):
            if not 0 <= r < R:
                raise ValueError(f"token {i}: request row {r} is outside [0, {R})")
        runs = []  # [row, first position, tokens]
        for i, (p, r) in enumerate(zip(pos, req)):
            if runs and runs[-1][0] == r:
                if p != runs[-1][1] + runs[-1][2]:
                    raise ValueError(_not_consecutive(i, r, runs[-1][1] + runs[-1][2], p))
                runs[-1][2] += 1
            else:
                runs.append([r, p, 1])
        if len({run[0] for run in runs}) < len(runs):
            raise ValueError(_NOT_CONTIGUOUS)
        for r, p, c in runs:
            self._check_run(r, p, c)
        return runs

    def plan(self, positions: Sequence[int] | Tensor, token_to_req: Sequence[int] | Tensor) -> None:
        """Check a step (host ``[n]`` integers) and give its requests the pages it writes
        and reads; the block-table changes wait in :meth:`take_changes`. Raises
        ``ValueError`` for a bad layout and ``RuntimeError`` when a pool runs out (nothing
        changed, either way)."""
        few = _few_ints(positions), _few_ints(token_to_req)
        if few[0] is not None and few[1] is not None:
            if len(few[0]) != len(few[1]):
                raise ValueError(f"positions and token_to_req differ in length ({len(few[0])} vs {len(few[1])})")
            runs = self._few_runs(*few)
            settled_to = self._settled_to
            moving = [run for run in runs if run[1] + run[2] > settled_to[run[0]]]
            if moving:
                self._give_few(moving)
            for r, p, c in runs:
                self._length[r] = p + c
                self._high[r] = max(int(self._high[r]), p + c - 1)
            self._touched = [r for r, _, _ in moving]
            return
        rows, p0, n = self._runs(positions, token_to_req)
        end = p0 + n
        moving = end > self._settled_to[rows]
        self._touched = []
        if np.count_nonzero(moving):
            rows_m, p0_m, end_m = rows[moving], p0[moving], end[moving]
            if rows_m.size <= FEW_TOKENS:  # (as most decode steps' are): on Python ints
                moved = rows_m.tolist()
                self._give_few(list(zip(moved, p0_m.tolist(), (end_m - p0_m).tolist())))
                self._touched = moved
            else:
                self._give_runs(rows_m, np.maximum(p0_m - self.window + 1, 0), end_m)
                self._touched = rows_m
        self._length[rows] = end
        self._high[rows] = np.maximum(self._high[rows], end - 1)

    def grow(self, row: int, length: int) -> None:
        """Give ``row`` the pages of a request that already holds ``length`` tokens (SWA:
        the positions its next step may read) and set its length, as if steps had written
        them: for benchmarks and tests that fill the caches directly."""
        if not 0 <= row < len(self._length) or not 0 <= length <= self.cache.max_seq_len:
            raise ValueError(f"need a row in [0, {len(self._length)}) and a length in [0, {self.cache.max_seq_len}], "
                             f"got row {row}, length {length}")
        if self._length[row] or self._high[row] >= 0:
            raise ValueError(f"row {row} already holds a request: release() it first")
        low = max(0, length - 1 - self.cache.swa_keep(self.window))
        self._give_runs(np.array([row]), np.array([low]), np.array([length]))
        self._length[row], self._high[row] = length, length - 1
        self._swa_low[row] = low // self.cache.page_size

    def _give_runs(self, rows: np.ndarray, swa_from: np.ndarray, end: np.ndarray) -> None:
        """Rows ``rows`` (distinct) get the SWA pages of positions ``swa_from .. end - 1`` and
        the compressed pages of their first ``end`` positions' entries (their lengths are
        the caller's to set). A pool short of pages raises ``RuntimeError`` before anything
        changes.

        A row's SWA pages are columns ``swa_low .. high // page_size`` and its compressed
        pages columns ``0 .. given - 1`` (pages are given as positions advance and taken
        back from the bottom), so only rows whose range leaves those can need a page: the
        array tests find them, and only they are walked column by column."""
        ps, keep = self.cache.page_size, self.cache.swa_keep(self.window)
        lo, hi = swa_from // ps, (end - 1) // ps
        high, swa_low = self._high[rows], self._swa_low[rows]
        may_need = (lo < swa_low) | (hi > high // ps)  # -1 // ps: no page yet
        # settled_to, as trim() leaves the rows: the next SWA page past the highest position,
        # the next one trim gives back, the max length; each ratio's next compressed page below
        high = np.maximum(high, end - 1)
        low = np.maximum(swa_low, np.maximum(high - keep, 0) // ps)
        to = np.minimum(np.minimum((high // ps + 1) * ps, (low + 1) * ps + keep), self.cache.max_seq_len)
        wanted, grown = {"swa": []}, {}
        if np.count_nonzero(may_need):
            wanted["swa"] = self._missing("swa", rows[may_need].tolist(), lo[may_need].tolist(), (hi[may_need] + 1).tolist())
        for ratio in self.ratios:
            entries = end // ratio
            if self.cache.dcp_world > 1:  # this rank's share
                share = self.cache.local_entries
                entries = np.fromiter((share(e, self.rank) for e in entries.tolist()), np.int64, entries.size)
            need = -(-entries // self._block_size[ratio])
            given = self._given[ratio][rows]
            more = need > given
            wanted[ratio] = []
            if np.count_nonzero(more):
                wanted[ratio] = self._missing(ratio, rows[more].tolist(), given[more].tolist(), need[more].tolist())
                grown[ratio] = rows[more], need[more]
            to = np.minimum(to, self._first_cmp_end(ratio, np.maximum(given, need)))
        self._take(wanted, grown)
        self._settled_to[rows] = to

    def _give_few(self, runs: list[tuple[int, int, int]]) -> None:
        """:meth:`_give_runs` of :meth:`_few_runs`' ``(row, first position, tokens)``, on Python ints."""
        ps, keep, window, max_seq_len = self.cache.page_size, self.cache.swa_keep(self.window), self.window, self.cache.max_seq_len
        high_of, swa_low_of, dcp = self._high.item, self._swa_low.item, self.cache.dcp_world > 1
        wanted, grown, settled = {"swa": [], **{ratio: [] for ratio in self.ratios}}, {}, []
        for r, p, c in runs:
            end, high, swa_low = p + c, high_of(r), swa_low_of(r)
            lo, hi = max(p - window + 1, 0) // ps, (end - 1) // ps
            if lo < swa_low or hi > high // ps:  # -1 // ps: no page yet
                wanted["swa"] += self._missing("swa", [r], [lo], [hi + 1])
            high = max(high, end - 1)
            low = max(swa_low, max(high - keep, 0) // ps)
            to = min((high // ps + 1) * ps, (low + 1) * ps + keep, max_seq_len)
            for ratio in self.ratios:
                entries = self.cache.local_entries(end // ratio, self.rank) if dcp else end // ratio  # this rank's share
                need, given = -(-entries // self._block_size[ratio]), self._given[ratio].item(r)
                if need > given:
                    wanted[ratio] += self._missing(ratio, [r], [given], [need])
                    grown.setdefault(ratio, ([], []))
                    grown[ratio][0].append(r)
                    grown[ratio][1].append(need)
                to = min(to, self._first_cmp_end(ratio, max(given, need)))
            settled.append(to)
        self._take(wanted, grown)
        for (r, _, _), to in zip(runs, settled):
            self._settled_to[r] = to

    def _first_cmp_end(self, ratio: int, given):
        """The end (exclusive) of the first run that needs a compressed page of ``ratio``
        past ``given`` (ints or arrays): the first entry this rank holds past those pages'
        ``m`` entries is global entry ``g``, closed by position ``(g + 1) * ratio - 1``."""
        m, leave = given * self._block_size[ratio], self.cache.dcp_interleave
        g = m // leave * (self.cache.dcp_world * leave) + self.rank * leave + m % leave
        return (g + 1) * ratio - 1

    def _take(self, wanted: dict, grown: dict) -> None:
        """Give each ``(row, column)`` of ``wanted[kind]`` a page of pool ``kind`` and set
        ``_given[ratio][rows] = need`` for ``grown[ratio] = (rows, need)``; raises
        ``RuntimeError`` before anything changes when a pool is short."""
        for kind, entries in wanted.items():
            if len(entries) > self._pools[kind].num_free:
                self._pools[kind].take_many(len(entries))  # raises: the pool is short
        for kind, entries in wanted.items():
            if entries:
                at, cols, changes = self._table_at[kind], self._tables[kind].shape[1], self._changes
                for (r, col), page in zip(entries, self._pools[kind].take_many(len(entries))):
                    self._store[at + r * cols + col] = changes[at + r * cols + col] = page
        for ratio, (at, need) in grown.items():
            self._given[ratio][at] = need

    def trim(self) -> None:
        """Give back the SWA pages of the last planned step's requests that no later step
        reads (call it once that step is launched: later work reuses them in stream order)."""
        rows, keep, ps = self._touched, self.cache.swa_keep(self.window), self.cache.page_size
        self._touched = []
        if not len(rows):  # no row took a page: none has one to give back
            return
        if isinstance(rows, list):  # a step of few tokens
            for r in rows:
                low, old = max(int(self._high[r]) - keep, 0) // ps, int(self._swa_low[r])
                if low > old:
                    self._give_back_swa(r, old, low)
        else:
            low = np.maximum(self._high[rows] - keep, 0) // ps
            old = self._swa_low[rows]
            up = low > old
            if np.count_nonzero(up):
                for r, start, stop in zip(rows[up].tolist(), old[up].tolist(), low[up].tolist()):
                    self._give_back_swa(r, start, stop)

    def _give_back_swa(self, r: int, start: int, stop: int) -> None:
        """Row ``r`` gives back its SWA pages of columns ``start .. stop - 1``; ``stop`` is its new lowest column."""
        at = self._table_at["swa"] + r * self._tables["swa"].shape[1]
        store, changes = self._store, self._changes
        for i in range(at + start, at + stop):
            if store[i] >= 0:
                self.swa_pool.give(int(store[i]))
                store[i] = changes[i] = -1
        self._swa_low[r] = stop

    def release(self, row: int) -> None:
        """A finished request: give back all its pages; the row starts over at position 0."""
        if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < len(self._length):
            raise ValueError(f"row must be a request row in 0..{len(self._length) - 1} (CacheConfig.max_requests), "
                             f"got {row!r}")
        for kind, table in self._tables.items():
            at = self._table_at[kind] + row * table.shape[1]
            for col in np.flatnonzero(table[row] >= 0).tolist():
                self._pools[kind].give(int(table[row, col]))
                table[row, col] = self._changes[at + col] = -1
        self._length[row], self._high[row], self._swa_low[row], self._settled_to[row] = 0, -1, 0, 0
        for given in self._given.values():
            given[row] = 0

    def take_changes(self) -> Optional[PageChanges]:
        """The block-table changes since the last call, for
        :meth:`graphs.StepMetadata.apply_pages` (``None``: nothing changed, as in most
        decode steps)."""
        if not self._changes:
            return None
        changes, self._changes = self._changes, {}
        k = len(changes)
        return PageChanges(torch.from_numpy(np.fromiter(changes.keys(), np.int64, k)),
                           torch.from_numpy(np.fromiter(changes.values(), np.int32, k)), self.tables)

    def pages_held(self) -> tuple[int, int]:
        """``(SWA, compressed)`` pages in use (compressed: of every ratio)."""
        held = {kind: pool.num_pages - pool.num_free for kind, pool in self._pools.items()}
        return held.pop("swa"), sum(held.values())

    @property
    def swa_table(self) -> Tensor:
        """Host copy ``[R, Bs]`` int32 of the SWA block table (``-1`` = no page)."""
        return torch.from_numpy(self._tables["swa"].copy())

    def cmp_table_of(self, ratio: int) -> Tensor:
        """Host copy ``[R, Bc]`` int32 of ratio ``ratio``'s compressed block table (``-1`` = no page)."""
        return torch.from_numpy(self._tables[ratio].copy())

    @property
    def cmp_table(self) -> Tensor:
        """Host copy ``[R, Bc]`` int32 of the compressed block table (one ratio; ``[R, 0]`` for none)."""
        if not self.ratios:
            return torch.zeros(len(self._length), 0, dtype=torch.int32)
        return self.cmp_table_of(self.ratios[0])

    def _missing(self, kind, rows: list[int], start: list[int], stop: list[int]) -> list[tuple[int, int]]:
        """``(row, column)`` of table ``kind``'s entries without a page in columns
        ``start[i] .. stop[i] - 1`` of ``rows[i]``, in that order."""
        table = self._tables[kind]
        return [(r, col) for r, a, b in zip(rows, start, stop) for col in range(a, b) if table[r, col] < 0]


def _not_consecutive(i: int, r: int, expected: int, got: int) -> str:
    return f"token {i}: request {r}'s tokens must be at consecutive positions ({expected} expected, got {got})"


_NOT_CONTIGUOUS = "each request's tokens must be contiguous in the step (a request appears in two runs)"


def _few_ints(values: Sequence[int] | Tensor | np.ndarray) -> Optional[list[int]]:
    """Host integers as a list of Python ints if there are at most ``FEW_TOKENS``, else ``None``."""
    size = values.numel() if isinstance(values, Tensor) else values.size if isinstance(values, np.ndarray) else len(values)
    if size > FEW_TOKENS:
        return None
    if isinstance(values, (Tensor, np.ndarray)):
        return [int(v) for v in values.reshape(-1).tolist()]
    return [int(v) for v in values]


def _host_array(values: Sequence[int] | Tensor) -> np.ndarray:
    """Host integers (a CPU tensor or a sequence) as a flat int64 array."""
    if type(values) is np.ndarray and values.dtype == np.int64:  # as StepRunner passes them
        return values.reshape(-1)
    if isinstance(values, Tensor):
        return values.detach().numpy().reshape(-1).astype(np.int64, copy=False)
    return np.asarray(values, dtype=np.int64).reshape(-1)
