"""Serving workloads for tests, the main job and the benchmark.

A :class:`Workload` is a list of steps; each step holds one :class:`Chunk` per request it
serves: a prefill chunk, one decode token, or a token plus draft tokens of which only the
first ``accepted`` are the request's (the rest are rejected: the request's next step
rewrites those positions). :func:`mixed_workload` builds one from prompt lengths (chunked
prefill and decode, optionally with drafts, mixed in the same steps, request rows reused
once requests finish); :func:`staggered` is a plain decode. :func:`run_workload` drives
any step function over it with the hidden states staged on the device beforehand and the
outputs gathered into one device buffer, so the loop itself never syncs with the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import torch
from torch import Tensor

StepFn = Callable[[Tensor, Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class Chunk:
    """Tokens of request ``request`` (in request row ``row``) at positions ``start ..
    start + n - 1`` of one step; positions from ``start + accepted`` on carry rejected draft
    tokens (``accepted == n``: none). ``kind`` is ``"prefill"``, ``"decode"`` or ``"draft"``
    (a token plus draft tokens); ``last`` marks the request's final step."""

    request: int
    row: int
    start: int
    n: int
    accepted: int
    kind: str = "decode"
    last: bool = False


@dataclass(frozen=True)
class Workload:
    """``lengths[q]``: tokens request ``q`` ends with; ``steps``: the chunks of each step."""

    lengths: tuple[int, ...]
    steps: tuple[tuple[Chunk, ...], ...]

    def tokens(self, step: int) -> int:
        return sum(c.n for c in self.steps[step])

    def kinds(self) -> dict[str, int]:
        """How many chunks of each kind the workload has (prefill / decode / draft)."""
        out = {"prefill": 0, "decode": 0, "draft": 0}
        for step in self.steps:
            for c in step:
                out[c.kind] += 1
        return out


def mixed_workload(
    prompts: Sequence[int], decode: int, *, chunk: int, max_tokens: int, rows: int, arrive_every: int = 1,
    drafts: int = 0,
) -> Workload:
    """Requests with prompts of ``prompts[q]`` tokens, prefilled in chunks of at most
    ``chunk`` tokens, then ``decode`` tokens each; request ``q`` arrives at step
    ``q * arrive_every`` (or when a row is free: at most ``rows`` at once) and every step
    holds at most ``max_tokens`` tokens, so prefill chunks and decode tokens share steps.

    With ``drafts > 0`` a decoding request sends, every other step, one token plus up to
    ``drafts`` draft tokens; a deterministic pattern accepts 0 to all of the drafts, and
    the next step rewrites the rejected positions (rewinds of at most ``drafts``
    positions). A finished request's row is reused by a later request (call the runner's
    ``release`` in between: :func:`run_workload` does, given ``release``).
    """
    total = [p + decode for p in prompts]
    length = [0] * len(prompts)
    row_of: dict[int, int] = {}
    free_rows = list(range(rows))  # a queue: rows freed last are reused last
    steps: list[tuple[Chunk, ...]] = []
    q_next, step = 0, 0
    while q_next < len(prompts) or row_of:
        while q_next < len(prompts) and free_rows and q_next * arrive_every <= step:
            row_of[q_next] = free_rows.pop(0)
            q_next += 1
        budget, chunks = max_tokens, []
        for q in sorted(row_of):
            if budget == 0:
                break
            p = length[q]
            if p < prompts[q]:
                n = accepted = min(chunk, prompts[q] - p, budget)
                kind = "prefill"
            else:
                n = min(1 + drafts if (step + q) % 2 else 1, total[q] - p, budget)
                accepted = n if n == 1 else 1 + (step + q) % n  # 1..n tokens kept
                kind = "draft" if n > 1 else "decode"
            length[q] = p + accepted
            chunks.append(Chunk(q, row_of[q], p, n, accepted, kind, last=length[q] == total[q]))
            budget -= n
        for c in chunks:
            if c.last:
                free_rows.append(row_of.pop(c.request))
        if chunks:
            steps.append(tuple(chunks))
        step += 1
    return Workload(tuple(total), tuple(steps))


