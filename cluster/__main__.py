"""`python -m cluster` is the `cluster` command."""

from cluster.cli import run

run()
