"""``python -m compile_ops.bench {sparse-mla,slots,dcp,indexer,linear} [options]``: run one benchmark.

Each benchmark is a module ``compile_ops.bench.<name with _>`` exposing ``main(argv)``;
``python -m compile_ops.bench NAME --help`` lists its options.
"""

import argparse
import importlib
import sys

BENCHMARKS = {
    "sparse-mla": ("compile_ops.bench.sparse_mla", "sparse_mla against FlashMLA and plain torch (GPU)"),
    "slots": ("compile_ops.bench.slots", "slot conversion kernels against their reference (GPU)"),
    "dcp": ("compile_ops.bench.dcp", "dcp_combine over NCCL, ag_rs against a2a (several GPUs)"),
    "indexer": ("compile_ops.bench.indexer", "indexer_topk against plain torch and the key-read floor (GPU)"),
    "linear": ("compile_ops.bench.linear", "fp8_linear against the bf16 GEMM and the byte floor (GPU)"),
}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m compile_ops.bench", usage="%(prog)s {sparse-mla,slots,dcp,indexer,linear} [options]",
        description="Run one benchmark; `python -m compile_ops.bench NAME --help` lists its options.",
        epilog="benchmarks: " + "; ".join(f"{name}: {what}" for name, (_, what) in BENCHMARKS.items()),
    )
    parser.add_argument("benchmark", choices=list(BENCHMARKS), help="which benchmark to run")
    args = parser.parse_args(argv[:1])  # the benchmark parses the rest, --help included
    return importlib.import_module(BENCHMARKS[args.benchmark][0]).main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
