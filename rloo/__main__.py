"""`python -m rloo train ...` (what `torchrun -m rloo train ...` runs on every process)."""

from rloo.cli import entry

entry()
