"""Decode schedules for tests, the demo and the benchmark.

A :class:`Schedule` gives each request row a first step and a length: request ``r`` has
its position-``p`` token in step ``starts[r] + p``. :func:`run_schedule` drives any step
function over it with all inputs staged on the device beforehand and outputs gathered into
one device buffer, so the loop itself has no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

StepFn = Callable[[Tensor, Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class Schedule:
    """``starts[r]`` / ``lengths[r]``: first step and token count of request row ``r``."""

    starts: tuple[int, ...]
    lengths: tuple[int, ...]

    @property
    def steps(self) -> int:
        return max(s + n for s, n in zip(self.starts, self.lengths))

    def tokens(self, step: int) -> tuple[list[int], list[int]]:
        """Request rows and positions of ``step``'s tokens (rows in increasing order)."""
        rows, positions = [], []
        for r, (s, n) in enumerate(zip(self.starts, self.lengths)):
            if s <= step < s + n:
                rows.append(r)
                positions.append(step - s)
        return rows, positions


def staggered(num_requests: int, steps: int, stagger: int = 3) -> Schedule:
    """Request ``r`` joins at step ``r * stagger`` and decodes to the end (so batch sizes
    vary and requests sit at different positions)."""
    starts = tuple(min(r * stagger, steps - 1) for r in range(num_requests))
    return Schedule(starts, tuple(steps - s for s in starts))


def hidden_states(schedule: Schedule, dim: int, seed: int = 0, device=None, scale: float = 1.0) -> list[Tensor]:
    """Random bf16 hidden states ``[lengths[r], dim]`` per request (drawn on the CPU)."""
    gen = torch.Generator().manual_seed(seed)
    return [(scale * torch.randn(n, dim, generator=gen)).to(torch.bfloat16).to(device) for n in schedule.lengths]


def run_schedule(
    step_fn: StepFn, schedule: Schedule, xs: list[Tensor], *, watch: Optional[Tensor] = None,
    sync_debug: Optional[str] = None, steps: Optional[range] = None,
) -> tuple[list[Tensor], Optional[list[Tensor]]]:
    """Run every step of ``schedule`` through ``step_fn(x [n, dim], positions [n],
    token_to_req [n]) -> [n, dim]``.

    Returns each request's outputs ``[lengths[r], dim]`` (fp32) and, when ``watch`` (a
    ``[max_tokens, ...]`` buffer the step writes, e.g. ``layer.topk_ids``) is given, its
    first ``n`` rows after each step, per request ``[lengths[r], ...]``. All inputs are
    staged on ``xs``' device first; the loop only launches work. ``sync_debug`` (e.g.
    ``"error"``) sets ``torch.cuda.set_sync_debug_mode`` for the loop alone. ``steps``
    runs only those steps; outputs then hold only the tokens of those steps, per request
    in position order (requests with none get an empty tensor).
    """
    device, dim = xs[0].device, xs[0].shape[1]
    steps = range(schedule.steps) if steps is None else steps
    staged = []
    for step in steps:
        rows, positions = schedule.tokens(step)
        x = torch.stack([xs[r][p] for r, p in zip(rows, positions)]) if rows else None
        staged.append((
            x, torch.tensor(positions, dtype=torch.int32).to(device), torch.tensor(rows, dtype=torch.int32).to(device),
        ))
    width = max(1, max(len(schedule.tokens(s)[0]) for s in steps))
    out = torch.zeros(len(steps), width, dim, dtype=torch.float32, device=device)
    seen = None if watch is None else torch.zeros(len(steps), width, *watch.shape[1:], dtype=watch.dtype, device=device)
    if sync_debug is not None:
        torch.cuda.set_sync_debug_mode(sync_debug)
    try:
        for step, (x, positions, rows) in enumerate(staged):
            if x is None:
                continue
            n = x.shape[0]
            out[step, :n].copy_(step_fn(x, positions, rows))
            if seen is not None:
                seen[step, :n].copy_(watch[:n])
    finally:
        if sync_debug is not None:
            torch.cuda.set_sync_debug_mode(0)
    outputs, watched = [], [] if seen is not None else None
    for r, (s, n) in enumerate(zip(schedule.starts, schedule.lengths)):
        mine = [step for step in range(s, s + n) if step in steps]
        index = torch.tensor([steps.index(step) for step in mine], dtype=torch.long, device=device)
        cols = torch.tensor([schedule.tokens(step)[0].index(r) for step in mine], dtype=torch.long, device=device)
        outputs.append(out[index, cols])
        if seen is not None:
            watched.append(seen[index, cols])
    return outputs, watched
