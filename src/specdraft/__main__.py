"""`python -m specdraft ...` (and `accelerate launch -m specdraft train KIND`): the `specdraft`
command (specdraft/cli.py)."""

import sys

from specdraft.cli import main

if __name__ == "__main__":
    sys.exit(main())
