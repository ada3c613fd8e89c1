"""How one ``sparse_mla`` call is launched: the plan both Triton kernels share.

The ``tl`` kernel (:mod:`compile_ops.mla.triton`) and the warp-specialized Gluon kernel
(:mod:`compile_ops.mla.gluon`) take the same arguments and the same split-K scheme; this
module computes them once per call from shapes only (no host sync), so that a launch is
CUDA-graph capturable: the grid, the split-K count, the partials' workspace, the format's
kernel constants, the page-size shift and the launch's positional arguments. The LSE merge
of the partials is :mod:`compile_ops.mla.merge`.

Shape legend: ``T`` tokens, ``H`` heads, ``W`` / ``K`` SWA / compressed index columns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor
from torch._subclasses.functional_tensor import FunctionalTensor

from compile_ops._checks import check_tensor
from compile_ops.formats import HEAD_DIM, LOG2E, KVFormat, get_format, num_slots
from compile_ops.mla.inputs import SparseMLAArgs, two_formats_unread

# sizes, strides and counts that change from call to call: specializing on them (== 1,
# divisible by 16) would recompile the attention kernels
UNSPECIALIZED = [
    "T", "H", "W", "K", "n_split", "has_sink", "s_swa_t", "s_cmp_t",
    "swa_page", "swa_slots", "cmp_page", "cmp_slots",
]
BH = 64  # heads per program: the M of both products (wgmma needs 64 rows per warpgroup)
BN = 64  # gathered rows per block: the Gluon kernel's, and the tl kernel's default
# the interpreter (CPU tests) has no SMs: a few, so that the tests exercise the split path
INTERPRETER_SMS = 8


def _cdiv(a, b):
    return -(-a // b)


PART_BYTES = (HEAD_DIM + 1) * 4  # one split-K partial row: o [512] fp32, then its lse
WORKSPACE_ALIGN = 16  # bytes: the partials are read as fp32 vectors


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (``INTERPRETER_SMS`` off CUDA)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRETER_SMS


def workspace_bytes(device: torch.device) -> int:
    """Bytes of a full split-K workspace of ``device``: ``num_sms * BH`` partial rows.

    Splitting is only used while ``T * ceil(H / BH) * n_split <= num_sms``, so
    ``n_split * T * H <= num_sms * BH`` rows always suffice."""
    return num_sms(device) * BH * PART_BYTES


def new_workspace(device: torch.device) -> Tensor:
    """A split-K workspace of ``device``: ``[workspace_bytes(device)]`` uint8, uninitialized."""
    return torch.empty(workspace_bytes(device), dtype=torch.uint8, device=device)


_DEFAULT: dict[torch.device, Tensor] = {}


def default_workspace(device: torch.device) -> Tensor:
    """The per-device workspace of eager calls that pass none, made on the first such call
    (under CUDA-graph capture too: it then lives in the graph's pool, held here)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _DEFAULT:
        _DEFAULT[device] = new_workspace(device)
    return _DEFAULT[device]


def check_workspace(workspace: Optional[Tensor], device: torch.device) -> None:
    """``workspace`` must be ``None`` or a contiguous 1-D uint8 tensor on ``device`` whose
    offset is a multiple of 16 bytes; any size (a smaller one only limits split-K)."""
    if workspace is None:
        return
    check_tensor("workspace", workspace, torch.uint8, 1, device)
    if workspace.stride(0) != 1 or workspace.storage_offset() % WORKSPACE_ALIGN:
        raise ValueError(f"workspace must be contiguous with an offset a multiple of {WORKSPACE_ALIGN} bytes, "
                         f"got stride {workspace.stride(0)}, offset {workspace.storage_offset()}")


def split_partials(workspace: Tensor) -> tuple[Tensor, Tensor]:
    """``(part_o [rows, 512], part_lse [rows])`` fp32 views of a uint8 ``workspace``."""
    rows = workspace.shape[0] // PART_BYTES
    parts = workspace[: rows * PART_BYTES].view(torch.float32)
    return parts[: rows * HEAD_DIM].view(rows, HEAD_DIM), parts[rows * HEAD_DIM:]


def choose_split(T, H: int, blocks, dsplit: int, num_sms: int, rows: int):
    """Programs per (token, head block, column part): enough to fill ``num_sms``, at most one
    per block of entries (``blocks`` of them per token); 1 once ``T`` alone fills the
    GPU. A symbolic ``T`` (a traced launch) gives a symbolic count and adds no guard."""
    progs = T * _cdiv(H, BH) * dsplit
    return torch.sym_max(1, torch.sym_min(blocks, torch.sym_min(num_sms // progs, rows // (T * H))))


def gluon_args_unsupported(args: SparseMLAArgs) -> Optional[str]:
    """The ``gluon`` backend's limits: ``None`` when the Gluon kernel can read this call's
    tensors, else why not (it copies cache rows and q's heads 16 bytes at a time, and reads
    two formats only when both have per-block scales)."""
    mixed = two_formats_unread("the Gluon kernel", args)
    if mixed:
        return mixed
    for name, cache in (("swa_cache", args.swa_cache), ("cmp_cache", args.cmp_cache)):
        if cache is None:
            continue
        size = cache.element_size()
        if cache.stride(0) * size % 16 or cache.storage_offset() * size % 16:
            return (f"the Gluon kernel needs {name}'s pages 16-byte aligned (page stride and offset in bytes a "
                    f"multiple of 16), got stride(0) {cache.stride(0) * size} B, offset {cache.storage_offset() * size} B")
    q = args.q
    q_strides = (q.stride(0), q.stride(1), q.storage_offset())
    if q.stride(2) == 1 and any(s % 8 for s in q_strides):  # else plan() makes q contiguous
        return f"the Gluon kernel needs q's token and head strides and offset multiples of 8, got {q_strides}"
    return None


@dataclass
class Launch:
    """One call's launch: ``grid``, the positional ``args`` both kernels take, the formats'
    constants, and what the LSE merge needs (``n_split`` may be symbolic when traced)."""

    grid: tuple
    args: tuple
    fmt: KVFormat
    cmp_fmt: KVFormat  # the compressed cache's format (``fmt`` unless the call has two)
    page_shift: bool
    rope_bytes: bool
    dsplit: int
    n_split: object
    blocks: int
    traced: bool
    part_o: Tensor
    part_lse: Tensor
    sink: Tensor  # the sink, or a never-read fp32 pointer no output aliases
    has_sink: int


def plan(
    args: SparseMLAArgs, out: Tensor, lse: Tensor, *, bn: int = BN, dsplit: int = 1, split_small_T: bool = False,
    n_split: Optional[int] = None,
) -> Optional[Launch]:
    """The launch of one validated call ``args`` writing ``out`` / ``lse``, or ``None`` when there is nothing to compute
    (``T == 0`` or ``H == 0``). Blocks hold ``bn`` gathered rows; ``dsplit`` programs share
    each head block (``512 / dsplit``
    output columns each); ``split_small_T`` makes it 2 while every program still holds a
    block (the Gluon kernel, eager). ``n_split`` overrides the split-K count. The partials
    go to ``args.workspace``; without one, to :func:`default_workspace` (eager) or to
    buffers of this launch (traced: a compiled graph owns its buffers)."""
    q, swa_cache, swa_indices, swa_lens, cmp_cache, cmp_indices, cmp_lens, sink, sm_scale, kv_format, kv_scale, workspace = args[:12]
    T, H, _ = q.shape
    if T == 0 or H == 0:
        return None
    fmt, cmp_fmt = get_format(kv_format), get_format(args.cmp_format)
    if q.stride(2) != 1:
        q = q.contiguous()
    if cmp_cache is None:  # an empty second segment: K = 0, any valid pointers
        cmp_cache, cmp_indices, cmp_lens, cmp_fmt = swa_cache, swa_indices[:, :0], swa_lens, fmt
    W, K = swa_indices.shape[1], cmp_indices.shape[1]
    traced = isinstance(q, FunctionalTensor)
    sms = num_sms(q.device)
    if workspace is None and not traced:
        workspace = default_workspace(q.device)
    rows = sms * BH if workspace is None else workspace.shape[0] // PART_BYTES
    blocks = _cdiv(W, bn) + _cdiv(K, bn)  # of bn entries, per token
    if split_small_T and not traced and T * _cdiv(H, BH) * 2 * blocks <= sms:
        dsplit = 2  # few programs: two per head block, each storing half the columns
    if n_split is None:
        n_split = choose_split(T, H, blocks, dsplit, sms, rows)
    else:
        n_split = max(1, min(int(n_split), rows // (T * H)))
    if workspace is None:  # traced without a caller's workspace: partials of this launch
        part_o = torch.empty((n_split * T * H, HEAD_DIM), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((n_split * T * H,), dtype=torch.float32, device=q.device)
    else:
        part_o, part_lse = split_partials(workspace)
    # fp8_ds_mla's bf16 RoPE values sit at odd addresses when a page stride is odd
    rope_bytes = any(f.bf16_rope and (c.stride(0) % 2 or c.storage_offset() % 2)
                     for f, c in ((fmt, swa_cache), (cmp_fmt, cmp_cache)))
    # power-of-two page sizes (the usual 64 / 256) map slots to pages with shifts
    pages = (swa_cache.shape[1], cmp_cache.shape[1])
    page_shift = all(p > 0 and p & (p - 1) == 0 for p in pages)
    if page_shift:
        pages = tuple(p.bit_length() - 1 for p in pages)
    kv_mul = float(kv_scale) if fmt.tensor_scaled else 1.0  # fp8: scores and output carry kv_scale
    no_sink = part_lse
    args = (
        q, out, lse, part_o, part_lse, sink if sink is not None else no_sink,
        swa_cache, swa_indices, swa_lens, cmp_cache, cmp_indices, cmp_lens,
        T, H, W, K, n_split, int(sink is not None), float(sm_scale) * LOG2E * kv_mul, kv_mul,
        q.stride(0), q.stride(1), swa_indices.stride(0), swa_indices.stride(1),
        cmp_indices.stride(0), cmp_indices.stride(1),
        pages[0], swa_cache.stride(0), num_slots(swa_cache),
        pages[1], cmp_cache.stride(0), num_slots(cmp_cache),
    )
    grid = (T * _cdiv(H, BH) * dsplit, n_split)
    return Launch(grid, args, fmt, cmp_fmt, page_shift, rope_bytes, dsplit, n_split, blocks, traced,
                  part_o, part_lse, sink if sink is not None else no_sink, int(sink is not None))
