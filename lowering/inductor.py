"""Inductor sees our Triton kernels: the ``dsv41`` ops decompose into ``wrap_triton`` launches.

The ops stay ``torch.library.custom_op`` ops (schemas, fake kernels, ``opcheck``, backend
choice, eager dispatch unchanged). :func:`install` adds one rule per op for
``FunctionalTensorMode``, the mode that AOTAutograd (``torch.compile``) and
``torch.export`` trace under. When the op runs on CUDA and its family resolves to the
``"triton"`` backend (:func:`compile_ops.backend_for`), the rule runs the op's own Python
body under the mode; the Triton launchers see ``FunctionalTensor`` arguments and launch
through :func:`torch.library.wrap_triton`, so the traced graph holds
``triton_kernel_wrapper_functional`` nodes that Inductor (and AOTInductor) compile into
their own generated code next to the fused kernels around them, with no dispatcher call.
``write_kv`` (the ``"kv"`` family) inlines as its Triton row store, which quantizes each
row in the kernel. The indexer's ``write_index_keys`` and ``indexer_topk`` inline
when Inductor compiles for AOTInductor (``torch._inductor.config.cpp_wrapper``; the top-k
when every step's scores fit one scratch chunk for the traced range of ``T``), so an
AOTInductor package of the decode step on CUDA calls no ``dsv41`` op at all; under
``torch.compile`` they stay extern calls (docs/lowering.md says what was and was not run). Anywhere else (CPU, the reference backend, FlashMLA / FlashInfer
backends, and ``dcp_combine``, whose collectives stay calls) the rule falls through and the op stays an
opaque node: Inductor calls it as an extern kernel (``torch.ops.dsv41.*``), the reference
being the CPU kernel. This is the mechanism of ``torch.library.triton_op``, applied only
where the Triton backend is the one that runs.

Trade-off: an inlined op's backend is fixed when the graph is traced. ``use_backends``
inside a compiled function is read at trace time (as a captured CUDA graph keeps its
backend); after changing :data:`compile_ops.config`, call ``torch._dynamo.reset()`` or
trace with :func:`inline_triton` ``(False)`` to keep the ops opaque and choose at run time.

Example (CUDA)::

    import lowering                       # installs the rules (idempotent)
    step = torch.compile(LayerStep(layer, meta), fullgraph=True)
    step(x)                               # sparse_mla / slots kernels are in Inductor's code
    with lowering.inductor.inline_triton(False):
        torch.compile(fn)(x)              # traced now: the ops stay extern calls
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from typing import Any, Callable, Iterator, Optional

import torch
from torch._library.custom_ops import CustomOpDef
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

from compile_ops import backends
from compile_ops.combine.ops import lse_combine
from compile_ops.indexer.ops import indexer_topk, write_index_keys
from compile_ops.kv.ops import write_kv
from compile_ops.mla.ops import sparse_mla, sparse_mla_out
from compile_ops.slots.ops import dcp_topk_to_slots, swa_indices, topk_to_slots

# op -> (backend family, argument whose device decides, kv_format argument or None)
INLINED_OPS: dict[CustomOpDef, tuple[str, str, Optional[str]]] = {
    write_index_keys: ("kv", "cache", None),
    indexer_topk: ("indexer", "q", None),
    sparse_mla_out: ("sparse_mla", "q", "kv_format"),
    sparse_mla: ("sparse_mla", "q", "kv_format"),
    topk_to_slots: ("slots", "topk", None),
    dcp_topk_to_slots: ("slots", "topk", None),
    swa_indices: ("slots", "positions", None),
    lse_combine: ("combine", "partial_out", None),
    write_kv: ("kv", "cache", None),
}

# inlined only for AOTInductor (the C++ wrapper, ``config.cpp_wrapper``): its proxy-executor
# calls of these two ops crash torch 2.11's package loader; torch.compile's Python wrapper
# calls them as extern kernels, the path its captured graphs were verified on
INDEXER_OPS = (write_index_keys, indexer_topk)

_state = threading.local()
_installed: list[str] = []


def inline_enabled() -> bool:
    """Whether traces started now inline the Triton paths (default ``True`` once installed)."""
    return getattr(_state, "enabled", True)


@contextlib.contextmanager
def inline_triton(enabled: bool) -> Iterator[None]:
    """Inline (``True``) or keep opaque (``False``) the Triton ops traced inside the block."""
    saved = inline_enabled()
    _state.enabled = bool(enabled)
    try:
        yield
    finally:
        _state.enabled = saved


def _export_keeps_triton_ops_opaque() -> bool:
    try:  # torch.export's switch for triton_op decomposition (present in torch >= 2.6)
        from torch.export._trace import custom_triton_ops_decomposition_disabled
    except ImportError:
        return False
    return custom_triton_ops_decomposition_disabled()


def inlines(op: CustomOpDef, *args: Any, **kwargs: Any) -> bool:
    """Whether a trace under ``FunctionalTensorMode`` inlines ``op(*args, **kwargs)`` now."""
    family, device_arg, format_arg = INLINED_OPS[op]
    if not inline_enabled() or _export_keeps_triton_ops_opaque():
        return False
    bound = inspect.signature(op._init_fn).bind(*args, **kwargs)
    bound.apply_defaults()
    device = bound.arguments[device_arg].device
    if device.type != "cuda":
        return False
    kv_format = bound.arguments[format_arg] if format_arg else None
    try:
        if backends.backend_for(family, device, kv_format) != "triton":
            return False
    except ValueError:  # no usable backend: the op itself raises the reason when it runs
        return False
    if op in INDEXER_OPS:
        if not torch._inductor.config.cpp_wrapper:  # AOTInductor's C++ wrapper only (see the module doc)
            return False
        if op is indexer_topk:  # its scores scratch must be one chunk for every T the trace admits
            from compile_ops.indexer.triton import one_chunk

            a = bound.arguments
            return one_chunk(a["q"].shape[0], a["block_table"].shape[1] * a["index_cache"].shape[1])
    return True


def _rule(op: CustomOpDef) -> Callable:
    def rule(mode: FunctionalTensorMode, func, types, args, kwargs):
        known = (torch.Tensor, FunctionalTensor)
        if any(not issubclass(t, torch._subclasses.FakeTensor) and t not in known for t in types):
            return NotImplemented  # another tensor subclass: let it handle the op first
        if not inlines(op, *args, **kwargs):
            return mode.__torch_dispatch__(func, types, args, kwargs)
        with mode:  # the op's own body: validation, backend choice, wrap_triton launches
            return op._init_fn(*args, **kwargs)

    return rule


def install() -> list[str]:
    """Register the rules (idempotent); returns the qualified names of the inlinable ops."""
    if not _installed:
        for op in INLINED_OPS:
            op.register_torch_dispatch(FunctionalTensorMode, _rule(op))
            _installed.append(f"{op._namespace}::{op._name}")
    return list(_installed)
