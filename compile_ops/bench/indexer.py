"""``python -m compile_ops.bench indexer``: ``indexer_topk`` against plain torch and its floor.

Decode cases (``T`` tokens, one request each, or ``--requests R``: prefill chunks of ``R``
requests, each token seeing one entry more than the one before; ``n`` entries per request,
an fp8 index cache (``--index-format fp4``: DeepSeek-V4.1's), 64 heads (``--heads``),
top-512): the op's time by
CUDA-graph replay, the index-key bytes it must read (``R * n * 132``, fp4 ``R * n * 68``) as
GB/s and as a share of the H200's 4.3 TB/s, next to the same call of
``torch.compile``'d plain torch (gather, dequantize, ``einsum``, ``torch.topk``; only where
its ``[T, n, 128]`` keys fit in 2 GiB), to the op on the ``triton`` backend (the portable
scores kernel) where ``auto`` picks another, and to ``torch.topk`` alone on the op's own scores,
against the op's top-k kernels alone on them (its launches after the scores kernel, which
writes a long row's group maxima too); each in descending score and in id order
(``order="id"``, the attention layer's call, which sorts nothing). Then the capacity check:
64 requests of 1K entries in caches whose block tables address 1K and 256K entries.

    python -m compile_ops.bench indexer --csv bench_indexer.csv --plot bench_indexer.png
"""

from __future__ import annotations

import argparse
import csv

import torch

from compile_ops._cli import description
from compile_ops.bench import COPY_BYTES_PER_S as HBM_BYTES_PER_S
from compile_ops.bench.slots import graph_args, graph_time_us, int_list, no_cuda

PAGE = 64
HEADS = 64
K = 512  # DeepSeek-V4.1-Flash's index_topk
DENSE_LIMIT = 1 << 29  # elements of the compiled reference's dequantized keys (2 GiB fp32)


