"""The `tpuscore` command."""

from tpuscore.cli.commands import main

__all__ = ["main"]
