"""``python -m graphs``: build, compile and capture the attention layer, decode, compare, time.

For each compress ratio (default 1 and 2): build the layer (GPU: V4.1-Flash dims, 256
request rows, 2048-token sequences, 64-token pages, buckets 1..256; CPU: the tiny config,
buckets 1, 2, 4), compile its decode step with ``torch.compile(fullgraph=True)``, capture
one CUDA graph per bucket (GPU), then run a staggered multi-request decode through the
compiled (GPU: replayed) step and through the eager layer, and compare them token by
token: the verdict is PASS when every token agrees within the stated tolerance, leaving
out tokens whose two indexer top-k picks differ by a near-tie (their outputs attend other
entries). The exit status is 1 if any layer fails. On a GPU it then times eager /
compiled / replayed steps per batch size (and plots them with ``--plot``); a CPU run
checks graph breaks and agreement only.

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
from compile_ops.formats import KV_FORMATS
from graphs import DEFAULT_BUCKETS, PRESETS, TINY, V41_FLASH, CacheConfig, DecodeRunner, DSV41Attention
from graphs.bench import REL_TOL, agreement, eager_twin, fill_random, flash_cache, plot, time_batches
from graphs.schedule import hidden_states, run_schedule, staggered

DEFAULT_RATIOS = (1, 2)
OP_FAMILIES = ("sparse_mla", "slots", "kv", "indexer")  # the families --backend chooses for


def parse_args(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m graphs", description=__doc__.split("\n\n")[1])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu or cuda[:N] (default: cuda when torch sees a GPU, else cpu)")
    p.add_argument("--preset", choices=sorted(PRESETS), help="model dims (default: V4.1-Flash on GPU, tiny on CPU)")
    p.add_argument("--ratios", type=int, nargs="+", default=list(DEFAULT_RATIOS),
                   help="compress ratios of the layers to run, each one of the preset's (default: 1 2)")
    p.add_argument("--steps", type=int, default=32, help="decode steps compared with the eager layer (default: 32)")
    p.add_argument("--requests", type=int, default=6, help="requests in the compared decode, staggered (default: 6)")
    p.add_argument("--kv-format", default="bf16", choices=sorted(KV_FORMATS), help="cache format (default: bf16)")
    p.add_argument("--backend", default="auto",
                   help="backend of sparse_mla and the slot ops: auto, or one both register: reference, triton "
                        "(default: auto)")
    p.add_argument("--iters", type=int, default=20, help="GPU: timed iterations, x5 for replays (default: 20)")
    p.add_argument("--position", type=int, help="GPU: position of the timed steps (default: 3/4 of max_seq_len)")
    p.add_argument("--plot", help="GPU: PNG path for the step-time plot (default: no plot)")
    p.add_argument("--json", help="write all results here")
    p.add_argument("--time-budget", type=float, default=float("inf"), help="GPU: seconds; skip timings past it")
    args = p.parse_args(argv)
    for name in ("steps", "requests", "iters"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    try:
        args.device = torch.device(args.device)
        for family in OP_FAMILIES:
            with compile_ops.use_backends(**{family: args.backend}):
                compile_ops.backend_for(family, args.device, args.kv_format)
        for ratio in args.ratios:  # every layer's geometry, before any work
            cfg, cache, _ = geometry(args, ratio)
            if ratio:
                cache.check_ratio(cfg.check_ratio(ratio))
    except (RuntimeError, ValueError) as err:
        p.error(str(err))
    return args


def geometry(args, ratio):
    """(model dims, cache geometry, buckets) of the layer of ``ratio`` on ``args.device``."""
    cuda = args.device.type == "cuda"
    cfg = PRESETS[args.preset] if args.preset else (V41_FLASH if cuda else TINY)
    if cuda:
        cache = flash_cache(kv_format=args.kv_format)
        return cfg, cache, list(DEFAULT_BUCKETS)
    # the CPU layer: long enough for a few compressed entries at every ratio it can run
    cache = CacheConfig(max_requests=4, max_tokens=4, max_seq_len=max(64, ratio), page_size=4, kv_format=args.kv_format)
    return cfg, cache, [1, 2, 4]


def progress(ratio: int, start: float, what: str) -> None:
    print(f"  [ratio {ratio}, {time.perf_counter() - start:5.1f} s] {what}", flush=True)


def run_layer(args, ratio, deadline) -> dict:
    from torch._dynamo.utils import counters

    device, start = args.device, time.perf_counter()
    cfg, cache, buckets = geometry(args, ratio)
    progress(ratio, start, f"building the {cfg.name} layer ({cache.max_requests} request rows, {cache.kv_format})")
    layer = DSV41Attention(cfg, cache, ratio, device=device)
    eager = eager_twin(layer, buckets)
    cuda = device.type == "cuda"
    torch._dynamo.reset()
    counters.clear()
    runner = DecodeRunner(layer, buckets)
    with torch.no_grad():
        if cuda:
            progress(ratio, start, f"compiling (fullgraph=True) and capturing {len(buckets)} CUDA graphs")
            runner.capture()
        else:
            progress(ratio, start, "compiling (fullgraph=True)")
            runner.run(buckets[-1])
    compile_s = time.perf_counter() - start
    info = {
        "config": layer.cfg.name, "ratio": ratio, "kv_format": args.kv_format, "buckets": buckets,
        "compile_and_capture_s": round(compile_s, 1),
        "graph_breaks": sum(counters["graph_break"].values()),
        "dynamo_graphs": counters["stats"]["unique_graphs"],
        "cuda_graphs_captured": len(runner.graphs),
        "backends": {f: compile_ops.backend_for(f, device, args.kv_format) for f in OP_FAMILIES},
    }
    schedule = staggered(min(args.requests, buckets[-1]), args.steps, stagger=3)
    progress(ratio, start, f"decoding {args.steps} steps of {len(schedule.starts)} staggered requests, "
                           f"{'replayed' if cuda else 'compiled'} and eager")
    xs = hidden_states(schedule, layer.cfg.dim, seed=1, device=device)
    with torch.no_grad():
        got, got_ids = run_schedule(runner.step, schedule, xs, watch=runner.layer.topk_ids if ratio else None)
        want, want_ids = run_schedule(eager.step, schedule, xs, watch=eager.layer.topk_ids if ratio else None)
    agree = agreement(got, want, got_ids, want_ids)
    info.update(decode_steps=args.steps, agreement=agree.__dict__, passed=agree.passed, verdict=agree.verdict())
    if cuda:
        fill_random(runner.layer)
        fill_random(eager.layer)
        position = args.position if args.position is not None else layer.cache_cfg.max_seq_len * 3 // 4
        info["timed_position"] = position
        progress(ratio, start, f"timing batches {buckets[0]}..{buckets[-1]} at position {position}")
        info["rows"] = time_batches(runner, eager, buckets, position, iters=args.iters, replay_iters=5 * args.iters,
                                    profile_batches={1, 8, 64, 256}, deadline=deadline)
    return info


def report(info: dict) -> None:
    print(f"\n== {info['config']} layer, compress_ratio={info['ratio']}, kv_format={info['kv_format']} ==")
    print(f"graph breaks: {info['graph_breaks']}   dynamo graphs: {info['dynamo_graphs']}   "
          f"CUDA graphs captured: {info['cuda_graphs_captured']} (buckets {info['buckets']})   "
          f"compile+capture: {info['compile_and_capture_s']} s   backends: {info['backends']}")
    print(f"{info['decode_steps']}-step decode, compiled vs eager layer: {info['verdict']}")
    rows = info.get("rows")
    if not rows:
        return
    print(f"step times at position {info['timed_position']} (us):")
    print(f"{'batch':>6} {'eager':>9} {'compiled':>9} {'step':>8} {'replay':>8} {'kernels':>8} "
          f"{'eager/step':>10} {'eager/replay':>12} {'replay/kern':>11}")
    for r in rows:
        kern = r.get("kernels_us", 0.0)  # profiled batches only
        ratio = f"{r['replay_us'] / kern:11.2f}" if kern else f"{'n/a':>11}"
        print(f"{r['batch']:>6} {r['eager_us']:9.1f} {r['compiled_us']:9.1f} {r['step_us']:8.1f} "
              f"{r['replay_us']:8.1f} {kern:8.1f} {r['eager_us'] / r['step_us']:10.1f} "
              f"{r['eager_us'] / r['replay_us']:12.1f} {ratio}")
    sources = sorted({r["kernels_from"] for r in rows if "kernels_from" in r})
    print(f"kernels = summed GPU time of the kernels, from torch.profiler of: {', '.join(sources) or 'none'}")
    for r in rows:
        if r.get("top_kernels") and r["batch"] in (1, max(x["batch"] for x in rows if "top_kernels" in x)):
            print(f"costliest kernels at batch {r['batch']} (us): "
                  + "; ".join(f"{name} {us}" for name, us in r["top_kernels"][:5]))


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    device = args.device
    deadline = time.perf_counter() + args.time_budget
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}")
    print("Each layer's compiled decode is compared with the eager layer on the same inputs and weights.", flush=True)
    results = {}
    for ratio in args.ratios:
        with compile_ops.use_backends(sparse_mla=args.backend, slots=args.backend, kv=args.backend, indexer=args.backend):
            info = run_layer(args, ratio, deadline)
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
    failed = [name for name, info in results.items() if not info["passed"]]
    print(f"\n{'FAIL: ' + ', '.join(failed) if failed else 'PASS: every layer'} "
          f"(compiled vs eager within {REL_TOL:g} of max |y|)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
