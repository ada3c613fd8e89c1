"""Worker for the DCP attention step tests (:mod:`compile_ops.dcp`), gloo on CPU and NCCL on GPUs.

Each process builds the same DCP=1 problem from a seed (a compressed cache holding every
entry, a replicated SWA cache, queries of all gathered heads), keeps its own shard of
the compressed entries, and checks ``dcp_sparse_mla`` of its heads against DCP=1
``sparse_mla``. On CUDA it also checks the step under ``torch.compile(fullgraph=True)``
and as a captured CUDA graph replayed with new indices, lengths and queries.

Run directly on a machine with 2 GPUs (what ``tests/test_dcp_step.py`` does)::

    python tests/scripts/dcp_step_runner.py --world 2
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import compile_ops
from compile_ops.dcp import dcp_sparse_mla

I32 = torch.int32


@dataclass(frozen=True)
class Shape:
    T: int = 5
    H: int = 2  # query heads per rank
    W: int = 6  # SWA window
    K: int = 8  # top-k
    R: int = 2  # requests
    n_cmp: int = 24  # compressed entries per request (global ids 0 .. n_cmp-1)
    block_size: int = 4  # compressed entries per page
    page_size: int = 4  # SWA tokens per page
    swa_pages: int = 4  # SWA pages per request


def _perm_table(R: int, pages: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randperm(R * pages, generator=gen).to(I32).view(R, pages)


def make_caches(s: Shape, world: int, rank: int, interleave: int, seed: int, device):
    """DCP=1 compressed cache and table, this rank's shard and table, the SWA cache and table."""
    gen = torch.Generator().manual_seed(seed)
    pages = -(-s.n_cmp // s.block_size)
    values = torch.randn(s.R, s.n_cmp, 512, generator=gen).bfloat16()
    ids = torch.arange(s.n_cmp)
    req = torch.arange(s.R).unsqueeze(1)

    table = _perm_table(s.R, pages, gen)
    cache = torch.zeros(s.R * pages, s.block_size, 512, dtype=torch.bfloat16)
    cache.view(-1, 512)[table[req, ids // s.block_size].long() * s.block_size + ids % s.block_size] = values

    shard_tables = [_perm_table(s.R, pages, gen) for _ in range(world)]  # every rank draws all
    mine = (ids // interleave) % world == rank
    local = (ids // (world * interleave)) * interleave + ids % interleave
    shard = torch.zeros(s.R * pages, s.block_size, 512, dtype=torch.bfloat16)
    shard_table = shard_tables[rank]
    slots = shard_table[req, local[mine] // s.block_size].long() * s.block_size + local[mine] % s.block_size
    shard.view(-1, 512)[slots] = values[:, mine]

    swa_table = _perm_table(s.R, s.swa_pages, gen)
    swa_cache = torch.randn(s.R * s.swa_pages, s.page_size, 512, generator=gen).bfloat16()
    sink = torch.randn(s.H * world, generator=gen)
    on = lambda *ts: [t.to(device) for t in ts]  # noqa: E731
    return on(cache, table, shard, shard_table, swa_cache, swa_table, sink)


def make_step(s: Shape, world: int, seed: int, device):
    """Step inputs: queries of all gathered heads, global top-k ids, positions, requests, validity."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(s.T, s.H * world, 512, generator=gen).bfloat16()
    token_to_req = torch.randint(0, s.R, (s.T,), generator=gen, dtype=I32)
    exists = torch.randint(0, s.n_cmp + 1, (s.T, 1), generator=gen)  # causal: ids < exists
    score = torch.rand(s.T, s.n_cmp, generator=gen).masked_fill(torch.arange(s.n_cmp) >= exists, -1.0)
    top = score.topk(min(s.K, s.n_cmp), dim=1)
    topk = torch.where(top.values >= 0, top.indices, -1).to(I32)
    if topk.shape[1] < s.K:
        topk = torch.cat([topk, topk.new_full((s.T, s.K - topk.shape[1]), -1)], 1)
    positions = torch.randint(0, s.swa_pages * s.page_size, (s.T,), generator=gen, dtype=I32)
    is_valid = torch.rand(s.T, generator=gen) > 0.15
    if s.T > 1:
        is_valid[-1] = False  # a CUDA-graph padding row
        topk[0] = -1  # a token with no compressed entry
    positions = torch.where(is_valid, positions, -1)
    return [t.to(device) for t in (q, topk, positions, token_to_req, is_valid)]


def check_close(what: str, out, lse, ref_out, ref_lse, log) -> None:
    err_out = (out.float() - ref_out.float()).abs().max().item() if out.numel() else 0.0
    finite = torch.isfinite(ref_lse)
    if not torch.equal(finite, torch.isfinite(lse)):
        raise AssertionError(f"{what}: lse is finite where the DCP=1 lse is not, or the reverse")
    err_lse = (lse - ref_lse)[finite].abs().max().item() if finite.any() else 0.0
    log(f"{what}: max|out - ref| = {err_out:.2e}, max|lse - ref| = {err_lse:.2e}")
    torch.testing.assert_close(out.float(), ref_out.float(), atol=1e-2, rtol=2e-2, msg=lambda m: f"{what} out: {m}")
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-4, msg=lambda m: f"{what} lse: {m}")


class Case:
    """One problem (caches fixed, step inputs by seed) on one rank."""

    def __init__(self, s: Shape, rank: int, world: int, interleave: int, group_name: str, device):
        self.s, self.rank, self.world, self.interleave, self.group_name = s, rank, world, interleave, group_name
        self.device = device
        (self.cache, self.table, self.shard, self.shard_table,
         self.swa_cache, self.swa_table, self.sink) = make_caches(s, world, rank, interleave, 1234, device)
        self.scale = 512**-0.5

    def inputs(self, seed: int) -> dict:
        s = self.s
        q, topk, positions, token_to_req, is_valid = make_step(s, self.world, seed, self.device)
        swa_idx, swa_lens = compile_ops.swa_indices(positions, token_to_req, self.swa_table, s.page_size, s.W)
        return dict(q_all=q, topk=topk, token_to_req=token_to_req, is_valid=is_valid, swa_idx=swa_idx, swa_lens=swa_lens)

    def reference(self, x: dict):
        """DCP=1 ``sparse_mla`` of this rank's heads."""
        slots, lens = compile_ops.topk_to_slots(x["topk"], x["token_to_req"], self.table, self.s.block_size, x["is_valid"])
        out, lse = compile_ops.sparse_mla(x["q_all"], self.swa_cache, x["swa_idx"], x["swa_lens"], self.cache, slots, lens, self.sink, self.scale)
        heads = slice(self.rank * self.s.H, (self.rank + 1) * self.s.H)
        return out[:, heads], lse[:, heads]

    def local_q(self, x: dict) -> torch.Tensor:
        return x["q_all"][:, self.rank * self.s.H : (self.rank + 1) * self.s.H].contiguous()

    def step(self, fn, q, x: dict, mode: str):
        return fn(q, self.swa_cache, x["swa_idx"], x["swa_lens"], self.shard, x["topk"], x["token_to_req"],
                  self.shard_table, self.s.block_size, x["is_valid"], self.sink, self.scale,
                  group_name=self.group_name, rank=self.rank, world=self.world, interleave=self.interleave, mode=mode)


def run_eager(case: Case, mode: str, fn, what: str, log, seed: int = 0) -> None:
    x = case.inputs(seed)
    out, lse = case.step(fn, case.local_q(x), x, mode)
    check_close(what, out, lse, *case.reference(x), log)


def run_graph(case: Case, mode: str, what: str, log, replays: int = 3) -> None:
    """Capture the eager step once, then replay it with new queries, indices and lengths."""
    x = case.inputs(0)
    static = {k: v.clone() for k, v in x.items()}
    static_q = case.local_q(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up: NCCL communicator, Triton compiles, allocator pools
            case.step(dcp_sparse_mla, static_q, static, mode)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out, lse = case.step(dcp_sparse_mla, static_q, static, mode)
    for seed in range(1, replays + 1):
        new = case.inputs(seed)
        for k, v in new.items():
            static[k].copy_(v)
        static_q.copy_(case.local_q(new))
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated()
        graph.replay()
        torch.cuda.synchronize()
        if torch.cuda.memory_allocated() != allocated:
            raise AssertionError(f"{what}: replay {seed} changed memory_allocated {allocated} -> {torch.cuda.memory_allocated()}")
        check_close(f"{what} replay {seed}", out, lse, *case.reference(new), log)


def worker(rank: int, world: int, store_path: str, backend: str, plan: list, log_path: str | None) -> None:
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, store=dist.FileStore(store_path, world), rank=rank, world_size=world, **kwargs)
    lines = []

    def log(msg: str) -> None:
        lines.append(f"[rank {rank}] {msg}")
        print(lines[-1], flush=True)

    torch._dynamo.config.recompile_limit = 64  # one compile per (T, interleave, mode)
    try:
        group_name = dist.group.WORLD.group_name
        log("backends: " + ", ".join(f"{f}={compile_ops.backend_for(f, device, 'bf16')}" for f in ("sparse_mla", "slots", "combine", "kv")))
        compiled = None
        for shape, interleave, mode, variants in plan:
            case = Case(shape, rank, world, interleave, group_name, device)
            tag = f"T={shape.T} I={interleave} {mode}"
            if "eager" in variants:
                run_eager(case, mode, dcp_sparse_mla, f"{tag} eager ({compile_ops.backend_for('combine', device)} combine)", log)
            if "eager_reference" in variants:
                with compile_ops.use_backends(slots="reference", combine="reference", kv="reference"):
                    run_eager(case, mode, dcp_sparse_mla, f"{tag} eager (reference slots+combine)", log)
            if "compile" in variants:
                # static shapes: with automatic dynamic shapes a changed interleave would reach
                # the ops' fake kernels as a SymInt, which compile_ops._checks.check_int rejects
                compiled = compiled or torch.compile(dcp_sparse_mla, fullgraph=True, dynamic=False)
                run_eager(case, mode, compiled, f"{tag} compiled", log, seed=5)
            if "graph" in variants:
                run_graph(case, mode, f"{tag} graph", log)
            if "graph_reference" in variants:
                with compile_ops.use_backends(slots="reference", combine="reference", kv="reference"):
                    run_graph(case, mode, f"{tag} graph (reference slots+combine)", log)
        dist.barrier()
    finally:
        if log_path is not None:
            with open(f"{log_path}.rank{rank}", "w") as f:
                f.write("\n".join(lines) + "\n")
        dist.destroy_process_group()


def launch(world: int, backend: str, plan: list, log_path: str | None = None) -> None:
    """Run ``plan`` on ``world`` spawned processes; an exception in any rank fails the call."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(world, os.path.join(tmp, "store"), backend, plan, log_path), nprocs=world)


def gpu_plan(tokens=(1, 8, 64, 512), modes=("ag_rs", "a2a")) -> list:
    """The NCCL proof: interleave 1 and 4, T in {1, 8, 64, 512}, both modes."""
    plan = []
    for T in tokens:
        shape = Shape(T=T, H=32, W=128, K=512, R=min(T, 4), n_cmp=2048, block_size=64, page_size=64, swa_pages=8)
        for interleave in (1, 4):
            for mode in modes:
                variants = ["eager", "graph"]
                if (interleave, mode) in ((1, "ag_rs"), (4, "a2a")):
                    variants.append("compile")
                if T == 64 and interleave == 1:
                    variants += ["eager_reference", "graph_reference"]
                plan.append((shape, interleave, mode, variants))
    return plan


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--log", default=None, help="write each rank's lines to LOG.rank<r>")
    parser.add_argument("--tokens", default="1,8,64,512", help="comma-separated T values")
    parser.add_argument("--modes", default="ag_rs,a2a")
    args = parser.parse_args()
    plan = gpu_plan(tuple(int(t) for t in args.tokens.split(",")), tuple(args.modes.split(",")))
    launch(args.world, "nccl", plan, args.log)
    sys.exit(0)
