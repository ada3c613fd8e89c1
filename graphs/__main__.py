"""``python -m graphs``: serve a mixed workload through one compiled, captured layer, check
it against the full-history oracle, and (on a GPU) time decode, prefill and long context.

For each compress ratio (default 1 and 2): build the layer (GPU: V4.1-Flash dims, 256
request rows, 136K-token sequences, steps up to 8192 tokens, fp8_dsv41 caches; CPU: the
tiny config), compile its step with ``torch.compile(fullgraph=True)`` and capture one CUDA
graph per token bucket (GPU: 1..4096), then serve a workload of requests with prompts of
different lengths, prefilled in chunks while others decode one token or a token plus
draft tokens (rejected drafts rewritten), all in shared steps, through the runner. Every
token is compared with the full-history oracle (``graphs.naive``): the verdict is PASS
when every output is within the stated tolerance and every top-k pick is the oracle's up
to the index format's rounding; the exit status is 1 if any layer fails. On a GPU it then
measures decode step times per batch at 1K tokens, steps of 512..8192 tokens (host vs
wall time; 8192 runs as two replays of the 4096 graph), the prefill of a 32K-token prompt in 4K chunks, 64 requests decoding
at 128K tokens against the byte floor, the layer's memory against its formula, and
decode cost in layers of 4K and 1M tokens of capacity (and plots with ``--plot``).

``--dcp N`` serves the same workload under decode context parallelism instead: N processes
(gloo on CPU, NCCL with one GPU each), each holding ``H / N`` heads and ``1 / N`` of the
compressed and index-key caches (``--interleave``), compiled, and checks every token's
output and top-k ids against the DCP=1 layer with the same weights, and each rank's cache
memory against DCP=1's.

Examples::

    python -m graphs                                   # CPU: tiny; GPU: V4.1-Flash
    python -m graphs --plot docs/performance-decode.png --json out.json
    python -m graphs --dcp 2 --interleave 4           # CPU: 2 gloo processes
    python -m graphs --stack                           # a DeepSeek-V4.1 stack of every layer kind
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch

import compile_ops
from compile_ops._cli import description
from compile_ops.formats import KV_FORMATS
from compile_ops.indexer.cache import INDEX_FORMATS
from compile_ops.indexer.ops import GLUON_INDEX_FORMATS
from graphs import (DEFAULT_BUCKETS, PRESETS, TINY, V41_CACHE_FORMATS, V41_FLASH, CacheConfig, DSV41Attention, StepRunner,
                    buffer_bytes)
from graphs.bench import (COPY_BYTES_PER_S, capacity_replays, pick_matched, decode_floor_us, decode_replay_at, eager_twin, fill_random, plot, time_batches,
                          time_large_steps, time_page_planning, time_prefill, read_weight_bytes, weight_bytes)
from graphs.fp8 import FP8_WEIGHTS_REL_TOL, dequantized_state_dict
from graphs.naive import cache_tolerance, oracle_verdict
from graphs.schedule import hidden_states, mixed_workload, run_workload

DEFAULT_RATIOS = (1, 2)
OP_FAMILIES = tuple(f.name for f in dataclasses.fields(compile_ops.BackendConfig))  # every family --backend sets
GPU_PROMPTS = (1000, 300, 64, 700, 5, 450, 130, 900, 33, 260)
CPU_PROMPTS = (40, 9, 23, 3, 17, 30)
LONG = 128 * 1024


def family_format(family: str, kv_format: str, index_format: str) -> str:
    """The format a family's backends are chosen by: the index keys' for the indexer, the
    attention cache's for the others."""
    return index_format if family == "indexer" else kv_format


def backend_choice(name: str, index_format: str) -> dict[str, str]:
    """``--backend name`` per op family: ``name`` where the family registers it, else ``auto``;
    the indexer's ``gluon`` backend reads ``fp4`` and ``fp8`` keys only, so with ``bf16`` keys
    the indexer stays on ``auto`` (``--backend gluon``: the Gluon kernels wherever they serve
    the run)."""
    def serves(family):
        return name in compile_ops.backends.backends(family) and (
            family != "indexer" or name != "gluon" or index_format in GLUON_INDEX_FORMATS)

    return {f: name if serves(f) else "auto" for f in OP_FAMILIES}


