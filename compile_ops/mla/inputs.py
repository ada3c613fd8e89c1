"""The inputs of one ``sparse_mla`` call, as every backend receives them.

Shape legend: ``T`` tokens, ``H`` heads, ``W`` SWA index columns, ``K`` compressed index
columns; every head is 512 wide (448 NoPE + 64 RoPE), value = key.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from torch import Tensor

from compile_ops.formats import get_format


class SparseMLAArgs(NamedTuple):
    """A validated ``sparse_mla`` call, its positional arguments in the op's order.

    ``q [T, H, 512]`` bf16; ``swa_cache`` / ``cmp_cache`` paged caches in ``kv_format``
    (``cmp_*`` all ``None`` for no compressed segment); ``swa_indices [T, W]`` /
    ``cmp_indices [T, K]`` int32 slots (``-1`` empty) with ``swa_lens`` / ``cmp_lens [T]``
    int32 counting each row's leading columns; ``sink [H]`` fp32 or ``None``; ``sm_scale``
    multiplies ``<q, k>``; ``kv_scale`` is the ``fp8`` format's per-tensor scale;
    ``workspace`` is the caller's scratch (1-D uint8) or ``None`` (the backend's default);
    ``cmp_kv_format`` is the compressed cache's format when it differs from ``kv_format``
    (DeepSeek-V4.1: ``fp8_dsv41`` window rows, ``fp4_dsv41`` compressed entries), ``None``:
    the same.
    A backend's ``run(args, out, lse)`` fills ``out [T, H, 512]`` bf16 and ``lse [T, H]``
    fp32 (base 2); its ``limits(args)`` returns why it cannot take this call, or ``None``.
    """

    q: Tensor
    swa_cache: Tensor
    swa_indices: Tensor
    swa_lens: Tensor
    cmp_cache: Optional[Tensor]
    cmp_indices: Optional[Tensor]
    cmp_lens: Optional[Tensor]
    sink: Optional[Tensor]
    sm_scale: float
    kv_format: str
    kv_scale: float
    workspace: Optional[Tensor] = None
    cmp_kv_format: Optional[str] = None

    @property
    def cmp_format(self) -> str:
        """The compressed cache's format: ``cmp_kv_format``, else ``kv_format``."""
        return self.cmp_kv_format or self.kv_format

    @property
    def mixed(self) -> bool:
        """Whether the two caches are in different formats."""
        return self.cmp_cache is not None and self.cmp_format != self.kv_format


def one_format_only(kernel: str, args: SparseMLAArgs) -> Optional[str]:
    """Why ``kernel`` (one format for both caches) refuses a call of two formats, or ``None``."""
    if args.mixed:
        return (f"{kernel} reads both caches in one format, got kv_format {args.kv_format!r} and cmp_kv_format "
                f"{args.cmp_kv_format!r}: the reference backend reads two")
    return None


def two_formats_unread(kernel: str, args: SparseMLAArgs) -> Optional[str]:
    """Why ``kernel`` refuses this call of two formats, or ``None``. The Triton and Gluon
    kernels read two formats when both are byte rows with per-block scales (``fp8_ds_mla``,
    ``fp8_dsv41``, ``fp4_dsv41``): ``fp8``'s per-tensor ``kv_scale`` is folded into every
    score, and ``bf16`` rows are another element type."""
    if args.mixed and any(get_format(f).block == 0 for f in (args.kv_format, args.cmp_format)):
        return (f"{kernel} reads two cache formats when both have per-block scales (fp8_ds_mla, fp8_dsv41, "
                f"fp4_dsv41), got kv_format {args.kv_format!r} and cmp_kv_format {args.cmp_kv_format!r}: "
                "the reference backend reads them")
    return None
