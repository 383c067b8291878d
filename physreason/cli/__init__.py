"""The `physreason` command line (typer); each subcommand lives in its own module."""

from physreason.cli.app import app, main

__all__ = ["app", "main"]
