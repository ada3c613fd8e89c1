"""``python -m graphs --stack``: serve a mixed workload through a DeepSeek-V4.1 stack, check
it against the layer-by-layer oracle, and (on a GPU) time decode per layer kind.

GPU: V4.1-Flash's attention (:data:`graphs.V41_FLASH`, fp8_dsv41 caches), all 40 layers of
:data:`graphs.V41_FLASH_PLAN` (``--stack all``) or the slice that keeps one layer of every
kind (``--stack``) -- layer 0 (sliding only),
2 (kv + index source, ratio 2), 3 (its reader), 20 (kv + index source of ratio 1 and the
candidate source), 21 (its reader), 24 (an index source that picks inside 20's candidate
blocks and reads 20's cache), 25 (a reader of 24's ids) -- compiled whole and captured as
one CUDA graph per bucket. CPU: the same kinds in an 8-layer plan of :data:`graphs.TINY_V41`.

It serves prompts prefilled in chunks while others decode and draft, through the runner,
then checks every token with :func:`graphs.naive.stack_verdict` (PASS: every layer's output
within the one-layer tolerance of the oracle's from the same residual input, which the
stack records (``record_inputs``: one copy per layer per step, in the timings too), given
the stack's own picks; every index layer's picks and the candidate blocks a valid top-k of
the oracle's scores; the final residual's difference is reported). On a GPU it then measures, at a
1K-token context and batches 1 / 64 / 256: the whole stack's replay, the step metadata of
every geometry captured alone, and each kind's block captured alone (reading the step's
derived inputs), with the kernels each runs; and the 40-layer step those add up to.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from compile_ops.linear import LAYOUTS
from graphs import TINY_V41, V41_FLASH, V41_FLASH_PLAN, CacheConfig, DSV41Stack, LayerPlan, StepRunner
from graphs.bench import fill_random, grow_rows, profile_kernels, time_replay
from graphs.memory import stack_buffer_bytes
from graphs.naive import stack_verdict
from graphs.schedule import hidden_states, mixed_workload, run_workload

# one layer of every kind of V4.1-Flash, and how many of each its 40 layers have
FLASH_KINDS = {"SWA only": (0, 2), "kv+index source, ratio 2": (2, 3), "reader, ratio 2": (3, 15),
               "kv+index+candidate source, ratio 1": (20, 1), "reader, ratio 1": (21, 15),
               "index source in candidates": (24, 4), "reader of an index source": (25, 0)}
TINY_PLAN = LayerPlan.from_lists([0, 2, 2, 2, 1, 1, 1, 1], kv_sources=[1, 4], index_sources=[1, 4, 6],
                                 candidate_source=4, candidate_topk_blocks=3, candidate_block_size=4)
TINY_KINDS = {"SWA only": (0, 1), "kv+index source, ratio 2": (1, 1), "reader, ratio 2": (2, 2),
              "kv+index+candidate source, ratio 1": (4, 1), "reader, ratio 1": (5, 1),
              "index source in candidates": (6, 1), "reader of an index source": (7, 1)}
BATCHES = (1, 64, 256)
CONTEXT = 1024


def build(device, kv_format: str, every_layer: bool = False, weights: str = "bf16", **formats):
    """``(stack, buckets, kinds)`` of the job on ``device`` (``every_layer``: V4.1-Flash's 40
    layers, not the slice; ``weights``: ``"bf16"`` or ``"fp8"``, V4.1's 32 x 32 blocks;
    ``formats``: the other caches' ``CacheConfig`` formats, ``cmp_kv_format`` and
    ``index_format``)."""
    if device.type == "cuda":
        cache = CacheConfig(max_requests=256, max_tokens=512, max_seq_len=2048, page_size=64, kv_format=kv_format,
                            max_rewind=3, **formats)
        ids = list(range(40)) if every_layer else [layer_id for layer_id, _ in FLASH_KINDS.values()]
        stack = DSV41Stack(V41_FLASH, cache, V41_FLASH_PLAN, ids, device, record_inputs=True, weights=weights)
        return stack, [1, 2, 4, 8, 16, 32, 64, 128, 256, 512], FLASH_KINDS
    cache = CacheConfig(4, 16, 64, 4, kv_format=kv_format, max_rewind=3, **formats)
    # (the grouped FP8 wo_a needs whole 128-row scale blocks per group)
    cfg = replace(TINY_V41, o_lora_rank=128, weight_block=32) if weights == "fp8" else TINY_V41
    return DSV41Stack(cfg, cache, TINY_PLAN, record_inputs=True, weights=weights), [1, 4, 16], TINY_KINDS


def watched(stack: DSV41Stack) -> dict:
    out = {i: layer.topk_ids for i, layer in stack.layers.items() if layer.indexer is not None}
    if stack.plan.candidate_source in stack.layers:
        out["candidates"] = stack.layers[stack.plan.candidate_source].candidate_ids
    out["inputs"] = stack.recorded_inputs()
    return out


def graph_of(fn, warmup: int = 2) -> "torch.cuda.CUDAGraph":
    """``fn`` captured as a CUDA graph (after ``warmup`` calls on a side stream)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


