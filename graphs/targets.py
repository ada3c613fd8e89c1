"""``python -m graphs.targets``: the decode and prefill targets on one GPU in one run, each figure
beside its floor or its limit.

Sections (``--only``, comma-separated; all by default):

* ``decode``: the heaviest layer kind (V4.1-Flash, ratio 2 with its own compressor and
  indexer, ``fp8_dsv41`` caches, 256 request rows) with bf16 and then FP8 weights, batch
  1 / 64 / 256 decoding at position 1026 (its rows hold 513 compressed entries, so the
  top-k searches): the replay (best of 3 x 200, CUDA events), its kernels, the weight
  floor (:func:`graphs.bench.decode_floor_us`), and :meth:`graphs.StepRunner.step`
  against the replay (:func:`graphs.bench.time_step_overhead`).
* ``long``: 64 requests at 128K tokens, FP8 weights: the replay against its byte floor
  (weights, index keys and attention rows at 4.3 TB/s).
* ``indexer``: ``indexer_topk`` (``order="id"``, the layer's call) at one token over 8K
  entries, 64 tokens over 64K against the index-key bytes floor, and its top-k kernels
  alone at 64 rows of 128K scores (``compile_ops.bench.indexer``'s problems: fp8 keys, 64
  heads, 64-entry pages, ``k = 512``).
* ``stack``: the V4.1-Flash stack's slice (one layer of each kind,
  :func:`graphs.stack_job.build`), FP8 weights, batch 1 at 1024 tokens: the replay per
  layer.
* ``fp4``: ``indexer_topk`` over DeepSeek-V4.1's fp4 index keys (68 B an entry, its 32
  index heads), 64 tokens over 64K entries, as a share of the HBM bandwidth.
* ``prefill``: the V4.1-Flash stack's slice with bf16 and then FP8 weights, captured at
  4096 tokens: a 32K-token prompt in 4K chunks against the matrix floor
  (:func:`graphs.bench.prefill_flops` at the bf16 rate; FP8 weights also at twice it, the
  FP8 rate, reported without a target), the share of its last chunk's kernel time inside
  the indexer ops, and an 8192-token step (two replays of the 4096 graph): its host time
  as a share of its wall time.

Prints one markdown table (target, measured, floor, met) and, with ``--json``, writes its
rows. Compiling dominates: about a minute per layer and weight kind on an H200 with a
cold Inductor cache, so a run of every section takes several minutes; a progress line
goes to stderr as each part starts.

    python -m graphs.targets --json targets.json
    python -m graphs.targets --only indexer,long
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Callable, NamedTuple, Optional

import torch

from compile_ops._cli import description

SECTIONS = ("decode", "long", "indexer", "stack", "fp4", "prefill")
DECODE_BATCHES = (1, 64, 256)
DECODE_POSITION = 1026  # 513 compressed entries at ratio 2: the top-k searches
LONG_ROWS, LONG_CONTEXT = 64, 128 * 1024
PREFILL_PROMPT, PREFILL_CHUNK = 32 * 1024, 4096


class Target(NamedTuple):
    """One target: ``measured`` against ``limit`` (both in ``unit``; met when at most the
    limit; ``None``: a figure reported beside the targets, none set for it), with the
    ``floor`` it stands beside (``None``: none applies) and a ``note``."""

    name: str
    measured: float
    limit: Optional[float]
    unit: str = "us"
    floor: Optional[float] = None
    note: str = ""

    @property
    def met(self) -> Optional[bool]:
        return None if self.limit is None else self.measured <= self.limit

    def row(self) -> dict:
        return {**self._asdict(), "met": self.met}


def _amount(value: float, unit: str) -> str:
    if unit == "x":
        return f"{value:.2f}x"
    return f"{value:.0f} {unit}" if unit == "kernels" else f"{value:.1f} {unit}"


def table(targets: list[Target]) -> str:
    """The targets as a markdown table; a floor shows with the measured figure's multiple of it."""
    lines = ["| target | measured | floor | met |", "| --- | --- | --- | --- |"]
    for t in targets:
        limit = ("" if t.limit is None else f" <= {t.limit:g}x" if t.unit == "x"
                 else f" <= {t.limit:g} {t.unit}")
        floor = "-" if t.floor is None else f"{_amount(t.floor, t.unit)} ({t.measured / t.floor:.2f}x)"
        note = f" ({t.note})" if t.note else ""
        met = "-" if t.met is None else "yes" if t.met else "no"
        lines.append(f"| {t.name}{limit} | {_amount(t.measured, t.unit)}{note} | {floor} | {met} |")
    return "\n".join(lines)


