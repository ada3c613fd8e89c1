"""Block-scaled FP8 linears and the bf16 one-token GEMV: ``ops`` (contract), ``reference``
(meaning), ``triton`` (fast path)."""

from compile_ops.linear.ops import (BLOCK, LAYOUTS, BlockLayout, bf16_linear, dequantize_blocks, fp8_linear,
                                    layout_of_block, layout_of_scale, quantize_blocks, quantize_tokens)

__all__ = ["BLOCK", "LAYOUTS", "BlockLayout", "bf16_linear", "dequantize_blocks", "fp8_linear", "layout_of_block",
           "layout_of_scale", "quantize_blocks", "quantize_tokens"]
