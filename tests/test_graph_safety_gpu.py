"""On a GPU: every op runs without a host sync and replays correctly from a CUDA graph."""

import pytest
import torch

import compile_ops
from compile_ops.formats import KV_FORMATS, new_cache

from test_compile import decode_step, inputs

pytestmark = pytest.mark.gpu
BACKENDS = ["reference", "triton", "auto"]  # auto: Gluon sparse_mla on sm_90


def on_cuda(args):
    return tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)


@pytest.fixture
def no_host_sync():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    yield
    torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kv_format", sorted(KV_FORMATS))
def test_ops_make_no_host_sync(backend, kv_format, no_host_sync):
    with compile_ops.use_backends(sparse_mla=backend, slots=backend, combine=backend, kv=backend):
        cache = new_cache(kv_format, 4, 64, device="cuda")
        slots = torch.arange(-1, 255, device="cuda", dtype=torch.int32)
        compile_ops.write_kv(cache, slots, torch.randn(256, 512, device="cuda"), kv_format)
        q = torch.randn(8, 16, 512, device="cuda").bfloat16()
        pos = torch.arange(8, device="cuda", dtype=torch.int32) * 30 - 1
        req = torch.zeros(8, device="cuda", dtype=torch.int32)
        table = torch.arange(4, device="cuda", dtype=torch.int32).view(1, 4)
        idx, lens = compile_ops.swa_indices(pos, req, table, 64, 128)
        topk = torch.randint(-1, 300, (8, 64), device="cuda", dtype=torch.int32)
        valid = torch.ones(8, device="cuda", dtype=torch.bool)
        cidx, clens = compile_ops.topk_to_slots(topk, req, table, 64, valid)
        compile_ops.dcp_topk_to_slots(topk, req, table, 64, valid, 1, 2, 4)
        out, lse = compile_ops.sparse_mla(q, cache, idx, lens, cache, cidx, clens, torch.zeros(16, device="cuda"), 0.05, kv_format)
        compile_ops.lse_combine(torch.stack([out, out]), torch.stack([lse, lse]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_chain_replays_from_a_cuda_graph_with_new_inputs(backend):
    # the inputs are made on the CPU (write_kv there): "triton" can only be sparse_mla's
    chosen = {"sparse_mla": backend} if backend == "triton" else dict(sparse_mla=backend, slots=backend, combine=backend, kv=backend)
    with compile_ops.use_backends(**chosen):
        static = on_cuda(inputs(0))
        decode_step(*static)  # warm up: Triton compiles, workspaces are allocated
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = decode_step(*static)
        for seed in (1, 2, 3):
            for dst, src in zip(static, on_cuda(inputs(seed))):
                if isinstance(dst, torch.Tensor):
                    dst.copy_(src)
            torch.cuda.synchronize()
            memory = torch.cuda.memory_allocated()
            graph.replay()
            torch.cuda.synchronize()
            assert torch.cuda.memory_allocated() == memory
            want = decode_step(*static)
            for got, ref in zip(captured[:2] + captured[2], want[:2] + want[2]):
                torch.testing.assert_close(got, ref, rtol=0, atol=0)
