"""Float64 oracles, written from the op reference (docs/ops.md) independently of the package's code.

They decode cache bytes bit by bit (their own e4m3 / bf16 / UE8M0 decoders), walk rows
entry by entry in Python and compute in numpy float64. Slow and obvious on purpose.
"""

from __future__ import annotations

import math

import numpy as np
import torch

# name: (data row bytes, scale row bytes, e4m3 values per row, values per UE8M0 scale)
LAYOUTS = {
    "bf16": (1024, 0, 0, 0),
    "fp8": (512, 0, 512, 0),
    "fp8_ds_mla": (576, 8, 448, 64),
    "fp8_dsv41": (512, 16, 512, 32),
    "fp4_dsv41": (256, 32, 0, 0),  # 512 e2m1 values, two per byte; one e4m3 scale per 16
}


def _e4m3_table() -> np.ndarray:
    table = np.empty(256, dtype=np.float64)
    for byte in range(256):
        sign = -1.0 if byte & 0x80 else 1.0
        exponent, mantissa = (byte >> 3) & 0xF, byte & 0x7
        if exponent == 0xF and mantissa == 0x7:
            table[byte] = math.nan
        elif exponent == 0:
            table[byte] = sign * (mantissa / 8.0) * 2.0**-6
        else:
            table[byte] = sign * (1.0 + mantissa / 8.0) * 2.0 ** (exponent - 7)
    return table


E4M3 = _e4m3_table()


def _e2m1(nibbles: np.ndarray) -> np.ndarray:
    """e2m1 codes ``s ee m`` -> float64: exponent bias 1, ``ee = 0`` subnormal (``m * 0.5``)."""
    sign = np.where(nibbles & 8, -1.0, 1.0)
    exponent, mantissa = (nibbles >> 1) & 3, nibbles & 1
    magnitude = np.where(exponent == 0, mantissa * 0.5, (1.0 + mantissa / 2.0) * 2.0 ** (exponent - 1.0))
    return sign * magnitude


def _e2m1_bytes(raw: np.ndarray) -> np.ndarray:
    """Bytes of two e2m1 values each (the even-numbered one in the low nibble) -> float64."""
    return np.stack([_e2m1(raw & 15), _e2m1(raw >> 4)], -1).reshape(-1)


def _bf16(raw: np.ndarray) -> np.ndarray:
    """Little-endian bf16 bytes -> float64."""
    bits = raw.astype(np.uint32)[0::2] | (raw.astype(np.uint32)[1::2] << 8)
    return (bits << 16).view(np.float32).astype(np.float64)


