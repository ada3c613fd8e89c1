"""KV writes: ``ops`` (contract), ``reference`` (meaning), ``triton`` (fast path)."""

from compile_ops.kv.ops import write_kv

__all__ = ["write_kv"]
