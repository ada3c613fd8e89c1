"""How the Triton launchers launch, shared by every op family's ``triton.py``."""

from __future__ import annotations

import torch
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.library import wrap_triton


def launchable(kernel, like: torch.Tensor):
    """What to launch: ``kernel`` on real tensors; ``wrap_triton(kernel)`` when ``like`` is a
    ``FunctionalTensor``, i.e. while ``lowering.inductor`` traces a launcher for Inductor or
    ``torch.export``, so that the launch becomes a node of the traced graph."""
    return wrap_triton(kernel) if isinstance(like, FunctionalTensor) else kernel
