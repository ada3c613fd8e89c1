"""How the Triton launchers launch, shared by every op family's ``triton.py``."""

from __future__ import annotations

import os

import torch
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.library import wrap_triton

# Triton's interpreter (TRITON_INTERPRET=1, the CPU tests) runs loops only to compile-time
# bounds and returns garbage from tl.dot on bf16 operands: the launchers adapt to it
# (constexpr trip counts, fp32 operands) there, and only there. Decided once, at import,
# like Triton itself.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def launchable(kernel, like: torch.Tensor):
    """What to launch: ``kernel`` on real tensors; ``wrap_triton(kernel)`` when ``like`` is a
    ``FunctionalTensor``, i.e. while ``lowering.inductor`` traces a launcher for Inductor or
    ``torch.export``, so that the launch becomes a node of the traced graph."""
    return wrap_triton(kernel) if isinstance(like, FunctionalTensor) else kernel
