"""``python -m compile_ops``: the self-check (see :mod:`compile_ops.selfcheck`)."""

import sys

from compile_ops.selfcheck import main

if __name__ == "__main__":
    sys.exit(main())
