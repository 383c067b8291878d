"""`physreason config`: check a recipe and print it fully resolved."""

from __future__ import annotations

from pathlib import Path

import tomli_w
import typer

from physreason.config import load_config

app = typer.Typer(help="Validate and print TOML recipes.", no_args_is_help=True)


@app.command("show")
def show(
    path: Path | None = typer.Argument(None, help="TOML recipe; omit for the defaults."),
    overrides: list[str] = typer.Option(
        [],
        "--set",
        metavar="KEY=VALUE",
        help=(
            "Override a key: --set train.optm_lr=2e-6 (repeatable). A dotted key changes one entry of a table "
            "(grpo.reward_function.format=0.5); a table value replaces it ('grpo.reward_function={accuracy=1}')."
        ),
    ),
) -> None:
    """Validate a recipe (with overrides) and print every setting, defaults included."""
    config = load_config(path, overrides)
    typer.echo(tomli_w.dumps(config.model_dump(mode="json", exclude_none=True)))


@app.command("check")
def check(
    paths: list[Path] = typer.Argument(..., metavar="RECIPE", help="TOML recipes to validate."),
) -> None:
    """Validate recipes; exits non-zero with the offending key named if one is invalid."""
    for path in paths:
        load_config(path)
        typer.echo(f"{path}: ok")
