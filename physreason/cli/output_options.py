"""One flag name per meaning for where a command writes and whether it may replace its earlier output.

Every command names the folder or file it writes with `--out`, and lets an earlier output of its own be replaced
with `--overwrite`. The names some commands used before (`--output-dir` of sft and grpo, `--results-dir` of eval,
`--force` of export) keep working as hidden aliases, so scripts written for them run unchanged; `--output-dir` also
works for the commands that write a folder (export, eval, data synth) and `--force` for every --overwrite.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer


def hidden_alias(name: str, flag: bool = False) -> Any:
    """A parameter default for an alias that works and stays out of --help (typer shows every name of one option)."""
    return typer.Option(False if flag else None, name, hidden=True)


def one_path(canonical: str, value: Path | None, aliases: dict[str, Path | None]) -> Path | None:
    """The path given under `canonical` or one of its aliases (flag name -> value); two different ones is an error."""
    given = [(canonical, value)] if value is not None else []
    given += [(name, path) for name, path in aliases.items() if path is not None]
    if len({str(Path(path)) for _, path in given}) > 1:
        names = " and ".join(name for name, _ in given)
        raise typer.BadParameter(f"{names} name the same output; give one of them", param_hint=f"'{canonical}'")
    return given[0][1] if given else None
