"""Benchmarks, timed by CUDA-graph replay on the GPU: ``python -m compile_ops.bench NAME``.

The floors they (and ``python -m graphs``) print use the H200's measured rates
(docs/performance.md)."""

COPY_BYTES_PER_S = 4.3e12  # copy bandwidth
BF16_FLOPS_PER_S = 790e12  # dense bf16 matrix rate


def progress(iterable=None, **kwargs):
    """A tqdm progress bar over ``iterable`` (tqdm is part of the ``bench`` extra)."""
    try:
        from tqdm import tqdm
    except ImportError as e:
        raise ImportError("the benchmarks draw progress bars with tqdm, part of the bench extra: "
                          "pip install 'dsv41-compile-ops[bench]'") from e
    return tqdm(iterable, **kwargs)
