"""``python -m cluster`` is the ``cluster`` command (for a virtualenv whose scripts are not on PATH)."""

import sys

from cluster.cli import main

if __name__ == "__main__":
    sys.exit(main())
