"""Which implementation runs an op: explicit, overridable, never read from the environment.

Each op family (``"sparse_mla"``, ``"slots"``, ``"combine"``, ``"kv"``, ``"indexer"``,
``"linear"``) has backends registered in
priority order, every one the same way: a name, a mapping from each of the family's ops to
the function that runs it, a predicate that returns ``None`` when the backend can run on a device
and format, or a *reason* string when it cannot, and optionally a second one, ``limits``,
that does the same for one call's validated arguments (alignment, widths): the op asks it,
:func:`backend_for` (which has no arguments to show it) does not. ``"auto"`` takes the
first backend that can run; an explicit choice that cannot raises ``ValueError`` with the
reason. Backends verified on hardware come before the others.

Choose with the module-level :data:`config` or, scoped, with :func:`use_backends`::

    import compile_ops
    with compile_ops.use_backends(sparse_mla="reference"):
        out, lse = compile_ops.sparse_mla(...)
    compile_ops.backend_for("sparse_mla", torch.device("cuda"), "fp8")   # -> "gluon" on sm_90

The choice is read when an op runs (or when a CUDA graph is captured), not when a
function is compiled: a captured graph keeps the backend it was captured with.
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass, fields
from typing import Callable, Iterator, Mapping, Optional

import torch

Predicate = Callable[[torch.device, Optional[str]], Optional[str]]
Limits = Callable[[tuple], Optional[str]]  # the op's validated arguments -> reason or None


def _check_choice(family: str, choice: str) -> None:
    if choice != "auto" and choice not in _check_family(family):
        raise ValueError(f"compile_ops.config.{family} must be 'auto' or one of {backends(family)}, got {choice!r}")


@dataclass
class BackendConfig:
    """Backend per op family; each is ``"auto"`` or a registered backend name (another name
    is refused when set, with the names it could be)."""

    sparse_mla: str = "auto"
    slots: str = "auto"
    combine: str = "auto"
    kv: str = "auto"
    indexer: str = "auto"
    linear: str = "auto"

    def __setattr__(self, family: str, choice: str) -> None:
        _check_choice(family, choice)
        super().__setattr__(family, choice)


config = BackendConfig()
_FAMILIES = tuple(f.name for f in fields(BackendConfig))
Ops = Mapping[str, Callable]  # op name -> the function that runs it on this backend
_REGISTRY: dict[str, dict[str, tuple[Predicate, Optional[Limits], Ops]]] = {name: {} for name in _FAMILIES}


def register_backend(family: str, name: str, predicate: Predicate, ops: Ops,
                     limits: Optional[Limits] = None) -> None:
    """Register backend ``name`` of ``family``, running each op of ``ops`` with its function
    (earlier registrations win ``auto``)."""
    _REGISTRY[family][name] = (predicate, limits, dict(ops))


def imported(module: str, name: str) -> Callable:
    """``module.name``, imported on its first call: ``import compile_ops`` imports no
    backend module (and so neither triton nor a vendor library)."""

    def call(*args, **kwargs):
        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    call.__qualname__ = f"{module}.{name}"
    return call


def _check_family(family: str) -> dict[str, tuple[Predicate, Optional[Limits], Ops]]:
    if family not in _REGISTRY:
        raise ValueError(f"op family must be one of {list(_FAMILIES)}, got {family!r}")
    return _REGISTRY[family]


def backends(family: str) -> list[str]:
    """Registered backend names of ``family``, in ``auto`` priority order."""
    return list(_check_family(family))


def resolve(family: str, device: torch.device, kv_format: Optional[str] = None,
            args: Optional[tuple] = None) -> tuple[str, Ops]:
    """The backend name and ops that ``family`` uses on ``device`` (for the validated call
    ``args``, when given)."""
    registry = _check_family(family)
    choice = getattr(config, family)
    device = torch.device(device)

    def unavailable(predicate, limits):
        reason = predicate(device, kv_format)
        if reason is None and limits is not None and args is not None:
            reason = limits(args)
        return reason

    _check_choice(family, choice)  # (again: a backend may be unregistered after it was chosen)
    if choice != "auto":
        predicate, limits, ops = registry[choice]
        reason = unavailable(predicate, limits)
        if reason is not None:
            raise ValueError(f"backend {choice!r} cannot run {family} on {device}: {reason}")
        return choice, ops
    reasons = []
    for name, (predicate, limits, ops) in registry.items():
        reason = unavailable(predicate, limits)
        if reason is None:
            return name, ops
        reasons.append(f"{name}: {reason}")
    raise ValueError(f"no backend can run {family} on {device} ({'; '.join(reasons)})")


def implementation(family: str, op: str, device: torch.device, kv_format: Optional[str] = None,
                   args: Optional[tuple] = None) -> Callable:
    """The function that runs ``op`` of ``family`` now: the chosen backend's (see :func:`resolve`)."""
    return resolve(family, device, kv_format, args)[1][op]


