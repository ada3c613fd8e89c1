"""The DCP attention step (:func:`compile_ops.dcp.dcp_sparse_mla`) against DCP=1 ``sparse_mla``:
2 gloo processes on CPU, 2 NCCL processes on GPUs (eager, compiled, CUDA-graph replay).

The worker lives in ``tests/scripts/dcp_step_runner.py``; its log lines give the max errors.
Tolerances (max over all elements): ``out`` within ``1e-2 + 2e-2 * |ref|`` (bf16 partials
are rounded once more by the scale and the bf16 reduce-scatter), ``lse`` within
``1e-3 + 1e-4 * |ref|`` (fp32), and ``-inf`` exactly where the DCP=1 lse is ``-inf``.
"""

import pytest
import torch

import compile_ops
from compile_ops.dcp import dcp_sparse_mla

from scripts.dcp_step_runner import Case, Shape, check_close, gpu_plan, launch

SHAPES = {"T5": Shape(), "T1": Shape(T=1, K=3, n_cmp=10)}


@pytest.mark.distributed
def test_dcp_step_gloo_two_ranks():
    plan = [
        (shape, interleave, mode, ["eager"])
        for shape in SHAPES.values()
        for interleave in (1, 4)
        for mode in ("ag_rs", "a2a")
    ]
    launch(2, "gloo", plan)


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_dcp_step_world_one_is_sparse_mla(shape):
    case = Case(shape, rank=0, world=1, interleave=1, group_name="unused", device=torch.device("cpu"))
    x = case.inputs(3)
    out, lse = case.step(dcp_sparse_mla, case.local_q(x), x, "ag_rs")
    check_close("world 1", out, lse, *case.reference(x), log=lambda msg: None)


def test_dcp_step_rejects_bad_arguments():
    case = Case(Shape(), rank=0, world=1, interleave=1, group_name="unused", device=torch.device("cpu"))
    x = case.inputs(0)
    with pytest.raises(ValueError, match="rank must be in"):
        dcp_sparse_mla(case.local_q(x), case.swa_cache, x["swa_idx"], x["swa_lens"], case.shard, x["topk"],
                       x["token_to_req"], case.shard_table, 4, x["is_valid"], case.sink, 0.1,
                       group_name="unused", rank=1, world=1)
    with pytest.raises(ValueError, match="sink"):
        dcp_sparse_mla(case.local_q(x), case.swa_cache, x["swa_idx"], x["swa_lens"], case.shard, x["topk"],
                       x["token_to_req"], case.shard_table, 4, x["is_valid"], case.sink[:1], 0.1,
                       group_name="unused", rank=0, world=1)


@pytest.mark.gpu
@pytest.mark.distributed
def test_dcp_step_nccl_two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    launch(2, "nccl", gpu_plan())


WIDE_WORLDS = [4, 8]


@pytest.mark.distributed
@pytest.mark.parametrize("world", WIDE_WORLDS, ids=[f"world{w}" for w in WIDE_WORLDS])
def test_dcp_step_gloo_wide_worlds(world):
    """Issue 8 on CPU: 128 gathered heads over 4 and 8 gloo ranks, interleave 1 and 4, both
    modes, eager (and torch.compile'd at world 4: eight concurrent compiles do not fit
    the CI machine's two cores)."""
    shape = Shape(T=6, H=128 // world, K=16, n_cmp=64)
    plan = [
        (shape, interleave, mode, ["eager", "compile"] if world == 4 and (interleave, mode) in ((1, "ag_rs"), (4, "a2a")) else ["eager"])
        for interleave in (1, 4)
        for mode in ("ag_rs", "a2a")
    ]
    launch(world, "gloo", plan)
