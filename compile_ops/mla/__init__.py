"""Sparse MLA attention: ``ops`` (contract), ``reference`` (meaning), ``triton`` (fast path)."""

from compile_ops.mla.ops import sparse_mla, sparse_mla_out, sparse_mla_workspace

__all__ = ["sparse_mla", "sparse_mla_out", "sparse_mla_workspace"]
