"""Block-scaled FP8 linears: ``ops`` (contract), ``reference`` (meaning), ``triton`` (fast path)."""

from compile_ops.linear.ops import (BLOCK, LAYOUTS, BlockLayout, dequantize_blocks, fp8_linear,
                                    layout_of_block, layout_of_scale, quantize_blocks, quantize_tokens)

__all__ = ["BLOCK", "LAYOUTS", "BlockLayout", "dequantize_blocks", "fp8_linear", "layout_of_block", "layout_of_scale",
           "quantize_blocks", "quantize_tokens"]
