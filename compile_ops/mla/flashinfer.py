"""FlashInfer backend of ``dsv41::sparse_mla``: SM100/SM103 (trtllm-gen) and SM120/SM121 (sparse).

**Unverified on hardware.** No SM100/SM120 GPU was available while this was written: the
argument translation below is unit-tested on CPU (``tests/test_flashinfer_translation.py``)
against FlashInfer's *documented* contract, but the kernels themselves have never run
through this file.

Based on flashinfer-ai/flashinfer at commit ``fb28d7242b3506a2348265962041acc1fb56cca4``
(2026-08-22, ``version.txt`` 0.6.18): ``flashinfer/mla/_core.py``
(``trtllm_batch_decode_sparse_mla_dsv4``, ``_trtllm_batch_decode_sparse_mla_sm120``,
``_SparseMLASegment``), ``flashinfer/mla/_sparse_mla_sm120.py``,
``csrc/trtllm_fmha_kernel_launcher.cu`` and the tests
``tests/attention/test_trtllm_gen_sparse_mla_dsv4.py`` / ``test_sparse_mla_sm120.py``.
What we rely on:

* **SM100** (``trtllm_batch_decode_sparse_mla_dsv4``, trtllm-gen): one combined table
  ``[T, 128 + K4]`` int32; columns ``0..127`` are SWA rows of ``swa_kv_cache``, the rest
  rows of ``compressed_kv_cache``; width a multiple of 4. ``sparse_topk_lens`` counts the
  fixed 128 SWA columns plus the active compressed ones; the SWA validity window comes
  from ``seq_lens`` (``min(seq_len, 128)`` leading columns for one query per request);
  ``-1`` entries are skipped (the test reference masks them). Query and both caches must
  share one dtype, bf16 or per-tensor e4m3 (so ``fp8`` needs an e4m3 query);
  ``h_q in {8, 16, 32, 64, 128}``; caches are 4D HND (a 3D cache is unsqueezed) and a
  sparse index is a *token row*: address ``index * stride(-2)`` from the pool base.
  ``bmm1_scale`` multiplies ``<q, k>`` (a tensor form is per-tensor fp32 on device),
  ``bmm2_scale`` the output. **No LSE**: the launcher passes ``lse=nullptr``, so on SM100
  this module computes the LSE with plain torch from the same table (a gather of the
  attended rows: it costs about the score half of the attention).
* **SM120** (private ``_trtllm_batch_decode_sparse_mla_sm120``, the call the public
  function makes with ``return_lse=False``; we pass ``return_lse=True``): up to two
  ``_SparseMLASegment(indices, lengths, kv_cache)``, the first reading the ``kv_cache``
  argument. Caches are packed uint8, 584 bytes/token, FlashMLA's footer-scale layout
  (= our ``fp8_ds_mla``), paged by ``stride(0)``; indices are slots
  ``page * page_size + offset``, ``-1`` skipped, columns ``>= lengths`` skipped. The
  decode kernels exist for ``num_heads in {8, ..., 128}`` x first-segment width in
  ``{128, 192, 256, 512, 1024}`` and page size 64 (``_DECODE_DSV4_DISPATCH``). The LSE is
  base 2 with the sink folded in (``log2(2^lse + 2^(sink * log2 e))``); a row with no
  entry and no sink holds ``-1e30`` (not ``-inf``).

Translation rules (all pure torch, shapes from shapes, no host sync): entries our contract
ignores (columns ``>= lens``, ``-1``, slots outside the cache) become ``-1`` so FlashInfer
never reads them; lens are clamped to ``[0, width]``; heads are zero-padded to the next
supported count (and split into chunks of 128 above 128) and sliced back; empty rows are
forced to ``out = 0``, ``lse = sink * log2(e)`` (or ``-inf``), never NaN.

Shape legend: ``T`` tokens, ``H`` heads, ``W`` SWA columns, ``K`` compressed columns.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from compile_ops.formats import HEAD_DIM, num_slots, read_kv
from compile_ops.mla.inputs import one_format_only

LOG2E = 1.0 / math.log(2.0)
WORKSPACE_BYTES = 128 * 1024 * 1024
SUPPORTED_HEADS = (8, 16, 32, 64, 128)
SM100_SWA_COLUMNS = 128
SM120_SWA_WIDTHS = (128, 192, 256, 512, 1024)
SM100_FORMATS = ("bf16", "fp8")
SM120_FORMATS = ("fp8_ds_mla",)
# FlashInfer's SM120 kernels write about -1e30 into the LSE of an empty row without sink.
SM120_EMPTY_LSE = -1e29
# Stand-in for a -inf sink (and the sink of padded heads): exp(-1e30 - x) == 0 exactly.
NEG_SINK = -1e30


# ----------------------------------------------------------------------------- predicate


def unavailable_reason(
    device_type: str,
    capability: Optional[tuple[int, int]],
    kv_format: Optional[str],
    import_error: Optional[str],
) -> Optional[str]:
    """Pure form of :func:`flashinfer_unavailable`: ``None`` or why FlashInfer cannot run."""
    if device_type != "cuda":
        return f"FlashInfer's DSV4 sparse MLA runs on CUDA devices only, got {device_type}"
    major = capability[0] if capability is not None else None
    if major == 10:
        formats = SM100_FORMATS
    elif major == 12:
        formats = SM120_FORMATS
    else:
        sm = "unknown" if capability is None else f"SM{capability[0]}{capability[1]}"
        return f"FlashInfer's DSV4 sparse MLA needs SM100/SM103 or SM120/SM121, got {sm}"
    if kv_format is not None and kv_format not in formats:
        return (
            f"FlashInfer's DSV4 kernels on SM{capability[0]}x read kv_format {list(formats)}, "
            f"got {kv_format!r}"
        )
    if import_error is not None:
        return import_error
    return None


@functools.lru_cache(maxsize=None)
def _import_error() -> Optional[str]:
    try:
        import flashinfer  # noqa: F401
    except Exception as exc:  # ImportError, or a CUDA/ABI mismatch raised at import
        return f"flashinfer is not importable ({type(exc).__name__}: {exc}); pip install 'dsv41-compile-ops[flashinfer]'"
    return None


def flashinfer_unavailable(device: torch.device, kv_format: Optional[str]) -> Optional[str]:
    """Backend predicate: ``None`` when FlashInfer can run ``sparse_mla`` on ``device``.

    Needs a CUDA device of compute capability 10.x (``bf16`` / ``fp8`` caches) or 12.x
    (``fp8_ds_mla`` caches) and an importable ``flashinfer``; otherwise returns the reason.
    """
    device = torch.device(device)
    capability = None
    if device.type == "cuda":
        capability = tuple(torch.cuda.get_device_capability(device))
    return unavailable_reason(
        device.type, capability, kv_format, None if device.type != "cuda" else _import_error()
    )


def flashinfer_args_unsupported(args) -> Optional[str]:
    """The ``flashinfer`` backend's limits on one call's ``sparse_mla`` arguments: the SWA
    width its kernels take (SM100: at most 128 columns; SM120: at most 1024) and the size of
    a caller's workspace; both caches in one format."""
    mixed = one_format_only("FlashInfer", args)
    if mixed:
        return mixed
    q, swa_indices = args.q, args.swa_indices
    major = torch.cuda.get_device_capability(q.device)[0]
    width = SM100_SWA_COLUMNS if major == 10 else SM120_SWA_WIDTHS[-1]
    if swa_indices.shape[1] > width:
        return f"FlashInfer's SM{major}x kernels take at most {width} SWA columns, got swa_indices of width {swa_indices.shape[1]}"
    if args.workspace is not None and args.workspace.shape[0] < WORKSPACE_BYTES:
        return (f"FlashInfer needs a zeroed workspace of at least {WORKSPACE_BYTES} bytes "
                f"(compile_ops.sparse_mla_workspace makes one), got {args.workspace.shape[0]}")
    return None


