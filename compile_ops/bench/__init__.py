"""Benchmarks, timed by CUDA-graph replay on the GPU: ``python -m compile_ops.bench NAME``.

The floors they (and ``python -m graphs``) print use the H200's measured rates
(docs/performance.md)."""

COPY_BYTES_PER_S = 4.3e12  # copy bandwidth
BF16_FLOPS_PER_S = 790e12  # dense bf16 matrix rate
