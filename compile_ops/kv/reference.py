"""Plain-torch row store of ``write_kv`` (any device, no host sync)."""

from __future__ import annotations

import torch

from compile_ops.formats import KVFormat, locate_slots, page_bytes, row_byte_index


def write_rows_reference(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, fmt: KVFormat) -> None:
    """Store encoded rows ``rows [N, bytes_per_token]`` uint8 at ``slots [N]`` of ``cache``
    (``fmt``'s page layout), skipping ``-1`` / out-of-range slots: byte deltas are added
    with ``index_put_(accumulate=True)`` and a skipped row adds zero."""
    page, offset, valid = locate_slots(cache, slots)
    pages = page_bytes(cache)
    index = (page.unsqueeze(-1).expand(-1, fmt.bytes_per_token), row_byte_index(fmt, cache.shape[1], offset))
    pages.index_put_(index, (rows - pages[index]) * valid.unsqueeze(-1), accumulate=True)
