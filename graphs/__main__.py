"""``python -m graphs``: build, compile and capture the attention layer, decode, compare, time.

On a GPU (default there): V4.1-Flash dims, ratio 1 and 2 layers, 256 request rows,
2048-token sequences, 64-token pages, buckets 1..256; each layer is compiled
(``fullgraph=True``), one CUDA graph is captured per bucket, a 32-step decode is replayed
and compared with the eager layer step by step, then eager / compiled / replay step times
are measured per batch size and plotted. On a CPU: the tiny config, buckets 1, 2, 4, no
capture (the compiled step is timed instead of a replay).

Examples::

    python -m graphs                                   # CPU: tiny; GPU: V4.1-Flash benchmark
    python -m graphs --plot docs/performance-decode.png --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

import compile_ops
from graphs import DEFAULT_BUCKETS, PRESETS, TINY, V41_FLASH, CacheConfig, DecodeRunner, DSV41Attention
from graphs.bench import eager_twin, fill_random, flash_layer, plot, time_batches
from graphs.schedule import hidden_states, run_schedule, staggered


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m graphs", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--preset", choices=sorted(PRESETS), help="model dims (default: V4.1-Flash on GPU, tiny on CPU)")
    p.add_argument("--ratios", type=int, nargs="+", help="compress ratios of the layers to run (default: 1 2)")
    p.add_argument("--steps", type=int, default=32, help="decode steps compared with the eager layer")
    p.add_argument("--requests", type=int, default=6, help="requests in the compared decode (staggered)")
    p.add_argument("--kv-format", default="bf16")
    p.add_argument("--backend", default="auto", help="sparse_mla and slot-op backend: auto, reference, triton")
    p.add_argument("--iters", type=int, default=20, help="timed iterations (x5 for replays)")
    p.add_argument("--position", type=int, help="position of the timed steps (default: 3/4 of max_seq_len)")
    p.add_argument("--plot", help="PNG path for the step-time plot (GPU; default: no plot)")
    p.add_argument("--json", help="write all measurements here")
    p.add_argument("--time-budget", type=float, default=float("inf"), help="seconds; skip timings past it")
    return p.parse_args(argv)


def build(args, ratio, device):
    cfg = PRESETS[args.preset] if args.preset else (V41_FLASH if device.type == "cuda" else TINY)
    if device.type == "cuda":
        return flash_layer(ratio, device, cfg=cfg, kv_format=args.kv_format), list(DEFAULT_BUCKETS)
    cache = CacheConfig(max_requests=4, max_tokens=4, max_seq_len=64, page_size=4, kv_format=args.kv_format)
    return DSV41Attention(cfg, cache, ratio, device=device), [1, 2, 4]


def run_layer(args, ratio, device, deadline) -> dict:
    from torch._dynamo.utils import counters

    layer, buckets = build(args, ratio, device)
    eager = eager_twin(layer, buckets)
    cuda = device.type == "cuda"
    torch._dynamo.reset()
    counters.clear()
    runner = DecodeRunner(layer, buckets)
    start = time.perf_counter()
    with torch.no_grad():
        if cuda:
            runner.capture()
        else:
            runner.run(buckets[-1])  # compile
    compile_s = time.perf_counter() - start
    info = {
        "config": layer.cfg.name, "ratio": ratio, "kv_format": args.kv_format, "buckets": buckets,
        "compile_and_capture_s": round(compile_s, 1),
        "graph_breaks": sum(counters["graph_break"].values()),
        "dynamo_graphs": counters["stats"]["unique_graphs"],
        "cuda_graphs_captured": len(runner.graphs),
        "backends": {f: compile_ops.backend_for(f, device, args.kv_format) for f in ("sparse_mla", "slots")},
    }
    schedule = staggered(min(args.requests, buckets[-1]), args.steps, stagger=3)
    xs = hidden_states(schedule, layer.cfg.dim, seed=1, device=device)
    with torch.no_grad():
        got, _ = run_schedule(runner.step, schedule, xs)
        want, _ = run_schedule(eager.step, schedule, xs)
    diff = max((g - w).abs().max().item() for g, w in zip(got, want))
    scale = max(w.abs().max().item() for w in want)
    info.update(decode_steps=args.steps, max_abs_diff=diff, max_rel_diff=diff / scale)
    fill_random(runner.layer)
    fill_random(eager.layer)
    position = args.position if args.position is not None else layer.cache_cfg.max_seq_len * 3 // 4
    info["timed_position"] = position
    info["rows"] = time_batches(runner, eager, buckets, position, iters=args.iters, replay_iters=5 * args.iters,
                                profile_batches={1, 8, 64, 256}, deadline=deadline)
    return info


def report(info: dict) -> None:
    cuda = "replay_us" in (info["rows"][0] if info["rows"] else {})
    print(f"\n== {info['config']} layer, compress_ratio={info['ratio']}, kv_format={info['kv_format']} ==")
    print(f"graph breaks: {info['graph_breaks']}   dynamo graphs: {info['dynamo_graphs']}   "
          f"CUDA graphs captured: {info['cuda_graphs_captured']} (buckets {info['buckets']})   "
          f"compile+capture: {info['compile_and_capture_s']} s   backends: {info['backends']}")
    print(f"{info['decode_steps']}-step decode, largest difference from the eager layer: "
          f"{info['max_abs_diff']:.3g} abs ({info['max_rel_diff']:.2e} of max |y|)")
    if cuda:
        print(f"step times at position {info['timed_position']} (us):")
        print(f"{'batch':>6} {'eager':>9} {'compiled':>9} {'step':>8} {'replay':>8} {'kernels':>8} "
              f"{'eager/step':>10} {'eager/replay':>12} {'replay/kern':>11}")
        for r in info["rows"]:
            kern = r.get("kernels_us", 0.0)  # profiled batches only
            ratio = f"{r['replay_us'] / kern:11.2f}" if kern else f"{'n/a':>11}"
            print(f"{r['batch']:>6} {r['eager_us']:9.1f} {r['compiled_us']:9.1f} {r['step_us']:8.1f} "
                  f"{r['replay_us']:8.1f} {kern:8.1f} {r['eager_us'] / r['step_us']:10.1f} "
                  f"{r['eager_us'] / r['replay_us']:12.1f} {ratio}")
        sources = sorted({r["kernels_from"] for r in info["rows"] if "kernels_from" in r})
        print(f"kernels = summed GPU time of the kernels, from torch.profiler of: {', '.join(sources) or 'none'}")
        for r in info["rows"]:
            if r.get("top_kernels") and r["batch"] in (1, max(x["batch"] for x in info["rows"] if "top_kernels" in x)):
                print(f"costliest kernels at batch {r['batch']} (us): "
                      + "; ".join(f"{name} {us}" for name, us in r["top_kernels"][:5]))
    else:
        print(f"step times at position {info['timed_position']} (us; no CUDA graphs on CPU):")
        print(f"{'batch':>6} {'eager':>9} {'compiled':>9} {'eager/compiled':>14}")
        for r in info["rows"]:
            print(f"{r['batch']:>6} {r['eager_us']:9.1f} {r['compiled_us']:9.1f} {r['eager_us'] / r['compiled_us']:14.2f}")


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    device = torch.device(args.device)
    ratios = args.ratios or ([1, 2] if device.type == "cuda" else [2])
    deadline = time.perf_counter() + args.time_budget
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}")
    results = {}
    for ratio in ratios:
        with compile_ops.use_backends(sparse_mla=args.backend, slots=args.backend):
            info = run_layer(args, ratio, device, deadline)
        report(info)
        results[f"ratio {ratio}"] = info
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    if args.plot and device.type == "cuda":
        first = next(iter(results.values()))
        plot({k: v["rows"] for k, v in results.items()}, args.plot,
             f"{first['config']} attention layer decode step, {torch.cuda.get_device_name(device)}")
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