def problem(T: int, n: int, capacity: int, device, index_format: str = "fp8", heads: int = HEADS, page: int = PAGE,
            requests: int = 0):
    """``T`` tokens of ``requests`` requests (default ``T``: decode, a token each) with ``n``
    entries each, in a table of ``page``-entry pages addressing ``capacity`` entries per
    request (pages past ``n`` are ``-1``). A request of ``m`` tokens is a prefill chunk: its
    tokens are consecutive, the last one sees the ``n`` entries and each one before it one
    entry fewer."""
    import compile_ops
    from compile_ops.indexer.cache import new_index_cache

    R = requests or T
    gen = torch.Generator(device=device).manual_seed(T + n)
    used = -(-n // page)
    cache = new_index_cache(index_format, R * used, page, device=device)
    compile_ops.write_index_keys(cache, torch.arange(R * used * page, device=device),
                                 torch.randn(R * used * page, 128, device=device, generator=gen), index_format)
    table = torch.full((R, capacity // page), -1, dtype=torch.int32, device=device)
    table[:, :used] = torch.randperm(R * used, device=device, generator=gen).to(torch.int32).view(R, used)
    q = torch.randn(T, heads, 128, device=device, generator=gen).bfloat16()
    weights = torch.randn(T, heads, device=device, generator=gen)
    rows = torch.arange(T, device=device) * R // T  # R runs of consecutive tokens
    last = torch.searchsorted(rows, rows, right=True) - 1  # each token's run's last token
    counts = (n - (last - torch.arange(T, device=device))).clamp(min=1).to(torch.int32)
    return q, weights, cache, table, rows.to(torch.int32), counts


def topk_alone_us(scores: torch.Tensor, n_local: torch.Tensor, sort: bool, calls: int = 20,
                  replays: int = 10, level_kernel="auto") -> float:
    """Microseconds of the op's top-k launches alone over ``scores [T, L]`` (each row's first
    ``n_local[t]``), ``k = K``: those after its scores kernel, so a long row's group maxima
    are given (the scores kernel writes them). ``level_kernel``: the kernel of the levels
    that keep id order (``compile_ops.indexer.triton.topk_of_rows``); ``"auto"``: the
    ``gluon`` backend's on sm_90 with a Gluon-capable Triton (as the op runs them), else
    the portable one (``None``)."""
    from compile_ops.backends import hopper_with_gluon
    from compile_ops.indexer import triton as tri

    if level_kernel == "auto":
        level_kernel = None
        if hopper_with_gluon(scores.device) is None:
            from compile_ops.indexer.gluon import _topk_level_kernel as level_kernel

    T, L = scores.shape
    ids, vals = torch.empty(T, K, dtype=torch.int32, device=scores.device), torch.empty(T, K, device=scores.device)
    maxima = tri.group_maxima_of(scores, n_local, K) if tri.grouped(L, K) else None
    tickets = torch.zeros(T, dtype=torch.int32, device=scores.device)  # (zeroed by the scores kernel in the op)
    return graph_time_us(lambda: tri.topk_of_rows(scores, n_local, ids, vals, K, sort=sort, maxima=maxima,
                                                  level_kernel=level_kernel, tickets=tickets), calls, replays)


def dense_reference(q, weights, cache, table, rows, counts, index_format):
    """Plain torch over every addressed entry: gather, dequantize, score, ``torch.topk``."""
    from compile_ops.indexer.cache import dequantize_e2m1, quantize_e2m1, quantize_e4m3, read_index_keys

    page = cache.shape[1]
    L = table.shape[1] * page
    ids = torch.arange(L, device=q.device)
    slots = table[rows.long()][:, ids // page].long() * page + ids % page
    valid = (ids < counts.unsqueeze(1)) & (slots >= 0)
    keys = read_index_keys(cache, torch.where(valid, slots, -1), index_format)
    if index_format == "fp4":
        qd, scale = dequantize_e2m1(*quantize_e2m1(q), packed=False), torch.ones_like(weights)
    else:
        qd, scale = quantize_e4m3(q)
    dots = torch.einsum("thd,tnd->thn", qd.float(), keys)
    scores = (dots.clamp_min(0) * (weights * scale).unsqueeze(-1)).sum(1).masked_fill(~valid, float("-inf"))
    return torch.topk(scores, min(K, L), dim=1).indices


def main(argv: list[str]) -> int:
    from compile_ops.bench import progress

    parser = argparse.ArgumentParser(prog="python -m compile_ops.bench indexer", description=description(__doc__))
    parser.add_argument("--tokens", type=int_list, default="1,8,64", help="comma-separated T values (decode tokens)")
    parser.add_argument("--requests", type=int, default=0,
                        help="the T tokens are prefill chunks of this many requests (default: T, decode)")
    parser.add_argument("--entries", type=int_list, default="8192,32768,131072",
                        help="comma-separated entries per request")
    graph_args(parser, 10, "bench_indexer.csv")
    parser.add_argument("--plot", default="", help="PNG of GB/s against entries per request")
    parser.add_argument("--index-format", choices=("fp8", "fp4"), default="fp8", help="the index-key cache's format")
    parser.add_argument("--heads", type=int, default=HEADS, help="index heads (DeepSeek-V4.1: 32)")
    parser.add_argument("--page-size", type=int, default=PAGE,
                        help="entries per index-cache page (DeepSeek's 64-token blocks at ratio 2: 32)")
    args = parser.parse_args(argv)
    if no_cuda("indexer"):
        return 1
    import compile_ops
    from compile_ops.indexer import ops
    from compile_ops.indexer.cache import get_index_format
    from compile_ops.indexer.inputs import local_counts

    fmt_name, heads, page = args.index_format, args.heads, args.page_size
    backend = compile_ops.backend_for("indexer", "cuda", fmt_name)
    entry_bytes = get_index_format(fmt_name).bytes_per_token
    device = torch.device("cuda")
    todo = [(T, n) for n in args.entries for T in args.tokens]
    rows = []
    compiled_reference = torch.compile(dense_reference, dynamic=False)
    for T, n in progress(todo, desc="indexer", unit="case"):
        p = problem(T, n, n, device, fmt_name, heads, page, args.requests)
        op_us = graph_time_us(lambda: compile_ops.indexer_topk(*p, K, fmt_name), args.calls, args.replays)
        portable_us = None
        if backend != "triton":
            with compile_ops.use_backends(indexer="triton"):
                portable_us = graph_time_us(lambda: compile_ops.indexer_topk(*p, K, fmt_name), args.calls,
                                            args.replays)
        # the layer's call: the same ids in id order, no sort
        op_id_us = graph_time_us(lambda: compile_ops.indexer_topk(*p, K, fmt_name, order="id"), args.calls,
                                 args.replays)
        fmt = ops._check_topk(*p, K, fmt_name)
        n_local = local_counts(ops._args(*p, K, fmt))[1]
        scores = torch.randn(T, n, device=device)
        topk_us = topk_alone_us(scores, n_local, True, args.calls, args.replays)
        topk_id_us = topk_alone_us(scores, n_local, False, args.calls, args.replays)
        torch_topk_us = graph_time_us(lambda: torch.topk(scores, K, dim=1), args.calls, args.replays)
        ref_us = None
        if T * n * 128 <= DENSE_LIMIT:
            ref_us = graph_time_us(lambda: compiled_reference(*p, fmt_name), 2, 3)
        nbytes = min(T, args.requests or T) * n * entry_bytes  # each request's keys, read once
        rows.append(dict(T=T, entries=n, key_bytes=nbytes, op_us=round(op_us, 1), op_id_order_us=round(op_id_us, 1),
                         triton_backend_us=None if portable_us is None else round(portable_us, 1),
                         GBps=round(nbytes / op_us / 1e3, 1),
                         pct_hbm=round(100 * nbytes / op_us / 1e-6 / HBM_BYTES_PER_S, 1),
                         compiled_reference_us=None if ref_us is None else round(ref_us, 1),
                         topk_kernel_us=round(topk_us, 1), topk_id_order_us=round(topk_id_us, 1),
                         torch_topk_us=round(torch_topk_us, 1)))
    capacity = {}
    for cap in (1024, 262144):
        p = problem(64, 1024, cap, device, fmt_name, heads, page)
        capacity[cap] = graph_time_us(lambda: compile_ops.indexer_topk(*p, K, fmt_name), args.calls, args.replays)
    with open(args.csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"\n{torch.cuda.get_device_name()}; {fmt_name} index cache, {page}-entry pages, {heads} heads, k = {K}; "
          f"backend {backend}; csv: {args.csv}\n")
    print("| T | entries / request | op us | op us, id order | triton backend us | key GB/s | % of 4.3 TB/s | "
          "compiled plain torch us | top-k kernels us | top-k, id order | torch.topk us |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        ref, tl_us = ("-" if r[key] is None else r[key] for key in ("compiled_reference_us", "triton_backend_us"))
        print(f"| {r['T']} | {r['entries']} | {r['op_us']} | {r['op_id_order_us']} | {tl_us} | {r['GBps']} | "
              f"{r['pct_hbm']} | {ref} | {r['topk_kernel_us']} | {r['topk_id_order_us']} | {r['torch_topk_us']} |")
    print(f"\ncapacity: 64 requests x 1K entries: {capacity[1024]:.1f} us in a table of 1K entries per request, "
          f"{capacity[262144]:.1f} us in one of 256K ({capacity[262144] / capacity[1024]:.2f}x)")
    if args.plot:
        plot(rows, args.plot, f"indexer_topk ({fmt_name}, {page}-entry pages, {heads} heads, k = {K})")
    return 0


def plot(rows: list[dict], path: str, title: str) -> None:
    """A PNG of the rows' key GB/s (the bench's CSV columns) against entries per request, a
    line per ``T``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for T in sorted({int(r["T"]) for r in rows}):
        pts = [r for r in rows if int(r["T"]) == T]
        ax.plot([int(r["entries"]) for r in pts], [float(r["GBps"]) for r in pts], marker="o", label=f"T = {T}")
    ax.axhline(HBM_BYTES_PER_S / 1e9, color="grey", linestyle="--", label="4.3 TB/s")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("entries per request")
    ax.set_ylabel("index-key GB/s")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
