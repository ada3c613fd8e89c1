"""The attention layer's decode step as an AOTInductor package (``.pt2``).

:class:`EngineStep` is the step with an engine's inputs: ``forward(x [T, dim] bf16,
positions [T], token_to_req [T], swa_block_table [R, Bs], cmp_block_table
[R, Bc]) -> [T, dim] bf16`` (int32 metadata, ``-1`` positions for padding rows). The layer's
weights, KV caches, compressor state and index keys are its buffers: the package holds them
and every call updates them in place, like the eager layer. :func:`export_step` runs
``torch.export`` with a dynamic token count ``T in [1, max_tokens]`` and :func:`package_step`
compiles that with ``torch._inductor.aoti_compile_and_package``; load the result with
``torch._inductor.aoti_load_package`` (Python) or ``torch::inductor::AOTIModelPackageLoader``
(C++), see ``docs/lowering.md``; to capture the loaded step in a CUDA graph, load it with
``run_single_threaded=True`` (the default runner synchronises on events).

On CUDA the Triton paths of ``sparse_mla``, the slot ops and ``write_kv`` are compiled into
the package (:mod:`lowering.inductor`), which then calls no ``dsv41`` op; ops left opaque
(every op on CPU, where the reference kernels run) are called through AOTInductor's proxy
executor, i.e. through the dispatcher, so the process must have ``compile_ops`` imported.

CLI: ``python -m lowering.aoti --out step.pt2 [--config tiny] [--ratio 2] [--device cuda]``.
"""

from __future__ import annotations

import argparse
import os
from typing import Optional

import torch
from torch import Tensor, nn
from torch.export import Dim, ExportedProgram

import lowering  # noqa: F401  (installs the Inductor rules before anything is traced)
from compile_ops._cli import description
from graphs.attention import DSV41Attention
from graphs.config import PRESETS, CacheConfig
from graphs.metadata import StepMetadata


class EngineStep(nn.Module):
    """One decode step of ``layer`` with the step metadata as inputs (see the module doc)."""

    def __init__(self, layer: DSV41Attention) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: Tensor, positions: Tensor, token_to_req: Tensor, swa_block_table: Tensor,
                cmp_block_table: Tensor) -> Tensor:
        inp = self.layer.step_inputs(positions, token_to_req, swa_block_table, cmp_block_table)
        return self.layer(x, inp)


def example_inputs(layer: DSV41Attention, num_tokens: int, meta: Optional[StepMetadata] = None) -> tuple[Tensor, ...]:
    """Inputs of :class:`EngineStep` for a step of ``num_tokens`` fresh requests (rows
    ``0..T-1``, position 0), with ``meta``'s block tables (default: :meth:`StepMetadata.for_layer`)."""
    meta = meta if meta is not None else StepMetadata.for_layer(layer)
    device = layer.swa_cache.device
    T = num_tokens
    positions = torch.zeros(T, dtype=torch.int32, device=device)
    rows = torch.arange(T, dtype=torch.int32, device=device)
    x = torch.randn(T, layer.cfg.dim, generator=torch.Generator().manual_seed(T)).to(torch.bfloat16).to(device)
    return x, positions, rows, meta.swa_block_table, meta.cmp_block_table


def export_step(layer: DSV41Attention, num_tokens: int = 2, *, dynamic: bool = True,
                meta: Optional[StepMetadata] = None) -> ExportedProgram:
    """``torch.export`` of :class:`EngineStep` (``T`` dynamic in ``[1, max_tokens]`` unless
    ``dynamic=False``; trace with ``num_tokens >= 2``, sizes 0 and 1 being specialised)."""
    args = example_inputs(layer, num_tokens, meta)
    shapes = None
    if dynamic:
        T = Dim("T", min=1, max=layer.cache_cfg.max_tokens)
        shapes = ({0: T}, {0: T}, {0: T}, None, None)
    with torch.no_grad():
        return torch.export.export(EngineStep(layer), args, dynamic_shapes=shapes)


def package_step(layer: DSV41Attention, path: str, num_tokens: int = 2, *, dynamic: bool = True,
                 meta: Optional[StepMetadata] = None) -> str:
    """Export the step and compile it to the AOTInductor package ``path``; returns the path."""
    from torch._inductor import aoti_compile_and_package

    program = export_step(layer, num_tokens, dynamic=dynamic, meta=meta)
    return aoti_compile_and_package(program, package_path=os.fspath(path))


def remaining_custom_ops(program: ExportedProgram) -> list[str]:
    """``dsv41`` ops left as calls in an exported program (inlined ones are Triton kernels)."""
    return sorted({str(n.target) for n in program.graph.nodes
                   if n.op == "call_function" and "dsv41" in str(n.target)})


def main(argv: Optional[list[str]] = None) -> None:
    """``python -m lowering.aoti --out step.pt2``: export and package the decode step."""
    parser = argparse.ArgumentParser(prog="python -m lowering.aoti", description=description(__doc__))
    parser.add_argument("--out", required=True, help="package path (.pt2)")
    parser.add_argument("--config", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--ratio", type=int, default=2, help="compress ratio of the layer (0 = SWA only)")
    parser.add_argument("--kv-format", default="bf16")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-seq-len", type=int, default=256)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    cache = CacheConfig(args.max_tokens, args.max_tokens, args.max_seq_len, args.page_size, kv_format=args.kv_format)
    layer = DSV41Attention(PRESETS[args.config], cache, args.ratio, device=args.device)
    program = export_step(layer)
    print(f"exported; dsv41 ops left as calls: {remaining_custom_ops(program) or 'none'}")
    from torch._inductor import aoti_compile_and_package

    print(aoti_compile_and_package(program, package_path=args.out))


if __name__ == "__main__":
    main()