def kernels_of(graph: "torch.cuda.CUDAGraph", iters: int = 3) -> dict:
    """Kernels per replay of ``graph`` (count, GPU microseconds, the costliest) by the profiler."""
    from compile_ops.indexer.triton import KERNEL_NAMES  # Triton's own names, not torch's gathers

    prof = profile_kernels(graph.replay, iters)
    # the compressor's and indexer's own kernels: a reader's part of the profile has none
    own = sorted(n for n in prof.names if n.startswith(KERNEL_NAMES))
    return {"kernels": prof.count, "kernel_us": round(prof.us, 1), "top": prof.top[:5], "indexer_kernels": own}


@torch.no_grad()
def time_kinds(runner: StepRunner, kinds: dict, iters: int) -> list[dict]:
    """Decode at :data:`CONTEXT` tokens for each of :data:`BATCHES`: the stack's replay,
    the metadata alone, each kind's block alone."""
    stack = runner.layer
    for layer in stack.layers.values():
        fill_random(layer)
    rows = []
    for b in BATCHES:
        grow_rows(runner, range(b), CONTEXT)
        bucket = runner.bucket_for(b)
        positions, req = torch.full((b,), CONTEXT, dtype=torch.int32), torch.arange(b, dtype=torch.int32)
        x = torch.randn(b, stack.cfg.dim, device=stack.device).to(torch.bfloat16)
        runner.step(x, positions, req)
        row = {"batch": b, "bucket": bucket, "stack_replay_us": round(time_replay(runner.graphs[bucket], iters), 1)}
        row["stack"] = kernels_of(runner.graphs[bucket])
        meta = graph_of(lambda: runner.meta.all_inputs(bucket))
        row["metadata_us"] = round(time_replay(meta, iters), 1)
        row["metadata"] = kernels_of(meta)
        inputs = runner.meta.all_inputs(bucket)
        h = torch.randn(bucket, stack.cfg.dim, device=stack.device)
        row["kinds"] = {}
        for kind, (layer_id, _) in kinds.items():
            block = stack.blocks[stack.layer_ids.index(layer_id)]
            layer = block.attn
            graph = graph_of(lambda: block(h, inputs[layer.compress_ratio], stack.shared(layer, bucket)))
            row["kinds"][kind] = {"layer": layer_id, "replay_us": round(time_replay(graph, iters), 1),
                                  **kernels_of(graph)}
        row["model_40_layers_us"] = round(row["metadata_us"] + sum(
            row["kinds"][k]["replay_us"] * n for k, (_, n) in kinds.items()), 1)
        rows.append(row)
        print(f"  batch {b}: stack replay {row['stack_replay_us']} us ({row['stack']['kernels']} kernels), "
              f"metadata {row['metadata_us']} us ({row['metadata']['kernels']} kernels); 40 layers ~ "
              f"{row['model_40_layers_us']} us", flush=True)
        for kind, k in row["kinds"].items():
            print(f"    {kind:36s} layer {k['layer']:2d}: {k['replay_us']:8.1f} us, {k['kernels']:3d} kernels"
                  f"{', indexer kernels ' + ','.join(k['indexer_kernels']) if k['indexer_kernels'] else ''}", flush=True)
    return rows