# ----------------------------------------------------------------------------- workspace

_WORKSPACES: dict[torch.device, Tensor] = {}


def default_workspace(device: torch.device) -> Tensor:
    """The 128 MiB uint8 FlashInfer workspace of calls that pass none, made zeroed on the
    first such call and never grown or replaced."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    buf = _WORKSPACES.get(device)
    if buf is None:
        buf = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        _WORKSPACES[device] = buf
    return buf


# ----------------------------------------------------------------------------- translation


def head_chunks(num_heads: int) -> list[tuple[int, int, int]]:
    """``(start, stop, padded)`` head chunks: at most 128 heads each, padded to a supported count."""
    if num_heads < 1:
        raise ValueError(f"num_heads must be >= 1, got {num_heads}")
    chunks = []
    for start in range(0, num_heads, SUPPORTED_HEADS[-1]):
        stop = min(start + SUPPORTED_HEADS[-1], num_heads)
        chunks.append((start, stop, next(h for h in SUPPORTED_HEADS if h >= stop - start)))
    return chunks


def pad_heads(q: Tensor, sink: Optional[Tensor], padded: int) -> tuple[Tensor, Optional[Tensor]]:
    """Zero-pad ``q [T, h, 512]`` to ``[T, padded, 512]``; ``sink [h]`` to ``[padded]`` fp32.

    ``-inf`` sinks (and padded heads) become ``NEG_SINK`` so the kernel never computes
    ``-inf - (-inf)``; the padded heads' outputs are sliced off by the caller.
    """
    T, h, D = q.shape
    if h != padded:
        q = torch.cat([q, q.new_zeros(T, padded - h, D)], dim=1)
    if sink is not None:
        sink = sink.float().clamp_min(NEG_SINK)
        if h != padded:
            sink = torch.cat([sink, sink.new_full((padded - h,), NEG_SINK)])
    return q.contiguous(), sink


class Segment(NamedTuple):
    """A masked index segment: ``indices [T, width]`` int32 with every ignored entry ``-1``,
    ``lens [T]`` int32 clamped to ``[0, width]``."""

    indices: Tensor
    lens: Tensor


def mask_segment(indices: Tensor, lens: Tensor, cache_slots: int, width: Optional[int] = None) -> Segment:
    """Turn every entry our contract ignores into ``-1`` and clamp ``lens``; pad to ``width``.

    Ignored: columns ``>= lens[t]``, ``-1``, and slots outside ``[0, cache_slots)``.
    """
    n = indices.shape[1]
    width = n if width is None else width
    if width < n:
        raise ValueError(f"cannot narrow a segment of {n} columns to {width}")
    lens = lens.clamp(0, n).to(torch.int32)
    columns = torch.arange(n, device=indices.device)
    keep = (columns < lens.unsqueeze(1)) & (indices >= 0) & (indices < cache_slots)
    table = torch.where(keep, indices, -1).to(torch.int32)
    if width > n:
        table = torch.cat([table, table.new_full((table.shape[0], width - n), -1)], dim=1)
    return Segment(table.contiguous(), lens)


def empty_rows(*segments: Segment) -> Tensor:
    """``[T]`` bool: rows with no entry left in any (masked) segment."""
    count = sum((s.indices >= 0).sum(-1) for s in segments)
    return count == 0


def flat_rows(cache: Tensor, name: str) -> tuple[Tensor, int]:
    """A ``[rows, 1, width]`` token-row view of a paged cache and its rows per page stride.

    SM100 addresses a sparse index ``i`` at ``i * stride(-2)`` from the pool base, so a slot
    ``page * page_size + offset`` becomes row ``page * span + offset`` with
    ``span = stride(0) / width`` (``== page_size`` unless pages are padded).
    """
    pages, page_size, width = cache.shape
    if cache.stride(0) % width:
        raise ValueError(
            f"{name}: FlashInfer's SM100 kernel needs the page stride ({cache.stride(0)}) to be "
            f"a multiple of the row width ({width}); got strides {cache.stride()}"
        )
    span = cache.stride(0) // width
    rows = max(pages - 1, 0) * span + page_size if pages else 0
    return cache.as_strided((rows, 1, width), (width, width, 1), cache.storage_offset()), span


def slots_to_rows(table: Tensor, page_size: int, span: int) -> Tensor:
    """Map slots of a masked table to token rows (``-1`` stays ``-1``)."""
    if span == page_size:
        return table
    rows = (table // page_size) * span + table % page_size
    return torch.where(table >= 0, rows, -1).to(torch.int32)


class SM100Args(NamedTuple):
    sparse_indices: Tensor  # [T, 128 + K4] int32 token rows, -1 = skip
    sparse_topk_lens: Tensor  # [T] int32, 128 + active compressed columns
    seq_lens: Tensor  # [T] int32, one request per token: its SWA count


def sm100_args(swa: Segment, cmp: Optional[Segment], swa_span=None, cmp_span=None) -> SM100Args:
    """The combined SM100 table from masked segments (``swa`` at most 128 columns wide).

    ``swa_span`` / ``cmp_span`` are ``(page_size, span)`` of padded-page caches (see
    :func:`flat_rows`), or ``None`` when slots already are rows.
    """
    T, W = swa.indices.shape
    if W > SM100_SWA_COLUMNS:
        raise ValueError(
            f"FlashInfer's SM100 kernel takes at most {SM100_SWA_COLUMNS} SWA columns, got "
            f"swa_indices of width {W}; use the triton backend"
        )
    swa_table = swa.indices
    if swa_span is not None:
        swa_table = slots_to_rows(swa_table, *swa_span)
    parts = [swa_table, swa_table.new_full((T, SM100_SWA_COLUMNS - W), -1)]
    topk_lens = torch.full_like(swa.lens, SM100_SWA_COLUMNS)
    if cmp is not None and cmp.indices.shape[1] > 0:
        K = cmp.indices.shape[1]
        cmp_table = cmp.indices if cmp_span is None else slots_to_rows(cmp.indices, *cmp_span)
        parts += [cmp_table, cmp_table.new_full((T, -K % 4), -1)]
        topk_lens = topk_lens + cmp.lens
    return SM100Args(torch.cat(parts, dim=1).contiguous(), topk_lens.contiguous(), swa.lens.contiguous())


def sm120_swa_width(width: int) -> int:
    """The SM120 decode kernel's first-segment width for ``width`` SWA columns."""
    for w in SM120_SWA_WIDTHS:
        if w >= width:
            return w
    raise ValueError(
        f"FlashInfer's SM120 kernel takes at most {SM120_SWA_WIDTHS[-1]} SWA columns, got {width}"
    )


