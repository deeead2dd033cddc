"""``python -m megatrain ...`` — the same as the ``megatrain`` console script."""

import sys

from megatrain.cli import main

if __name__ == "__main__":
    sys.exit(main())