def parse_args(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m graphs", description=description(__doc__, 1))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu or cuda[:N] (default: cuda when torch sees a GPU, else cpu)")
    p.add_argument("--preset", choices=sorted(PRESETS), help="model dims (default: V4.1-Flash on GPU, tiny on CPU)")
    p.add_argument("--ratios", type=int, nargs="+", default=list(DEFAULT_RATIOS),
                   help="compress ratios of the layers to run, each one of the preset's (default: 1 2)")
    p.add_argument("--requests", type=int, default=6, help="requests of the served workload (default: 6)")
    p.add_argument("--decode", type=int, default=16, help="tokens each request decodes after its prompt (default: 16)")
    p.add_argument("--drafts", type=int, default=3, help="draft tokens per multi-token step (default: 3)")
    p.add_argument("--kv-format", choices=sorted(KV_FORMATS),
                   help="cache format (default: with --stack fp8_dsv41, DeepSeek-V4.1's; else fp8_dsv41 on GPU, bf16 on "
                        "CPU)")
    p.add_argument("--cmp-kv-format", choices=sorted(KV_FORMATS),
                   help="the compressed cache's format when not --kv-format's (default: with --stack fp4_dsv41, "
                        "DeepSeek-V4.1's; else --kv-format)")
    p.add_argument("--index-format", choices=sorted(INDEX_FORMATS),
                   help="the index-key cache's format (default: with --stack fp4, DeepSeek-V4.1's; else fp8)")
    p.add_argument("--backend", default="auto",
                   help="backend of every op family (sparse_mla, slots, combine, kv, indexer, linear): auto, "
                        "reference or triton; a backend only some families have (gluon, flashmla, flashinfer, "
                        "scaled_mm) is used by those and the others stay auto; the indexer's gluon only with fp4 or fp8 "
                        "index keys (default: auto)")
    p.add_argument("--iters", type=int, default=20, help="GPU: timed iterations, x5 for replays (default: 20)")
    p.add_argument("--plot", help="GPU: PNG path for the step-time plot (default: no plot)")
    p.add_argument("--json", help="write all results here")
    p.add_argument("--time-budget", type=float, default=float("inf"), help="GPU: seconds from the start, compiling included; skip the timings past it")
    p.add_argument("--weights", choices=("bf16", "fp8"), default="bf16",
                   help="projection weights: bf16, or DeepSeek's block-scaled fp8 (the preset's weight_block), checked against the bf16 "
                        "layer with the dequantized weights (the tiny config then has o_lora_rank 128); with --stack, against the "
                        "layer-by-layer oracle with the dequantized weights, in steps of at most 64 tokens (default: bf16)")
    p.add_argument("--stack", nargs="?", const="slice", choices=("slice", "all"),
                   help="serve a DeepSeek-V4.1 stack instead (graphs.stack_job): one layer of every kind, or "
                        "'all' of V4.1-Flash's 40 layers (GPU)")
    p.add_argument("--dcp", type=int, default=1,
                   help="serve the workload under DCP over this many processes (gloo on CPU, NCCL on GPUs, one "
                        "GPU each) and check it against the DCP=1 layer (default: 1, no DCP)")
    p.add_argument("--interleave", type=int, default=1, help="DCP: the compressed caches' shard interleave (default: 1)")
    args = p.parse_args(argv)
    for name in ("requests", "decode", "iters", "dcp", "interleave"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.drafts < 0:
        p.error(f"--drafts must be >= 0, got {args.drafts}")
    try:
        args.device = torch.device(args.device)
        if args.stack:  # DeepSeek-V4.1's own formats, where not given
            for name, fmt in V41_CACHE_FORMATS.items():
                if getattr(args, name) is None:
                    setattr(args, name, fmt)
        if args.kv_format is None:
            args.kv_format = "fp8_dsv41" if args.device.type == "cuda" else "bf16"
        if args.index_format is None:
            args.index_format = "fp8"
        known = {name for family in OP_FAMILIES for name in compile_ops.backends.backends(family)} | {"auto"}
        if args.backend not in known:
            raise ValueError(f"--backend must be 'auto' or one of {sorted(known - {'auto'})}, got {args.backend!r}")
        for family, name in backend_choice(args.backend, args.index_format).items():
            with compile_ops.use_backends(**{family: name}):
                compile_ops.backend_for(family, args.device, family_format(family, args.kv_format, args.index_format))
        for ratio in args.ratios:  # every layer's geometry, before any work
            cfg, cache, _ = geometry(args, ratio)
            if ratio:
                cache.check_ratio(cfg.check_ratio(ratio))
        if cfg.n_heads % args.dcp or cfg.o_groups % args.dcp:
            raise ValueError(f"--dcp {args.dcp} must divide {cfg.name}'s {cfg.n_heads} heads and {cfg.o_groups} "
                             "output groups")
        if args.dcp > 1 and args.device.type == "cuda" and torch.cuda.device_count() < args.dcp:
            raise ValueError(f"--dcp {args.dcp} needs {args.dcp} GPUs, this machine has {torch.cuda.device_count()}")
    except (RuntimeError, ValueError) as err:
        p.error(str(err))
    return args


def geometry(args, ratio):
    """(model dims, cache geometry, buckets) of the layer of ``ratio`` on ``args.device``."""
    cuda = args.device.type == "cuda"
    cfg = PRESETS[args.preset] if args.preset else (V41_FLASH if cuda else TINY)
    if args.weights == "fp8" and cfg.o_lora_rank % 128:
        cfg = dataclasses.replace(cfg, o_lora_rank=128)  # the grouped wo_a in whole 128-row scale blocks
    rewind = max(args.drafts, 1)
    formats = dict(cmp_kv_format=args.cmp_kv_format, index_format=args.index_format)
    if cuda:
        cache = CacheConfig(max_requests=256, max_tokens=8192, max_seq_len=LONG + 8192, page_size=64,
                            kv_format=args.kv_format, max_rewind=rewind, **formats)
        return cfg, cache, list(DEFAULT_BUCKETS)
    # the CPU layer: long enough for a few compressed entries at every ratio it can run
    longest = max(CPU_PROMPTS) + args.decode + 1
    cache = CacheConfig(max_requests=4, max_tokens=16, max_seq_len=max(longest, 2 * ratio + longest), page_size=4,
                        kv_format=args.kv_format, max_rewind=rewind, **formats)
    return cfg, cache, [1, 2, 4, 8, 16]


def workload(args, cuda: bool):
    prompts = (GPU_PROMPTS if cuda else CPU_PROMPTS)
    prompts = [prompts[i % len(prompts)] for i in range(args.requests)]
    if cuda:
        return mixed_workload(prompts, args.decode, chunk=256, max_tokens=512, rows=8, arrive_every=3,
                              drafts=args.drafts)
    return mixed_workload(prompts, args.decode, chunk=7, max_tokens=16, rows=4, arrive_every=2, drafts=args.drafts)


def progress(ratio: int, start: float, what: str) -> None:
    print(f"  [ratio {ratio}, {time.perf_counter() - start:5.1f} s] {what}", flush=True)


def run_layer(args, ratio, deadline) -> dict:
    from torch._dynamo.utils import counters

    device, start = args.device, time.perf_counter()
    cfg, cache, buckets = geometry(args, ratio)
    cuda = device.type == "cuda"
    progress(ratio, start, f"building the {cfg.name} layer ({cache.max_requests} request rows, {cache.kv_format})")
    if cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(device)
    layer = DSV41Attention(cfg, cache, ratio, device=device, weights=args.weights)
    info = {"config": cfg.name, "ratio": ratio, "kv_format": cache.kv_format, "cmp_kv_format": cache.compressed_format,
            "index_format": cache.index_format, "weights": args.weights, "buckets": buckets}
    if cuda:
        torch.cuda.synchronize()
        formula = buffer_bytes(cfg, cache, ratio)
        info["memory"] = {"measured_bytes": torch.cuda.memory_allocated(device) - before,
                          "formula_bytes": formula["total"] + weight_bytes(layer), "weights_bytes": weight_bytes(layer),
                          "buffers": formula, "max_seq_len": cache.max_seq_len, "max_requests": cache.max_requests}
    torch._dynamo.reset()
    counters.clear()
    runner = StepRunner(layer, buckets)
    with torch.no_grad():
        if cuda:
            progress(ratio, start, f"compiling (fullgraph=True, dynamic tokens) and capturing {len(buckets)} CUDA graphs")
            runner.capture()
        else:
            progress(ratio, start, "compiling (fullgraph=True, dynamic tokens)")
            runner.trace()
    info.update(compile_and_capture_s=round(time.perf_counter() - start, 1))
    work = workload(args, cuda)
    kinds = work.kinds()
    progress(ratio, start, f"serving {len(work.lengths)} requests in {len(work.steps)} steps "
                           f"({kinds['prefill']} prefill chunks, {kinds['decode']} decode tokens, {kinds['draft']} "
                           f"multi-token steps, <= {max(work.tokens(s) for s in range(len(work.steps)))} tokens/step)")
    xs = hidden_states(work, cfg.dim, seed=1, device=device)
    with torch.no_grad():
        outs, topk = run_workload(runner.step, work, xs, watch=layer.topk_ids if ratio else None, release=runner.release)
    info.update(graph_breaks=sum(counters["graph_break"].values()), dynamo_graphs=counters["stats"]["unique_graphs"],
                cuda_graphs_captured=len(runner.graphs),
                backends={f: compile_ops.backend_for(f, device, family_format(f, cache.kv_format, cache.index_format))
                          for f in OP_FAMILIES},
                workload={"requests": len(work.lengths), "steps": len(work.steps), **kinds})
    twin = None
    if args.weights == "fp8":  # the bf16 layer with the dequantized weights: the FP8 layer's meaning
        progress(ratio, start, "serving the same workload through the bf16 layer with the dequantized weights")
        twin = DSV41Attention(cfg, cache, ratio, device=device)
        twin.load_state_dict(dequantized_state_dict(layer.state_dict()), strict=True)
        eager = StepRunner(twin, buckets, compile=False, cuda_graphs=False)
        with torch.no_grad():
            want, want_ids = run_workload(eager.step, work, xs, watch=twin.topk_ids if ratio else None,
                                          release=eager.release)
        fp8 = pick_matched(outs, want, topk if layer.indexer is not None else None,
                           want_ids if layer.indexer is not None else None,
                           tolerance=FP8_WEIGHTS_REL_TOL, min_share=0.8)
        info["fp8_vs_bf16"] = fp8.__dict__
        info["fp8_verdict"] = fp8.verdict("fp8 weights vs the dequantized bf16 layer")
        oracle_layer, outs, topk = twin, want, want_ids
    else:
        oracle_layer = layer
    progress(ratio, start, "checking every token against the full-history oracle")
    verdict = oracle_verdict(oracle_layer, xs, outs, topk)
    info.update(oracle=verdict.__dict__, verdict=verdict.verdict(),
                passed=verdict.passed and (twin is None or fp8.passed))
    if cuda:
        time_gpu(args, runner, info, start, deadline, twin)
    return info


def time_gpu(args, runner: StepRunner, info: dict, start: float, deadline: float, bf16_twin=None) -> None:
    """The GPU measurements of one layer (each skipped once ``deadline`` has passed); with
    FP8 weights, the decode rows of the bf16 twin too, each with its weight-read floor."""
    layer, ratio = runner.layer, runner.layer.compress_ratio
    late = lambda: time.perf_counter() > deadline  # noqa: E731
    fill_random(layer)
    eager = eager_twin(layer, runner.buckets)
    batches = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    if not late():
        progress(ratio, start, "decode step times per batch at 1024 tokens")
        info["rows"] = time_batches(runner, eager, batches, 1024, iters=args.iters,
                                    replay_iters=5 * args.iters, profile_batches={1, 64, 256}, deadline=deadline)
        info["weight_floor_us"] = round(read_weight_bytes(layer) / COPY_BYTES_PER_S * 1e6, 1)
    del eager
    if bf16_twin is not None and not late():
        progress(ratio, start, "the bf16 layer's decode step times, compiled and captured")
        twin = StepRunner(bf16_twin, runner.buckets)
        twin.capture()
        fill_random(bf16_twin)
        info["rows_bf16"] = time_batches(twin, eager_twin(bf16_twin, runner.buckets), batches, 1024, iters=args.iters,
                                         replay_iters=5 * args.iters, profile_batches={1, 64, 256}, deadline=deadline)
        info["weight_floor_bf16_us"] = round(read_weight_bytes(bf16_twin) / COPY_BYTES_PER_S * 1e6, 1)
        del twin
    if not late():
        progress(ratio, start, "steps of 512..8192 tokens: host vs wall time")
        info["large_steps"] = time_large_steps(runner, [512, 1024, 2048, 4096, 8192])
    if not late():
        progress(ratio, start, "prefill of a 32K-token prompt in 4K chunks")
        info["prefill"] = time_prefill(runner, 32 * 1024, 4096)
    if not late():
        progress(ratio, start, f"64 requests decoding at {LONG} tokens")
        replay = decode_replay_at(runner, 64, LONG, 5 * args.iters)
        floor = decode_floor_us(layer, 64, LONG)
        info["long_decode"] = {"batch": 64, "context": LONG, "replay_us": round(replay, 1),
                               "floor_us": round(floor["floor_us"], 1), "floor_bytes": floor["bytes"],
                               "over_floor": round(replay / floor["floor_us"], 2)}
        for r in range(64):
            runner.release(r)
    if not late():
        progress(ratio, start, "decode replay in layers of 4K and 1M tokens of capacity")
        info["capacity"] = capacity_replays(layer.cfg, ratio, layer.swa_cache.device)


def report(info: dict) -> None:
    print(f"\n== {info['config']} layer, compress_ratio={info['ratio']}, kv_format={info['kv_format']}, "
          f"cmp_kv_format={info['cmp_kv_format']}, index_format={info['index_format']} ==")
    print(f"graph breaks: {info['graph_breaks']}   dynamo graphs: {info['dynamo_graphs']}   "
          f"CUDA graphs captured: {info['cuda_graphs_captured']} (buckets {info['buckets']})   "
          f"compile+capture: {info['compile_and_capture_s']} s   backends: {info['backends']}")
    w = info["workload"]
    print(f"workload: {w['requests']} requests, {w['steps']} steps ({w['prefill']} prefill chunks, {w['decode']} "
          f"decode tokens, {w['draft']} multi-token steps)")
    print(f"verdict: {info['verdict']}")
    if "fp8_verdict" in info:
        print(f"        {info['fp8_verdict']}")
    mem = info.get("memory")
    if mem:
        print(f"layer memory ({mem['max_requests']} rows x {mem['max_seq_len']} tokens): measured "
              f"{mem['measured_bytes'] / 2**30:.3f} GiB, formula {mem['formula_bytes'] / 2**30:.3f} GiB "
              f"(weights {mem['weights_bytes'] / 2**30:.3f} GiB), ratio {mem['measured_bytes'] / mem['formula_bytes']:.3f}")
    rows = info.get("rows")
    if rows:
        print("decode step times at 1024 tokens (us):")
        print(f"{'batch':>6} {'eager':>9} {'compiled':>9} {'step':>8} {'replay':>8} {'kernels':>8} {'launches':>8}")
        for r in rows:
            print(f"{r['batch']:>6} {r['eager_us']:9.1f} {r['compiled_us']:9.1f} {r['step_us']:8.1f} "
                  f"{r['replay_us']:8.1f} {r.get('kernels_us', 0.0):8.1f} {r.get('kernels_per_step', '-'):>8}")
        for r in rows:
            if r.get("top_kernels"):
                print(f"costliest kernels at batch {r['batch']} (us): "
                      + "; ".join(f"{name} {us}" for name, us in r["top_kernels"][:5]))
    if info.get("rows_bf16"):
        print(f"decode replay (us), fp8 weights (weight-read floor {info['weight_floor_us']} us) vs bf16 weights "
              f"(floor {info['weight_floor_bf16_us']} us):")
        for f, b in zip(rows, info["rows_bf16"]):
            print(f"{f['batch']:>6} fp8 {f['replay_us']:8.1f}   bf16 {b['replay_us']:8.1f}")
        for r in info["rows_bf16"]:
            if r.get("top_kernels"):
                print(f"bf16 weights, costliest kernels at batch {r['batch']} (us): "
                      + "; ".join(f"{name} {us}" for name, us in r["top_kernels"][:5]))
    for r in info.get("large_steps", []):
        print(f"a step of {r['tokens']} tokens ({r['pieces']} graph replay{'s' if r['pieces'] > 1 else ''}) from an "
              f"idle GPU: host {r['host_us']} us, wall {r['wall_us']} us")
    if "prefill" in info:
        p = info["prefill"]
        print(f"prefill {p['prompt']} tokens in {p['chunk']}-token chunks: {p['ms']} ms, {p['tokens_per_s']} tokens/s, "
              f"{p['tflops']} TFLOP/s = {p['pct_of_bf16_rate']} % of the bf16 rate")
        print(f"the last {p['chunk']}-token chunk: {p['chunk_kernels_us']} us of kernels, {p['chunk_indexer_us']} us "
              f"in the indexer ops; costliest (us): " + "; ".join(f"{name} {us}" for name, us in p["chunk_top_kernels"]))
    if "long_decode" in info:
        d = info["long_decode"]
        print(f"decode of {d['batch']} requests at {d['context']} tokens: replay {d['replay_us']} us, floor "
              f"{d['floor_us']} us ({', '.join(f'{k} {v / 1e6:.1f} MB' for k, v in d['floor_bytes'].items())}), "
              f"{d['over_floor']}x the floor")
    if "capacity" in info:
        c = info["capacity"]
        print("decode replay of 64 requests at 1K tokens by layer capacity: "
              + ", ".join(f"max_seq_len {r['max_seq_len']}: {r['replay_us']} us" for r in c)
              + f" (ratio {c[-1]['replay_us'] / c[0]['replay_us']:.2f})")


def cache_bytes(layer: DSV41Attention) -> int:
    """Bytes of a layer's KV and index-key caches (what DCP shards, the SWA pool included)."""
    return sum(b.numel() * b.element_size() for name, b in layer.named_buffers()
               if name in ("swa_cache", "cmp_cache", "indexer.index_cache"))


def dcp_worker(rank: int, args, store: str, out: str) -> None:
    """One rank of ``--dcp N``: the workload through the DCP layer and through a DCP=1
    layer with the same weights, compared token by token (outputs and top-k ids)."""
    import dataclasses

    import torch.distributed as dist
    from torch._dynamo.utils import counters

    world, cuda = args.dcp, args.device.type == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
        args.device = torch.device("cuda", rank)
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.FileStore(store, world), rank=rank,
                            world_size=world)
    group = dist.group.WORLD.group_name
    results = {}
    with torch.no_grad():
        for ratio in args.ratios:
            cfg, cache, buckets = geometry(args, ratio)
            work = workload(args, cuda)
            xs = hidden_states(work, cfg.dim, seed=1, device=args.device)
            served, held = [], []
            for dcp_cache, name in ((cache, None), (dataclasses.replace(cache, dcp_world=world,
                                                                        dcp_interleave=args.interleave), group)):
                layer = DSV41Attention(cfg, dcp_cache, ratio, device=args.device, dcp_group=name)
                held.append(cache_bytes(layer))
                torch._dynamo.reset()  # each layer compiles afresh (the recompile limit counts code, not layers)
                runner = StepRunner(layer, buckets)
                if cuda:
                    runner.capture()
                counters.clear()
                served.append(run_workload(runner.step, work, xs, watch=layer.topk_ids if ratio else None,
                                           release=runner.release))
                breaks = sum(counters["graph_break"].values())
                del runner, layer
            (want, want_ids), (got, got_ids) = served
            scale = max(w.abs().max().item() for w in want)
            diff = max((g - w).abs().max().item() for g, w in zip(got, want)) / scale
            mismatched = sum(int((a != b).any(-1).sum()) for a, b in zip(got_ids, want_ids)) if ratio else 0
            tol = cache_tolerance(cache.kv_format, cache.compressed_format)
            results[ratio] = {"tokens": sum(len(w) for w in want), "max_rel_diff": diff, "id_mismatches": mismatched,
                              "tolerance": tol, "graph_breaks": breaks, "cache_bytes_dcp1": held[0],
                              "cache_bytes_per_rank": held[1],
                              "passed": diff <= tol and mismatched == 0 and breaks == 0}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # skip interpreter finalization, where gloo's threads can abort


