"""Test setup shared by every test file.

On a machine without CUDA the Triton kernels run in Triton's interpreter: the switch is
made once, here, before anything imports triton (Triton reads TRITON_INTERPRET at import).
Tests marked ``gpu`` are skipped without CUDA; they run on the device machine. Under
pytest-xdist (the README's command) each worker process sets torch's threads to its share
of the cores, so the workers do not oversubscribe them. GPU-only
test files end in ``_gpu.py``; ``scripts/`` holds programs the tests start (not tests).

Hypothesis profiles: ``ci`` (the default, 100 examples per property) and ``deep`` (10 000),
chosen with ``pytest --hypothesis-profile deep``; each property takes a share of them
(``helpers.examples``).
"""

import os

import pytest
import torch
from hypothesis import settings

settings.register_profile("ci", max_examples=100, deadline=None)
settings.register_profile("deep", max_examples=10_000, deadline=None)
settings.load_profile("ci")
collect_ignore = ["scripts"]

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if "PYTEST_XDIST_WORKER_COUNT" in os.environ:  # a pytest-xdist worker: its share of the cores
    from helpers import cores_each  # (imports triton: after the interpreter switch above)

    torch.set_num_threads(cores_each(int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run `pytest -m gpu` on the device machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