def _say(start: float, what: str) -> None:
    print(f"[{time.time() - start:.0f} s] {what}", file=sys.stderr, flush=True)


def _indexer_op(T: int, n: int, index_format: str, heads: int) -> tuple[float, float]:
    """``(us, floor us)`` of ``indexer_topk`` (``order="id"``) for ``T`` tokens over ``n``
    entries each (``compile_ops.bench.indexer``'s problem), best of 3, and its key bytes at
    4.3 TB/s."""
    import compile_ops
    from compile_ops.bench import COPY_BYTES_PER_S
    from compile_ops.bench.indexer import K, problem
    from compile_ops.bench.slots import graph_time_us
    from compile_ops.indexer.cache import get_index_format

    p = problem(T, n, n, "cuda", index_format, heads=heads)
    us = min(graph_time_us(lambda: compile_ops.indexer_topk(*p, K, index_format, order="id")) for _ in range(3))
    return us, T * n * get_index_format(index_format).bytes_per_token / COPY_BYTES_PER_S * 1e6


def decode_targets(say: Callable[[str], None]) -> list[Target]:
    """The heaviest layer kind's decode replays and steps, bf16 then FP8 weights."""
    from graphs.bench import (decode_floor_us, decode_replay_at, fill_random, flash_layer, profile_kernels,
                              time_step_overhead)
    from graphs.runner import StepRunner

    limits = {1: {"bf16": 130.0, "fp8": 100.0}, 64: 220.0, 256: 400.0}
    out = []
    for weights in ("bf16", "fp8"):
        say(f"decode: compiling and capturing the {weights} layer, buckets {DECODE_BATCHES}")
        layer = flash_layer(2, "cuda", weights=weights, kv_format="fp8_dsv41", max_tokens=max(DECODE_BATCHES))
        runner = StepRunner(layer, list(DECODE_BATCHES))
        runner.capture()
        fill_random(layer)
        for b in DECODE_BATCHES:
            say(f"decode: {weights} batch {b}")
            replay = decode_replay_at(runner, b, DECODE_POSITION, 200, reps=3)
            kernels = profile_kernels(runner.graphs[b].replay)
            floor = decode_floor_us(layer, b, DECODE_POSITION)["floor_us"]
            limit = limits[b][weights] if b == 1 else limits[b]
            out.append(Target(f"{weights} batch-{b} decode replay", replay, limit, floor=floor,
                              note=f"{kernels.count} kernels"))
            if b == 1:
                out.append(Target(f"{weights} batch-1 kernels per replay", kernels.count, 60, unit="kernels"))
            overhead = time_step_overhead(runner, b, DECODE_POSITION)
            out.append(Target(f"{weights} batch-{b} StepRunner.step / replay", overhead["ratio"], 1.05, unit="x",
                              note=f"{overhead['step_us']} / {overhead['replay_us']} us; the host alone "
                                   f"{overhead['host_us']} us"))
        del runner, layer
        torch.cuda.empty_cache()
    return out


