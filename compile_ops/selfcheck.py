"""``python -m compile_ops``: run every op on a backend and compare with float64 oracles.

Every public op has a row. The oracles here are dense reformulations (attention over the whole cache weighted by how
often each slot is selected, stable argsort compaction, logsumexp), not the per-entry
gathers the reference uses, so the two agree only if both read docs/ops.md the same way.
``indexer_topk`` is checked on integer-valued data (exact scores): its error is the number
of tokens whose ids differ. Prints one row per op: backend, shapes, max error, tolerance,
verdict; exits 1 on a failure.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from dataclasses import dataclass, fields

import numpy as np
import torch

import compile_ops
from compile_ops._cli import description
from compile_ops.formats import KV_FORMATS, get_format, new_cache, read_kv
from compile_ops.kv import write_kv

i32 = torch.int32
FP4_ROW_TOLERANCE = 0.34  # of a row's largest value: 1/4 + (1/4) * (1/3) * (1 + 2**-4) (e4m3-rounded scale)


@dataclass
class Row:
    op: str
    backend: str
    shapes: str
    error: float
    tolerance: float

    @property
    def verdict(self) -> str:
        return "ok" if self.error <= self.tolerance else "FAIL"


def _dense_attention(q, caches, index_sets, sink, sm_scale, kv_format, kv_scale):
    """float64 attention over every slot of every cache, each weighted by its multiplicity."""
    T, H, _ = q.shape
    logits, values, counts = [], [], []
    for cache, (indices, lens) in zip(caches, index_sets):
        n = cache.shape[0] * cache.shape[1]
        keys = read_kv(cache, torch.arange(n), kv_format, kv_scale).double()
        valid = (torch.arange(indices.shape[1]) < lens[:, None]) & (indices >= 0) & (indices < n)
        count = torch.zeros(T, n + 1, dtype=torch.float64)
        count.scatter_add_(1, torch.where(valid, indices.long(), n), valid.double())
        logits.append(torch.einsum("thd,nd->thn", q.double(), keys) * sm_scale)
        values.append(keys)
        counts.append(count[:, :n])
    logit, value, count = torch.cat(logits, -1), torch.cat(values, 0), torch.cat(counts, -1)
    weight = count[:, None, :] * torch.exp(logit)
    total = weight.sum(-1)
    if sink is not None:
        total = total + torch.exp(sink.double())[None, :]
    out = torch.nan_to_num(torch.einsum("thn,nd->thd", weight, value) / total[..., None])
    return out, torch.log2(total)


def check_sparse_mla(kv_format: str, gen: torch.Generator, device, into_buffers: bool = False) -> Row:
    """``sparse_mla`` (or, ``into_buffers``, ``sparse_mla_out`` into caller-owned ``out`` /
    ``lse`` and workspace) against float64 attention over every slot."""
    T, H, W, K, page = 7, 64, 16, 48, 16
    kv_scale = 0.25 if kv_format == "fp8" else 1.0
    swa, cmp = new_cache(kv_format, 3, page, device=device), new_cache(kv_format, 5, page, page_gap=32, device=device)
    for cache in (swa, cmp):
        n = cache.shape[0] * cache.shape[1]
        write_kv(cache, torch.arange(n, dtype=i32, device=device), torch.randn(n, 512, generator=gen).to(device), kv_format, kv_scale)
    q = torch.randn(T, H, 512, generator=gen).bfloat16()
    swa_idx = torch.randint(-1, 3 * page + 4, (T, W), generator=gen, dtype=i32)
    cmp_idx = torch.randint(-1, 5 * page + 4, (T, K), generator=gen, dtype=i32)
    swa_lens = torch.randint(0, W + 1, (T,), generator=gen, dtype=i32)
    cmp_lens = torch.randint(0, K + 1, (T,), generator=gen, dtype=i32)
    swa_lens[0] = cmp_lens[0] = 0  # an empty row
    sink = torch.randn(H, generator=gen)
    args = [a.to(device) for a in (q, swa, swa_idx, swa_lens, cmp, cmp_idx, cmp_lens, sink)]
    if into_buffers:
        out = torch.full((T, H, 512), float("nan"), dtype=torch.bfloat16, device=device)
        lse = torch.full((T, H), float("nan"), device=device)
        compile_ops.sparse_mla_out(*args, 512**-0.5, kv_format, kv_scale, out, lse,
                                   compile_ops.sparse_mla_workspace(device, kv_format))
    else:
        out, lse = compile_ops.sparse_mla(*args, 512**-0.5, kv_format, kv_scale)
    want_out, want_lse = _dense_attention(
        q, [swa.cpu(), cmp.cpu()], [(swa_idx, swa_lens), (cmp_idx, cmp_lens)], sink, 512**-0.5, kv_format, kv_scale
    )
    scale = want_out.abs().amax(-1, keepdim=True) + 1e-6
    error = max(((out.cpu().double() - want_out).abs() / scale).max().item(), (lse.cpu().double() - want_lse).abs().max().item())
    backend = compile_ops.backend_for("sparse_mla", device, kv_format)
    # the reference rounds an fp32 result to bf16 once (2**-8 of the row's largest value);
    # fast kernels also feed bf16 probabilities to the tensor cores
    tolerance = 2.0**-8 + 1e-5 if backend == "reference" else 1e-2
    name = "sparse_mla_out" if into_buffers else "sparse_mla"
    return Row(f"{name}[{kv_format}]", backend, f"T={T} H={H} W={W} K={K} page={page}", error, tolerance)


def check_fp8_linear(block: int, M: int, gen: torch.Generator, device) -> Row:
    """``fp8_linear`` (grouped, in the block layout ``block``, ``M`` tokens) against the
    float64 product of its operands as the op takes them: the weight's blocks, and the
    tokens rounded per token per block (more than the layout's ``weight_only_tokens``) or in bf16."""
    from compile_ops.linear import LAYOUTS, dequantize_blocks, fp8_linear, quantize_blocks, quantize_tokens

    N, K, G = 256, 384, 2
    x = torch.randn(M, G * K, generator=gen).bfloat16()
    w = torch.randn(N, K, generator=gen) / K**0.5
    wq, ws = quantize_blocks(w, block)
    got = fp8_linear(x.to(device), wq.to(device), ws.to(device), G).cpu().double()
    if M <= LAYOUTS[block].weight_only_tokens:
        xd = x.double()
    else:
        xq, xs = quantize_tokens(x, block)
        xd = xq.double() * xs.double().repeat_interleave(block, 1)
    wd = dequantize_blocks(wq, ws).double()
    want = torch.einsum("mgk,gnk->mgn", xd.view(M, G, K), wd.view(G, N // G, K)).reshape(M, N)
    error = ((got - want).abs() / want.abs().amax(-1, keepdim=True)).max().item()
    backend = compile_ops.backends.resolve("linear", device, args=(x.to(device), wq.to(device), ws.to(device), G))[0]
    # one bf16 rounding (2**-8 of the row's largest value); fast kernels sum in other orders
    tolerance = 2.0**-8 + 1e-5 if backend == "reference" else 2.0**-7
    layout = "fp32" if block == 128 else "ue8m0"
    return Row(f"fp8_linear[{block}x{block} {layout}]", backend, f"M={M} N={N} K={K} groups={G}", error, tolerance)


def check_bf16_linear(M: int, out_dtype: torch.dtype, gen: torch.Generator, device) -> Row:
    """``bf16_linear`` (``M`` tokens: one is the GEMV on a CUDA GPU) against the float64
    product of its bf16 operands."""
    from compile_ops.linear import bf16_linear

    N, K = 200, 1300
    x = torch.randn(M, K, generator=gen).bfloat16()
    w = (torch.randn(N, K, generator=gen) / K**0.5).bfloat16()
    got = bf16_linear(x.to(device), w.to(device), out_dtype).cpu().double()
    want = x.double() @ w.double().t()
    error = ((got - want).abs() / want.abs().amax(-1, keepdim=True)).max().item()
    path = "triton" if M == 1 and compile_ops.backends.cuda_with_triton(torch.device(device), None) is None else "torch"
    # one rounding to the output (2**-8 of the row's largest value in bf16), fp32 sums
    tolerance = 2.0**-8 + 1e-5 if out_dtype == torch.bfloat16 else 1e-5
    return Row(f"bf16_linear[{str(out_dtype).split('.')[-1]} out]", path, f"M={M} N={N} K={K}", error, tolerance)


def check_writes(gen: torch.Generator, device) -> list[Row]:
    """``write_kv`` in every format and ``write_index_keys`` in both: rows written at shuffled
    slots (``-1`` and out-of-range ones skipped) read back within the format's rounding of
    float64 rows, relative to each row's largest value; a slot nobody wrote must stay zero
    (each one that does not adds 1 to the error)."""
    from compile_ops.indexer.cache import INDEX_FORMATS, new_index_cache, read_index_keys

    pages, page, n = 3, 16, 40
    slots = torch.randperm(pages * page, generator=gen)[:n].to(i32)
    slots[::7] = -1
    slots[3] = pages * page + 5  # out of range: skipped, never written
    written = slots[(slots >= 0) & (slots < pages * page)].long()
    untouched = torch.ones(pages * page, dtype=torch.bool)
    untouched[written] = False
    all_slots = torch.arange(pages * page, device=device)
    rows = []

    def row(name, backend, back, want, width, tolerance):
        ok = (slots >= 0) & (slots < pages * page)
        err = ((back[slots[ok].long()] - want[ok]).abs().amax(-1) / want[ok].abs().amax(-1)).max().item()
        err += float((back[untouched] != 0).any(-1).sum())
        rows.append(Row(name, backend, f"N={n} pages={pages}x{page} width={width}", err, tolerance))

    for kv_format in KV_FORMATS:
        x = torch.randn(n, 512, generator=gen, dtype=torch.float64) * torch.logspace(-2, 1, 512, dtype=torch.float64)
        cache = new_cache(kv_format, pages, page, device=device)
        write_kv(cache, slots.to(device), x.float().to(device), kv_format)
        back = read_kv(cache, all_slots, kv_format).double().cpu()
        # bf16: one rounding; e4m3 (with fp8_ds_mla's bf16 RoPE part): 2**-4 of the largest value;
        # e2m1: 2**-2 of a value plus 2**-2 of its block's scale (at most a third of its max)
        row(f"write_kv[{kv_format}]", compile_ops.backend_for("kv", device), back, x, 512,
            2.0**-8 if kv_format == "bf16" else FP4_ROW_TOLERANCE if get_format(kv_format).fp4 else 2.0**-4)
    for index_format in INDEX_FORMATS:
        x = torch.randn(n, 128, generator=gen, dtype=torch.float64)
        cache = new_index_cache(index_format, pages, page, device=device)
        compile_ops.write_index_keys(cache, slots.to(device), x.float().to(device), index_format)
        back = read_index_keys(cache, all_slots, index_format).double().cpu()
        row(f"write_index_keys[{index_format}]", compile_ops.backend_for("kv", device), back, x, 128,
            {"bf16": 2.0**-8, "fp8": 2.0**-4, "fp4": FP4_ROW_TOLERANCE}[index_format])
    return rows


def _compact_numpy(slots: np.ndarray, valid: np.ndarray):
    order = np.argsort(~valid, axis=1, kind="stable")
    packed = np.take_along_axis(np.where(valid, slots, -1), order, 1)
    return packed, valid.sum(1)


def _table_numpy(table, req, page_index, ok):
    R, B = table.shape
    safe = ok & (req >= 0) & (req < R) & (page_index >= 0) & (page_index < B)
    page = np.where(safe, table[np.clip(req, 0, max(R - 1, 0)), np.clip(page_index, 0, max(B - 1, 0))], -1)
    return page, safe & (page >= 0)


def check_slots(gen: torch.Generator, device) -> list[Row]:
    T, K, R, B, block = 64, 512, 4, 40, 64
    topk = torch.randint(-1, B * block + 100, (T, K), generator=gen, dtype=i32)
    req = torch.randint(0, R, (T,), generator=gen, dtype=i32)
    table = torch.randint(-1, 1000, (R, B), generator=gen, dtype=i32)
    is_valid = torch.rand(T, generator=gen) < 0.9
    positions = torch.randint(-1, B * 16, (T,), generator=gen, dtype=i32)
    dev = [x.to(device) for x in (topk, req, table, is_valid, positions)]
    ids, r, tab, ok = topk.numpy().astype(np.int64), req.numpy()[:, None], table.numpy(), is_valid.numpy()[:, None]
    rows = []
    backend = compile_ops.backend_for("slots", device)

    def row(name, got, want, shapes):
        error = float(np.abs(got[0].cpu().numpy() - want[0]).max() + np.abs(got[1].cpu().numpy() - want[1]).max())
        rows.append(Row(name, backend, shapes, error, 0.0))

    page, valid = _table_numpy(tab, r, ids // block, ok & (ids >= 0))
    want = _compact_numpy(page * block + ids % block, valid)
    row("topk_to_slots", compile_ops.topk_to_slots(dev[0], dev[1], dev[2], block, dev[3]), want, f"T={T} K={K} R={R} B={B}")
    world, rank, inter = 4, 1, 4
    mine = (ids >= 0) & ((ids // inter) % world == rank)
    local = (ids // (world * inter)) * inter + ids % inter
    page, valid = _table_numpy(tab, r, local // block, ok & mine)
    want = _compact_numpy(page * block + local % block, valid)
    got = compile_ops.dcp_topk_to_slots(dev[0], dev[1], dev[2], block, dev[3], rank, world, inter)
    row("dcp_topk_to_slots", got, want, f"T={T} K={K} world={world} I={inter}")
    window, page_size = 128, 16
    p = positions.numpy().astype(np.int64)[:, None]
    lens = np.where(p >= 0, np.minimum(p + 1, window), 0)
    x = p - lens + 1 + np.arange(window)
    page, valid = _table_numpy(tab, r, x // page_size, np.arange(window) < lens)
    want = (np.where(valid, page * page_size + x % page_size, -1), lens[:, 0])
    row("swa_indices", compile_ops.swa_indices(dev[4], dev[1], dev[2], page_size, window), want, f"T={T} W={window}")
    return rows


def check_lse_combine(gen: torch.Generator, device) -> Row:
    N, T, H, D = 4, 16, 32, 512
    partial_out = torch.randn(N, T, H, D, generator=gen)
    partial_lse = torch.randn(N, T, H, generator=gen) * 30
    partial_lse[0, 0] = -math.inf
    partial_lse[:, 1] = -math.inf
    out, lse = compile_ops.lse_combine(partial_out.to(device), partial_lse.to(device))
    want_lse = torch.logsumexp(partial_lse.double() * math.log(2), 0) / math.log(2)
    weights = torch.nan_to_num(torch.exp2(partial_lse.double() - want_lse))
    want_out = (weights[..., None] * partial_out.double()).sum(0)
    finite = torch.isfinite(want_lse)
    error = max(
        (out.cpu().double() - want_out).abs().max().item(),
        (lse.cpu().double()[finite] - want_lse[finite]).abs().max().item(),
        float(not torch.equal(torch.isinf(lse.cpu()), ~finite)),
    )
    return Row("lse_combine", compile_ops.backend_for("combine", device), f"N={N} T={T} H={H} D={D}", error, 1e-5)


def _dcp_worker(rank: int, world: int, store: str, result_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    gen = torch.Generator().manual_seed(0)
    T, H_all, D = 8, 16, 512
    outs = torch.randn(world, T, H_all, D, generator=gen)
    lses = torch.randn(world, T, H_all, generator=gen) * 10
    lses[1:, 0] = -math.inf
    heads = slice(rank * H_all // world, (rank + 1) * H_all // world)
    want_lse = torch.logsumexp(lses.double() * math.log(2), 0) / math.log(2)
    want_out = (torch.exp2(lses.double() - want_lse)[..., None] * outs.double()).sum(0)
    error = 0.0
    for mode in ("ag_rs", "a2a"):
        out, lse = compile_ops.dcp_combine(outs[rank], lses[rank], dist.group.WORLD.group_name, mode)
        error = max(error, (out.double() - want_out[:, heads]).abs().max().item(), (lse.double() - want_lse[:, heads]).abs().max().item())
    with open(os.path.join(result_dir, f"rank{rank}"), "w") as f:
        f.write(repr(error))
    dist.barrier()  # no rank tears gloo down while a peer still sends
    dist.destroy_process_group()
    os._exit(0)  # skip interpreter finalization, where gloo's threads can abort the process


def check_dcp_combine(world: int = 2) -> Row:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_dcp_worker, args=(world, os.path.join(tmp, "store"), tmp), nprocs=world)
        error = max(float(open(os.path.join(tmp, f"rank{r}")).read()) for r in range(world))
    return Row("dcp_combine[ag_rs,a2a]", "gloo", f"world={world} T=8 H_all=16 D=512", error, 1e-5)


def _indexer_problem(index_format: str, gen: torch.Generator, hole: bool = True):
    """Integer-valued keys ``[slots, 128]``, a block table (with a hole: a ``-1`` page),
    queries, weights, rows and entry counts (exact in every precision, so ties are exact
    too); and the float64 top-k of every token (a stable sort: ties to the lower id)."""
    T, Hi, R, B, page, k = 6, 8, 3, 5, 16, 24
    n_slots = (R * B + 1) * page
    keys = torch.randint(-4, 5, (n_slots, 128), generator=gen).float()
    table = torch.randperm(R * B + 1, generator=gen)[: R * B].view(R, B).to(i32)
    if hole:
        table[1, 2] = -1
    q = torch.randint(-2, 3, (T, Hi, 128), generator=gen).to(torch.bfloat16)  # e4m3-exact after scaling
    weights = torch.randint(-3, 4, (T, Hi), generator=gen).float()
    rows = torch.tensor([0, 1, 2, 1, 3, -1], dtype=i32)
    n = torch.tensor([80, 70, 5, 0, 10, 9], dtype=i32)
    nb, block = 3, 8
    want = torch.full((T, k), -1, dtype=i32)
    blocks = torch.full((T, nb), -1, dtype=i32)  # indexer_candidates
    inside = torch.full((T, k), -1, dtype=i32)  # indexer_topk inside those blocks
    for t in range(T):
        r, count = int(rows[t]), min(int(n[t]), B * page)
        if not 0 <= r < R or count <= 0:
            continue
        ids = torch.arange(count)
        ids = ids[table[r, ids // page] >= 0]
        slots = table[r, ids // page].long() * page + ids % page
        score = (torch.einsum("hd,nd->hn", q[t].double(), keys[slots].double()).clamp_min(0)
                 * weights[t].double()[:, None]).sum(0)
        order = torch.sort(-score, stable=True).indices
        want[t, : min(k, order.shape[0])] = ids[order[:k]].to(i32)
        best = {(count - 1) // block: float("inf")}  # the newest entry's block is always kept
        for c, v in zip(ids.tolist(), score.tolist()):
            best[c // block] = max(best.get(c // block, float("-inf")), v)
        chosen = sorted(best, key=lambda b: (-best[b], b))[:nb]
        blocks[t, : len(chosen)] = torch.tensor(chosen, dtype=i32)
        kept = [c for c in ids[order].tolist() if c // block in chosen][:k]
        inside[t, : len(kept)] = torch.tensor(kept, dtype=i32)
    return dict(keys=keys, table=table, q=q, weights=weights, rows=rows, n=n, k=k, page=page, nb=nb, block=block,
                blocks=blocks, inside=inside), want


def check_indexer_topk(index_format: str, gen: torch.Generator, device) -> Row:
    """``indexer_topk`` on integer-valued data against float64 scores over every entry and a
    stable sort; the error is the number of tokens whose ids differ."""
    from compile_ops.indexer.cache import new_index_cache

    p, want = _indexer_problem(index_format, gen)
    cache = new_index_cache(index_format, p["keys"].shape[0] // p["page"], p["page"], device=device)
    compile_ops.write_index_keys(cache, torch.arange(p["keys"].shape[0], device=device), p["keys"].to(device),
                                 index_format)
    got = compile_ops.indexer_topk(p["q"].to(device), p["weights"].to(device), cache, p["table"].to(device),
                                   p["rows"].to(device), p["n"].to(device), p["k"], index_format).cpu()
    T, Hi = p["q"].shape[:2]
    error = float((got != want).any(1).sum())
    return Row(f"indexer_topk[{index_format}]", compile_ops.backend_for("indexer", device, index_format),
               f"T={T} Hi={Hi} k={p['k']} n<=80", error, 0.0)


def check_indexer_candidates(index_format: str, gen: torch.Generator, device) -> list[Row]:
    """``indexer_candidates`` and ``indexer_topk`` inside its blocks, and
    ``indexer_topk_and_candidates``, on integer-valued data against float64 block maxima and
    scores; the error is the number of tokens whose blocks or ids differ."""
    from compile_ops.indexer.cache import new_index_cache

    p, want = _indexer_problem(index_format, gen)
    cache = new_index_cache(index_format, p["keys"].shape[0] // p["page"], p["page"], device=device)
    compile_ops.write_index_keys(cache, torch.arange(p["keys"].shape[0], device=device), p["keys"].to(device),
                                 index_format)
    call = (p["q"].to(device), p["weights"].to(device), cache, p["table"].to(device), p["rows"].to(device),
            p["n"].to(device))
    blocks = compile_ops.indexer_candidates(*call, p["nb"], p["block"], index_format)
    inside = compile_ops.indexer_topk(*call, p["k"], index_format, blocks, p["block"]).cpu()
    error = float(((blocks.cpu() != p["blocks"]).any(1) | (inside != p["inside"]).any(1)).sum())
    ids, both = compile_ops.indexer_topk_and_candidates(*call, p["k"], p["nb"], p["block"], index_format)
    both_error = float(((ids.cpu() != want).any(1) | (both.cpu() != p["blocks"]).any(1)).sum())
    backend = compile_ops.backend_for("indexer", device, index_format)
    shapes = f"T={p['q'].shape[0]} blocks={p['nb']}x{p['block']} k={p['k']}"
    return [Row(f"indexer_candidates[{index_format}]", backend, shapes, error, 0.0),
            Row(f"indexer_topk_and_candidates[{index_format}]", backend, shapes, both_error, 0.0)]


def _dcp_indexer_worker(rank: int, world: int, store: str, result_dir: str) -> None:
    """``dcp_indexer_topk`` on rank ``rank``'s shard (interleave 2) of the same problem."""
    import torch.distributed as dist

    from compile_ops.indexer.cache import new_index_cache

    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    interleave = 2
    p, want = _indexer_problem("fp8", torch.Generator().manual_seed(1), hole=False)
    page, table = p["page"], p["table"]
    R, B = table.shape
    span, total = world * interleave, B * page
    # this rank's entries of each request, at their local ids, in pages of its own
    held = (total // span) * interleave + min(max(total % span - rank * interleave, 0), interleave)
    local_pages = -(-held // page)
    cache = new_index_cache("fp8", R * local_pages, page)
    local_table = torch.arange(R * local_pages, dtype=i32).view(R, local_pages)
    for r in range(R):
        c = torch.arange(total)
        c = c[(c // interleave) % world == rank]
        local = (c // span) * interleave + c % interleave
        src = table[r, c // page].long() * page + c % page
        dst = local_table[r, local // page].long() * page + local % page
        compile_ops.write_index_keys(cache, dst, p["keys"][src], "fp8")
    call = (p["q"], p["weights"], cache, local_table, p["rows"], p["n"])
    group = dist.group.WORLD.group_name
    got = compile_ops.dcp_indexer_topk(*call, p["k"], "fp8", group, interleave)
    blocks = compile_ops.dcp_indexer_candidates(*call, p["nb"], p["block"], "fp8", group, interleave)
    inside = compile_ops.dcp_indexer_topk(*call, p["k"], "fp8", group, interleave, blocks, p["block"])
    ids, both = compile_ops.dcp_indexer_topk_and_candidates(*call, p["k"], p["nb"], p["block"], "fp8", group,
                                                            interleave)
    errors = [(got != want).any(1), (blocks != p["blocks"]).any(1) | (inside != p["inside"]).any(1),
              (ids != want).any(1) | (both != p["blocks"]).any(1)]
    with open(os.path.join(result_dir, f"rank{rank}"), "w") as f:
        f.write(" ".join(repr(float(e.sum())) for e in errors))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def check_dcp_indexer_topk(world: int = 2) -> list[Row]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_dcp_indexer_worker, args=(world, os.path.join(tmp, "store"), tmp), nprocs=world)
        errors = [[float(e) for e in open(os.path.join(tmp, f"rank{r}")).read().split()] for r in range(world)]
    topk, candidates, both = (max(e[i] for e in errors) for i in range(3))
    return [Row("dcp_indexer_topk[fp8]", "gloo", f"world={world} I=2 T=6 k=24", topk, 0.0),
            Row("dcp_indexer_candidates[fp8]", "gloo", f"world={world} I=2 T=6 blocks=3x8", candidates, 0.0),
            Row("dcp_indexer_topk_and_candidates[fp8]", "gloo", f"world={world} I=2 T=6 k=24 blocks=3x8", both, 0.0)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m compile_ops", description=description(__doc__))
    parser.add_argument("--device", default="cpu", help="device to run the ops on (default: cpu)")
    parser.add_argument("--backend", default="reference", help="backend for every op family, or 'auto' (default: reference)")
    parser.add_argument("--no-dcp", action="store_true",
                        help="skip the 2-process gloo checks (dcp_combine, dcp_indexer_topk)")
    args = parser.parse_args(argv)
    families = [f.name for f in fields(compile_ops.BackendConfig)]
    choice = {family: args.backend for family in families}
    try:  # a device torch cannot use, or a backend that cannot run there: before any work
        device = torch.device(args.device)
        with compile_ops.use_backends(**choice):
            for family in families:
                compile_ops.backend_for(family, device)
    except (RuntimeError, ValueError) as err:
        parser.error(str(err))
    gen = torch.Generator().manual_seed(0)
    with compile_ops.use_backends(**choice):
        rows = [check_sparse_mla(f, gen, device) for f in KV_FORMATS]
        rows += [check_sparse_mla("fp8_dsv41", gen, device, into_buffers=True)]
        rows += check_writes(gen, device)
        rows += [check_indexer_topk(f, gen, device) for f in ("bf16", "fp8")]
        rows += [row for f in ("bf16", "fp8") for row in check_indexer_candidates(f, gen, device)]
        rows += [check_fp8_linear(block, M, gen, device) for block in (128, 32) for M in (5, 20)]
        rows += [check_bf16_linear(M, dt, gen, device) for M in (1, 3) for dt in (torch.bfloat16, torch.float32)]
        rows += check_slots(gen, device)
        rows.append(check_lse_combine(gen, device))
        if not args.no_dcp:
            rows.append(check_dcp_combine())
            rows += check_dcp_indexer_topk()
    header = ("op", "backend", "shapes", "max error", "tolerance", "verdict")
    table = [header] + [(r.op, r.backend, r.shapes, f"{r.error:.2e}", f"{r.tolerance:.1e}", r.verdict) for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    for i, line in enumerate(table):
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths)))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    failed = [r.op for r in rows if r.verdict != "ok"]
    print(f"\n{len(rows) - len(failed)}/{len(rows)} ops match their float64 oracle" + (f"; FAILED: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
