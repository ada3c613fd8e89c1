"""``python -m compile_ops.bench slots``: Triton slot kernels vs the plain-torch reference.

Times ``topk_to_slots``, ``dcp_topk_to_slots`` (world 2, interleave 4, rank 1) and
``swa_indices`` for every ``T`` and ``K`` by CUDA-graph replay: capture ``--calls`` calls in
one graph, replay it ``--replays`` times between CUDA events, divide. GB/s counts the bytes
each call must move (ids read, slots written, per-token metadata), not the block-table
reads; at small ``T`` they sit in L2, so small-``T`` GB/s is a latency figure.

    python -m compile_ops.bench slots --csv bench_slots.csv
"""

from __future__ import annotations

import argparse
import csv
from typing import Callable

import torch

from compile_ops._cli import description

I32 = torch.int32


def graph_time_us(fn: Callable[[], object], calls: int = 20, replays: int = 10) -> float:
    """Microseconds per call of ``fn``, timed by replaying a CUDA graph of ``calls`` calls."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compile / warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    del graph
    return start.elapsed_time(end) * 1e3 / (replays * calls)


def int_list(text: str) -> list[int]:
    """An argparse type: ``"1,8,64"`` -> ``[1, 8, 64]`` (a bad value is a usage error)."""
    try:
        return [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def graph_args(parser: argparse.ArgumentParser, calls: int, csv_path: str) -> None:
    """The options of every CUDA-graph-timed benchmark: calls per graph, replays, CSV path."""
    parser.add_argument("--calls", type=int, default=calls, help="calls captured in one graph")
    parser.add_argument("--replays", type=int, default=10)
    parser.add_argument("--csv", default=csv_path)


def no_cuda(what: str) -> bool:
    """``True`` (after saying why) when no CUDA GPU can time ``what``'s graphs."""
    if torch.cuda.is_available():
        return False
    print(f"the {what} benchmark times CUDA graphs: it needs a CUDA GPU")
    return True


def topk_problem(T: int, K: int, device, block_size: int = 64, pages: int = 64):
    """``T`` tokens over ``min(T, 64)`` requests, each with ``pages`` pages of ``block_size``
    compressed entries; top-k ids are distinct valid ids with ~10% ``-1`` padding."""
    gen = torch.Generator(device=device).manual_seed(T * 7 + K)
    R = min(T, 64)
    n_ids = block_size * pages
    topk = torch.randint(0, n_ids, (T, K), device=device, dtype=I32, generator=gen)
    topk = torch.where(torch.rand(T, K, device=device, generator=gen) < 0.1, -1, topk)
    token_to_req = torch.randint(0, R, (T,), device=device, dtype=I32, generator=gen)
    table = torch.randperm(R * pages, device=device, generator=gen).to(I32).view(R, pages)
    is_valid = torch.ones(T, dtype=torch.bool, device=device)
    positions = torch.randint(0, n_ids, (T,), device=device, dtype=I32, generator=gen)
    return topk, token_to_req, table, is_valid, positions, block_size


def cases(tokens, topks, window):
    from compile_ops.slots import reference as ref
    from compile_ops.slots import triton as tri

    impls = {
        "topk_to_slots": (tri.topk_to_slots_triton, ref.topk_to_slots_reference),
        "dcp_topk_to_slots": (tri.dcp_topk_to_slots_triton, ref.dcp_topk_to_slots_reference),
        "swa_indices": (tri.swa_indices_triton, ref.swa_indices_reference),
    }
    for op, (fast, slow) in impls.items():
        for K in topks if op != "swa_indices" else [window]:
            for T in tokens:
                yield op, fast, slow, T, K


def call(op, fn, p):
    topk, token_to_req, table, is_valid, positions, block_size = p
    if op == "topk_to_slots":
        return lambda: fn(topk, token_to_req, table, block_size, is_valid)
    if op == "dcp_topk_to_slots":
        return lambda: fn(topk, token_to_req, table, block_size, is_valid, 1, 2, 4)
    window = topk.shape[1]
    return lambda: fn(positions, token_to_req, table, block_size, window)


def moved_bytes(op: str, T: int, K: int) -> int:
    per_token = 4 + 4 + 1 if op != "swa_indices" else 4 + 4 + 4  # lens, token_to_req, is_valid / positions
    return T * (2 * 4 * K + per_token)


def main(argv: list[str]) -> int:
    from compile_ops.bench import progress

    parser = argparse.ArgumentParser(prog="python -m compile_ops.bench slots", description=description(__doc__))
    parser.add_argument("--tokens", type=int_list, default="1,4,16,64,256,512,1024,4096", help="comma-separated T values")
    parser.add_argument("--topk", type=int_list, default="512,2048", help="comma-separated K values")
    parser.add_argument("--window", type=int, default=128)
    graph_args(parser, 20, "bench_slots.csv")
    args = parser.parse_args(argv)
    if no_cuda("slots"):
        return 1
    device = torch.device("cuda")
    todo = list(cases(args.tokens, args.topk, args.window))
    rows = []
    for op, fast, slow, T, K in progress(todo, desc="slots", unit="case"):
        p = topk_problem(T, K, device)
        fast_us = graph_time_us(call(op, fast, p), args.calls, args.replays)
        slow_us = graph_time_us(call(op, slow, p), args.calls, args.replays)
        nbytes = moved_bytes(op, T, K)
        rows.append(dict(op=op, T=T, K=K, bytes=nbytes, triton_us=round(fast_us, 2), reference_us=round(slow_us, 2),
                         triton_GBps=round(nbytes / fast_us / 1e3, 1), reference_GBps=round(nbytes / slow_us / 1e3, 1),
                         speedup=round(slow_us / fast_us, 1)))
    with open(args.csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"\n{torch.cuda.get_device_name()}; {args.calls} calls per graph, {args.replays} replays; csv: {args.csv}\n")
    print("| op | K (W) | T | Triton us | Triton GB/s | reference us | reference GB/s | speedup |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['op']} | {r['K']} | {r['T']} | {r['triton_us']} | {r['triton_GBps']} | {r['reference_us']} | {r['reference_GBps']} | {r['speedup']}x |")
    return 0
