"""What a user of the installed distribution relies on besides the ops themselves."""

import inspect
import re
from pathlib import Path

import pytest
import torch

import compile_ops

ROOT = Path(__file__).resolve().parent.parent
OPS = ["sparse_mla", "sparse_mla_out", "topk_to_slots", "dcp_topk_to_slots", "swa_indices",
       "lse_combine", "dcp_combine", "write_kv"]


def test_version_is_the_distributions():
    assert re.fullmatch(r"\d+\.\d+\.\d+", compile_ops.__version__)
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'version = { attr = "compile_ops.__version__" }' in pyproject


@pytest.mark.parametrize("name", OPS)
def test_public_ops_show_their_signature(name):
    """``inspect.signature`` / ``help()`` see the op's parameters, in the schema's order."""
    params = list(inspect.signature(getattr(compile_ops, name)).parameters)
    schema = getattr(torch.ops.dsv41, name).default._schema
    assert params == [a.name for a in schema.arguments]


def test_typed_and_licensed():
    for package in ("compile_ops", "graphs", "lowering"):
        assert (ROOT / package / "py.typed").exists()
    assert "Apache License" in (ROOT / "LICENSE").read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    # the SPDX string of PEP 639; a license classifier beside it is an error for setuptools
    assert 'license = "Apache-2.0"' in pyproject and "License ::" not in pyproject


def test_nothing_cites_a_document_outside_the_repo():
    """Docs and code point into the repo (docs/design.md), never at an external design doc."""
    hits = []
    paths = [ROOT / "README.md", ROOT / "pyproject.toml"]
    paths += [p for top in ("compile_ops", "graphs", "lowering", "tests", "docs") for p in (ROOT / top).rglob("*")]
    for path in paths:
        if path.suffix in (".py", ".md", ".toml"):
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if re.search(r"DESIGN(\.md| \d)", line) and path.name != "test_package.py":
                    hits.append(f"{path.relative_to(ROOT)}:{i}")
    assert hits == []


def test_every_public_name_is_in_the_docs():
    """A name a package exports (``__all__``) is named in the README or ``docs/``: an export
    added without its reference fails here."""
    import graphs
    import lowering

    docs = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    missing = [f"{package.__name__}.{name}" for package in (compile_ops, graphs, lowering)
               for name in package.__all__ if name != "__version__" and not re.search(rf"\b{re.escape(name)}\b", docs)]
    assert missing == []


def test_public_docstring_examples_run():
    """Every ``>>>`` example in a public name's docstring runs and prints what it shows."""
    import doctest

    import compile_ops
    import graphs
    import graphs.checkpoint
    import graphs.fp8
    import graphs.pages
    import graphs.plan

    ran = 0
    public = [getattr(compile_ops, n) for n in compile_ops.__all__] + [getattr(graphs, n) for n in graphs.__all__]
    for obj in public + [graphs.pages, graphs.checkpoint, graphs.fp8, graphs.plan]:
        name = getattr(obj, "__name__", repr(obj))
        doc = getattr(obj, "__doc__", None) or ""
        if ">>>" not in doc:
            continue
        test = doctest.DocTestParser().get_doctest(doc, {}, name, None, 0)
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
        runner.run(test)
        assert runner.failures == 0, f"{name}'s docstring example fails"
        ran += 1
    assert ran >= 12
