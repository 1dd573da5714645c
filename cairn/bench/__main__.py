"""`python -m cairn.bench ...` is `cairn bench ...` (see cairn/bench/cli.py)."""

import sys

from cairn.cli import main

sys.exit(main(["bench", *sys.argv[1:]]))
