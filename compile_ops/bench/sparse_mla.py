"""``python -m compile_ops.bench sparse-mla``: Triton sparse MLA vs FlashMLA vs torch.compile.

For every (H, K) shape and token count T, with a 128-entry SWA segment (each token's own
window of contiguous slots) plus K compressed entries drawn at random from a pool larger
than L2, it times:

* ours: ``compile_ops.sparse_mla_out`` on each of ``--backends`` (the warp-specialized
  Gluon kernel, ``gluon``, and the portable ``tl`` kernel, ``triton``), for every ``kv_format``;
* FlashMLA (``sgl-flash-mla``, ``use_legacy=True``) on the same ``fp8_ds_mla`` caches;
* the plain-torch reference under ``torch.compile`` (bf16 caches, at ``--ref-T``: T = 1 and
  128 by default: at larger T it takes minutes to compile and time).

GPU work is timed by CUDA-graph replay: ``--calls`` calls (cycling over ``--sets`` input sets
so that consecutive calls read different rows) are captured once, the graph is replayed
``--reps`` times and the median replay is divided by ``--calls``. Each timing starts after
``--settle`` idle seconds: after a heavy case the H200 caps its power (``nvidia-smi``: SW
power cap, lower SM clock) and the next case runs slower for up to a second, so
back-to-back timings would favour whatever follows a light case. Reported per case:
microseconds, TFLOP/s (``4 T H A 512``, ``A = 128 + K`` attended entries), GB/s of KV rows,
and % of roofline ``max(flops / 790e12, bytes / 4.3e12)`` (bytes: KV rows + indices + q,
out and lse, each once). Writes ``sparse_mla.csv``, ``sparse_mla.md`` and ``sparse_mla.png``
to ``--out``. ``--profile-T`` adds, for those T, each kernel's device time per call (ours
and FlashMLA's, from ``torch.profiler`` over eager calls, once every case is timed) to
``sparse_mla_kernels.csv``: where a call's time goes when it is latency-bound.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import time

import torch

from compile_ops._cli import description
from compile_ops.bench import BF16_FLOPS_PER_S as PEAK_FLOPS
from compile_ops.bench import COPY_BYTES_PER_S as PEAK_BYTES
from compile_ops.bench.slots import no_cuda

# "window+compressed": a call of two formats; V41 is DeepSeek-V4.1's pair
V41 = "fp8_dsv41+fp4_dsv41"
FORMATS = ("bf16", "fp8", "fp8_ds_mla", "fp8_dsv41", "fp4_dsv41", V41)
W, PAGE = 128, 64


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m compile_ops.bench sparse-mla", description=description(__doc__))
    p.add_argument("--T", default="1,8,32,128,512,2048", help="token counts")
    p.add_argument("--shapes", default="64:512,128:1024", help="H:K pairs")
    p.add_argument("--formats", default=",".join(FORMATS),
                   help="kv_formats, or window+compressed pairs of two (V4.1's: fp8_dsv41+fp4_dsv41)")
    p.add_argument("--ref-T", default="1,128", help="T at which to time the torch.compile'd reference ('' = none)")
    p.add_argument("--no-flashmla", action="store_true")
    p.add_argument("--backends", default="gluon,triton", help="our sparse_mla backends to time (one that cannot run here is skipped)")
    p.add_argument("--configs", default="", help="extra tl-kernel launch configs, bn:dsplit:warps:stages,...")
    p.add_argument("--pool", type=int, default=1 << 18, help="compressed-cache slots the top-k is drawn from")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--sets", type=int, default=4)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--settle", type=float, default=1.0,
                   help="idle seconds before each timed case (0: back to back; see the module doc)")
    p.add_argument("--profile-T", default="", help="T at which to list per-kernel device times ('' = none)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default="bench-out")
    return p.parse_args(argv)


def cycle_timer(device, calls, reps, settle=0.0):
    """``time(fns) -> us per call``: CUDA-graph replay on a GPU (after ``settle`` idle
    seconds), a wall clock elsewhere."""

    def time_graph(fns):
        for f in fns:
            f()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                fns[i % len(fns)]()
        graph.replay()
        torch.cuda.synchronize()
        time.sleep(settle)
        times = []
        for _ in range(reps):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) * 1e3 / calls)
        return statistics.median(times)

    def time_wall(fns):
        fns[0]()
        t0 = time.perf_counter()
        for f in fns:
            f()
        return (time.perf_counter() - t0) * 1e6 / len(fns)

    return time_graph if device.type == "cuda" else time_wall


def kernel_times(fn, iters=20):
    """``{kernel name: device microseconds per call}`` of ``fn`` (eager, ``torch.profiler``)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return {e.key: e.self_device_time_total / iters for e in prof.key_averages()
            if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0}


