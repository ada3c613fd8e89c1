"""Slot conversion: ``ops`` (contract), ``reference`` (meaning), ``triton`` (fast path)."""

from compile_ops.slots.ops import dcp_topk_to_slots, swa_indices, topk_to_slots

__all__ = ["topk_to_slots", "dcp_topk_to_slots", "swa_indices"]
