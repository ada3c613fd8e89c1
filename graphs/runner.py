"""Step capture and replay: one CUDA graph per token bucket, larger steps compiled.

:class:`LayerStep` is the whole step as a module: it reads its :class:`StepMetadata`
buffers, derives the slot mappings and runs the layer, so the only runtime input is the
hidden states ``x [T, dim]``. :class:`StepRunner` compiles it with
``torch.compile(fullgraph=True)`` (one graph, dynamic ``T``), captures one
``torch.cuda.CUDAGraph`` per token bucket (largest first, one shared memory pool) and
serves every step kind through them: a step of ``n`` tokens (any mix of prefill chunks,
decode and draft tokens) replays the smallest bucket ``>= n``, padded with padding rows
(position ``-1``: no cache or state writes, empty attention rows); a step larger than
every bucket runs as consecutive pieces of the largest bucket, each a replay of its graph
(attention is causal and each piece continues its requests where the one before left them,
as chunked prefill does, so the pieces compute the step). Its :class:`PageAllocator` checks
each step and gives requests their pages on the host.

``torch.compile(LayerStep(layer, meta), mode="reduce-overhead")`` is the other way to get
graphs: buffers are static inputs, so Inductor's CUDA-graph trees record the same step.
"""

from __future__ import annotations

import bisect
import contextlib
from typing import TYPE_CHECKING, Callable, Optional, Sequence, Union

import numpy as np
import torch
from torch import Tensor, nn

from graphs.attention import DSV41Attention
from graphs.metadata import StepMetadata
from graphs.pages import FEW_TOKENS, PageAllocator

if TYPE_CHECKING:
    from graphs.stack import DSV41Stack

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
# Inductor options of the step: combo kernels launch independent small kernels (norms, RoPE
# of separate tensors, the compressor's and the indexer's pointwise work) as one, and at
# small steps launches, not math, set the time; the program's order kept (no locality
# reordering), which launches the q GEMM on its side stream before the cache writes, not
# next to its readers after them (``graphs.fused.project_beside``)
STEP_INDUCTOR_OPTIONS = {"combo_kernels": True, "reorder_for_locality": False}
STAGING_DEPTH = 4
"""Pinned buffers a :class:`StepRunner` stages its steps' integers in, used in turn: the
host may plan this many steps ahead of the GPU before it waits for a buffer's copy."""
PAGE_STAGING_WORDS = 4096
"""int32 words of each of the ring's buffers of block-table changes (three per changed
entry: an int64 index into :attr:`graphs.StepMetadata.block_tables` and a page), enough for
1365 changes a step; a step of more packs into a buffer of its own."""


class LayerStep(nn.Module):
    """``forward(x [T, dim]) -> [T, dim]``: one step of ``layer`` (a
    :class:`graphs.DSV41Attention` or a :class:`graphs.DSV41Stack`) on ``meta``'s first
    ``T`` columns (``T`` from ``x.shape[0]``), every geometry's inputs derived once."""

    def __init__(self, layer: Union[DSV41Attention, "DSV41Stack"], meta: StepMetadata) -> None:
        super().__init__()
        self.layer = layer
        self.meta = meta

    def forward(self, x: Tensor) -> Tensor:
        T = x.shape[0]
        if isinstance(self.layer, DSV41Attention):
            return self.layer(x, self.meta.inputs(T))
        return self.layer(x, self.meta.all_inputs(T))


def _size_oblivious():
    """Dynamo specialises sizes 0 and 1; with ``backed_size_oblivious`` a dynamic token dim
    stays symbolic at size 1 too, so one graph serves every bucket."""
    try:
        import torch.fx.experimental._config as fx_config

        return fx_config.patch(backed_size_oblivious=True)
    except (ImportError, AttributeError, KeyError):  # older torch: bucket 1 compiles once more
        return contextlib.nullcontext()


def mark_tokens_dynamic(x: Tensor) -> Tensor:
    """Mark ``x``'s token dim dynamic (call :func:`compiled_call` to run it)."""
    torch._dynamo.mark_dynamic(x, 0)
    return x


