"""Combine ops: ``lse_combine`` (local) and ``dcp_combine`` (across a DCP process group).

Shape legend: ``N`` partials (ranks), ``T`` tokens, ``H`` heads, ``D`` head dim. LSEs are
fp32 and base 2.
"""

from __future__ import annotations

import torch
from torch import Tensor

from compile_ops import backends
from compile_ops._checks import check_tensor
from compile_ops._groups import group_size
from compile_ops.combine.reference import dcp_combine_reference, lse_combine_reference

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
DCP_MODES = ("ag_rs", "a2a")


def _check_lse_combine(partial_out: Tensor, partial_lse: Tensor) -> None:
    check_tensor("partial_out", partial_out, FLOAT_DTYPES, 4)
    check_tensor("partial_lse", partial_lse, torch.float32, 3, partial_out.device)
    if tuple(partial_lse.shape) != tuple(partial_out.shape[:3]):
        raise ValueError(
            f"partial_lse must be [N, T, H] = {list(partial_out.shape[:3])} (partial_out.shape[:3]), "
            f"got {list(partial_lse.shape)}"
        )


@torch.library.custom_op("dsv41::lse_combine", mutates_args=())
def lse_combine(partial_out: Tensor, partial_lse: Tensor) -> tuple[Tensor, Tensor]:
    _check_lse_combine(partial_out, partial_lse)
    return backends.implementation("combine", "lse_combine", partial_out.device)(partial_out, partial_lse)


@lse_combine.register_fake
def _(partial_out, partial_lse):
    _check_lse_combine(partial_out, partial_lse)
    _, T, H, D = partial_out.shape
    return partial_out.new_empty((T, H, D)), partial_lse.new_empty((T, H))


def _check_dcp_combine(out: Tensor, lse: Tensor, group_name: str, mode: str) -> int:
    check_tensor("out", out, FLOAT_DTYPES, 3)
    check_tensor("lse", lse, torch.float32, 2, out.device)
    if tuple(lse.shape) != tuple(out.shape[:2]):
        raise ValueError(f"lse must be [T, H_all] = {list(out.shape[:2])} (out.shape[:2]), got {list(lse.shape)}")
    if mode not in DCP_MODES:
        raise ValueError(f"mode must be one of {list(DCP_MODES)}, got {mode!r}")
    world = group_size(group_name)
    if out.shape[1] % world:
        raise ValueError(f"out.shape[1] (H_all = {out.shape[1]}) must be divisible by the group size {world}")
    return world


@torch.library.custom_op("dsv41::dcp_combine", mutates_args=())
def dcp_combine(out: Tensor, lse: Tensor, group_name: str, mode: str = "ag_rs") -> tuple[Tensor, Tensor]:
    world = _check_dcp_combine(out, lse, group_name, mode)
    return backends.implementation("combine", "dcp_combine", out.device)(out, lse, group_name, world, mode)


@dcp_combine.register_fake
def _(out, lse, group_name, mode="ag_rs"):
    world = _check_dcp_combine(out, lse, group_name, mode)
    T, H_all, D = out.shape
    return out.new_empty((T, H_all // world, D)), lse.new_empty((T, H_all // world))


backends.register_backend("combine", "triton", backends.cuda_with_triton, {
    "lse_combine": backends.imported("compile_ops.combine.triton", "lse_combine_triton"),
    "dcp_combine": backends.imported("compile_ops.combine.triton", "dcp_combine_triton"),
})
backends.register_backend("combine", "reference", backends.any_device,
                          {"lse_combine": lse_combine_reference, "dcp_combine": dcp_combine_reference})

lse_combine.__doc__ = """Merge ``N`` partial attention results by their base-2 LSEs.

``L = log2(sum_r 2**L_r)`` and ``out = sum_r 2**(L_r - L) * o_r``. Partials with LSE
``-inf`` weigh 0; when all are ``-inf`` the result is ``out = 0``, ``lse = -inf``. NaN or
``+inf`` LSEs are a caller bug and are treated as ``-inf``.

Args:
    partial_out: ``[N, T, H, D]`` bf16, fp16 or fp32.
    partial_lse: ``[N, T, H]`` fp32, base 2.

Returns:
    ``(out [T, H, D] in partial_out's dtype, lse [T, H] fp32)``.

Example::

    >>> import torch, compile_ops
    >>> o = torch.stack([torch.ones(1, 1, 4), 3 * torch.ones(1, 1, 4)])
    >>> out, lse = compile_ops.lse_combine(o, torch.zeros(2, 1, 1))
    >>> out[0, 0].tolist(), lse.tolist()
    ([2.0, 2.0, 2.0, 2.0], [[1.0]])
"""

dcp_combine.__doc__ = """Combine DCP partial attention across a process group and hand back this rank's heads.

Every rank holds attention of all ``H_all`` gathered heads over its own KV shard. The
result is the exact attention of this rank's heads
``[rank * H_all / N, (rank + 1) * H_all / N)`` over all shards. Every rank of the group
must call it with the same shapes and mode (it is a collective).

Args:
    out: ``[T, H_all, D]`` bf16/fp16/fp32 partial outputs of this rank.
    lse: ``[T, H_all]`` fp32 base-2 LSEs of this rank (``-inf`` = empty shard).
    group_name: the c10d group's name (``group.group_name``), so the op traces and captures.
    mode: ``"ag_rs"``: all-gather the LSEs, rescale locally, reduce-scatter the outputs;
        ``"a2a"``: one all-to-all of every head slice's (out, lse), then :func:`lse_combine`.

Returns:
    ``(out [T, H_all / N, D] in out's dtype, lse [T, H_all / N] fp32)``.

Example (inside an initialised process group of size ``N``)::

    out_local, lse_local = compile_ops.dcp_combine(out, lse, dist.group.WORLD.group_name)
"""
