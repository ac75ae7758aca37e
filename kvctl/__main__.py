"""``python -m kvctl`` runs the command line."""

from kvctl.cli import run

run()
