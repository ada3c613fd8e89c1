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
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

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


def flashmla_indices(indices: torch.Tensor, lens: torch.Tensor, n_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Our ``[T, N]`` slots + lens -> FlashMLA's: out-of-range -> -1, width padded to 64, lens clamped."""
    width = indices.shape[1]
    valid = (indices >= 0) & (indices < n_slots)
    safe = torch.where(valid, indices, -1)
    target = max(INDEX_BLOCK, -(-width // INDEX_BLOCK) * INDEX_BLOCK)
    padded = F.pad(safe, (0, target - width), value=-1)
    return padded.contiguous(), lens.clamp(0, width).to(torch.int32)


def lse_from_flashmla(lse_natural: torch.Tensor, sink: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA's natural-log LSE without sink ``[T, H]`` -> (our base-2 LSE with sink, non-empty mask)."""
    non_empty = torch.isfinite(lse_natural)
    natural = torch.where(non_empty, lse_natural, -math.inf)
    if sink is not None:
        natural = torch.logaddexp(natural, sink.view(1, -1))
    return natural / math.log(2.0), non_empty


def sparse_mla_flashmla(q, swa_cache, swa_indices, swa_lens, cmp_cache, cmp_indices, cmp_lens, sink, sm_scale, kv_format, kv_scale, out, lse):
    """Fill ``out`` / ``lse`` through ``flash_mla.flash_mla_with_kvcache(..., use_legacy=True)``."""
    import flash_mla

    for name, cache in (("swa_cache", swa_cache), ("cmp_cache", cmp_cache)):
        if cache is not None and cache.shape[0] > 1 and cache.stride(0) % PAGE_ALIGN_BYTES:
            raise ValueError(
                f"the flashmla backend needs {name}'s pages {PAGE_ALIGN_BYTES}-byte aligned "
                f"(stride(0) % {PAGE_ALIGN_BYTES} == 0), got stride(0) = {cache.stride(0)}; make the cache "
                "with compile_ops.formats.new_cache or choose another backend with use_backends"
            )
    T, H, _ = q.shape
    swa = flashmla_indices(swa_indices, swa_lens, swa_cache.shape[0] * swa_cache.shape[1])
    if cmp_cache is None:
        main_cache, (main_idx, main_lens), extra = swa_cache, swa, {}
    else:
        main_cache = cmp_cache
        main_idx, main_lens = flashmla_indices(cmp_indices, cmp_lens, cmp_cache.shape[0] * cmp_cache.shape[1])
        extra = dict(
            extra_k_cache=swa_cache.unsqueeze(2),
            extra_indices_in_kvcache=swa[0].unsqueeze(1),
            extra_topk_length=swa[1],
        )
    for h0 in range(0, H, FLASHMLA_HEADS[-1]):
        h1 = min(H, h0 + FLASHMLA_HEADS[-1])
        pad = padded_heads(h1 - h0) - (h1 - h0)
        q_chunk = F.pad(q[:, h0:h1], (0, 0, 0, pad)).contiguous()
        sink_chunk = None if sink is None else F.pad(sink[h0:h1], (0, pad), value=-math.inf)
        sched, _ = flash_mla.get_mla_metadata()
        fm_out, fm_lse = flash_mla.flash_mla_with_kvcache(
            q_chunk.unsqueeze(1), main_cache.unsqueeze(2), None, None, 512, sched,
            softmax_scale=sm_scale, is_fp8_kvcache=True, indices=main_idx.unsqueeze(1),
            attn_sink=sink_chunk, topk_length=main_lens, use_legacy=True, **extra,
        )
        chunk_lse, non_empty = lse_from_flashmla(fm_lse.view(T, -1)[:, : h1 - h0], None if sink is None else sink[h0:h1])
        lse[:, h0:h1] = chunk_lse
        out[:, h0:h1] = torch.where(non_empty.unsqueeze(-1), fm_out.view(T, -1, 512)[:, : h1 - h0], 0)
