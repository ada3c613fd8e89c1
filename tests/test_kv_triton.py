"""``write_kv``'s Triton row store (``compile_ops.kv.triton``) against the plain-torch one.

On CPU the kernel runs under ``TRITON_INTERPRET=1`` (set by conftest.py); on a GPU compiled.
Stores are bytes: every case must match the reference exactly.
"""

import pytest
import torch

from compile_ops.formats import KV_FORMATS, encode_rows, new_cache
from compile_ops.kv.reference import write_rows_reference
from compile_ops.kv.triton import write_rows_triton

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("kv_format", sorted(KV_FORMATS))
@pytest.mark.parametrize("page_size,page_gap", [(1, 0), (8, 24), (64, None)])
def test_write_rows(kv_format, page_size, page_gap):
    """``write_kv``'s Triton row store leaves the same bytes as the reference: rows land at
    their slots (page gaps honoured), ``-1`` / out-of-range rows change nothing."""
    if page_gap is not None and kv_format == "fp8_ds_mla":
        page_gap = 2 * page_gap
    cache = new_cache(kv_format, 5, page_size, device=DEVICE, page_gap=page_gap)
    noise = torch.randint(0, 256, cache.view(torch.uint8).shape, dtype=torch.uint8)
    cache.view(torch.uint8).copy_(noise)
    want = cache.clone()
    n = 5 * page_size
    # every other entry of a longer tensor: a strided int64 slots argument
    slots = torch.tensor([n - 1, 9, -1, 9, 0, 9, n, 9, n // 2, 9, -7, 9, 1 % n], device=DEVICE)[::2]
    rows = encode_rows(torch.randn(7, 512, device=DEVICE), kv_format)
    write_rows_triton(cache, slots, rows, KV_FORMATS[kv_format])
    write_rows_reference(want, slots, rows, KV_FORMATS[kv_format])
    assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8))
