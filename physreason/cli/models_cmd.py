"""`physreason models`: make tiny random models for trying the toolkit without downloads."""

from __future__ import annotations

from pathlib import Path

import typer

from physreason.cli.output_options import hidden_alias
from physreason.models.kinds import TINY_KINDS, normalize_kind

app = typer.Typer(help="Tiny random models for tests and dry runs.", no_args_is_help=True)


# The mark `physreason models tiny` leaves in its folder: --overwrite replaces the files of such a folder only.
TINY_MARKER = "physreason-tiny.json"


@app.command("tiny")
def tiny(
    out: Path = typer.Argument(..., help="Folder to write the Hugging Face model folder into."),
    kind: str = typer.Option(
        "qwen2_5_vl", help=f"Architecture: {', '.join(TINY_KINDS)} ('-' works for '_', e.g. qwen3-vl)."
    ),
    seed: int = typer.Option(0, help="Seed of the random weights."),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Replace the files of a tiny model this command wrote before (marked by its "
        f"{TINY_MARKER}); never another folder's."
    ),
    force: bool = hidden_alias("--force", flag=True),
) -> None:
    """Write a tiny random model (config, safetensors, tokenizer, processor) that loads like a real one."""
    import json

    from physreason.errors import PhysReasonError
    from physreason.models.tiny import save_tiny_model
    from physreason.overwrite import check_replace

    kind = normalize_kind(kind)
    if kind not in TINY_KINDS:
        raise PhysReasonError(f"--kind {kind!r} is not a tiny model kind; choose one of {', '.join(TINY_KINDS)}")
    if out.is_file():
        raise PhysReasonError(f"{out} is a file: give a folder to write the model into")
    if out.is_dir() and any(out.iterdir()) and not (overwrite or force):
        what = "a model" if (out / "config.json").is_file() else "files"
        raise PhysReasonError(
            f"{out} already holds {what}: give a new or empty folder, or pass --overwrite to replace its files"
        )
    check_replace(out, option="OUT", marked=(out / TINY_MARKER).is_file(),
                  mark=f"{TINY_MARKER}, which physreason models tiny writes", remedy="give a new or empty folder")  # fmt: skip
    folder = save_tiny_model(kind, out, seed=seed)  # type: ignore[arg-type]
    (folder / TINY_MARKER).write_text(json.dumps({"written_by": "physreason models tiny", "kind": kind}) + "\n")
    typer.echo(f"wrote tiny {kind} model to {folder}")
