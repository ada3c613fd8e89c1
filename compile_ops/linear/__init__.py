"""Block-scaled FP8 linears: ``ops`` (contract), ``reference`` (meaning), ``triton`` (fast path)."""

from compile_ops.linear.ops import BLOCK, dequantize_blocks, fp8_linear, quantize_blocks, quantize_tokens

__all__ = ["BLOCK", "dequantize_blocks", "fp8_linear", "quantize_blocks", "quantize_tokens"]