def make_caches(kv_format, slots, device, gen):
    from compile_ops.formats import get_format, new_cache
    from compile_ops.kv import write_kv

    pages = slots // PAGE
    # FlashMLA pads fp8_ds_mla pages to a multiple of 576 bytes; we take any stride
    gap = -(PAGE * 584) % 576 if kv_format == "fp8_ds_mla" else 0
    cache = new_cache(kv_format, pages, PAGE, device=device, page_gap=gap)
    chunk = 1 << 16
    for s in range(0, slots, chunk):
        n = min(chunk, slots - s)
        kv = torch.randn(n, 512, device=device, generator=gen)
        write_kv(cache, torch.arange(s, s + n, dtype=torch.int32, device=device), kv, kv_format, 1.0)
    return cache, get_format(kv_format).bytes_per_token


def make_inputs(T, H, K, n_swa, n_cmp, n_sets, device, gen):
    sets = []
    for s in range(n_sets):
        base = (torch.arange(T, device=device) * W + s * T * W) % max(n_swa - W, 1)
        swa_idx = (base[:, None] + torch.arange(W, device=device)).to(torch.int32)
        cmp_idx = torch.randint(0, n_cmp, (T, K), device=device, generator=gen, dtype=torch.int32)
        q = torch.randn(T, H, 512, device=device, generator=gen).to(torch.bfloat16)
        sets.append((q, swa_idx, torch.full((T,), W, dtype=torch.int32, device=device), cmp_idx, torch.full((T,), K, dtype=torch.int32, device=device)))
    return sets


def split_format(fmt):
    """``(window's format, compressed cache's format)`` of a ``--formats`` entry."""
    window, _, compressed = fmt.partition("+")
    return window, compressed or window


def roofline(T, H, K, fmt, bytes_per_token):
    """(flops, KV bytes, roofline seconds) of a case: ``W`` window rows and ``K`` entries in
    their formats (``bytes_per_token`` of each format)."""
    window, compressed = split_format(fmt)
    A = W + K
    flops = 4.0 * T * H * A * 512
    kv_bytes = T * (W * bytes_per_token[window] + K * bytes_per_token[compressed])
    io_bytes = kv_bytes + T * A * 4 + T * H * 512 * 2 * 2 + T * H * 4
    return flops, kv_bytes, max(flops / PEAK_FLOPS, io_bytes / PEAK_BYTES)


