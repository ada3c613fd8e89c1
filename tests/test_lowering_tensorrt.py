"""Torch-TensorRT registration of the ``dsv41`` ops (``lowering.tensorrt``).

The schema split runs everywhere; the registration and a compile of a small slot-conversion
module run only where ``torch_tensorrt`` imports (it needs a CUDA build of torch of its
own minor version and the TensorRT wheels; see docs/lowering.md). TensorRT is never mocked.
"""

from __future__ import annotations

import pytest
import torch

from lowering import tensorrt as trt_lowering


def test_schema_split():
    assert trt_lowering.plugin_ops() == ["topk_to_slots", "dcp_topk_to_slots", "swa_indices", "lse_combine"]
    assert trt_lowering.torch_executed_ops() == {
        f"torch.ops.dsv41.{name}.default" for name in ("sparse_mla", "sparse_mla_out", "dcp_combine", "write_kv")
    }
    assert "mutates" in trt_lowering.plugin_unsupported("write_kv")


def _torch_tensorrt():
    try:
        import torch_tensorrt
    except Exception as err:  # ImportError, or a CUDA / TensorRT library that fails to load
        pytest.skip(f"torch_tensorrt does not import here ({type(err).__name__}: {err})")
    if not torch.cuda.is_available():
        pytest.skip("torch_tensorrt needs a CUDA GPU")
    return torch_tensorrt


class _Window(torch.nn.Module):
    def forward(self, positions, token_to_req, block_table):
        idx, lens = torch.ops.dsv41.swa_indices(positions, token_to_req, block_table, 4, 8)
        return idx * 2, lens


def test_compile_with_plugins():
    _torch_tensorrt()
    assert set(trt_lowering.register()) >= {"dsv41::swa_indices", "dsv41::topk_to_slots"}
    i32 = dict(dtype=torch.int32, device="cuda")
    args = [torch.tensor([5, 0, -1], **i32), torch.tensor([0, 1, 0], **i32), torch.arange(8, **i32).view(2, 4)]
    compiled = trt_lowering.compile(_Window().cuda(), args)
    for got, want in zip(compiled(*args), _Window()(*args)):
        torch.testing.assert_close(got, want)
