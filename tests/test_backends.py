"""Backend selection: explicit, scoped, reported, with reasons."""

import pytest
import torch

import compile_ops
from compile_ops import backends
from compile_ops.formats import new_cache

FAMILIES = ["sparse_mla", "slots", "combine"]


@pytest.mark.parametrize("family", FAMILIES)
def test_auto_uses_the_reference_on_cpu(family):
    assert compile_ops.backend_for(family, torch.device("cpu"), "bf16") == "reference"


@pytest.mark.parametrize("family", FAMILIES)
def test_explicit_backend_that_cannot_run_raises_its_reason(family):
    with compile_ops.use_backends(**{family: "triton"}):
        with pytest.raises(ValueError, match="triton"):
            compile_ops.backend_for(family, "cpu")


def test_unknown_backend_and_family_are_rejected():
    with compile_ops.use_backends(sparse_mla="cudnn"):
        with pytest.raises(ValueError, match=r"'auto' or one of .*'reference'.*got 'cudnn'"):
            compile_ops.backend_for("sparse_mla", "cpu")
    with pytest.raises(ValueError, match="op family must be one of"):
        compile_ops.backend_for("attention", "cpu")
    with pytest.raises(ValueError, match="use_backends takes"):
        with compile_ops.use_backends(attention="reference"):
            pass


def test_use_backends_restores_the_config_even_on_error():
    with pytest.raises(RuntimeError):
        with compile_ops.use_backends(sparse_mla="reference", combine="reference"):
            assert compile_ops.config.sparse_mla == "reference"
            raise RuntimeError("boom")
    assert compile_ops.config.sparse_mla == "auto" and compile_ops.config.combine == "auto"


def test_the_op_runs_the_chosen_backend():
    calls = []
    backends.register_backend("sparse_mla", "spy", backends.any_device, lambda *a: calls.append(a))
    try:
        cache = new_cache("bf16", 1, 4)
        idx, lens = torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
        q = torch.randn(1, 2, 512).bfloat16()
        compile_ops.sparse_mla(q, cache, idx, lens, None, None, None, None, 0.1)
        assert calls == []
        with compile_ops.use_backends(sparse_mla="spy"):
            compile_ops.sparse_mla(q, cache, idx, lens, None, None, None, None, 0.1)
        assert len(calls) == 1
    finally:
        del backends._REGISTRY["sparse_mla"]["spy"]


def test_gluon_backend_priority_and_reason_off_gpu():
    """The warp-specialized kernel comes before FlashMLA and the tl kernel; off sm_90 an
    explicit choice of it says why it cannot run."""
    assert compile_ops.backends.backends("sparse_mla") == ["flashinfer", "gluon", "flashmla", "triton", "reference"]
    with compile_ops.use_backends(sparse_mla="gluon"):
        with pytest.raises(ValueError, match="Gluon kernel runs on CUDA devices only"):
            compile_ops.backend_for("sparse_mla", "cpu")