def long_targets(say: Callable[[str], None]) -> list[Target]:
    """64 requests decoding at 128K tokens with FP8 weights, against the byte floor."""
    from graphs.bench import decode_floor_us, decode_replay_at, fill_random, flash_layer
    from graphs.runner import StepRunner

    say(f"long: compiling and capturing the FP8 layer for {LONG_ROWS} rows of {LONG_CONTEXT} tokens")
    layer = flash_layer(2, "cuda", weights="fp8", kv_format="fp8_dsv41", max_requests=LONG_ROWS, max_tokens=LONG_ROWS,
                        max_seq_len=LONG_CONTEXT + 256)
    runner = StepRunner(layer, [LONG_ROWS])
    runner.capture()
    fill_random(layer)
    replay = decode_replay_at(runner, LONG_ROWS, LONG_CONTEXT, 100, reps=3)
    floor = decode_floor_us(layer, LONG_ROWS, LONG_CONTEXT)["floor_us"]
    del runner, layer
    torch.cuda.empty_cache()
    return [Target(f"{LONG_ROWS} x 128K decode replay / floor", replay / floor, 1.6, unit="x",
                   note=f"{replay:.1f} us against {floor:.1f} us")]


def indexer_targets(say: Callable[[str], None]) -> list[Target]:
    """``indexer_topk`` at one token over 8K entries and 64 x 64K, its top-k at 64 x 128K."""
    from compile_ops.bench.indexer import HEADS, K, problem, topk_alone_us
    from compile_ops.indexer import ops
    from compile_ops.indexer.inputs import local_counts

    say("indexer: 1 x 8192")
    us, floor = _indexer_op(1, 8192, "fp8", HEADS)
    out = [Target("indexer_topk 1 x 8K", us, 15.0, floor=floor)]
    say("indexer: 64 x 65536")
    us, floor = _indexer_op(64, 65536, "fp8", HEADS)
    out.append(Target("indexer_topk 64 x 64K / bytes floor", us / floor, 1.4, unit="x",
                      note=f"{us:.1f} us against {floor:.1f} us"))
    say("indexer: top-k alone, 64 x 128K")
    T, n = 64, 128 * 1024
    p = problem(T, n, n, "cuda")
    n_local = local_counts(ops._args(*p, K, ops._check_topk(*p, K, "fp8")))[1]
    scores = torch.randn(T, n, device="cuda")
    us = min(topk_alone_us(scores, n_local, False) for _ in range(3))
    out.append(Target(f"top-k alone {T} x 128K", us, 50.0, note="id order, after the scores kernel"))
    return out


def stack_targets(say: Callable[[str], None]) -> list[Target]:
    """The V4.1-Flash stack slice with FP8 weights, batch 1 at 1024 tokens, per layer."""
    from graphs.bench import decode_replay_at, profile_kernels
    from graphs.runner import StepRunner
    from graphs.stack_job import build

    say("stack: compiling and capturing the FP8 slice")
    stack, _, _ = build(torch.device("cuda"), "fp8_dsv41", weights="fp8")
    runner = StepRunner(stack, [1])
    runner.capture()
    replay = decode_replay_at(runner, 1, 1024, 100, reps=3)
    kernels = profile_kernels(runner.graphs[1].replay)
    layers = len(stack.layers)
    del runner, stack
    torch.cuda.empty_cache()
    return [Target(f"FP8 stack batch-1 replay per layer ({layers} layers)", replay / layers, 90.0,
                   note=f"{replay:.1f} us, {kernels.count} kernels")]


def fp4_targets(say: Callable[[str], None]) -> list[Target]:
    """``indexer_topk`` over fp4 index keys at 64 x 64K, as a share of the HBM bandwidth."""
    say("fp4: indexer_topk 64 x 65536 over fp4 keys, 32 heads")
    us, floor = _indexer_op(64, 65536, "fp4", 32)
    # met at >= 70 % of the bandwidth: the time at most 1 / 0.7 of the bytes floor
    return [Target("fp4 indexer_topk 64 x 64K / bytes floor", us / floor, round(1 / 0.7, 3), unit="x",
                   note=f"{us:.1f} us, {100 * floor / us:.1f} % of 4.3 TB/s")]