def lse_from_sm120(lse: Tensor, empty: Tensor, sink: Optional[Tensor]) -> Tensor:
    """Our base-2 LSE ``[T, H]`` from the SM120 kernel's (base 2, sink folded in).

    Empty rows (and the kernel's ``-1e30`` sentinel) become ``sink * log2(e)`` or ``-inf``.
    """
    empty = empty.unsqueeze(1) | ~(lse > SM120_EMPTY_LSE)  # also catches NaN
    if sink is None:
        fill = torch.full_like(lse, float("-inf"))
    else:
        fill = (sink.float() * LOG2E).unsqueeze(0).expand_as(lse)
    return torch.where(empty, fill, lse)


def lse_torch(q: Tensor, caches, segments, sink: Optional[Tensor], sm_scale: float, kv_format: str, kv_scale: float) -> Tensor:
    """Base-2 LSE ``[T, H]`` (sink folded in) of masked segments, in plain torch (SM100)."""
    T, H = q.shape[:2]
    out = torch.empty(T, H, dtype=torch.float32, device=q.device)
    for start in range(0, T, 32):
        rows = slice(start, start + 32)
        scores = []
        for cache, seg in zip(caches, segments):
            keys = read_kv(cache, seg.indices[rows], kv_format, kv_scale)
            s = torch.einsum("thd,tnd->thn", q[rows].float(), keys) * sm_scale
            scores.append(s.masked_fill(seg.indices[rows].unsqueeze(1) < 0, float("-inf")))
        lse_e = torch.cat(scores, -1).logsumexp(-1)
        if sink is not None:
            lse_e = torch.logaddexp(lse_e, sink.float().unsqueeze(0))
        out[rows] = lse_e * LOG2E
    return out


