"""Decode-step capture and replay: one CUDA graph per batch-size bucket.

:class:`DecodeStep` is the whole step as a module: it reads its :class:`StepMetadata`
buffers, derives the slot mappings and runs the layer, so the only runtime input is the
hidden states ``x [T, dim]``. :class:`DecodeRunner` compiles it with
``torch.compile(fullgraph=True)``, captures one ``torch.cuda.CUDAGraph`` per bucket
(largest first, one shared memory pool) and replays: a batch of ``n`` tokens is padded to
the smallest bucket ``>= n`` with padding rows (position ``-1``: no cache or state writes,
empty attention rows).

``torch.compile(DecodeStep(layer, meta), mode="reduce-overhead")`` is the other way to
get graphs: buffers are static inputs, so Inductor's CUDA-graph trees record the same step.
"""

from __future__ import annotations

import bisect
import contextlib
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor, nn

from graphs.attention import DSV41Attention
from graphs.metadata import StepMetadata

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class DecodeStep(nn.Module):
    """``forward(x [T, dim]) -> [T, dim]``: one decode step of ``layer`` on ``meta``'s
    first ``T`` columns (``T`` from ``x.shape[0]``)."""

    def __init__(self, layer: DSV41Attention, meta: StepMetadata) -> None:
        super().__init__()
        self.layer = layer
        self.meta = meta

    def forward(self, x: Tensor) -> Tensor:
        return self.layer(x, self.meta.inputs(x.shape[0]))


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


class DecodeRunner:
    """Compile, capture and replay ``layer``'s decode step per batch-size bucket.

    Args:
        layer: the attention layer (its caches are mutated by every valid step).
        buckets: step sizes to capture; a step of ``n`` tokens runs the smallest bucket
            ``>= n``. Largest bucket <= ``layer.cache_cfg.max_tokens``.
        meta: step buffers (default: :meth:`StepMetadata.for_layer`).
        compile: ``torch.compile(fullgraph=True)`` the step (``False``: run it eagerly,
            still padded and, on CUDA, still captured).
        backend: ``torch.compile`` backend (``"inductor"``).
        cuda_graphs: capture graphs (default: when the layer is on CUDA).

    ``step()`` returns a view into the bucket's static output, valid until the next step.

    Example::

        >>> import torch
        >>> from graphs import CacheConfig, DecodeRunner, DSV41Attention, TINY
        >>> layer = DSV41Attention(TINY, CacheConfig(4, 4, 32, 4), compress_ratio=2)
        >>> runner = DecodeRunner(layer, buckets=(2, 4), compile=False)
        >>> x = torch.randn(3, TINY.dim, dtype=torch.bfloat16)
        >>> i32 = lambda *v: torch.tensor(v, dtype=torch.int32)
        >>> runner.step(x, i32(0, 0, 0), i32(0, 1, 2)).shape
        torch.Size([3, 64])
    """

    def __init__(
        self,
        layer: DSV41Attention,
        buckets: Sequence[int] = DEFAULT_BUCKETS,
        *,
        meta: Optional[StepMetadata] = None,
        compile: bool = True,
        backend: str | Callable = "inductor",
        cuda_graphs: Optional[bool] = None,
    ) -> None:
        self.buckets = sorted(set(int(b) for b in buckets))
        if not self.buckets or self.buckets[0] < 1 or self.buckets[-1] > layer.cache_cfg.max_tokens:
            raise ValueError(f"buckets must be in [1, max_tokens={layer.cache_cfg.max_tokens}], got {list(buckets)}")
        self.layer = layer
        self.meta = meta if meta is not None else StepMetadata.for_layer(layer, self.buckets[-1])
        self.module = DecodeStep(layer, self.meta)
        self.compiled = compile
        self.fn = torch.compile(self.module, fullgraph=True, backend=backend) if compile else self.module
        device = layer.swa_cache.device
        self.cuda_graphs = device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self.x = torch.zeros(self.buckets[-1], layer.cfg.dim, dtype=torch.bfloat16, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, Tensor] = {}
        self.captures = 0

    def bucket_for(self, n: int) -> int:
        i = bisect.bisect_left(self.buckets, n)
        if n < 1 or i == len(self.buckets):
            raise ValueError(f"a step must have 1..{self.buckets[-1]} tokens (the largest bucket), got {n}")
        return self.buckets[i]

    def run(self, bucket: int) -> Tensor:
        """Run the (compiled) step on the first ``bucket`` rows of the static input."""
        x = self.x[:bucket]
        return compiled_call(self.fn, x) if self.compiled else self.fn(x)

    @torch.no_grad()
    def capture(self, warmup: int = 2) -> None:
        """Compile (on first use) and capture one graph per bucket, largest first.

        Warm-up and capture run on all-padding metadata, so they write nothing that a
        valid token reads; the metadata is left all padding.
        """
        if not self.cuda_graphs:
            raise RuntimeError("capture() needs a CUDA layer (cuda_graphs=True)")
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
    def step(
        self,
        x: Tensor,
        positions: Tensor,
        token_to_req: Tensor,
        seq_lens: Optional[Tensor] = None,
        *,
        swa_block_table: Optional[Tensor] = None,
        cmp_block_table: Optional[Tensor] = None,
    ) -> Tensor:
        """One decode step of ``n = x.shape[0]`` tokens: copy inputs into the static
        buffers, replay the bucket's graph (or run the compiled step), return ``[n, dim]``."""
        n = x.shape[0]
        bucket = self.bucket_for(n)
        self.meta.update(positions, token_to_req, seq_lens, swa_block_table=swa_block_table,
                         cmp_block_table=cmp_block_table, bucket=bucket)
        self.x[:n].copy_(x, non_blocking=True)
        if self.cuda_graphs:
            if bucket not in self.graphs:
                raise RuntimeError(f"bucket {bucket} was not captured; call capture() first")
            self.graphs[bucket].replay()
            return self.outputs[bucket][:n]
        return self.run(bucket)[:n]
