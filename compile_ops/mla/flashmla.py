"""FlashMLA backend of ``sparse_mla``: DeepSeek's legacy SM90 sparse-decode kernels.

Extra ``flashmla`` (``pip install 'dsv41-compile-ops[flashmla]'``, package ``sgl-flash-mla``,
import name ``flash_mla``; read against sgl-flash-mla 1.0.0's ``flash_mla_interface.py``).
Runs on SM90 (H100/H200) and reads ``fp8_ds_mla`` caches only. The translation:

* FlashMLA takes 64 or 128 query heads: heads are processed in chunks of 128, each chunk
  zero-padded to 64 or 128 heads (padded heads get a ``-inf`` sink), outputs sliced back.
* Its main segment is ``k_cache`` + ``indices`` + ``topk_length``, the other is
  ``extra_k_cache`` + ``extra_indices_in_kvcache`` + ``extra_topk_length``: the compressed
  segment is the main one when present, the SWA segment the extra one.
* It treats only ``-1`` as empty and reads any other index (no bounds check): slots
  outside the cache become ``-1`` here, lengths are clamped to ``[0, width]``, and index
  widths are padded with ``-1`` to a multiple of 64 (its gather block).
* Its LSE is natural-log and excludes the sink, and it reports an empty row with a
  non-finite LSE: ``lse = log2(exp(lse_fm) + exp(sink))``, ``out = 0`` on empty rows.
* Its tile-scheduler metadata depends on the *values* of the lengths, so a fresh
  ``FlashMLASchedMeta`` is made per call and the schedule is recomputed on the device:
  a captured CUDA graph replays correctly when lengths change between replays.
* Its pages must be a multiple of 576 bytes apart (``cache.stride(0) % 576 == 0``);
  :func:`compile_ops.formats.new_cache` lays ``fp8_ds_mla`` caches out that way.

The translation runs as two small Triton kernels (one before FlashMLA for each index
segment, one after it for the outputs), so the backend adds three launches to FlashMLA's
own (schedule + decode + split merge).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from compile_ops.mla.inputs import one_format_only

FLASHMLA_HEADS = (64, 128)
INDEX_BLOCK = 64
PAGE_ALIGN_BYTES = 576


def flashmla_unavailable(device: torch.device, kv_format: Optional[str], capability=None) -> Optional[str]:
    """``None`` when FlashMLA can run ``sparse_mla`` on ``device`` for ``kv_format``, else why not."""
    if device.type != "cuda":
        return f"FlashMLA runs on CUDA devices only, got {device.type}"
    if kv_format is not None and kv_format != "fp8_ds_mla":
        return f"FlashMLA's SM90 kernels read fp8_ds_mla caches only, got kv_format {kv_format!r}"
    major, minor = capability or torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        return f"FlashMLA's legacy sparse decode needs SM90 (H100/H200), got sm_{major}{minor}"
    try:
        import flash_mla
    except ImportError:
        return "sgl-flash-mla is not installed (pip install 'dsv41-compile-ops[flashmla]')"
    from flash_mla._loader import has_legacy

    if not has_legacy():
        return "this sgl-flash-mla build has no legacy SM90 kernels"
    return None


def padded_heads(heads: int) -> int:
    """FlashMLA head count that holds a chunk of ``heads <= 128`` query heads."""
    return next(h for h in FLASHMLA_HEADS if heads <= h)


@triton.jit
def _bound_indices_kernel(idx_ptr, stride_t, stride_k, lens_ptr, out_ptr, out_lens_ptr, width, n_slots,
                          PADDED: tl.constexpr, BLOCK: tl.constexpr):
    """Row ``t``: slots outside ``[0, n_slots)`` -> -1, columns ``width..PADDED`` -> -1, lens clamped."""
    i_t = tl.program_id(0).to(tl.int64)
    for i_c in range(PADDED // BLOCK):
        o_k = i_c * BLOCK + tl.arange(0, BLOCK)
        # [BLOCK]
        b_idx = tl.load(idx_ptr + i_t * stride_t + o_k * stride_k, mask=o_k < width, other=-1)
        b_idx = tl.where((b_idx >= 0) & (b_idx < n_slots), b_idx, -1)
        tl.store(out_ptr + i_t * PADDED + o_k, b_idx)
    b_len = tl.load(lens_ptr + i_t)
    tl.store(out_lens_ptr + i_t, tl.minimum(tl.maximum(b_len, 0), width))


@triton.jit
def _outputs_kernel(fm_out_ptr, fm_lse_ptr, sink_ptr, out_ptr, lse_ptr, H_pad, H_out, h0, n_heads,
                    HAS_SINK: tl.constexpr, BH: tl.constexpr, D: tl.constexpr):
    """Token ``t``, heads ``[h, h + BH)`` of a chunk: base-2 LSE with the sink, zeroed empty rows."""
    i_t, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_h = i_h * BH + tl.arange(0, BH)
    m_h = o_h < n_heads
    o_d = tl.arange(0, D)
    # [BH] natural-log LSE without the sink; FlashMLA marks an empty row non-finite
    b_nat = tl.load(fm_lse_ptr + i_t * H_pad + o_h, mask=m_h, other=float("-inf"))
    m_row = (b_nat == b_nat) & (tl.abs(b_nat) < float("inf"))
    b_nat = tl.where(m_row, b_nat, float("-inf"))
    if HAS_SINK:
        b_sink = tl.load(sink_ptr + h0 + o_h, mask=m_h, other=float("-inf"))
        b_max = tl.maximum(b_nat, b_sink)
        b_safe = tl.where(b_max > float("-inf"), b_max, 0.0)
        b_nat = b_safe + tl.log(tl.exp(b_nat - b_safe) + tl.exp(b_sink - b_safe))
    tl.store(lse_ptr + i_t * H_out + h0 + o_h, b_nat * 1.4426950408889634, mask=m_h)
    # [BH, D]
    b_o = tl.load(fm_out_ptr + (i_t * H_pad + o_h[:, None]) * D + o_d[None, :], mask=m_h[:, None], other=0.0)
    b_o = tl.where(m_row[:, None], b_o, 0.0)
    tl.store(out_ptr + (i_t * H_out + h0 + o_h[:, None]) * D + o_d[None, :], b_o.to(out_ptr.dtype.element_ty), mask=m_h[:, None])


def bound_indices(indices: torch.Tensor, lens: torch.Tensor, n_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Our ``[T, N]`` slots + lens -> FlashMLA's, in one launch: slots outside
    ``[0, n_slots)`` -> -1, width padded with -1 to a multiple of 64 (at least 64), lens
    clamped to ``[0, N]``."""
    T, width = indices.shape
    padded = max(INDEX_BLOCK, -(-width // INDEX_BLOCK) * INDEX_BLOCK)
    out = torch.empty(T, padded, dtype=torch.int32, device=indices.device)
    out_lens = torch.empty(T, dtype=torch.int32, device=indices.device)
    if T:
        _bound_indices_kernel[(T,)](
            indices, indices.stride(0), indices.stride(1), lens, out, out_lens, width, n_slots,
            PADDED=padded, BLOCK=INDEX_BLOCK, num_warps=1,
        )
    return out, out_lens


def write_outputs(fm_out, fm_lse, sink, out, lse, h0: int, n_heads: int) -> None:
    """FlashMLA's natural-log LSE without sink -> our base-2 LSE with the sink, and its output
    zeroed on empty (non-finite LSE) rows, written into ``out`` / ``lse`` heads
    ``[h0, h0 + n_heads)`` in one launch. ``fm_out`` is ``[T, 1, H_pad, 512]``,
    ``fm_lse`` ``[T, H_pad, 1]``, both contiguous."""
    T, H_pad = fm_out.shape[0], fm_out.shape[2]
    if T == 0:
        return
    bh = 8
    _outputs_kernel[(T, triton.cdiv(n_heads, bh))](
        fm_out, fm_lse, sink if sink is not None else fm_lse, out, lse, H_pad, out.shape[1], h0, n_heads,
        HAS_SINK=sink is not None, BH=bh, D=512, num_warps=4,
    )


def flashmla_args_unsupported(args) -> Optional[str]:
    """The ``flashmla`` backend's limits on one call's ``sparse_mla`` arguments: FlashMLA's
    SM90 kernels read pages aligned to 576 bytes, both caches in one format."""
    mixed = one_format_only("FlashMLA", args)
    if mixed:
        return mixed
    for name, cache in (("swa_cache", args.swa_cache), ("cmp_cache", args.cmp_cache)):
        if cache is not None and cache.shape[0] > 1 and cache.stride(0) % PAGE_ALIGN_BYTES:
            return (f"FlashMLA needs {name}'s pages {PAGE_ALIGN_BYTES}-byte aligned (stride(0) % "
                    f"{PAGE_ALIGN_BYTES} == 0), got stride(0) = {cache.stride(0)}; compile_ops.formats.new_cache "
                    "makes such caches")
    return None


def sparse_mla_flashmla(args, out, lse):
    """Fill ``out`` / ``lse`` through ``flash_mla.flash_mla_with_kvcache(..., use_legacy=True)``."""
    q, swa_cache, swa_indices, swa_lens, cmp_cache, cmp_indices, cmp_lens, sink, sm_scale, kv_format, kv_scale = args[:11]
    import flash_mla

    T, H, _ = q.shape
    swa_idx, swa_n = bound_indices(swa_indices, swa_lens, swa_cache.shape[0] * swa_cache.shape[1])
    if cmp_cache is None:
        main_cache, main_idx, main_n, extra = swa_cache, swa_idx, swa_n, {}
    else:
        main_cache = cmp_cache
        main_idx, main_n = bound_indices(cmp_indices, cmp_lens, cmp_cache.shape[0] * cmp_cache.shape[1])
        extra = dict(extra_k_cache=swa_cache.unsqueeze(2), extra_indices_in_kvcache=swa_idx.unsqueeze(1), extra_topk_length=swa_n)
    for h0 in range(0, H, FLASHMLA_HEADS[-1]):
        h1 = min(H, h0 + FLASHMLA_HEADS[-1])
        pad = padded_heads(h1 - h0) - (h1 - h0)
        q_chunk = q[:, h0:h1]
        if pad or not q_chunk.is_contiguous():
            q_chunk = F.pad(q_chunk, (0, 0, 0, pad)).contiguous()
        sink_chunk = None if sink is None else (F.pad(sink[h0:h1], (0, pad), value=-math.inf) if pad else sink[h0:h1])
        sched, _ = flash_mla.get_mla_metadata()  # fresh: its schedule depends on the lengths' values
        fm_out, fm_lse = flash_mla.flash_mla_with_kvcache(
            q_chunk.unsqueeze(1), main_cache.unsqueeze(2), None, None, 512, sched,
            softmax_scale=sm_scale, is_fp8_kvcache=True, indices=main_idx.unsqueeze(1),
            attn_sink=sink_chunk, topk_length=main_n, use_legacy=True, **extra,
        )
        write_outputs(fm_out.contiguous(), fm_lse.contiguous(), sink, out, lse, h0, h1 - h0)
