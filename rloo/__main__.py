"""`python -m rloo train ...` (what `torchrun -m rloo train ...` runs on every process)."""

import sys

from rloo.cli import main

sys.exit(main())
