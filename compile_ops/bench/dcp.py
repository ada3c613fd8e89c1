"""``python -m compile_ops.bench dcp``: ``dcp_combine`` vs the raw NCCL collectives that move
the same bytes, on every GPU of this host (one process per GPU).

For each ``T``, with ``H_all`` gathered heads of ``D = 512`` bf16 and fp32 LSEs:

* ``ag_rs``: ``dcp_combine(mode="ag_rs")`` vs ``all_gather_into_tensor`` of the LSEs
  (``T * H_all * 4`` bytes per rank) + ``reduce_scatter_tensor`` of the outputs
  (``T * H_all * D * 2`` bytes per rank);
* ``a2a``: ``dcp_combine(mode="a2a")`` vs one ``all_to_all_single`` of the same packed
  bytes (``T * H_all * (2 * D + 4)`` per rank, 16-byte aligned rows);
* the local kernels of the Triton combine alone (rescale, a2a pack, the two torch copies
  the pack replaces, lse_combine of the received partials), to show where time goes.

The combine runs with the ``triton`` and the ``reference`` combine backends. Everything is
timed by CUDA-graph replay (``--calls`` calls captured in one graph, ``--replays``
replays between CUDA events); a row reports the slowest rank.

    python -m compile_ops.bench dcp --csv bench_dcp.csv
"""

from __future__ import annotations

import argparse
import csv
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from compile_ops._cli import description
from compile_ops.bench.slots import int_list

D = 512
CASES = ("raw ag+rs", "ag_rs triton", "ag_rs reference", "raw a2a", "a2a triton", "a2a reference",
         "local rescale", "local pack", "local pack torch", "local combine")


