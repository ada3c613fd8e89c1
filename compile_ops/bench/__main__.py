"""``python -m compile_ops.bench {sparse-mla,slots,dcp} [options]``: run one benchmark.

Each benchmark is a module ``compile_ops.bench.<name with _>`` exposing ``main(argv)``.
"""

import importlib
import sys

BENCHMARKS = {
    "sparse-mla": "compile_ops.bench.sparse_mla",
    "slots": "compile_ops.bench.slots",
    "dcp": "compile_ops.bench.dcp",
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHMARKS:
        print(f"usage: python -m compile_ops.bench {{{','.join(BENCHMARKS)}}} [options]", file=sys.stderr)
        return 2
    return importlib.import_module(BENCHMARKS[argv[0]]).main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
