"""The docs' Python examples that need no GPU run as written (``docs/graphs.md``: serving a
layer on the CPU, checking a run against the oracle)."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick  # the quick subset: python -m pytest -m quick

DOCS = Path(__file__).resolve().parent.parent / "docs"


def python_blocks(doc: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (DOCS / doc).read_text(), flags=re.S)


def test_graphs_cpu_examples_run():
    blocks = [b for b in python_blocks("graphs.md") if 'device="cuda"' not in b and "path/to" not in b
              and "attention_part_of_checkpoint" not in b and "checkpoint_attention_part" not in b]
    serving = next(b for b in blocks if "StepRunner(layer, buckets=(1, 4, 16)" in b and "oracle" not in b)
    oracle = next(b for b in blocks if "oracle_verdict" in b)
    scope: dict = {}
    exec(compile(serving, "docs/graphs.md (serving on a CPU)", "exec"), scope)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(oracle, "docs/graphs.md (the oracle)", "exec"), scope)
    assert printed.getvalue().startswith("PASS: 37 tokens against the full-history oracle")


def test_graphs_stack_examples_run():
    """``docs/graphs.md``'s stack: serving one step, then the oracle check of a workload."""
    blocks = python_blocks("graphs.md")
    serving = next(b for b in blocks if "DSV41Stack(TINY_V41" in b and "stack_verdict" not in b)
    oracle = next(b for b in blocks if "stack_verdict" in b)
    scope: dict = {}
    exec(compile(serving, "docs/graphs.md (a stack)", "exec"), scope)
    assert tuple(scope["h"].shape) == (7, 64)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(oracle, "docs/graphs.md (the stack's oracle)", "exec"), scope)
    assert printed.getvalue().startswith("PASS: 108 tokens through 3 index layers")