def _bench_rank(rank: int, world: int, store_path: str, args) -> None:
    import compile_ops
    from compile_ops.bench.slots import graph_time_us
    from compile_ops.combine.triton import a2a_layout

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", store=dist.FileStore(store_path, world), rank=rank, world_size=world, device_id=device)
    group = dist.group.WORLD
    H_all = args.heads
    todo = [(T, what) for T in args.tokens for what in CASES]
    rows = []
    cases = todo
    if rank == 0:
        from compile_ops.bench import progress

        cases = progress(todo, desc=f"dcp x{world}", unit="case")
    for T, what in cases:
        gen = torch.Generator(device=device).manual_seed(rank * 1000 + T)
        out = torch.randn(T, H_all, D, device=device, generator=gen).bfloat16()
        lse = torch.randn(T, H_all, device=device, generator=gen) * 4
        if what.startswith("local"):
            fn, nbytes = _local_kernel(what, out, lse, world, rank)
        elif what == "raw ag+rs":
            lse_all = torch.empty(world * T * H_all, device=device)
            out_mine = torch.empty(T * H_all * D // world, dtype=torch.bfloat16, device=device)
            out_flat = out.view(-1)

            def fn():
                dist.all_gather_into_tensor(lse_all, lse.view(-1), group=group)
                dist.reduce_scatter_tensor(out_mine, out_flat, group=group)

            nbytes = lse.numel() * 4 + out.numel() * 2
        elif what == "raw a2a":
            row_bytes = a2a_layout(T, H_all // world, D, torch.bfloat16)[2]
            send = torch.randint(0, 255, (world * row_bytes,), dtype=torch.uint8, device=device)
            recv = torch.empty_like(send)

            def fn():
                dist.all_to_all_single(recv, send, group=group)

            nbytes = send.numel()
        else:
            mode, backend = what.split()

            def fn(mode=mode):
                compile_ops.dcp_combine(out, lse, group.group_name, mode)

            nbytes = lse.numel() * 4 + out.numel() * 2
            with compile_ops.use_backends(combine=backend):
                fn()  # warm-up under the backend that the graph captures
                us = _timed(graph_time_us, fn, args, device, world)
        if what.startswith(("raw", "local")):
            fn()
            us = _timed(graph_time_us, fn, args, device, world)
        rows.append(dict(T=T, H_all=H_all, case=what, bytes_per_rank=nbytes, us=round(us, 2), GBps=round(nbytes / us / 1e3, 1)))
    if rank == 0:
        _report(rows, world, args)
    dist.barrier()
    dist.destroy_process_group()


def _local_kernel(what, out, lse, world, rank):
    """The local (no communication) kernels of the Triton combine, and the bytes each moves."""
    from compile_ops.combine import triton as tri

    T, H_all, _ = out.shape
    H = H_all // world
    gathered = torch.stack([lse] * world)  # [N, T, H_all], as the all-gather delivers it
    received = tri.a2a_pack(out, lse, world)
    part_out, part_lse = tri.a2a_views(received, T, H, D, out.dtype)
    nbytes = 2 * out.numel() * out.element_size()
    if what == "local rescale":
        return (lambda: tri.dcp_rescale_triton(out, gathered, rank)), nbytes
    if what == "local pack":
        return (lambda: tri.a2a_pack(out, lse, world)), nbytes
    if what == "local pack torch":
        def copies():
            part_out.copy_(out.view(T, world, H, D).transpose(0, 1))
            part_lse.copy_(lse.view(T, world, H).transpose(0, 1))

        return copies, nbytes
    return (lambda: tri.lse_combine_triton(part_out, part_lse)), nbytes * 3 // 4


def _timed(graph_time_us, fn, args, device, world) -> float:
    """Per-call microseconds of ``fn`` on the slowest rank (all ranks replay together)."""
    torch.cuda.synchronize()
    dist.barrier()
    us = torch.tensor([graph_time_us(fn, args.calls, args.replays)], device=device)
    dist.all_reduce(us, op=dist.ReduceOp.MAX)
    return us.item()


def _report(rows, world, args) -> None:
    with open(args.csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    by = {(r["T"], r["case"]): r["us"] for r in rows}
    print(f"\n{world} x {torch.cuda.get_device_name()}; H_all={args.heads}, D={D} bf16; {args.calls} calls per graph, "
          f"{args.replays} replays; slowest rank; csv: {args.csv}\n")
    print("| T | raw ag+rs us | ag_rs triton us | ratio | ag_rs reference us | raw a2a us | a2a triton us | ratio | a2a reference us |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for T in sorted({r["T"] for r in rows}):
        g = lambda case: by[T, case]  # noqa: E731
        print(f"| {T} | {g('raw ag+rs')} | {g('ag_rs triton')} | {g('ag_rs triton') / g('raw ag+rs'):.2f} | {g('ag_rs reference')} "
              f"| {g('raw a2a')} | {g('a2a triton')} | {g('a2a triton') / g('raw a2a'):.2f} | {g('a2a reference')} |")
    print("\nLocal kernels of the Triton combine, no communication (us; GB/s of bytes read + written):\n")
    print("| T | ag_rs rescale | a2a pack (Triton) | a2a pack (2 torch copies) | a2a lse_combine |")
    print("| --- | --- | --- | --- | --- |")
    gbps = {(r["T"], r["case"]): r["GBps"] for r in rows}
    for T in sorted({r["T"] for r in rows}):
        cells = [f"{by[T, c]} ({gbps[T, c]:.0f})" for c in ("local rescale", "local pack", "local pack torch", "local combine")]
        print(f"| {T} | " + " | ".join(cells) + " |")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m compile_ops.bench dcp", description=description(__doc__))
    parser.add_argument("--tokens", type=int_list, default="1,8,64,512", help="comma-separated T values")
    parser.add_argument("--heads", type=int, default=128, help="gathered heads H_all")
    parser.add_argument("--world", type=int, default=0, help="GPUs to use (default: all)")
    parser.add_argument("--calls", type=int, default=20, help="calls captured in one graph")
    parser.add_argument("--replays", type=int, default=10)
    parser.add_argument("--csv", default="bench_dcp.csv")
    args = parser.parse_args(argv)
    world = args.world or torch.cuda.device_count()
    if world < 2:
        print(f"the dcp benchmark needs at least 2 CUDA GPUs, found {torch.cuda.device_count()}")
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_bench_rank, args=(world, os.path.join(tmp, "store"), args), nprocs=world)
    return 0
