"""``python -m compile_ops.bench linear``: ``fp8_linear`` against the bf16 GEMM and the byte floor.

For each V4.1-Flash projection and token count ``M`` (weights in ``--block`` blocks: 32,
V4.1's layout, or 128, V4's): the op as ``auto`` picks (and each
CUDA backend that takes the call), the bf16 product of the same weight (``F.linear``;
``bmm`` for the grouped ``wo_a``), and each one's floor, the bytes it must move once
(weight, tokens in, bf16 out) at the copy bandwidth. Timed by CUDA-graph replay.

    python -m compile_ops.bench linear --csv bench_linear.csv
"""

from __future__ import annotations

import argparse
import csv

import torch
import torch.nn.functional as F

from compile_ops._cli import description
from compile_ops.bench import COPY_BYTES_PER_S
from compile_ops.bench.slots import graph_args, graph_time_us, int_list, no_cuda

# V4.1-Flash's FP8 projections: name -> (N, K, groups); wo_a is 8 groups of 1024 x 4096
FLASH_PROJECTIONS = {"wq_a": (1280, 5120, 1), "wq_b": (32768, 1280, 1), "wkv": (512, 5120, 1),
                     "wo_a": (8192, 4096, 8), "wo_b": (5120, 8192, 1), "indexer.wq_b": (4096, 1280, 1)}


def floor_us(weight_bytes: int, M: int, N: int, K: int) -> float:
    return (weight_bytes + 2 * M * K + 2 * M * N) / COPY_BYTES_PER_S * 1e6


def main(argv: list[str]) -> int:
    from compile_ops.bench import progress

    import compile_ops
    from compile_ops.backends import resolve
    from compile_ops.linear import fp8_linear, quantize_blocks

    parser = argparse.ArgumentParser(prog="python -m compile_ops.bench linear", description=description(__doc__))
    parser.add_argument("--tokens", type=int_list, default="1,4,16,64,128,256,1024,4096",
                        help="comma-separated token counts M")
    parser.add_argument("--block", type=int, choices=(32, 128), default=32,
                        help="weight blocks: 32 (V4.1's ue8m0 scales) or 128 (V4's fp32 scales)")
    graph_args(parser, 20, "bench_linear.csv")
    args = parser.parse_args(argv)
    if no_cuda("linear"):
        return 1
    device = torch.device("cuda")
    rows = []
    todo = [(name, M) for name in FLASH_PROJECTIONS for M in args.tokens]
    for name, M in progress(todo, desc="linear", unit="case"):
        N, K, G = FLASH_PROJECTIONS[name]
        gen = torch.Generator(device=device).manual_seed(M)
        w = torch.randn(N, K, device=device, generator=gen) / K**0.5
        wq, ws = quantize_blocks(w, args.block)
        wb = w.bfloat16()
        x = torch.randn(M, G * K, device=device, generator=gen).bfloat16()
        auto = resolve("linear", device, args=(x, wq, ws, G))[0]
        row = {"projection": name, "N": N, "K": K, "groups": G, "M": M, "block": args.block, "auto": auto,
               "fp8_us": round(graph_time_us(lambda: fp8_linear(x, wq, ws, G), args.calls, args.replays), 1)}
        if auto != "triton":
            with compile_ops.use_backends(linear="triton"):
                row["triton_us"] = round(graph_time_us(lambda: fp8_linear(x, wq, ws, G), args.calls, args.replays), 1)
        if G == 1:
            bf16 = lambda: F.linear(x, wb)  # noqa: E731
        else:
            per_group = wb.view(G, N // G, K)
            bf16 = lambda: torch.bmm(x.view(M, G, K).transpose(0, 1), per_group.transpose(1, 2))  # noqa: E731
        row["bf16_us"] = round(graph_time_us(bf16, args.calls, args.replays), 1)
        row["fp8_floor_us"] = round(floor_us(wq.numel() + ws.element_size() * ws.numel(), M, N, G * K), 1)
        row["bf16_floor_us"] = round(floor_us(2 * wb.numel(), M, N, G * K), 1)
        rows.append(row)
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with open(args.csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.calls} calls per graph, "
          f"{args.replays} replays; csv: {args.csv}\n")
    print("| projection | M | auto | FP8 us | Triton us | bf16 us | FP8 floor | bf16 floor | bf16 / FP8 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['projection']} | {r['M']} | {r['auto']} | {r['fp8_us']} | {r.get('triton_us', '')} | "
              f"{r['bf16_us']} | {r['fp8_floor_us']} | {r['bf16_floor_us']} | {r['bf16_us'] / r['fp8_us']:.2f}x |")
    return 0
