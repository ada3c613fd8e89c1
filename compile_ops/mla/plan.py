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

from compile_ops.formats import HEAD_DIM, LOG2E, KVFormat, get_format, num_slots
from compile_ops.mla.inputs import SparseMLAArgs

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


class Workspace:
    """Split-K partials of one device: ``part_o [rows, 512]`` and ``part_lse [rows]`` fp32.

    Allocated once at a fixed size and never grown. Splitting is only used while
    ``T * ceil(H / BH) * n_split <= num_sms``, so ``n_split * T * H <= rows = num_sms * BH``
    always holds. A caller that captures CUDA graphs may own one (``Workspace(device)``) and
    pass it to every call; without one, :func:`default_workspace` is used.
    """

    def __init__(self, device) -> None:
        device = torch.device(device)
        self.num_sms, self.rows = workspace_size(device)
        self.part_o = torch.empty(self.rows, HEAD_DIM, dtype=torch.float32, device=device)
        self.part_lse = torch.empty(self.rows, dtype=torch.float32, device=device)


_DEFAULT: dict[torch.device, Workspace] = {}


def workspace_size(device: torch.device) -> tuple[int, int]:
    """``(num_sms, rows)`` of ``device``'s split-K workspace, without allocating it."""
    device = torch.device(device)
    if device.type == "cuda":
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        num_sms = INTERPRETER_SMS
    return num_sms, num_sms * BH


def default_workspace(device: torch.device) -> Workspace:
    """The per-device workspace of calls that pass none, made on the first such call."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _DEFAULT:
        _DEFAULT[device] = Workspace(device)
    return _DEFAULT[device]


def choose_split(T, H: int, blocks, dsplit: int, num_sms: int, rows: int):
    """Programs per (token, head block, column part): enough to fill ``num_sms``, at most one
    per block of entries (``blocks`` of them per token); 1 once ``T`` alone fills the
    GPU. A symbolic ``T`` (a traced launch) gives a symbolic count and adds no guard."""
    progs = T * _cdiv(H, BH) * dsplit
    return torch.sym_max(1, torch.sym_min(blocks, torch.sym_min(num_sms // progs, rows // (T * H))))


def gluon_args_unsupported(args: SparseMLAArgs) -> Optional[str]:
    """The ``gluon`` backend's limits: ``None`` when the Gluon kernel can read this call's
    tensors, else why not (it copies cache rows and q's heads 16 bytes at a time)."""
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
    """One call's launch: ``grid``, the positional ``args`` both kernels take, the format's
    constants, and what the LSE merge needs (``n_split`` may be symbolic when traced)."""

    grid: tuple
    args: tuple
    fmt: KVFormat
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
    n_split: Optional[int] = None, workspace: Optional[Workspace] = None,
) -> Optional[Launch]:
    """The launch of one validated call ``args`` writing ``out`` / ``lse``, or ``None`` when there is nothing to compute
    (``T == 0`` or ``H == 0``). Blocks hold ``bn`` gathered rows; ``dsplit`` programs share
    each head block (``512 / dsplit``
    output columns each); ``split_small_T`` makes it 2 while every program still holds a
    block (the Gluon kernel, eager). ``n_split`` overrides the split-K count."""
    q, swa_cache, swa_indices, swa_lens, cmp_cache, cmp_indices, cmp_lens, sink, sm_scale, kv_format, kv_scale = args
    T, H, _ = q.shape
    if T == 0 or H == 0:
        return None
    fmt = get_format(kv_format)
    if q.stride(2) != 1:
        q = q.contiguous()
    if cmp_cache is None:  # an empty second segment: K = 0, any valid pointers
        cmp_cache, cmp_indices, cmp_lens = swa_cache, swa_indices[:, :0], swa_lens
    W, K = swa_indices.shape[1], cmp_indices.shape[1]
    traced = isinstance(q, FunctionalTensor)
    if traced:  # partials of this launch only: a traced graph owns its buffers (no global cache)
        num_sms, rows = workspace_size(q.device)
    else:
        workspace = workspace or default_workspace(q.device)
        num_sms, rows = workspace.num_sms, workspace.rows
    blocks = _cdiv(W, bn) + _cdiv(K, bn)  # of bn entries, per token
    if split_small_T and not traced and T * _cdiv(H, BH) * 2 * blocks <= num_sms:
        dsplit = 2  # few programs: two per head block, each storing half the columns
    if n_split is None:
        n_split = choose_split(T, H, blocks, dsplit, num_sms, rows)
    else:
        n_split = max(1, min(int(n_split), rows // (T * H)))
    if traced:
        part_o = torch.empty((n_split * T * H, HEAD_DIM), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((n_split * T * H,), dtype=torch.float32, device=q.device)
    else:
        part_o, part_lse = workspace.part_o, workspace.part_lse
    # fp8_ds_mla's bf16 RoPE values sit at odd addresses when a page stride is odd
    rope_bytes = fmt.bf16_rope and any(
        c.stride(0) % 2 or c.storage_offset() % 2 for c in (swa_cache, cmp_cache))
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
    return Launch(grid, args, fmt, page_shift, rope_bytes, dsplit, n_split, blocks, traced,
                  part_o, part_lse, sink if sink is not None else no_sink, int(sink is not None))
