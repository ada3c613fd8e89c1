"""c10d process groups by name, as the DCP ops take them (a name traces and captures)."""

from __future__ import annotations


def group_size(group_name: str) -> int:
    """Size of the c10d process group registered as ``group_name`` (``ValueError`` if none)."""
    if not isinstance(group_name, str):
        raise TypeError(f"group_name must be a str (a c10d group name), got {type(group_name).__name__}")
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"group_name {group_name!r}: torch.distributed is not initialized")
    try:
        return _resolve_process_group(group_name).size()
    except (RuntimeError, ValueError, KeyError) as err:
        raise ValueError(f"group_name {group_name!r} names no c10d process group ({err})") from None


def group_rank(group_name: str) -> int:
    """This process's rank in the c10d group registered as ``group_name``."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name).rank()
