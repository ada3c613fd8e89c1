"""Input validation shared by every op's real and fake kernel.

Each helper raises ``TypeError`` (wrong dtype or type) or ``ValueError`` (wrong shape,
device or value) with a message that names the argument, what was expected and what was
given. Checks read shapes, dtypes and devices only, never data, so they are free of host
syncs and run unchanged on fake tensors.
"""

from __future__ import annotations

import math

from typing import Optional, Sequence

import torch


def check_tensor(
    name: str,
    t: object,
    dtype: torch.dtype | Sequence[torch.dtype],
    ndim: int,
    device: Optional[torch.device] = None,
) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    dtypes = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
    if t.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} must have dtype {want}, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device} (like q), got {t.device}")
    return t


def check_dim(name: str, t: torch.Tensor, dim: int, size, what: str) -> None:
    if t.shape[dim] != size:
        raise ValueError(
            f"{name}.shape[{dim}] must equal {what} ({size}), got shape {tuple(t.shape)}"
        )


def check_int(name: str, value: object, minimum: int) -> int:
    """An int (or a SymInt, as ints reach fake kernels under dynamic shapes) >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_device(name: str, device) -> Optional[torch.device]:
    """``device`` (a string or a ``torch.device``; ``None`` stays ``None``, torch's default) as
    a ``torch.device``, or a ``ValueError`` naming it when this torch cannot place tensors
    there (a CUDA device on a CPU-only torch, an index past the GPUs it sees)."""
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"{name} must be a torch device (e.g. 'cpu', 'cuda', 'cuda:1'), got {device!r}") from e
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{name}={device!r}, but this torch ({torch.__version__}) sees no CUDA GPU: "
                             "install a CUDA build of torch on a machine with a GPU, or use device='cpu'")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"{name}={device!r}, but only {torch.cuda.device_count()} CUDA device(s) are visible")
    return dev


def check_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    return float(value)


def check_positive(name: str, value: object) -> float:
    """A finite float ``> 0`` (a scale: a negative or NaN one gives a silently wrong answer)."""
    v = check_float(name, value)
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"{name} must be a positive finite float, got {value!r}")
    return v