def run_dcp(args) -> int:
    """``--dcp N``: spawn the N ranks, print each layer's verdict against DCP=1."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.json")
        print(f"serving under DCP={args.dcp} (interleave {args.interleave}, "
              f"{'NCCL' if args.device.type == 'cuda' else 'gloo'}), each ratio against the DCP=1 layer", flush=True)
        # by its importable name: the children cannot unpickle a function of "__main__"
        from graphs.__main__ import dcp_worker as worker

        mp.spawn(worker, args=(args, os.path.join(tmp, "store"), out), nprocs=args.dcp)
        with open(out) as f:
            results = json.load(f)
    failed = []
    for ratio, r in results.items():
        verdict = "PASS" if r["passed"] else "FAIL"
        print(f"ratio {ratio}: {verdict}: {r['tokens']} tokens, DCP={args.dcp} vs DCP=1 largest difference "
              f"{r['max_rel_diff']:.2e} of max |y| (tolerance {r['tolerance']:g}), {r['id_mismatches']} token(s) "
              f"with other top-k ids, {r['graph_breaks']} graph breaks (compiled, fullgraph=True); caches per rank "
              f"{r['cache_bytes_per_rank'] / 2**20:.2f} MiB vs DCP=1 {r['cache_bytes_dcp1'] / 2**20:.2f} MiB = "
              f"{r['cache_bytes_per_rank'] / r['cache_bytes_dcp1']:.3f}x")
        if not r["passed"]:
            failed.append(f"ratio {ratio}")
    print(f"\n{'FAIL: ' + ', '.join(failed) if failed else 'PASS: every layer'} (DCP={args.dcp} against DCP=1)")
    return 1 if failed else 0


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    device = args.device
    deadline = time.perf_counter() + args.time_budget
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}")
    if args.dcp > 1:
        return run_dcp(args)
    if args.stack:
        from graphs.stack_job import run_stack

        with compile_ops.use_backends(**backend_choice(args.backend, args.index_format)):
            info = run_stack(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"stack": info}, f, indent=1)
        print(f"\n{'PASS' if info['passed'] else 'FAIL'}: the V4.1 stack against the layer-by-layer oracle")
        return 0 if info["passed"] else 1
    results = {}
    for ratio in args.ratios:
        with compile_ops.use_backends(**backend_choice(args.backend, args.index_format)):
            info = run_layer(args, ratio, deadline)
        report(info)
        results[f"ratio {ratio}"] = info
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    timed = {k: v["rows"] for k, v in results.items() if v.get("rows")}
    if args.plot and device.type == "cuda" and not timed:
        print(f"no plot: --time-budget {args.time_budget} s ran out before the decode timings (compiling counts)")
    elif args.plot and device.type == "cuda":
        first = next(iter(results.values()))
        plot(timed, args.plot,
             f"{first['config']} attention layer decode step at 1024 tokens, {torch.cuda.get_device_name(device)}")
        print(f"plot: {args.plot}")
    planning = time_page_planning() + time_page_planning(stagger=True)
    print("host page work per decode step from 1024 tokens (V4.1-Flash serving geometry; staggered rows in brackets): "
          + ", ".join(f"batch {a['batch']} {a['host_us']} ({b['host_us']}) us"
                      for a, b in zip(planning[:len(planning) // 2], planning[len(planning) // 2:])))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**results, "page_planning": planning}, f, indent=1)
    failed = [name for name, info in results.items() if not info["passed"]]
    print(f"\n{'FAIL: ' + ', '.join(failed) if failed else 'PASS: every layer'} "
          f"(every token against the full-history oracle, within each verdict's tolerance of max |y|)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
