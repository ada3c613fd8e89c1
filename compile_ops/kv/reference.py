"""Plain-torch row store of ``write_kv`` and ``write_index_keys`` (any device, no host sync)."""

from __future__ import annotations

from typing import Union

import torch

from compile_ops.formats import KVFormat, encode_rows, locate_slots, page_bytes, row_byte_index
from compile_ops.indexer.cache import IndexFormat, encode_index_rows


def write_values_reference(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor,
                           fmt: Union[KVFormat, IndexFormat], kv_scale: float = 1.0) -> None:
    """Quantize ``values`` by the format's one quantizer (:func:`compile_ops.formats.encode_rows`
    or :func:`compile_ops.indexer.cache.encode_index_rows`) and store them
    (:func:`write_rows_reference`)."""
    if isinstance(fmt, IndexFormat):
        rows = encode_index_rows(values, fmt.name)
    else:
        rows = encode_rows(values, fmt.name, kv_scale)
    write_rows_reference(cache, slots, rows, fmt)


def write_rows_reference(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, fmt: KVFormat) -> None:
    """Store encoded rows ``rows [N, bytes_per_token]`` uint8 at ``slots [N]`` of ``cache``
    (``fmt``'s page layout), skipping ``-1`` / out-of-range slots: byte deltas are added
    with ``index_put_(accumulate=True)`` and a skipped row adds zero."""
    page, offset, valid = locate_slots(cache, slots)
    pages = page_bytes(cache)
    index = (page.unsqueeze(-1).expand(-1, fmt.bytes_per_token), row_byte_index(fmt, cache.shape[1], offset))
    pages.index_put_(index, (rows - pages[index]) * valid.unsqueeze(-1), accumulate=True)