def main(argv=None):
    args = parse(argv)
    import compile_ops
    from compile_ops.mla import triton as mla_triton
    from compile_ops.mla.inputs import SparseMLAArgs
    from compile_ops.mla.reference import sparse_mla_reference

    from compile_ops.bench import progress
    device = torch.device(args.device)
    if device.type == "cuda" and no_cuda("sparse-mla"):  # (--device cpu times the reference by wall clock)
        return 1
    Ts = [int(t) for t in args.T.split(",") if t]
    ref_Ts = {int(t) for t in args.ref_T.split(",") if t}
    profile_Ts = {int(t) for t in args.profile_T.split(",") if t}
    kernel_rows, profile_jobs = [], []
    shapes = [tuple(int(v) for v in s.split(":")) for s in args.shapes.split(",")]
    formats = [f for f in args.formats.split(",") if f]
    impls = []  # (name, backend, config): our op per backend, then the tl kernel per extra config
    for name in [b for b in args.backends.split(",") if b]:
        if name == "flashmla":
            print("backend flashmla: timed as 'op [flashmla backend]', next to FlashMLA itself")
            continue
        try:
            with compile_ops.use_backends(sparse_mla=name):
                compile_ops.backend_for("sparse_mla", device)
            impls.append((name, name, None))
        except ValueError as e:
            print(f"backend {name} skipped: {e}")
    for c in [c for c in args.configs.split(",") if c]:
        cfg = mla_triton.Config(*map(int, c.split(":")))
        impls.append((f"triton[{c}]", "triton", cfg))
    flash_mla = None
    if not args.no_flashmla and device.type == "cuda":
        try:
            import flash_mla
        except ImportError as e:
            print(f"FlashMLA not importable ({e}); skipping it")
    timer = cycle_timer(device, args.calls, args.reps, args.settle)
    gen = torch.Generator(device=device).manual_seed(0)
    os.makedirs(args.out, exist_ok=True)
    sm_scale = 512**-0.5
    rows = []

    def ours(fmt, backend, cfg, a):
        q, si, sl, ci, cl = a
        T, H = q.shape[:2]
        out = torch.empty(T, H, 512, dtype=torch.bfloat16, device=device)
        lse = torch.empty(T, H, device=device)
        window, compressed = split_format(fmt)
        call = (q, swa[window], si, sl, cmp[compressed], ci, cl, sink, sm_scale, window, 1.0)
        if cfg is not None:
            return lambda: mla_triton.sparse_mla_triton(SparseMLAArgs(*call, None, compressed), out, lse, config=cfg)

        def run():
            with compile_ops.use_backends(sparse_mla=backend):
                compile_ops.sparse_mla_out(*call, out, lse, None, compressed)

        return run

    def flashmla(a, sched):
        q, si, sl, ci, cl = a
        T, H = q.shape[:2]
        swa_c, cmp_c, sink_ = swa["fp8_ds_mla"], cmp["fp8_ds_mla"], sink  # this shape's, not the last one's
        return lambda: flash_mla.flash_mla_with_kvcache(
            q.view(T, 1, H, 512), cmp_c.unsqueeze(2), None, None, 512, sched,
            softmax_scale=sm_scale, is_fp8_kvcache=True, indices=ci.view(T, 1, -1), attn_sink=sink_,
            extra_k_cache=swa_c.unsqueeze(2), extra_indices_in_kvcache=si.view(T, 1, W),
            topk_length=cl, extra_topk_length=sl, use_legacy=True,
        )

    def reference_fn(q, swa_c, si, sl, cmp_c, ci, cl, sink_, fmt):
        out = torch.empty(*q.shape, dtype=torch.bfloat16, device=q.device)
        lse = torch.empty(q.shape[:2], device=q.device)
        sparse_mla_reference(SparseMLAArgs(q, swa_c, si, sl, cmp_c, ci, cl, sink_, sm_scale, fmt, 1.0), out, lse)
        return out, lse

    compiled_ref = torch.compile(reference_fn, dynamic=False)
    jobs = [(H, K, T) for H, K in shapes for T in Ts]
    bar = progress(total=len(jobs), desc="sparse-mla", unit="case")
    swa = cmp = None
    for H, K in shapes:
        n_swa = -(-max(2 * max(Ts) * W, 4 * W) // PAGE) * PAGE
        n_cmp = max(args.pool // PAGE * PAGE, PAGE)
        swa, cmp, bpt = {}, {}, {}
        for fmt in sorted({f for pair in formats for f in split_format(pair)}):
            swa[fmt], bpt[fmt] = make_caches(fmt, n_swa, device, gen)
            cmp[fmt], _ = make_caches(fmt, n_cmp, device, gen)
        sink = torch.randn(H, device=device, generator=gen)
        for T in Ts:
            sets = make_inputs(T, H, K, n_swa, n_cmp, args.sets, device, gen)
            for fmt in formats:
                for name, backend, cfg in impls:
                    us = timer([ours(fmt, backend, cfg, a) for a in sets])
                    rows.append(dict(H=H, K=K, T=T, impl=name, kv_format=fmt, us=us))
            if flash_mla is not None and "fp8_ds_mla" in formats:
                sched, _ = flash_mla.get_mla_metadata()
                rows.append(dict(H=H, K=K, T=T, impl="flashmla", kv_format="fp8_ds_mla", us=timer([flashmla(a, sched) for a in sets])))
                us = timer([ours("fp8_ds_mla", "flashmla", None, a) for a in sets])  # FlashMLA behind our op
                rows.append(dict(H=H, K=K, T=T, impl="dsv41 op [flashmla backend]", kv_format="fp8_ds_mla", us=us))
            if T in profile_Ts and device.type == "cuda":
                fns = [(f"{name} {fmt}", ours(fmt, backend, cfg, sets[0])) for fmt in formats for name, backend, cfg in impls]
                if flash_mla is not None and "fp8_ds_mla" in formats:
                    sched, _ = flash_mla.get_mla_metadata()
                    fns.append(("flashmla fp8_ds_mla", flashmla(sets[0], sched)))
                profile_jobs.append((H, K, T, fns))
            if T in ref_Ts and "bf16" in formats:
                q, si, sl, ci, cl = sets[0]
                t0 = time.perf_counter()
                fn = lambda: compiled_ref(q, swa["bf16"], si, sl, cmp["bf16"], ci, cl, sink, "bf16")  # noqa: E731
                fn()
                compile_s = time.perf_counter() - t0
                try:
                    us = timer([fn])
                except Exception as e:  # capture can fail; fall back to a synchronised wall clock
                    print(f"compiled reference not capturable ({type(e).__name__}); timing eagerly")
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(args.calls):
                        fn()
                    torch.cuda.synchronize()
                    us = (time.perf_counter() - t0) * 1e6 / args.calls
                rows.append(dict(H=H, K=K, T=T, impl="torch.compile(reference)", kv_format="bf16", us=us, compile_s=round(compile_s, 1)))
            bar.update(1)
    bar.close()
    # profiled last: once torch.profiler has run, every later graph replay of a small call
    # takes longer
    for H, K, T, fns in profile_jobs:
        for impl, fn in fns:
            for kernel, us in kernel_times(fn).items():
                kernel_rows.append(dict(H=H, K=K, T=T, impl=impl, kernel=kernel[:80], us=round(us, 2)))
    for r in rows:
        flops, kv_bytes, roof = roofline(r["T"], r["H"], r["K"], r["kv_format"], bpt)
        r["tflops"] = flops / r["us"] / 1e6
        r["kv_gbps"] = kv_bytes / r["us"] / 1e3
        r["pct_roofline"] = 100 * roof / (r["us"] * 1e-6)
    report(rows, args.out, torch.cuda.get_device_name(device) if device.type == "cuda" else device.type.upper())
    if kernel_rows:
        with open(os.path.join(args.out, "sparse_mla_kernels.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, list(kernel_rows[0]))
            w.writeheader()
            w.writerows(kernel_rows)
        for r in kernel_rows:
            print(f"H={r['H']} K={r['K']} T={r['T']} {r['impl']:>22}: {r['us']:8.2f} us  {r['kernel']}")
    return 0


# the peers each table row compares ours against; every other timed implementation is ours
PEERS = ("flashmla", "dsv41 op [flashmla backend]", "torch.compile(reference)")


def _is_ours(impl):
    return impl not in PEERS


def _best(by_impl, fmt):
    """Our fastest row for ``fmt`` in one case (``None`` when none was timed)."""
    mine = [r for (impl, f), r in by_impl.items() if f == fmt and _is_ours(impl)]
    return min(mine, key=lambda r: r["us"]) if mine else None


def report(rows, out_dir, device_name):
    """Write ``sparse_mla.csv``, the table ``sparse_mla.md`` (also printed) and, with
    matplotlib, ``sparse_mla.png`` (TFLOP/s against T) for ``rows`` timed on ``device_name``."""
    if not rows:
        print("nothing was timed: no backend of ours, FlashMLA or reference T runs on this device")
        return
    keys = ["H", "K", "T", "impl", "kv_format", "us", "tflops", "kv_gbps", "pct_roofline", "compile_s"]
    with open(os.path.join(out_dir, "sparse_mla.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, keys)
        w.writeheader()
        for r in rows:
            # four significant digits, not decimals: a slow (CPU) run's GB/s stays nonzero
            w.writerow({k: (float(f"{v:.4g}") if isinstance(v, float) else v) for k, v in r.items()})
    # one table: per (H, K, T) our us / TFLOP/s / % roofline per format, then the peers
    by = {}
    for r in rows:
        by.setdefault((r["H"], r["K"], r["T"]), {})[(r["impl"], r["kv_format"])] = r
    ours = sorted({(r["impl"], r["kv_format"]) for r in rows if _is_ours(r["impl"])}, key=lambda x: (x[0], FORMATS.index(x[1])))
    head = ["H", "K", "T"] + [f"{i} {f} us / TF/s / %roof" for i, f in ours]
    head += ["FlashMLA us", "FlashMLA / best ours (fp8_ds_mla)", "op [flashmla backend] us", "compiled ref us (bf16)", "ref / best ours (bf16)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (H, K, T), d in sorted(by.items()):
        cells = [str(H), str(K), str(T)]
        for key in ours:
            r = d.get(key)
            cells.append(f"{r['us']:.1f} / {r['tflops']:.0f} / {r['pct_roofline']:.0f}%" if r else "")
        fm = d.get(("flashmla", "fp8_ds_mla"))
        mine = _best(d, "fp8_ds_mla")
        cells.append(f"{fm['us']:.1f}" if fm else "")
        cells.append(f"{fm['us'] / mine['us']:.2f}x" if fm and mine else "")
        via_op = d.get(("dsv41 op [flashmla backend]", "fp8_ds_mla"))
        cells.append(f"{via_op['us']:.1f}" if via_op else "")
        ref = d.get(("torch.compile(reference)", "bf16"))
        mine16 = _best(d, "bf16")
        cells.append(f"{ref['us']:.0f}" if ref else "")
        cells.append(f"{ref['us'] / mine16['us']:.1f}x" if ref and mine16 else "")
        lines.append("| " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    with open(os.path.join(out_dir, "sparse_mla.md"), "w") as f:
        f.write(table + "\n")
    print(table)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    shapes = sorted({(r["H"], r["K"]) for r in rows})
    impls = sorted({r["impl"] for r in rows}, key=lambda i: (not _is_ours(i), i))
    styles = ["-", "--", ":", "-.", (0, (5, 1, 1, 1))]  # one per implementation, one colour per format
    fig, axes = plt.subplots(1, len(shapes), figsize=(5.5 * len(shapes), 4), squeeze=False)
    for ax, (H, K) in zip(axes[0], shapes):
        for impl, fmt in sorted({(r["impl"], r["kv_format"]) for r in rows}):
            pts = sorted((r["T"], r["tflops"]) for r in rows if (r["H"], r["K"], r["impl"], r["kv_format"]) == (H, K, impl, fmt))
            label = f"ours {impl} {fmt}" if _is_ours(impl) else f"{impl} {fmt}"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=label,
                    color=f"C{FORMATS.index(fmt)}", linestyle=styles[impls.index(impl) % len(styles)])
        ax.set_xscale("log", base=2)
        ax.set_xlabel("T (tokens)")
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"H={H}, top-k={K} + 128 SWA ({device_name})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "sparse_mla.png"), dpi=72)


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
