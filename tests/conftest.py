"""Test setup shared by every test file.

On a machine without CUDA the Triton kernels run in Triton's interpreter: the switch is
made once, here, before anything imports triton (Triton reads TRITON_INTERPRET at import).
Tests marked ``gpu`` are skipped without CUDA; they run on the device machine.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run `pytest -m gpu` on the device machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
