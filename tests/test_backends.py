"""Backend selection: explicit, scoped, reported, with reasons."""

import pytest
import torch

import compile_ops
from compile_ops import backends
from compile_ops.formats import new_cache
from compile_ops.mla.inputs import SparseMLAArgs
from compile_ops.backends import gluon_triton_unsupported

FAMILIES = ["sparse_mla", "slots", "combine", "kv"]


@pytest.mark.parametrize("family", FAMILIES)
def test_auto_uses_the_reference_on_cpu(family):
    assert compile_ops.backend_for(family, torch.device("cpu"), "bf16") == "reference"


@pytest.mark.parametrize("family", FAMILIES)
def test_explicit_backend_that_cannot_run_raises_its_reason(family):
    with compile_ops.use_backends(**{family: "triton"}):
        with pytest.raises(ValueError, match="triton"):
            compile_ops.backend_for(family, "cpu")


def test_unknown_backend_and_family_are_rejected():
    """An unknown backend name is refused when set, not at the first op call."""
    with pytest.raises(ValueError, match=r"'auto' or one of .*'reference'.*got 'cudnn'"):
        with compile_ops.use_backends(sparse_mla="cudnn"):
            pass
    with pytest.raises(ValueError, match=r"config.indexer must be 'auto' or one of"):
        compile_ops.config.indexer = "cudnn"
    assert compile_ops.config.sparse_mla == "auto" and compile_ops.config.indexer == "auto"
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
    backends.register_backend("sparse_mla", "spy", backends.any_device, {"sparse_mla": lambda *a: calls.append(a)})
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
    """Backends verified on hardware first (the warp-specialized kernel before FlashMLA and
    the tl kernel), FlashInfer (never run on its GPUs) after them; off sm_90 an explicit
    choice of the Gluon kernel says why it cannot run."""
    assert compile_ops.backends.backends("sparse_mla") == ["gluon", "flashmla", "triton", "flashinfer", "reference"]
    assert compile_ops.backends.backends("indexer") == ["gluon", "triton", "reference"]
    with compile_ops.use_backends(sparse_mla="gluon", indexer="gluon"):
        with pytest.raises(ValueError, match="Gluon kernels run on CUDA devices only"):
            compile_ops.backend_for("sparse_mla", "cpu")
        with pytest.raises(ValueError, match="reads fp4 and fp8 index keys only, got bf16"):
            compile_ops.backend_for("indexer", "cpu", "bf16")
        with pytest.raises(ValueError, match="Gluon kernels run on CUDA devices only"):
            compile_ops.backend_for("indexer", "cpu", "fp4")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.skipif(torch.cuda.is_available(), reason="asks a torch that cannot use CUDA")
def test_a_cuda_device_without_cuda_is_a_clear_error(family):
    """A CPU-only torch (or no visible GPU) is named, never a raw assertion from deep inside
    a backend's predicate."""
    with pytest.raises(ValueError, match=rf"no backend can run {family} on cuda: .*torch"):
        compile_ops.backend_for(family, "cuda", "fp8_dsv41")


@pytest.mark.parametrize("version, supported", [
    ("3.5.1", False), ("3.6.0", True), ("3.7.0", True), ("3.7.1", True), ("3.8.0", True),
    ("3.8.1+gitabc", True), ("3.9.0", False), ("3.10.0", False),
])
def test_gluon_triton_range(version, supported):
    reason = gluon_triton_unsupported(version)
    assert (reason is None) == supported
    if not supported:
        assert version in reason


@pytest.fixture
def hopper_without_cuda(monkeypatch):
    """This process as if it saw one sm_90 GPU (predicates only: nothing is launched)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))


def test_gluon_on_an_unsupported_triton_falls_back_to_tl(hopper_without_cuda, monkeypatch):
    """On Triton 3.9 ``auto`` takes the ``tl`` kernel and ``backend_for`` says so; an
    explicit ``gluon`` raises the reason, naming the Triton release."""
    pytest.importorskip("triton")
    import triton

    monkeypatch.setattr(triton, "__version__", "3.8.0")
    assert compile_ops.backend_for("sparse_mla", "cuda", "bf16") == "gluon"
    monkeypatch.setattr(triton, "__version__", "3.9.0")
    assert compile_ops.backend_for("sparse_mla", "cuda", "bf16") == "triton"
    with compile_ops.use_backends(sparse_mla="gluon"):
        with pytest.raises(ValueError, match=r"Triton >= 3\.6, < 3\.9 .*got triton 3\.9\.0"):
            compile_ops.backend_for("sparse_mla", "cuda", "bf16")


def test_a_call_the_gluon_kernel_cannot_read_goes_to_tl_or_raises(hopper_without_cuda, monkeypatch):
    """The ``gluon`` backend's limits see the call: a cache whose pages are off 16 bytes
    makes ``auto`` take the ``tl`` kernel and an explicit ``gluon`` raise why, never a
    silent switch behind a backend name that says otherwise."""
    pytest.importorskip("triton")
    import triton

    from compile_ops.mla.ops import _gluon_unavailable

    monkeypatch.setattr(triton, "__version__", "3.8.0")
    aligned = new_cache("fp8_dsv41", 2, 4)
    odd = new_cache("fp8_dsv41", 2, 4, page_gap=3)  # page stride 4 * 528 + 3 bytes
    q = torch.zeros(1, 2, 512, dtype=torch.bfloat16)
    idx, lens = torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, dtype=torch.int32)

    def chosen(cache):
        args = SparseMLAArgs(q, cache, idx, lens, None, None, None, None, 0.1, "fp8_dsv41", 1.0)
        return backends.resolve("sparse_mla", torch.device("cuda"), "fp8_dsv41", args)[0]

    assert _gluon_unavailable(torch.device("cuda"), "fp8_dsv41") is None
    assert chosen(aligned) == "gluon" and chosen(odd) == "triton"
    with compile_ops.use_backends(sparse_mla="gluon"):
        with pytest.raises(ValueError, match="swa_cache's pages 16-byte aligned"):
            chosen(odd)


@pytest.mark.parametrize("index_format", ["fp4", "fp8"])
def test_indexer_gluon_limits_send_to_triton(index_format):
    """The Gluon scores kernel's limits (``auto`` then takes ``triton``): more than 64 heads,
    and pages whose stride or offset is not a multiple of its 16-byte copies."""
    pytest.importorskip("triton.experimental.gluon")
    from compile_ops.indexer import ops
    from compile_ops.indexer.cache import new_index_cache
    from compile_ops.indexer.gluon import gluon_args_unsupported

    def limits(heads, cache):
        q, w = torch.zeros(2, heads, 128, dtype=torch.bfloat16), torch.zeros(2, heads)
        args = (q, w, cache, torch.zeros(1, 2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32),
                torch.ones(2, dtype=torch.int32))
        return gluon_args_unsupported(ops._args(*args, 4, ops._check_topk(*args, 4, index_format)))

    assert limits(64, new_index_cache(index_format, 3, 32)) is None
    assert "at most 64 heads, got 128" in limits(128, new_index_cache(index_format, 3, 32))
    assert "16-byte aligned, got a page stride" in limits(32, new_index_cache(index_format, 3, 6))
    row = new_index_cache(index_format, 1, 1).shape[2]  # 68 or 132 bytes: a page from its second row on
    assert f"at offset {row}" in limits(32, new_index_cache(index_format, 3, 8)[:, 1:3])
