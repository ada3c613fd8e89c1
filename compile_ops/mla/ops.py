"""``dsv41::sparse_mla`` and ``dsv41::sparse_mla_out``: schema, validation, fake, dispatch.

Shape legend: ``T`` tokens (queries), ``H`` query heads, ``W`` SWA index columns, ``K``
compressed index columns; every head is 512 wide (448 NoPE + 64 RoPE), value = key.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from compile_ops import backends
from compile_ops._compat import omittable_mutated_args
from compile_ops._checks import check_dim, check_positive, check_tensor
from compile_ops.formats import HEAD_DIM, check_cache, get_format
from compile_ops.mla.inputs import SparseMLAArgs, two_formats_unread
from compile_ops.mla.plan import check_workspace, workspace_bytes
from compile_ops.mla.reference import sparse_mla_reference


def _checked(*args) -> SparseMLAArgs:
    """The op's positional arguments, validated (real and fake kernels alike)."""
    args = SparseMLAArgs(*args)
    q, swa_cache, swa_indices, swa_lens, cmp_cache, cmp_indices, cmp_lens, sink, sm_scale, kv_format, kv_scale, workspace = args[:12]
    check_tensor("q", q, torch.bfloat16, 3)
    if q.shape[2] != HEAD_DIM:
        raise ValueError(f"q must be [T, H, {HEAD_DIM}], got shape {tuple(q.shape)}")
    device, (T, H) = q.device, q.shape[:2]
    check_cache("swa_cache", swa_cache, kv_format, device)
    check_tensor("swa_indices", swa_indices, torch.int32, 2, device)
    check_dim("swa_indices", swa_indices, 0, T, "q.shape[0], the token count T")
    check_tensor("swa_lens", swa_lens, torch.int32, 1, device)
    check_dim("swa_lens", swa_lens, 0, T, "q.shape[0], the token count T")
    given = [x is not None for x in (cmp_cache, cmp_indices, cmp_lens)]
    if any(given) and not all(given):
        raise ValueError(
            "cmp_cache, cmp_indices and cmp_lens must be given together or all be None; "
            f"got cmp_cache={'set' if given[0] else None}, cmp_indices={'set' if given[1] else None}, "
            f"cmp_lens={'set' if given[2] else None}"
        )
    if all(given):
        check_cache("cmp_cache", cmp_cache, args.cmp_format, device)
        check_tensor("cmp_indices", cmp_indices, torch.int32, 2, device)
        check_dim("cmp_indices", cmp_indices, 0, T, "q.shape[0], the token count T")
        check_tensor("cmp_lens", cmp_lens, torch.int32, 1, device)
        check_dim("cmp_lens", cmp_lens, 0, T, "q.shape[0], the token count T")
    if sink is not None:
        check_tensor("sink", sink, torch.float32, 1, device)
        check_dim("sink", sink, 0, H, "q.shape[1], the head count H")
    if args.cmp_kv_format is not None:
        get_format(args.cmp_kv_format)
    check_positive("sm_scale", sm_scale)
    check_positive("kv_scale", kv_scale)
    check_workspace(workspace, device)
    return args


def _run(args: SparseMLAArgs, out: Tensor, lse: Tensor) -> None:
    backends.implementation("sparse_mla", "sparse_mla", args.q.device, args.kv_format, args)(args, out, lse)


def _check_outputs(q: Tensor, out: Tensor, lse: Tensor) -> None:
    T, H = q.shape[:2]
    check_tensor("out", out, torch.bfloat16, 3, q.device)
    if tuple(out.shape) != (T, H, HEAD_DIM) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [T, H, {HEAD_DIM}] = [{T}, {H}, {HEAD_DIM}] tensor, got shape {tuple(out.shape)} strides {out.stride()}")
    check_tensor("lse", lse, torch.float32, 2, q.device)
    if tuple(lse.shape) != (T, H) or not lse.is_contiguous():
        raise ValueError(f"lse must be a contiguous [T, H] = [{T}, {H}] tensor, got shape {tuple(lse.shape)} strides {lse.stride()}")


@omittable_mutated_args
@torch.library.custom_op("dsv41::sparse_mla_out", mutates_args=("out", "lse", "workspace"))
def sparse_mla_out(
    q: Tensor,
    swa_cache: Tensor,
    swa_indices: Tensor,
    swa_lens: Tensor,
    cmp_cache: Optional[Tensor],
    cmp_indices: Optional[Tensor],
    cmp_lens: Optional[Tensor],
    sink: Optional[Tensor],
    sm_scale: float,
    kv_format: str,
    kv_scale: float,
    out: Tensor,
    lse: Tensor,
    workspace: Optional[Tensor] = None,
    cmp_kv_format: Optional[str] = None,
) -> None:
    args = _checked(q, swa_cache, swa_indices, swa_lens, cmp_cache, cmp_indices, cmp_lens, sink, sm_scale, kv_format,
                    kv_scale, workspace, cmp_kv_format)
    _check_outputs(q, out, lse)
    _run(args, out, lse)


