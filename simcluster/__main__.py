"""``python -m simcluster``: the same program as the ``simcluster`` console script."""

import sys

from simcluster.cli import main

if __name__ == "__main__":
    sys.exit(main())