def quantize_query_fp8(q: Tensor, sm_scale: float, kv_scale: float) -> tuple[Tensor, Tensor]:
    """Per-tensor e4m3 query for SM100 ``fp8`` caches and its device-side ``bmm1_scale [1]``."""
    q_scale = q.abs().amax().float().clamp_min(1e-4) / 448.0
    q8 = (q.float() / q_scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q8, (q_scale * (sm_scale * kv_scale)).reshape(1)


# ----------------------------------------------------------------------------- backend


class Plan(NamedTuple):
    """Translated FlashInfer calls: ``calls`` of ``(start, stop, kwargs)`` per head chunk
    (``kwargs["out"]`` is ``[T, 1, padded, 512]`` bf16, SM120 also ``kwargs["lse"]``
    ``[T, padded]`` fp32), ``empty [T]`` bool and the masked segments with their caches."""

    calls: list
    empty: Tensor
    segments: list
    caches: list


def _segments(swa_cache, swa_indices, swa_lens, cmp_cache, cmp_indices, cmp_lens, swa_width=None):
    segs = [mask_segment(swa_indices, swa_lens, num_slots(swa_cache), swa_width)]
    caches = [swa_cache]
    if cmp_cache is not None and cmp_indices.shape[1] > 0:
        segs.append(mask_segment(cmp_indices, cmp_lens, num_slots(cmp_cache)))
        caches.append(cmp_cache)
    return segs, caches


def plan_sm100(q, swa_cache, swa_indices, swa_lens, cmp_cache, cmp_indices, cmp_lens,
               sink, sm_scale, kv_format, kv_scale, ws) -> Plan:
    """Keyword arguments of ``flashinfer.mla.trtllm_batch_decode_sparse_mla_dsv4`` (SM10x)."""
    T, H = q.shape[:2]
    segs, caches = _segments(swa_cache, swa_indices, swa_lens, cmp_cache, cmp_indices, cmp_lens)
    swa_rows, swa_span = flat_rows(swa_cache, "swa_cache")
    cmp_rows, cmp_span = swa_rows, None
    if len(segs) > 1:
        cmp_rows, span = flat_rows(cmp_cache, "cmp_cache")
        cmp_span = (cmp_cache.shape[1], span)
    args = sm100_args(segs[0], segs[1] if len(segs) > 1 else None, (swa_cache.shape[1], swa_span), cmp_span)
    calls = []
    for start, stop, padded in head_chunks(H):
        q_c, sink_c = pad_heads(q[:, start:stop], None if sink is None else sink[start:stop], padded)
        bmm1, bmm2 = float(sm_scale), 1.0
        if kv_format == "fp8":
            q_c, bmm1 = quantize_query_fp8(q_c, sm_scale, kv_scale)
            bmm2 = float(kv_scale)
        out_c = torch.empty(T, 1, padded, HEAD_DIM, dtype=torch.bfloat16, device=q.device)
        calls.append((start, stop, dict(
            query=q_c.unsqueeze(1), swa_kv_cache=swa_rows, workspace_buffer=ws,
            sparse_indices=args.sparse_indices, compressed_kv_cache=cmp_rows,
            sparse_topk_lens=args.sparse_topk_lens, seq_lens=args.seq_lens, out=out_c,
            bmm1_scale=bmm1, bmm2_scale=bmm2, sinks=sink_c, kv_layout="HND",
        )))
    return Plan(calls, empty_rows(*segs), segs, caches)


def plan_sm120(q, swa_cache, swa_indices, swa_lens, cmp_cache, cmp_indices, cmp_lens,
               sink, sm_scale, kv_format, kv_scale, ws, segment_type=None) -> Plan:
    """Keyword arguments of ``flashinfer.mla._core._trtllm_batch_decode_sparse_mla_sm120`` (SM12x).

    ``segment_type`` builds a segment from ``(indices, lengths, kv_cache)``; it defaults to
    FlashInfer's ``_SparseMLASegment`` (imported here, so only on SM12x).
    """
    if segment_type is None:
        from flashinfer.mla._core import _SparseMLASegment as segment_type
    T, H = q.shape[:2]
    width = sm120_swa_width(swa_indices.shape[1])
    segs, caches = _segments(swa_cache, swa_indices, swa_lens, cmp_cache, cmp_indices, cmp_lens, width)
    fi_segments = [segment_type(indices=segs[0].indices, lengths=segs[0].lens)]
    if len(segs) > 1:
        fi_segments.append(segment_type(indices=segs[1].indices, lengths=segs[1].lens, kv_cache=cmp_cache))
    calls = []
    for start, stop, padded in head_chunks(H):
        q_c, sink_c = pad_heads(q[:, start:stop], None if sink is None else sink[start:stop], padded)
        calls.append((start, stop, dict(
            query=q_c.unsqueeze(1), kv_cache=swa_cache, workspace_buffer=ws,
            sparse_mla_segments=fi_segments,
            out=torch.empty(T, 1, padded, HEAD_DIM, dtype=torch.bfloat16, device=q.device),
            sm_scale=float(sm_scale), sinks=sink_c,
            lse=torch.empty(T, padded, dtype=torch.float32, device=q.device),
            return_lse=True, kv_scale_format="auto",
        )))
    return Plan(calls, empty_rows(*segs), segs, caches)


def finish(plan: Plan, q, sink, sm_scale, kv_format, kv_scale, out: Tensor, lse: Tensor) -> None:
    """Copy the kernels' outputs back into ``out`` / ``lse`` in our contract.

    Slices the padded heads off; empty rows get ``out = 0``; the LSE comes from the SM120
    kernel (converted by :func:`lse_from_sm120`) or, for SM100 plans (no ``"lse"``), from
    :func:`lse_torch`.
    """
    T = out.shape[0]
    for start, stop, kw in plan.calls:
        out[:, start:stop] = kw["out"][:, 0, : stop - start]
        if "lse" in kw:
            lse[:, start:stop] = lse_from_sm120(
                kw["lse"][:, : stop - start], plan.empty, None if sink is None else sink[start:stop]
            )
    if "lse" not in plan.calls[0][2]:
        lse.copy_(lse_torch(q, plan.caches, plan.segments, sink, sm_scale, kv_format, kv_scale))
    out.masked_fill_(plan.empty.view(T, 1, 1), 0.0)


def sparse_mla_flashinfer(args, out, lse) -> None:
    """Fill ``out [T, H, 512]`` bf16 and ``lse [T, H]`` fp32 with FlashInfer's DSV4 kernels.

    Same contract as ``dsv41::sparse_mla_out`` (validated there). SM10x: ``kv_format``
    ``bf16`` / ``fp8`` (an ``fp8`` cache gets a per-tensor e4m3 query), at most 128 SWA
    columns, LSE computed in plain torch. SM12x: ``fp8_ds_mla``, page size 64 for the
    decode kernels, at most 1024 SWA columns, LSE from the kernel. Unverified on hardware.
    """
    q, swa_cache, swa_indices, swa_lens, cmp_cache, cmp_indices, cmp_lens, sink, sm_scale, kv_format, kv_scale, workspace = args[:12]
    if q.shape[0] == 0:
        return
    args = (q, swa_cache, swa_indices, swa_lens, cmp_cache, cmp_indices, cmp_lens,
            sink, sm_scale, kv_format, kv_scale, workspace if workspace is not None else default_workspace(q.device))
    if torch.cuda.get_device_capability(q.device)[0] == 10:
        from flashinfer.mla import trtllm_batch_decode_sparse_mla_dsv4 as kernel

        plan = plan_sm100(*args)
    else:
        from flashinfer.mla._core import _trtllm_batch_decode_sparse_mla_sm120 as kernel

        plan = plan_sm120(*args)
    for _, _, kwargs in plan.calls:
        kernel(**kwargs)
    finish(plan, q, sink, sm_scale, kv_format, kv_scale, out, lse)


__all__ = [
    "flashinfer_unavailable", "unavailable_reason", "default_workspace", "head_chunks", "pad_heads",
    "mask_segment", "empty_rows", "flat_rows", "slots_to_rows", "sm100_args", "sm120_swa_width",
    "lse_from_sm120", "lse_torch", "quantize_query_fp8", "plan_sm100", "plan_sm120", "finish",
    "sparse_mla_flashinfer",
]
