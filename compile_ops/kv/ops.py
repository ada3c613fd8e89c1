"""``dsv41::write_kv``: schema, validation, fake, dispatch to the ``"kv"`` backends.

A backend takes the rows as given and quantizes and stores them: the reference by
:func:`compile_ops.formats.encode_rows` (the format's one quantizer), the Triton kernel
in registers with the same bytes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from compile_ops import backends
from compile_ops._checks import check_tensor
from compile_ops.formats import HEAD_DIM, KVFormat, check_cache, num_slots
from compile_ops.kv.reference import write_values_reference


def check_kv_write(cache, slots, kv, kv_format, kv_scale) -> KVFormat:
    """``write_kv``'s checks of its arguments; returns the cache's format."""
    fmt = check_cache("cache", cache, kv_format)
    check_tensor("slots", slots, (torch.int32, torch.int64), 1, cache.device)
    check_tensor("kv", kv, (torch.bfloat16, torch.float16, torch.float32), 2, cache.device)
    if kv.shape[0] != slots.shape[0] or kv.shape[1] != HEAD_DIM:
        raise ValueError(f"kv must be [len(slots), {HEAD_DIM}] = [{slots.shape[0]}, {HEAD_DIM}], got {list(kv.shape)}")
    if not float(kv_scale) > 0.0:
        raise ValueError(f"kv_scale must be a positive float, got {kv_scale}")
    return fmt


@torch.library.custom_op("dsv41::write_kv", mutates_args=("cache",))
def write_kv(cache: Tensor, slots: Tensor, kv: Tensor, kv_format: str, kv_scale: float = 1.0) -> None:
    fmt = check_kv_write(cache, slots, kv, kv_format, kv_scale)
    if num_slots(cache) == 0 or slots.shape[0] == 0:
        return
    backends.implementation("kv", "write_kv", cache.device)(cache, slots, kv, fmt, kv_scale)


@write_kv.register_fake
def _(cache, slots, kv, kv_format, kv_scale=1.0):
    check_kv_write(cache, slots, kv, kv_format, kv_scale)


write_kv.__doc__ = """Quantize ``kv [N, 512]`` and write row ``i`` to slot ``slots[i]`` of ``cache``, in place.

``slots`` is ``[N]`` int32/int64; rows whose slot is ``-1`` or out of range are skipped
(CUDA-graph padding tokens) with no host sync and their memory is never written. Two
valid rows with the same slot leave that slot's bytes undefined. The rows are encoded as
:func:`compile_ops.formats.encode_rows` does and stored by the ``"kv"`` backend: on CUDA a
Triton kernel that quantizes and stores each row in one program, elsewhere
``encode_rows`` and ``index_put_`` of byte deltas.

Example::

    >>> import torch
    >>> from compile_ops import read_kv, write_kv
    >>> from compile_ops.formats import new_cache
    >>> cache = new_cache("fp8_dsv41", num_pages=2, page_size=4)
    >>> kv = torch.ones(2, 512)
    >>> write_kv(cache, torch.tensor([5, -1]), kv, "fp8_dsv41")
    >>> read_kv(cache, torch.tensor([5]), "fp8_dsv41").unique().tolist()
    [1.0]
"""


backends.register_backend("kv", "triton", backends.cuda_with_triton,
                          {"write_kv": backends.imported("compile_ops.kv.triton", "write_rows_triton")})
backends.register_backend("kv", "reference", backends.any_device, {"write_kv": write_values_reference})