def slot_decoder(cache: torch.Tensor, kv_format: str, kv_scale: float = 1.0):
    """A function ``slot -> float64 [512]`` decoding token rows of ``cache`` from its raw bytes."""
    raw = torch.empty(0, dtype=torch.uint8).set_(cache.untyped_storage()).numpy().copy()
    esize = cache.element_size()
    base, page_stride, page_size = cache.storage_offset() * esize, cache.stride(0) * esize, cache.shape[1]
    data_bytes, scale_bytes, n_e4m3, block = LAYOUTS[kv_format]

    def decode(slot: int) -> np.ndarray:
        page, offset = divmod(slot, page_size)
        start = base + page * page_stride
        data = raw[start + offset * data_bytes : start + (offset + 1) * data_bytes]
        if kv_format == "bf16":
            return _bf16(data)
        if kv_format == "fp4_dsv41":
            scales_at = start + page_size * data_bytes + offset * scale_bytes
            return _e2m1_bytes(data) * np.repeat(E4M3[raw[scales_at : scales_at + scale_bytes]], 16)
        values = E4M3[data[:n_e4m3]]
        if kv_format == "fp8":
            return values * kv_scale
        scales_at = start + page_size * data_bytes + offset * scale_bytes
        exps = raw[scales_at : scales_at + n_e4m3 // block].astype(np.float64)
        values = values * np.repeat(2.0 ** (exps - 127.0), block)
        return np.concatenate([values, _bf16(data[n_e4m3:])])

    return decode


def sparse_mla(q, swa_cache, swa_indices, swa_lens, cmp_cache, cmp_indices, cmp_lens, sink, sm_scale, kv_format, kv_scale=1.0,
               cmp_kv_format=None):
    """``sparse_mla`` (docs/ops.md) in float64: returns (out [T, H, 512], lse [T, H]) numpy arrays;
    the compressed cache decoded in ``cmp_kv_format`` when given."""
    qd = q.double().numpy()
    T, H, _ = qd.shape
    out = np.zeros((T, H, 512))
    lse = np.zeros((T, H))
    segments = [(swa_cache, swa_indices, swa_lens)]
    if cmp_cache is not None:
        segments.append((cmp_cache, cmp_indices, cmp_lens))
    formats = [kv_format, cmp_kv_format or kv_format]
    segments = [(c, slot_decoder(c, f, kv_scale), i, n) for (c, i, n), f in zip(segments, formats)]
    sink_d = None if sink is None else sink.double().numpy()
    for t in range(T):
        keys = []
        for cache, decode, indices, lens in segments:
            n_slots = cache.shape[0] * cache.shape[1]
            for j in range(int(lens[t])):
                if j >= indices.shape[1]:
                    break
                slot = int(indices[t, j])
                if 0 <= slot < n_slots:
                    keys.append(decode(slot))
        for h in range(H):
            logits = [sm_scale * float(qd[t, h] @ k) for k in keys]
            if sink_d is not None:
                logits.append(float(sink_d[h]))
            finite = [x for x in logits if x != -math.inf]
            if not finite:
                out[t, h], lse[t, h] = 0.0, -math.inf
                continue
            top = max(finite)
            weights = [math.exp(x - top) for x in logits]
            total = sum(weights)
            acc = sum((w * k for w, k in zip(weights, keys)), np.zeros(512))
            out[t, h] = acc / total
            lse[t, h] = (top + math.log(total)) / math.log(2.0)
    return out, lse


def _table_slot(block_table, req: int, cid: int, block_size: int) -> int | None:
    R, B = block_table.shape
    if cid < 0 or not 0 <= req < R or cid // block_size >= B:
        return None
    page = int(block_table[req, cid // block_size])
    if page < 0:
        return None
    return page * block_size + cid % block_size


def topk_to_slots(topk, token_to_req, block_table, block_size, is_valid, owner=None):
    """``topk_to_slots`` / ``dcp_topk_to_slots`` (docs/ops.md); ``owner(c) -> local id or None`` filters global ids for DCP."""
    T, K = topk.shape
    slots = np.full((T, K), -1, dtype=np.int64)
    lens = np.zeros(T, dtype=np.int64)
    for t in range(T):
        if not bool(is_valid[t]):
            continue
        found = []
        for c in topk[t].tolist():
            cid = c if owner is None else owner(c)
            slot = None if cid is None else _table_slot(block_table, int(token_to_req[t]), cid, block_size)
            if slot is not None:
                found.append(slot)
        slots[t, : len(found)] = found
        lens[t] = len(found)
    return slots, lens


def dcp_topk_to_slots(topk, token_to_req, block_table, block_size, is_valid, rank, world, interleave):
    def owner(c):
        if c < 0 or (c // interleave) % world != rank:
            return None
        return (c // (world * interleave)) * interleave + c % interleave

    return topk_to_slots(topk, token_to_req, block_table, block_size, is_valid, owner)


def swa_indices(positions, token_to_req, block_table, page_size, window):
    T = positions.shape[0]
    indices = np.full((T, window), -1, dtype=np.int64)
    lens = np.zeros(T, dtype=np.int64)
    R = block_table.shape[0]
    for t in range(T):
        p, r = int(positions[t]), int(token_to_req[t])
        if p < 0 or not 0 <= r < R:
            continue
        first = max(0, p - window + 1)
        for j, x in enumerate(range(first, p + 1)):
            slot = _table_slot(block_table, r, x, page_size)
            indices[t, j] = -1 if slot is None else slot
        lens[t] = p + 1 - first
    return indices, lens


def lse_combine(partial_out, partial_lse):
    o = partial_out.double().numpy()
    L = partial_lse.double().numpy()
    N, T, H, D = o.shape
    out = np.zeros((T, H, D))
    lse = np.full((T, H), -math.inf)
    for t in range(T):
        for h in range(H):
            terms = [(L[r, t, h], o[r, t, h]) for r in range(N) if math.isfinite(L[r, t, h]) or L[r, t, h] == -math.inf]
            terms = [(x, v) for x, v in terms if x != -math.inf]
            if not terms:
                continue
            top = max(x for x, _ in terms)
            total = sum(2.0 ** (x - top) for x, _ in terms)
            lse[t, h] = top + math.log2(total)
            out[t, h] = sum(2.0 ** (x - lse[t, h]) * v for x, v in terms)
    return out, lse


def _round_e4m3(x: np.ndarray) -> np.ndarray:
    """Round float64 values (already within +-448) to the nearest e4m3 value, ties to the
    even mantissa, by searching the sorted table of finite e4m3 values."""
    finite = np.unique(E4M3[np.isfinite(E4M3)])
    codes = {float(v): b for b, v in enumerate(E4M3) if np.isfinite(v) and not (v == 0 and b)}
    hi = np.clip(np.searchsorted(finite, x), 1, len(finite) - 1)
    lo_v, hi_v = finite[hi - 1], finite[hi]
    pick_hi = (x - lo_v > hi_v - x) | ((x - lo_v == hi_v - x) & np.array([codes[float(v)] % 2 == 0 for v in hi_v.ravel()]).reshape(hi_v.shape))
    return np.where(pick_hi, hi_v, lo_v)


def _pow2_scale(amax: float) -> float:
    """The power-of-two scale ``2**ceil(log2(max(amax, 1e-4) / 448))``, by exact comparison."""
    target = max(amax, 1e-4) / 448.0
    e = math.frexp(target)[1]  # target in [2**(e-1), 2**e)
    return 2.0 ** (e - 1) if target == 2.0 ** (e - 1) else 2.0**e


def _fp4_scale(amax: float) -> float:
    """The index keys' fp4 scale: ``2**ceil(log2(fp32(max(amax, 6 * 2**-126) * fp32(1/6))))``."""
    target = float(np.float32(max(amax, 6 * 2.0**-126)) * np.float32(1 / 6))
    e = math.frexp(target)[1]
    return 2.0 ** (e - 1) if target == 2.0 ** (e - 1) else 2.0**e


def _round_e2m1(x: np.ndarray) -> np.ndarray:
    """Round float64 values within +-6 to the nearest e2m1 value, ties to the even code."""
    grid = _e2m1(np.arange(8))  # 0, 0.5, ..., 6 in code order
    mag = np.abs(x)
    hi = np.clip(np.searchsorted(grid, mag), 1, 7)
    lo_v, hi_v = grid[hi - 1], grid[hi]
    pick_hi = (mag - lo_v > hi_v - mag) | ((mag - lo_v == hi_v - mag) & (hi % 2 == 0))
    return np.sign(x) * np.where(pick_hi, hi_v, lo_v)


def index_key_decoder(cache: torch.Tensor, index_format: str):
    """A function ``slot -> float64 [128]`` decoding index keys from the cache's raw bytes:
    ``fp8`` pages hold ``page_size`` rows of 128 e4m3 bytes, then ``page_size`` fp32 scales;
    ``fp4`` pages ``page_size`` rows of 64 e2m1 bytes, then ``page_size`` rows of 4 UE8M0 bytes."""
    raw = torch.empty(0, dtype=torch.uint8).set_(cache.untyped_storage()).numpy().copy()
    esize = cache.element_size()
    base, page_stride, page_size = cache.storage_offset() * esize, cache.stride(0) * esize, cache.shape[1]

    def decode(slot: int) -> np.ndarray:
        page, offset = divmod(slot, page_size)
        start = base + page * page_stride
        if index_format == "bf16":
            return _bf16(raw[start + offset * 256 : start + (offset + 1) * 256])
        if index_format == "fp4":
            exps = raw[start + page_size * 64 + offset * 4 : start + page_size * 64 + offset * 4 + 4].astype(np.float64)
            return _e2m1_bytes(raw[start + offset * 64 : start + (offset + 1) * 64]) * np.repeat(2.0 ** (exps - 127), 32)
        values = E4M3[raw[start + offset * 128 : start + (offset + 1) * 128]]
        at = start + page_size * 128 + offset * 4
        return values * float(raw[at : at + 4].view(np.float32)[0])

    return decode


def indexer_topk(q, weights, index_cache, block_table, token_to_req, n_entries, k, index_format):
    """``indexer_topk`` (docs/ops.md) in float64, entry by entry: ids ``[T, k]`` (lists) and
    the float64 scores of the chosen ids."""
    decode = index_key_decoder(index_cache, index_format)
    qd, w = q.double().numpy(), weights.double().numpy()
    R, B = block_table.shape
    page_size = index_cache.shape[1]
    num_slots = index_cache.shape[0] * page_size
    ids_out, scores_out = [], []
    for t in range(q.shape[0]):
        r, n = int(token_to_req[t]), int(n_entries[t])
        row_q, row_w = qd[t], w[t]
        if index_format == "fp8":  # q quantized per head row like the keys
            scales = np.array([_pow2_scale(float(np.abs(h).max())) for h in row_q])
            row_q = _round_e4m3(np.clip(row_q / scales[:, None], -448, 448))
            row_w = row_w * scales
        elif index_format == "fp4":  # q quantized per 32 values like the keys (fake-quantized)
            blocks = row_q.reshape(row_q.shape[0], -1, 32)
            scales = np.array([[_fp4_scale(float(np.abs(b).max())) for b in h] for h in blocks])
            row_q = (_round_e2m1(np.clip(blocks / scales[..., None], -6, 6)) * scales[..., None]).reshape(row_q.shape)
        found = []
        if 0 <= r < R and n > 0:
            for c in range(min(n, B * page_size)):
                page = int(block_table[r, c // page_size])
                slot = page * page_size + c % page_size
                if page < 0 or slot >= num_slots:
                    continue
                key = decode(slot)
                found.append((float(np.sum(row_w * np.maximum(row_q @ key, 0.0))), c))
        found.sort(key=lambda sc: (-sc[0], sc[1]))
        chosen = found[:k]
        ids_out.append([c for _, c in chosen] + [-1] * (k - len(chosen)))
        scores_out.append([s for s, _ in chosen])
    return ids_out, scores_out