def compiled_call(fn: Callable, x: Tensor) -> Tensor:
    """``fn(x)`` with ``x``'s token dim dynamic and size-1 kept symbolic: one Dynamo graph
    (one compile) for every bucket."""
    with _size_oblivious():
        return fn(mark_tokens_dynamic(x))


class StepRunner:
    """Compile, capture and replay ``layer``'s step per token bucket; run larger steps in pieces.

    Args:
        layer: the attention layer, or a :class:`graphs.DSV41Stack` (the whole stack is one
            graph per bucket); its caches are mutated by every valid step.
        buckets: step sizes (tokens) to capture as CUDA graphs (those ``<= max_tokens``
            are kept); a step of ``n`` tokens runs the smallest bucket ``>= n``, a larger one
            (up to ``max_tokens``) runs as consecutive pieces of the largest bucket.
        pages: the host-side page allocator (default: :meth:`PageAllocator.for_layer`).
        compile: ``torch.compile(fullgraph=True)`` the step (``False``: run it eagerly,
            still padded and, on CUDA, still captured).
        backend: ``torch.compile`` backend (``"inductor"``, compiled with
            :data:`STEP_INDUCTOR_OPTIONS`).
        cuda_graphs: capture graphs (default: when the layer is on CUDA).

    ``step()`` returns a view into a static output, valid until the next step.

    Example::

        >>> import torch
        >>> from graphs import CacheConfig, StepRunner, DSV41Attention, TINY
        >>> layer = DSV41Attention(TINY, CacheConfig(4, 8, 32, 4), compress_ratio=2)
        >>> runner = StepRunner(layer, buckets=(2, 4), compile=False)
        >>> i32 = lambda *v: torch.tensor(v, dtype=torch.int32)
        >>> runner.step(torch.randn(6, TINY.dim, dtype=torch.bfloat16), i32(0, 1, 2, 3, 4, 0), i32(0, 0, 0, 0, 0, 1)).shape
        torch.Size([6, 64])
        >>> runner.step(torch.randn(2, TINY.dim, dtype=torch.bfloat16), i32(5, 1), i32(0, 1)).shape  # decode
        torch.Size([2, 64])
    """

    def __init__(
        self,
        layer: Union[DSV41Attention, "DSV41Stack"],
        buckets: Sequence[int] = DEFAULT_BUCKETS,
        *,
        pages: Optional[PageAllocator] = None,
        compile: bool = True,
        backend: str | Callable = "inductor",
        cuda_graphs: Optional[bool] = None,
    ) -> None:
        max_tokens = layer.cache_cfg.max_tokens
        self.buckets = sorted(set(int(b) for b in buckets if b <= max_tokens))
        if not self.buckets or self.buckets[0] < 1:
            raise ValueError(f"buckets must hold sizes in [1, max_tokens={max_tokens}], got {list(buckets)}")
        self.layer = layer
        self.meta = StepMetadata.for_layer(layer)
        self.pages = pages if pages is not None else PageAllocator.for_layer(layer)
        self.module = LayerStep(layer, self.meta)
        self.compiled = compile
        options = STEP_INDUCTOR_OPTIONS if backend == "inductor" else None
        self.fn = torch.compile(self.module, fullgraph=True, backend=backend, options=options) if compile else self.module
        device = layer.device
        self.cuda_graphs = device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self.x = torch.zeros(max_tokens, layer.cfg.dim, dtype=torch.bfloat16, device=device)
        # the steps' integers, staged in turn in pinned buffers (with the event of the copy
        # that read each): no allocation per step, and a buffer is rewritten only once its
        # copy ran; a copy from pageable memory would wait for the stream to drain
        pinned = device.type == "cuda"
        self._staged = [torch.empty(self.meta.ints.shape, dtype=torch.int32, pin_memory=pinned)
                        for _ in range(STAGING_DEPTH)]
        self._staged_host = [t.numpy() for t in self._staged]
        for host in self._staged_host:
            host[0], host[1] = -1, 0
        # and the block-table changes of the step (StepMetadata.apply_pages), beside them
        self._staged_pages = [torch.empty(PAGE_STAGING_WORDS, dtype=torch.int32, pin_memory=pinned)
                              for _ in range(STAGING_DEPTH)]
        self._staged_copied = [torch.cuda.Event() if pinned else None for _ in range(STAGING_DEPTH)]
        self._device_index = (device.index if device.index is not None else torch.cuda.current_device()) if pinned else None
        # on CUDA the integers of a step of several tokens go on to a device buffer of the
        # ring by a copy on a side stream, which need not wait for the previous step's graph
        # (graphs.staging); the buffer is rewritten only once its turn's event has passed
        self._ring = list(torch.empty((STAGING_DEPTH, *self.meta.ints.shape), dtype=torch.int32,
                                      device=device).unbind()) if pinned else []
        self._ring_copied = [torch.cuda.Event() for _ in range(STAGING_DEPTH)] if pinned else []
        self._copy_stream = torch.cuda.Stream(device) if pinned else None
        self._turn = 0
        self._x_rows: dict[int, Tensor] = {}  # input(n): x[:n], sliced once per size
        # a step larger than every bucket gathers its pieces' outputs here (each piece's
        # graph writes the same static rows), and keeps its first piece's rows of the
        # layer's step_rows() aside while later pieces write theirs
        largest = self.buckets[-1]
        pieces = max_tokens > largest
        self._pieces_out = torch.empty(max_tokens, layer.cfg.dim, dtype=torch.bfloat16, device=device) if pieces else None
        self._first_rows = [torch.empty_like(b[:largest]) for b in layer.step_rows()] if pieces else []
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, Tensor] = {}
        self.captures = 0
        self._traced = False

    def bucket_for(self, n: int) -> int:
        """The captured size a step of ``n`` tokens runs at: the smallest bucket ``>= n``;
        past the largest bucket, the largest (the step runs in pieces of that size)."""
        max_tokens = self.layer.cache_cfg.max_tokens
        if not 1 <= n <= max_tokens:
            raise ValueError(f"a step must have 1..{max_tokens} tokens (CacheConfig.max_tokens), got {n}")
        i = bisect.bisect_left(self.buckets, n)
        return self.buckets[min(i, len(self.buckets) - 1)]

    def run(self, size: int) -> Tensor:
        """Run the (compiled) step on the first ``size`` rows of the static input."""
        x = self.x[:size]
        return compiled_call(self.fn, x) if self.compiled else self.fn(x)

    @torch.no_grad()
    def trace(self) -> None:
        """Compile the step now, if ``compile`` and not done yet (``capture()`` and the first
        ``step()`` call it): traced first at size 1, on all-padding metadata (it writes
        nothing a valid token reads); traced at a larger size, Dynamo would guard ``T >= 2``
        and size 1 would compile a second graph."""
        if self.compiled and not self._traced:
            self.meta.ints[0].fill_(-1)
            self.run(1)
            self._traced = True

    @torch.no_grad()
    def capture(self, warmup: int = 2) -> None:
        """Compile (on first use) and capture one graph per bucket, largest first.

        Warm-up and capture run on all-padding metadata, so they write nothing that a
        valid token reads; the metadata is left all padding.
        """
        if not self.cuda_graphs:
            raise RuntimeError("capture() needs a CUDA layer (cuda_graphs=True)")
        self.trace()
        self.meta.ints[0].fill_(-1)
        pool = None
        stream = torch.cuda.Stream()
        for bucket in reversed(self.buckets):
            if bucket in self.graphs:
                continue
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(warmup):
                    self.run(bucket)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.run(bucket)
            pool = graph.pool()
            self.graphs[bucket], self.outputs[bucket] = graph, out
            self.captures += 1
        torch.cuda.synchronize()

    @torch.no_grad()
    def step(self, x: Tensor, positions: Tensor | Sequence[int], token_to_req: Tensor | Sequence[int]) -> Tensor:
        """One step of ``n = x.shape[0]`` tokens; returns ``[n, dim]``.

        ``x [n, dim]`` (any floating dtype; bf16 saves a conversion) is copied into the static
        bf16 input rows, unless it is the tensor
        :meth:`input` returned for ``n`` (the step's hidden states written there).
        ``positions`` / ``token_to_req`` are the step's ``[n]`` host integers (what the
        engine's scheduler has): the page allocator checks and plans them on the host, then
        they are copied into the static buffers and the bucket's graph replays (or the
        compiled step runs). Each request's tokens are contiguous, at consecutive positions,
        continuing at its length or rewinding at most ``max_rewind`` positions.

        A step of more tokens than the largest bucket is planned and checked whole, then
        runs as consecutive pieces of the largest bucket (graph replays); its output is
        gathered in one static buffer and the layer's ``step_rows()`` (the top-k ids of
        each token) are left as one step would leave them.
        """
        dim = self.layer.cfg.dim
        if not isinstance(x, Tensor) or x.dim() != 2 or x.shape[1] != dim or not x.is_floating_point():
            got = f"{tuple(x.shape)} {x.dtype}" if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"x must be the step's hidden states [n, dim = {dim}], floating point (copied in "
                             f"as bf16), got {got}")
        positions, token_to_req = _host_ints(positions, "positions"), _host_ints(token_to_req, "token_to_req")
        n = x.shape[0]
        if len(positions) != n or len(token_to_req) != n:
            raise ValueError(f"positions and token_to_req must be [n] = [{n}] like x's tokens, got "
                             f"[{len(positions)}] and [{len(token_to_req)}]")
        size = self.bucket_for(n)
        if self.cuda_graphs and size not in self.graphs:
            raise RuntimeError(f"bucket {size} was not captured; call capture() first")
        if self.compiled and not self._traced:
            self.trace()
        self.pages.plan(positions, token_to_req)
        turn = self._next_turn()
        self.meta.apply_pages(self.pages.take_changes(), staging=self._staged_pages[turn])
        in_place = x is self._x_rows.get(n)  # the hidden states written in place (input())
        if n <= size:
            out = self._run_piece(turn, x, in_place, positions, token_to_req)
        else:  # past the largest bucket: in pieces of it
            out, rows = self._pieces_out[:n], self.layer.step_rows()
            for a in range(0, n, size):
                b = min(a + size, n)
                piece = self._run_piece(turn if a == 0 else self._next_turn(), x[a:b], in_place and a == 0,
                                        positions[a:b], token_to_req[a:b])
                out[a:b].copy_(piece, non_blocking=True)
                for buffer, first in zip(rows, self._first_rows):  # the step's rows where one step leaves them
                    (first if a == 0 else buffer[a:b]).copy_(buffer[:b - a])
            for buffer, first in zip(rows, self._first_rows):
                buffer[:size].copy_(first)
        self.pages.trim()
        return out

    def _run_piece(self, turn: int, x: Tensor, in_place: bool, positions: list[int] | np.ndarray,
                   token_to_req: list[int] | np.ndarray) -> Tensor:
        """Run ``n = len(positions) <=`` the largest bucket's tokens, planned already: stage
        their integers in the ring's buffers ``turn``, copy ``x`` into the static input rows
        (unless ``in_place``: it is those rows) and replay the bucket's graph (or run the
        compiled step); returns the ``[n, dim]`` output rows."""
        n = len(positions)
        size = self.bucket_for(n)
        self._stage(turn, size, positions, token_to_req, None if in_place else x)
        if self.cuda_graphs:
            self.graphs[size].replay()
            return self.outputs[size] if n == size else self.outputs[size][:n]
        return self.run(size)[:n]

    def input(self, n: int) -> Tensor:
        """The static input rows ``[n, dim]`` (bf16, on the layer's device) a step of ``n``
        tokens reads. An engine that writes the step's hidden states here (say, as its
        previous layer's output) and passes this tensor to :meth:`step` saves the step a
        device copy; the same tensor object comes back for the same ``n``."""
        if not 1 <= n <= self.x.shape[0]:
            raise ValueError(f"a step must have 1..{self.x.shape[0]} tokens (CacheConfig.max_tokens), got {n}")
        rows = self._x_rows.get(n)
        if rows is None:
            rows = self._x_rows[n] = self.x[:n]
        return rows

    def _next_turn(self) -> int:
        """The staging ring's next buffers, once the copies that read them last have run."""
        i = self._turn
        self._turn = (i + 1) % STAGING_DEPTH
        if self._staged_copied[i] is not None:
            self._staged_copied[i].synchronize()  # at once, unless the GPU is STAGING_DEPTH steps behind
        return i

    def _stage(self, i: int, size: int, positions: list[int] | np.ndarray, token_to_req: list[int] | np.ndarray,
               x: Optional[Tensor]) -> None:
        """Bring the step's ``[n]`` integers, padded to the bucket's ``size`` (position
        ``-1``, request row 0), into the layer's metadata through the staging ring's buffers
        ``i``, and ``x`` into the static input rows (``None``: it is those rows). On CUDA one
        kernel does both (:mod:`graphs.staging`): a one-token step's integers are its
        arguments, a larger step's reach the ring's device buffer by a copy on the side
        stream first; elsewhere :meth:`StepMetadata.update_padded` and a copy."""
        copied, host, n = self._staged_copied[i], self._staged_host[i], len(positions)
        rows = self.input(n)
        if size > 1 or copied is None:
            host[0, :n], host[1, :n] = positions, token_to_req
            if n < size:
                host[0, n:size], host[1, n:size] = -1, 0
        if copied is None:
            self.meta.update_padded(self._staged[i])
            if x is not None:
                rows.copy_(x)
            return
        from graphs.staging import stage_one_token, stage_step

        stream = torch.cuda.current_stream(self._device_index)  # an index: cheaper than a device
        if size == 1:
            stage_one_token(self.meta.ints, int(positions[0]), int(token_to_req[0]), x, rows)
        else:
            torch.cuda.set_stream(self._copy_stream)
            try:
                self._ring[i].copy_(self._staged[i], non_blocking=True)
                self._ring_copied[i].record(self._copy_stream)
            finally:
                torch.cuda.set_stream(stream)
            stream.wait_event(self._ring_copied[i])
            # (a later piece's x lies past the largest bucket, never over the rows it goes to)
            stage_step(self.meta.ints, self._ring[i], size, x, rows)
        copied.record(stream)

    def release(self, row: int) -> None:
        """A request finished: give its pages back (:meth:`PageAllocator.release`)."""
        self.pages.release(row)


_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _host_ints(values, name: str) -> list[int] | np.ndarray:
    """A step's host integers (a 1-D CPU integer tensor or a sequence of ints): a list of
    ints for a step of at most ``graphs.pages.FEW_TOKENS`` tokens (the page allocator plans
    those on Python ints), else an int64 array."""
    if isinstance(values, Tensor):
        if not values.is_cpu:
            raise ValueError(f"{name} must be host (CPU) integers: the page allocator plans each step on the host "
                             f"(got a {values.device.type} tensor)")
        if values.dtype not in _INT_DTYPES:
            raise TypeError(f"{name} must be an integer tensor (int32 or int64), got {values.dtype}")
        if values.dim() != 1:
            raise ValueError(f"{name} must be a 1-D [n] tensor, got shape {tuple(values.shape)}")
        if values.shape[0] <= FEW_TOKENS:
            return values.tolist()
        return values.numpy().astype(np.int64, copy=False)  # (integer tensors never require grad)
    values = list(values)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise TypeError(f"{name} must be ints, got {[type(v).__name__ for v in values if not isinstance(v, int)][:3]}")
    return values if len(values) <= FEW_TOKENS else np.array(values, dtype=np.int64)
