"""Root of the `physreason` command: global options and subcommand registration."""

from __future__ import annotations

import sys

import typer
from rich.console import Console
from rich.text import Text

import physreason
from physreason.errors import PhysReasonError

app = typer.Typer(
    name="physreason",
    help="Inference, fine-tuning, GRPO and evaluation for physical-AI reasoning VLMs (Cosmos-Reason1 family).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Help texts name TOML sections like [model]; rich markup would swallow them.
    rich_markup_mode=None,
)
err_console = Console(stderr=True)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"physreason {physreason.__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """physreason: inference, SFT, GRPO and evaluation for Cosmos-Reason1-family models."""


def _register() -> None:
    # Imported here so that `physreason --version` stays fast and each module owns its command.
    from physreason.cli import (
        config_cmd,
        data_cmd,
        demo_cmd,
        eval_cmd,
        grpo_cmd,
        infer_cmd,
        models_cmd,
        serve_cmd,
        sft_cmd,
    )

    app.command("demo")(demo_cmd.demo)
    app.command("infer")(infer_cmd.infer)
    app.command("serve")(serve_cmd.serve)
    app.add_typer(eval_cmd.app, name="eval")
    app.command("sft")(sft_cmd.sft)
    app.command("grpo")(grpo_cmd.grpo)
    app.add_typer(data_cmd.app, name="data")
    app.add_typer(config_cmd.app, name="config")
    app.add_typer(models_cmd.app, name="models")


_register()


def main() -> None:
    """Entry point: run the app; user-fixable errors print one clear line instead of a traceback."""
    try:
        app(standalone_mode=False)
    except PhysReasonError as exc:
        err_console.print(Text.assemble(("error: ", "bold red"), str(exc)), highlight=False, soft_wrap=True)
        sys.exit(2)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        err_console.print("aborted")
        sys.exit(130)
    except Exception as exc:  # click usage errors carry their own exit code and message
        import click

        if isinstance(exc, click.ClickException):
            exc.show()
            sys.exit(exc.exit_code)
        raise