@sparse_mla_out.register_fake
def _(q, swa_cache, swa_indices, swa_lens, cmp_cache, cmp_indices, cmp_lens, sink, sm_scale, kv_format, kv_scale, out, lse,
      workspace=None, cmp_kv_format=None):
    _checked(q, swa_cache, swa_indices, swa_lens, cmp_cache, cmp_indices, cmp_lens, sink, sm_scale, kv_format, kv_scale,
             workspace, cmp_kv_format)
    _check_outputs(q, out, lse)


@torch.library.custom_op("dsv41::sparse_mla", mutates_args=())
def sparse_mla(
    q: Tensor,
    swa_cache: Tensor,
    swa_indices: Tensor,
    swa_lens: Tensor,
    cmp_cache: Optional[Tensor],
    cmp_indices: Optional[Tensor],
    cmp_lens: Optional[Tensor],
    sink: Optional[Tensor],
    sm_scale: float,
    kv_format: str = "bf16",
    kv_scale: float = 1.0,
    cmp_kv_format: Optional[str] = None,
) -> tuple[Tensor, Tensor]:
    args = _checked(q, swa_cache, swa_indices, swa_lens, cmp_cache, cmp_indices, cmp_lens, sink, sm_scale, kv_format, kv_scale,
                    None, cmp_kv_format)
    out, lse = _new_outputs(q)
    _run(args, out, lse)
    return out, lse


def _new_outputs(q: Tensor) -> tuple[Tensor, Tensor]:
    T, H = q.shape[:2]
    return (
        torch.empty((T, H, HEAD_DIM), dtype=torch.bfloat16, device=q.device),
        torch.empty((T, H), dtype=torch.float32, device=q.device),
    )


@sparse_mla.register_fake
def _(q, swa_cache, swa_indices, swa_lens, cmp_cache, cmp_indices, cmp_lens, sink, sm_scale, kv_format="bf16", kv_scale=1.0,
      cmp_kv_format=None):
    _checked(q, swa_cache, swa_indices, swa_lens, cmp_cache, cmp_indices, cmp_lens, sink, sm_scale, kv_format, kv_scale,
             None, cmp_kv_format)
    return _new_outputs(q)


sparse_mla.__doc__ = """Sparse MLA attention over an SWA segment and a compressed segment, with a sink.

For token ``t`` and head ``h``, let ``J`` be the first ``swa_lens[t]`` entries of
``swa_indices[t]`` plus the first ``cmp_lens[t]`` entries of ``cmp_indices[t]``, dropping
``-1`` and slots outside their cache (never read). With ``s_j = sm_scale * <q[t,h], k_j>``
and ``v_j = k_j``::

    out[t, h] = sum_j exp(s_j) v_j / (sum_j exp(s_j) + exp(sink[h]))
    lse[t, h] = log2(sum_j exp(s_j) + exp(sink[h]))

An empty row gives ``out = 0`` and ``lse = sink[h] * log2(e)`` (``-inf`` without sink).

Args:
    q: ``[T, H, 512]`` bf16 queries (any ``H >= 1``).
    swa_cache: paged cache ``[pages, page_size, row_width]`` in ``kv_format``
        (see :mod:`compile_ops.formats`).
    swa_indices: ``[T, W]`` int32 slots of ``swa_cache``; ``-1`` = empty.
    swa_lens: ``[T]`` int32; only the first ``swa_lens[t]`` columns count.
    cmp_cache, cmp_indices, cmp_lens: the compressed segment (``[T, K]`` / ``[T]`` int32),
        or all three ``None``.
    sink: ``[H]`` fp32 attention-sink logits, or ``None``; ``-inf`` has no effect.
    sm_scale: softmax scale applied to ``<q, k>``.
    kv_format: ``"bf16"``, ``"fp8"``, ``"fp8_ds_mla"``, ``"fp8_dsv41"`` or ``"fp4_dsv41"``.
    kv_scale: per-tensor scale of the ``"fp8"`` format (ignored by the others).
    cmp_kv_format: the compressed cache's format when it is not ``kv_format`` (DeepSeek-V4.1:
        ``"fp8_dsv41"`` window rows, ``"fp4_dsv41"`` compressed entries); ``None``: the same.
        The Triton and Gluon kernels read two formats that both have per-block scales; other
        pairs run on the reference backend.

Returns:
    ``(out [T, H, 512] bf16, lse [T, H] fp32, base 2)``.

Example::

    >>> import torch, compile_ops
    >>> from compile_ops.formats import new_cache
    >>> cache = new_cache("bf16", num_pages=2, page_size=4)
    >>> q = torch.randn(1, 8, 512, dtype=torch.bfloat16)
    >>> idx = torch.tensor([[0, 1, -1]], dtype=torch.int32)
    >>> lens = torch.tensor([2], dtype=torch.int32)
    >>> out, lse = compile_ops.sparse_mla(q, cache, idx, lens, None, None, None, None, 0.04)
    >>> out.shape, lse.shape
    (torch.Size([1, 8, 512]), torch.Size([1, 8]))
"""