def backend_for(family: str, device, kv_format: Optional[str] = None) -> str:
    """Name of the backend ``family`` would use on ``device`` (and ``kv_format``) now.

    Raises ``ValueError`` with the reason when none can: an explicit choice that cannot run,
    no backend that can, or a device this torch cannot use (``"cuda"`` on a CPU-only build).
    """
    device = torch.device(device)
    reason = device_unavailable(device)
    if reason is not None:  # before any predicate asks the device for its properties
        raise ValueError(f"no backend can run {family} on {device}: {reason}")
    return resolve(family, device, kv_format)[0]


@contextlib.contextmanager
def use_backends(**choices: str) -> Iterator[BackendConfig]:
    """Temporarily set backends, e.g. ``use_backends(sparse_mla="reference")``."""
    unknown = set(choices) - set(_FAMILIES)
    if unknown:
        raise ValueError(f"use_backends takes {list(_FAMILIES)}, got {sorted(unknown)}")
    saved = {name: getattr(config, name) for name in choices}
    try:
        for name, value in choices.items():
            setattr(config, name, value)
        yield config
    finally:
        for name, value in saved.items():
            setattr(config, name, value)


def device_unavailable(device: torch.device) -> Optional[str]:
    """``None`` when this torch can run work on ``device``, else why not (a CUDA device on a
    CPU-only build of torch, or with no GPU visible). An op's own tensors are on a device
    torch can use, so only :func:`backend_for`, asked about any device, checks this."""
    if device.type == "cuda" and not torch.cuda.is_available():
        if torch.version.cuda is None:
            return f"this torch ({torch.__version__}) was built without CUDA"
        return f"torch {torch.__version__} sees no CUDA device"
    return None


def any_device(device: torch.device, kv_format: Optional[str]) -> Optional[str]:
    """Predicate of backends that run everywhere (the plain-torch reference)."""
    return None


# Triton releases whose sm_90 builds of the Gluon kernels are tested spill-free
# (tests/test_gluon_build.py): from 3.6, the first with this Gluon API, up to but not
# including 3.9, whose register allocation spills the attention kernel in every format at one column
# split (docs/backends.md, "Supported Triton releases").
GLUON_TRITON = ((3, 6), (3, 9))


def gluon_triton_unsupported(version: str) -> Optional[str]:
    """``None`` when the Gluon kernel supports Triton ``version`` (e.g. ``"3.8.0"``), else why not."""
    try:
        release = tuple(int(part) for part in version.split("+")[0].split(".")[:2])
    except ValueError:
        return f"the Gluon kernel cannot tell which Triton release {version!r} is"
    if GLUON_TRITON[0] <= release < GLUON_TRITON[1]:
        return None
    (lo_major, lo_minor), (hi_major, hi_minor) = GLUON_TRITON
    return (
        f"the Gluon kernel supports Triton >= {lo_major}.{lo_minor}, < {hi_major}.{hi_minor} "
        f"(Triton 3.9's sm_90 build of it spills registers), got triton {version}"
    )


def hopper_with_gluon(device: torch.device) -> Optional[str]:
    """Predicate part of the Gluon backends: an sm_90 device and a Triton release whose Gluon
    API and sm_90 builds are tested (:data:`GLUON_TRITON`)."""
    if device.type != "cuda":
        return f"the Gluon kernels run on CUDA devices only, got {device.type}"
    capability = torch.cuda.get_device_capability(device)
    if capability != (9, 0):
        return f"the Gluon kernels need sm_90 (Hopper wgmma), got sm_{capability[0]}{capability[1]}"
    try:
        import triton
        import triton.experimental.gluon  # noqa: F401
    except ImportError as err:
        return f"the Gluon kernels need triton with triton.experimental.gluon ({err})"
    return gluon_triton_unsupported(triton.__version__)


def cuda_with_triton(device: torch.device, kv_format: Optional[str]) -> Optional[str]:
    """Predicate of the Triton backends: a CUDA device and an importable triton."""
    if device.type != "cuda":
        return f"Triton kernels run on CUDA devices only, got {device.type}"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed (pip install 'dsv41-compile-ops[test]')"
    return None