def prefill_targets(say: Callable[[str], None]) -> list[Target]:
    """The stack slice's 32K-token prefill in 4K chunks and an 8192-token step, bf16 then
    FP8 weights."""
    from compile_ops.bench import BF16_FLOPS_PER_S
    from graphs import V41_FLASH, V41_FLASH_PLAN, CacheConfig, DSV41Stack
    from graphs.bench import prefill_flops, time_large_steps, time_prefill
    from graphs.runner import StepRunner
    from graphs.stack_job import FLASH_KINDS

    cache = CacheConfig(max_requests=2, max_tokens=2 * PREFILL_CHUNK, max_seq_len=PREFILL_PROMPT + 2 * PREFILL_CHUNK,
                        page_size=64, kv_format="fp8_dsv41")
    ids = [layer_id for layer_id, _ in FLASH_KINDS.values()]
    out = []
    for weights in ("bf16", "fp8"):
        say(f"prefill: compiling and capturing the {weights} stack slice at {PREFILL_CHUNK} tokens")
        stack = DSV41Stack(V41_FLASH, cache, V41_FLASH_PLAN, ids, "cuda", weights=weights)
        runner = StepRunner(stack, [PREFILL_CHUNK])
        runner.capture()
        say(f"prefill: {weights} {PREFILL_PROMPT}-token prompt in {PREFILL_CHUNK}-token chunks")
        p = time_prefill(runner, PREFILL_PROMPT, PREFILL_CHUNK)
        floor_ms = prefill_flops(stack, PREFILL_PROMPT) / BF16_FLOPS_PER_S * 1e3
        rate = f"{p['tokens_per_s']} tokens/s, {p['pct_of_bf16_rate']} % of the bf16 rate"
        if weights == "bf16":
            out.append(Target(f"bf16 stack {PREFILL_PROMPT // 1024}K prefill / bf16 matrix floor", p["ms"] / floor_ms,
                              2.0, unit="x", note=f"{p['ms']} ms against {floor_ms:.2f} ms; {rate}"))
        else:  # weights read at the FP8 rate, twice the bf16 one
            out.append(Target(f"FP8 stack {PREFILL_PROMPT // 1024}K prefill / FP8 matrix floor", 2 * p["ms"] / floor_ms,
                              None, unit="x", note=f"{p['ms']} ms against {floor_ms / 2:.2f} ms; {rate}"))
        share = 100 * p["chunk_indexer_us"] / p["chunk_kernels_us"]
        out.append(Target(f"{weights} indexer share of a {PREFILL_CHUNK}-token chunk's kernels", share, 20.0, unit="%",
                          note=f"{p['chunk_indexer_us']} of {p['chunk_kernels_us']} us; costliest: "
                               + ", ".join(f"{name} {us}" for name, us in p["chunk_top_kernels"][:4])))
        say(f"prefill: {weights} {2 * PREFILL_CHUNK}-token step")
        large = time_large_steps(runner, [2 * PREFILL_CHUNK])[0]
        out.append(Target(f"{weights} {2 * PREFILL_CHUNK}-token step host / wall", 100 * large["host_us"] / large["wall_us"],
                          15.0, unit="%", note=f"{large['host_us']} / {large['wall_us']} us, {large['pieces']} replays"))
        del runner, stack
        torch.cuda.empty_cache()
    return out


RUNNERS = {"decode": decode_targets, "long": long_targets, "indexer": indexer_targets, "stack": stack_targets,
           "fp4": fp4_targets, "prefill": prefill_targets}


def sections(value: str) -> list[str]:
    """``--only``'s comma-separated sections, each one of :data:`SECTIONS`."""
    names = [s.strip() for s in value.split(",") if s.strip()]
    unknown = [s for s in names if s not in SECTIONS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"sections are {', '.join(SECTIONS)}; got {value!r}")
    return names


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m graphs.targets", description=description(__doc__))
    p.add_argument("--only", type=sections, default=list(SECTIONS),
                   help=f"comma-separated sections to run (default: all of {', '.join(SECTIONS)})")
    p.add_argument("--json", help="write the targets' rows here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("python -m graphs.targets times CUDA graphs on the GPU the targets are set for: it needs a CUDA GPU")
        return 1
    start = time.time()
    targets = []
    for name in args.only:
        targets += RUNNERS[name](lambda what: _say(start, what))
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}; {time.time() - start:.0f} s\n")
    print(table(targets))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([t.row() for t in targets], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
