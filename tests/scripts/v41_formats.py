"""DeepSeek-V4.1's cache formats against fp8 entries and keys on one GPU: the decode replay
of 64 requests at 128K tokens (the V4.1-Flash layer, ratio 2, FP8 weights) beside its byte
floor, then the 40-layer stack's buffers per token of context, measured by
``torch.cuda.memory_allocated`` and by the formula. Figures: docs/performance-decode.md.

    python tests/scripts/v41_formats.py [--json out.json]
"""

import argparse
import gc
import json
import time

import torch

from graphs import CacheConfig, DSV41Stack, StepRunner, V41_FLASH, V41_FLASH_PLAN
from graphs.bench import decode_floor_us, decode_replay_at, fill_random, flash_layer, profile_kernels
from graphs.memory import stack_buffer_bytes

LONG, ROWS = 128 * 1024, 64
FORMATS = {
    "V4.1": dict(kv_format="fp8_dsv41", cmp_kv_format="fp4_dsv41", index_format="fp4"),
    "fp8 entries and keys": dict(kv_format="fp8_dsv41", index_format="fp8"),
}


def long_decode(fmt: dict) -> dict:
    """Best of 3 x 100 replays of a 64-row decode step at 128K, its floor and kernels."""
    layer = flash_layer(2, "cuda", weights="fp8", max_requests=ROWS, max_tokens=ROWS, max_seq_len=LONG + 256, **fmt)
    runner = StepRunner(layer, [ROWS])
    runner.capture()
    fill_random(layer)
    replay = decode_replay_at(runner, ROWS, LONG, 100, reps=3)
    floor = decode_floor_us(layer, ROWS, LONG)
    kernels = profile_kernels(runner.graphs[ROWS].replay)
    return dict(replay_us=replay, floor=floor, x_floor=replay / floor["floor_us"], top_kernels=kernels.top)


def stack_bytes_per_token(fmt: dict) -> dict:
    """The stack's buffers per token of context and row, from 64K to 128K tokens: measured
    (allocated around its construction), counted (its buffers) and by the formula."""
    got = {}
    for seq in (65536, 131072):
        cache = CacheConfig(max_requests=ROWS, max_tokens=ROWS, max_seq_len=seq, page_size=64, **fmt)
        gc.collect()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        stack = DSV41Stack(V41_FLASH, cache, V41_FLASH_PLAN, device="cuda", weights="fp8")
        got[seq] = dict(allocated=torch.cuda.memory_allocated() - before,
                        buffers=sum(b.numel() * b.element_size() for b in stack.buffers()),
                        formula=stack_buffer_bytes(V41_FLASH, cache, V41_FLASH_PLAN)["total"])
        del stack
    return {k: (got[131072][k] - got[65536][k]) / (ROWS * 65536) for k in got[65536]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    t0, out = time.time(), {}
    for name, fmt in FORMATS.items():
        r = long_decode(fmt)
        print(f"[{time.time() - t0:.0f} s] {name}: 64 x 128K replay {r['replay_us']:.1f} us, floor "
              f"{r['floor']['floor_us']:.1f} us ({r['x_floor']:.2f}x), kernels {r['top_kernels'][:4]}", flush=True)
        gc.collect()
        torch.cuda.empty_cache()
        r["stack_bytes_per_token"] = stack_bytes_per_token(fmt)
        print(f"[{time.time() - t0:.0f} s] {name}: stack bytes per token of context {r['stack_bytes_per_token']}",
              flush=True)
        out[name] = r
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    main()
