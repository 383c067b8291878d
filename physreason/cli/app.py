"""Root of the `physreason` command: global options and subcommand registration."""

from __future__ import annotations

import logging
import os
import sys

import typer
from rich.text import Text

import physreason
from physreason.errors import Interrupted, PhysReasonError
from physreason.progress import make_console

app = typer.Typer(
    name="physreason",
    help="Inference, fine-tuning, GRPO and evaluation for physical-AI reasoning VLMs (Cosmos-Reason1 and Cosmos-Reason2).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Help texts name TOML sections like [model]; rich markup would swallow them.
    rich_markup_mode=None,
)
err_console = make_console(stderr=True)
# transformers imports torchao (the fp8 extra) whenever it is installed, on every model load; torchao then warns about
# each of its CUDA kernel libraries a CPU machine cannot load (kernels only float8 training on a GPU uses, which
# checks for itself), and newer torch warns that torchao registers its enums in a deprecated way. Neither is the
# user's to act on.
for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)


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
    """physreason: inference, SFT, GRPO and evaluation for Cosmos-Reason1 and Cosmos-Reason2 models."""


def _quiet_argument_types() -> None:
    """Show an argument's metavar alone in help: typer adds its Python type beside it (`RECIPE.toml... <list[Path]>`)."""
    from typer import core

    shown = getattr(core.TyperArgument, "display_type_rich", None)
    if shown is None:  # another typer layout: its help is left as it is
        return

    def display_type_rich(self: core.TyperArgument, ctx: object) -> str | None:
        return None if self.metavar is not None else shown(self, ctx)

    core.TyperArgument.display_type_rich = display_type_rich  # type: ignore[method-assign]


def _register() -> None:
    # Imported here so that `physreason --version` stays fast and each module owns its command.
    from physreason.cli import (
        config_cmd,
        data_cmd,
        demo_cmd,
        eval_cmd,
        experiment_cmd,
        export_cmd,
        gpu_check_cmd,
        grpo_cmd,
        infer_cmd,
        models_cmd,
        plan_cmd,
        plot_cmd,
        serve_cmd,
        sft_cmd,
    )

    app.command("demo")(demo_cmd.demo)
    app.command("infer")(infer_cmd.infer)
    app.command("serve")(serve_cmd.serve)
    app.add_typer(eval_cmd.app, name="eval")
    app.command("sft")(sft_cmd.sft)
    app.command("grpo")(grpo_cmd.grpo)
    app.command("export")(export_cmd.export)
    app.command("plan")(plan_cmd.plan)
    app.command("plot")(plot_cmd.plot)
    app.add_typer(data_cmd.app, name="data")
    app.add_typer(config_cmd.app, name="config")
    app.add_typer(models_cmd.app, name="models")
    app.add_typer(experiment_cmd.app, name="experiment")
    app.command("gpu-check")(gpu_check_cmd.gpu_check)


_register()
_quiet_argument_types()


def _click_exception_types() -> tuple[type[Exception], ...]:
    """The usage-error classes the installed typer raises: its own copy of click's (typer >= 0.22) and click's."""
    found: list[type[Exception]] = []
    try:
        from typer._click.exceptions import ClickException as TyperClickException

        found.append(TyperClickException)
    except ImportError:
        pass
    try:
        from click import ClickException

        found.append(ClickException)
    except ImportError:
        pass
    return tuple(found)


def _exit_interrupted() -> None:
    # Result files are flushed line by line; say so, and exit like a shell does on SIGINT so `cmd && next` stops.
    sys.stdout.flush()
    err_console.print("interrupted: results written so far are kept; rerun the same command to continue")
    sys.exit(130)


def main() -> None:
    """Entry point: run the app; user-fixable errors print one clear line instead of a traceback.

    Exit codes: 0 success, 1 a command's own failure, 2 a usage or user-fixable error, 130 Ctrl-C.
    """
    if not sys.stderr.isatty():
        # transformers' and the Hub's tqdm bars write every redraw into a log; physreason's own bars print lines.
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        # Without standalone mode typer returns the code of a typer.Exit (130 for Ctrl-C) instead of exiting.
        code = app(standalone_mode=False)
    except Interrupted as exc:
        # Every torchrun rank stops the same way; one of them says so.
        if os.environ.get("RANK", "0") == "0":
            sys.stdout.flush()
            err_console.print(str(exc), highlight=False, soft_wrap=True)
        sys.exit(exc.exit_code)
    except PhysReasonError as exc:
        err_console.print(Text.assemble(("error: ", "bold red"), str(exc)), highlight=False, soft_wrap=True)
        sys.exit(2)
    except typer.Abort:
        err_console.print("aborted")
        sys.exit(1)
    except KeyboardInterrupt:
        _exit_interrupted()
    except _click_exception_types() as exc:
        exc.show()  # type: ignore[attr-defined]
        sys.exit(exc.exit_code)  # type: ignore[attr-defined]
    if code == 130:
        _exit_interrupted()
    if isinstance(code, int) and code:
        sys.exit(code)
