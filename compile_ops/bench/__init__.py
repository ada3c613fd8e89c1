"""Benchmarks, timed by CUDA-graph replay on the GPU: ``python -m compile_ops.bench NAME``."""