def staggered(num_requests: int, steps: int, stagger: int = 3) -> Workload:
    """Plain decode: request ``q`` (row ``q``) joins at step ``q * stagger`` and sends one
    token per step to the end (so batch sizes vary and requests sit at different positions)."""
    starts = [min(q * stagger, steps - 1) for q in range(num_requests)]
    plan = [tuple(Chunk(q, q, step - s, 1, 1, "decode", last=step == steps - 1) for q, s in enumerate(starts) if s <= step)
            for step in range(steps)]
    return Workload(tuple(steps - s for s in starts), tuple(plan))


def hidden_states(workload: Workload, dim: int, seed: int = 0, device=None, scale: float = 1.0) -> list[Tensor]:
    """Random bf16 hidden states ``[lengths[q], dim]`` per request (drawn on the CPU)."""
    gen = torch.Generator().manual_seed(seed)
    return [(scale * torch.randn(n, dim, generator=gen)).to(torch.bfloat16).to(device) for n in workload.lengths]


def run_workload(
    step_fn: StepFn, workload: Workload, xs: list[Tensor], *, watch: Union[None, Tensor, dict[str, Tensor]] = None,
    release: Optional[Callable[[int], None]] = None, sync_debug: Optional[str] = None,
    steps: Optional[range] = None, seed: int = 0,
) -> tuple[list[Tensor], Optional[list[Tensor]]]:
    """Run ``workload`` through ``step_fn(x [n, dim], positions [n], token_to_req [n]) ->
    [n, dim]`` (host int32 positions and rows; ``x`` on ``xs``' device).

    Rejected draft tokens get other hidden states than the request's (random, from
    ``seed``). Returns each request's outputs ``[lengths[q], dim]`` fp32, position ``p``
    taken from the step whose accepted tokens last covered ``p``, and, when ``watch`` (a
    ``[max_tokens, ...]`` buffer the step writes, e.g. ``layer.topk_ids``) is given, its
    rows likewise (``watch`` a dict of buffers: a dict of such lists). ``release(row)`` is called after a request's last step. ``sync_debug``
    (e.g. ``"error"``) sets ``torch.cuda.set_sync_debug_mode`` for the loop alone. ``steps``
    runs only those steps (positions they do not cover stay zero).
    """
    device, dim = xs[0].device, xs[0].shape[1]
    steps = range(len(workload.steps)) if steps is None else steps
    offsets = [0]
    for n in workload.lengths:
        offsets.append(offsets[-1] + n)
    dump = offsets[-1]
    gen = torch.Generator().manual_seed(seed)
    staged = []
    for s in steps:
        chunks = workload.steps[s]
        parts, positions, rows, where = [], [], [], []
        for c in chunks:
            x = xs[c.request][c.start : c.start + c.n]
            if c.accepted < c.n:  # rejected drafts: not the request's tokens
                wrong = torch.randn(c.n - c.accepted, dim, generator=gen).to(x.dtype).to(device)
                x = torch.cat([x[: c.accepted], wrong])
            parts.append(x)
            positions.extend(range(c.start, c.start + c.n))
            rows.extend([c.row] * c.n)
            where.extend(offsets[c.request] + c.start + i if i < c.accepted else dump for i in range(c.n))
        staged.append((torch.cat(parts), torch.tensor(positions, dtype=torch.int32),
                       torch.tensor(rows, dtype=torch.int32), torch.tensor(where).to(device), chunks))
    out = torch.zeros(dump + 1, dim, dtype=torch.float32, device=device)
    buffers = {} if watch is None else watch if isinstance(watch, dict) else {None: watch}
    seen = {k: torch.zeros(dump + 1, *w.shape[1:], dtype=w.dtype, device=device) for k, w in buffers.items()}
    if sync_debug is not None:
        torch.cuda.set_sync_debug_mode(sync_debug)
    try:
        for x, positions, rows, where, chunks in staged:
            n = x.shape[0]
            out.index_copy_(0, where, step_fn(x, positions, rows).float())
            for k, w in buffers.items():
                seen[k].index_copy_(0, where, w[:n])
            if release is not None:
                for c in chunks:
                    if c.last:
                        release(c.row)
    finally:
        if sync_debug is not None:
            torch.cuda.set_sync_debug_mode(0)
    outputs = [out[offsets[q] : offsets[q + 1]] for q in range(len(workload.lengths))]
    watched = {k: [v[offsets[q] : offsets[q + 1]] for q in range(len(workload.lengths))] for k, v in seen.items()}
    if not isinstance(watch, dict):
        watched = watched.get(None)
    return outputs, watched
