"""LSE combine and DCP combine: ``ops`` (contract), ``reference`` (meaning), ``triton``."""

from compile_ops.combine.ops import dcp_combine, lse_combine

__all__ = ["lse_combine", "dcp_combine"]