def run_stack(args) -> dict:
    from torch._dynamo.utils import counters

    device, start = args.device, time.perf_counter()
    cuda = device.type == "cuda"

    def say(what):
        print(f"  [stack, {time.perf_counter() - start:5.1f} s] {what}", flush=True)

    stack, buckets, kinds = build(device, args.kv_format, args.stack == "all", args.weights,
                                  cmp_kv_format=args.cmp_kv_format, index_format=args.index_format)
    say(f"built {stack.extra_repr()}")
    memory = stack_buffer_bytes(stack.cfg, stack.cache_cfg, stack.plan, stack.layer_ids, record_inputs=True)
    held = sum(b.numel() * b.element_size() for b in stack.buffers())
    info = {"layers": stack.layer_ids, "weights": args.weights, "buckets": buckets, "buffers_formula": memory["total"], "buffers_held": held,
            "buffers_per_layer": memory["per_layer"],
            "model_40_layers_buffers": (stack_buffer_bytes(stack.cfg, stack.cache_cfg, stack.plan)["total"]
                                        if cuda else None)}
    torch._dynamo.reset()
    counters.clear()
    runner = StepRunner(stack, buckets)
    with torch.no_grad():
        say(f"compiling the whole stack (fullgraph=True){' and capturing %d CUDA graphs' % len(buckets) if cuda else ''}")
        runner.capture() if cuda else runner.trace()
    info["compile_and_capture_s"] = round(time.perf_counter() - start, 1)
    # (the 40-layer stack serves fewer tokens: the oracle's time grows with layers x tokens)
    prompts = ((500, 200, 64, 5) if args.stack == "all" else (1000, 300, 64, 700, 5, 450)) if cuda else (30, 9, 41, 4)
    # FP8 weights: steps of at most the layout's weight_only_tokens, whose projections take the
    # tokens in bf16, so the oracle's dequantized weights are exactly the layer's product
    most = LAYOUTS[stack.cfg.weight_block].weight_only_tokens if args.weights == "fp8" else 512
    work = (mixed_workload(prompts, 16, chunk=min(256, most), max_tokens=most, rows=8, arrive_every=2, drafts=3)
            if cuda else mixed_workload(prompts, 6, chunk=7, max_tokens=16, rows=3, arrive_every=2, drafts=3))
    k = work.kinds()
    say(f"serving {len(work.lengths)} requests in {len(work.steps)} steps ({k['prefill']} prefill chunks, "
        f"{k['decode']} decode tokens, {k['draft']} multi-token steps)")
    xs = hidden_states(work, stack.cfg.dim, seed=1, device=device)
    watch = watched(stack)
    with torch.no_grad():
        outs, seen = run_workload(runner.step, work, xs, watch=watch, release=runner.release,
                                  sync_debug="error" if cuda else None)
    info.update(graph_breaks=sum(counters["graph_break"].values()), dynamo_graphs=counters["stats"]["unique_graphs"],
                cuda_graphs=len(runner.graphs))
    say("checking every token against the layer-by-layer oracle")
    ids = {i: seen[i] for i in watch if isinstance(i, int)}
    verdict = stack_verdict(stack, xs, outs, ids, seen.get("candidates"), seen["inputs"])
    info.update(oracle=verdict.__dict__, verdict=verdict.verdict(), passed=verdict.passed and info["graph_breaks"] == 0
                and info["dynamo_graphs"] == 1)
    print(f"  {verdict.verdict()}; {info['dynamo_graphs']} Dynamo graph(s), {info['graph_breaks']} breaks, "
          f"{info['cuda_graphs']} CUDA graphs; buffers {held / 2**20:.1f} MiB (formula "
          f"{memory['total'] / 2**20:.1f} MiB)", flush=True)
    if cuda:
        say(f"decode at {CONTEXT} tokens per layer kind")
        info["decode"] = time_kinds(runner, kinds, args.iters * 5)
    return info