sparse_mla_out.__doc__ = """:func:`sparse_mla` writing into caller-owned ``out [T, H, 512]`` bf16 and
``lse [T, H]`` fp32 (both contiguous); returns ``None``. ``kv_format`` and ``kv_scale``
are required here. Use it with static buffers under CUDA-graph capture.

``workspace`` is the backend's scratch, owned by the caller: a contiguous 1-D uint8 tensor
from :func:`sparse_mla_workspace` (its contents are overwritten, never read by the next
call). Any size is valid for the Triton and Gluon kernels (a smaller one only limits how
far short steps are split over the GPU); FlashInfer needs the full size. ``None`` uses a
per-device default made on the first call that needs it.
"""


def sparse_mla_workspace(device, kv_format: str = "bf16") -> Tensor:
    """A zeroed workspace for :func:`sparse_mla_out` on ``device``: ``[bytes]`` uint8, sized
    for the backend chosen now for ``kv_format`` (the Triton / Gluon split-K partials,
    ``num_sms * 64 * 2052`` bytes; FlashInfer's 128 MiB; at least the former always)."""
    device = torch.device(device)
    size = workspace_bytes(device)
    if device.type == "cuda" and backends.backend_for("sparse_mla", device, kv_format) == "flashinfer":
        from compile_ops.mla.flashinfer import WORKSPACE_BYTES

        size = max(size, WORKSPACE_BYTES)
    return torch.zeros(size, dtype=torch.uint8, device=device)


def _triton_unavailable(device, kv_format):
    return backends.cuda_with_triton(device, kv_format)


def _gluon_unavailable(device, kv_format):
    return backends.hopper_with_gluon(device)


def _flashmla_unavailable(device, kv_format):
    if device.type != "cuda":  # decided before importing the backend module, which imports triton
        return f"FlashMLA runs on CUDA devices only, got {device.type}"
    try:
        from compile_ops.mla.flashmla import flashmla_unavailable
    except ImportError as err:
        return f"the flashmla backend needs triton ({err})"
    return flashmla_unavailable(device, kv_format)


def _flashinfer_unavailable(device, kv_format):
    # the predicate module imports only torch; flashinfer itself is imported on first use
    from compile_ops.mla.flashinfer import flashinfer_unavailable

    return flashinfer_unavailable(device, kv_format)


# Verified on hardware first: the Gluon kernel (sm_90), FlashMLA (sm_90, fp8_ds_mla, reached
# only where Gluon refuses), the tl kernel (any CUDA GPU); FlashInfer (SM100/SM120), never
# run on such a GPU, only when chosen; the reference everywhere.
backends.register_backend("sparse_mla", "gluon", _gluon_unavailable,
                          {"sparse_mla": backends.imported("compile_ops.mla.gluon", "sparse_mla_gluon")},
                          limits=backends.imported("compile_ops.mla.plan", "gluon_args_unsupported"))
backends.register_backend("sparse_mla", "flashmla", _flashmla_unavailable,
                          {"sparse_mla": backends.imported("compile_ops.mla.flashmla", "sparse_mla_flashmla")},
                          limits=backends.imported("compile_ops.mla.flashmla", "flashmla_args_unsupported"))
backends.register_backend("sparse_mla", "triton", _triton_unavailable,
                          {"sparse_mla": backends.imported("compile_ops.mla.triton", "sparse_mla_triton")},
                          limits=lambda args: two_formats_unread("the tl kernel", args))
backends.register_backend("sparse_mla", "flashinfer", _flashinfer_unavailable,
                          {"sparse_mla": backends.imported("compile_ops.mla.flashinfer", "sparse_mla_flashinfer")},
                          limits=backends.imported("compile_ops.mla.flashinfer", "flashinfer_args_unsupported"))
backends.register_backend("sparse_mla", "reference", backends.any_device, {"sparse_mla": sparse_mla_reference})
