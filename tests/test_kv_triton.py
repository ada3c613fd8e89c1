"""The Triton row store (``compile_ops.kv.triton``: quantize and store each row in one
program) against the plain-torch one (``encode_rows`` / ``encode_index_rows``, then
``index_put_``).

On CPU the kernel runs under ``TRITON_INTERPRET=1`` (set by conftest.py); on a GPU compiled.
Stores are bytes: every case must match the reference exactly.
"""

import inspect

import pytest
import torch

from compile_ops.formats import KV_FORMATS, new_cache
from compile_ops.indexer.cache import INDEX_FORMATS, new_index_cache
from compile_ops.kv.reference import write_values_reference
from compile_ops.kv.triton import write_rows_triton

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def rows_to_write(n: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows of very different magnitudes: tiny (under the scale floor), zero, ordinary,
    huge (saturating e4m3 under a unit ``kv_scale``), with exact power-of-two block maxima."""
    gen = torch.Generator().manual_seed(width + n)
    x = torch.randn(n, width, generator=gen) * torch.tensor([1e-7, 0.0, 1.0, 3e3, 0.02, 7.0, 1.0])[:n].unsqueeze(1)
    x[6, :32] = 0.5  # a block whose amax / 448 is a power of two
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_format", sorted(KV_FORMATS))
@pytest.mark.parametrize("page_size,page_gap", [(1, 0), (8, 24), (64, None)])
def test_write_rows(kv_format, page_size, page_gap, dtype):
    """``write_kv``'s Triton row store leaves the same bytes as the reference: each row
    quantized as ``encode_rows`` does, landing at its slot (page gaps honoured); ``-1`` /
    out-of-range rows change nothing. ``fp8_ds_mla`` takes an odd gap: an odd page stride
    puts its bf16 RoPE values at odd addresses (a 2-byte store there faults on a GPU)."""
    if page_gap and kv_format == "fp8_ds_mla":
        page_gap += 1
    cache = new_cache(kv_format, 5, page_size, device=DEVICE, page_gap=page_gap)
    noise = torch.randint(0, 256, cache.view(torch.uint8).shape, dtype=torch.uint8)
    cache.view(torch.uint8).copy_(noise)
    want = cache.clone()
    n = 5 * page_size
    # every other entry of a longer tensor: a strided int64 slots argument
    slots = torch.tensor([n - 1, 9, -1, 9, 0, 9, n, 9, n // 2, 9, -7, 9, 1 % n], device=DEVICE)[::2]
    values = rows_to_write(7, 512, dtype)
    scale = 0.5 if kv_format == "fp8" else 1.0
    write_rows_triton(cache, slots, values, KV_FORMATS[kv_format], scale)
    write_values_reference(want, slots, values, KV_FORMATS[kv_format], scale)
    assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("index_format", sorted(INDEX_FORMATS))
def test_write_index_rows(index_format):
    """``write_index_keys``' rows (128 e4m3 and one fp32 power-of-two scale, or bf16), the
    same bytes as ``encode_index_rows`` and the reference store."""
    cache = new_index_cache(index_format, 3, 4, device=DEVICE)
    cache.view(torch.uint8).copy_(torch.randint(0, 256, cache.view(torch.uint8).shape, dtype=torch.uint8))
    want = cache.clone()
    slots = torch.tensor([11, -1, 0, 5, 12, 7, 3], device=DEVICE)
    values = rows_to_write(7, 128, torch.bfloat16)
    fmt = INDEX_FORMATS[index_format]
    write_rows_triton(cache, slots, values, fmt)
    write_values_reference(want, slots, values, fmt)
    assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("fmt", [*KV_FORMATS.values(), *INDEX_FORMATS.values()], ids=lambda f: f.name)
def test_the_row_store_launch_names_every_constexpr(fmt):
    """Inductor, tracing the launch (``torch.compile`` of ``write_kv`` on CUDA, the
    lowering), passes the kernel only the arguments given, no defaults: the launch names
    every constexpr of the row store, for every format."""
    from compile_ops.kv.triton import _layout, _store_rows_kernel

    params = inspect.signature(_store_rows_kernel.fn).parameters.values()  # (JIT or interpreted)
    assert set(_layout(fmt)) == {p.name for p in params if "constexpr" in str(p.annotation)}
