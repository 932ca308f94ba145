"""``python -m simcluster``: the same program as the ``simcluster`` console script."""

import sys

from simcluster.cli import console_main

if __name__ == "__main__":
    sys.exit(console_main())
