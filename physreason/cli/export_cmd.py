"""`physreason export`: any checkpoint of a training run as a Hugging Face folder (transformers, vLLM, new runs)."""

from __future__ import annotations

from pathlib import Path

import typer

from physreason.cli.output_options import hidden_alias, one_path
from physreason.train.export_run import EXPORT_DTYPES


def export(
    run_dir: Path = typer.Argument(
        ..., metavar="RUN_DIR", help="The train.output_dir of an sft or grpo run, finished or interrupted."
    ),
    out: Path | None = typer.Option(
        None, "--out", help="Folder to write the model into: new or empty, or an earlier export with --overwrite. [required]"
    ),
    step: int | None = typer.Option(None, "--step", help="Checkpoint step to export (default: the latest complete one)."),
    adapter_only: bool = typer.Option(
        False, "--adapter-only", help="LoRA runs: write the PEFT adapter folder alone instead of the merged model."
    ),
    dtype: str | None = typer.Option(
        None, "--dtype", help=f"Saved weight dtype: {', '.join(EXPORT_DTYPES)} (default: the run's model.dtype)."
    ),
    overwrite: bool = typer.Option(
        False,
        "--overwrite",
        help="Replace an earlier physreason export in --out (marked by its physreason-export.json); never the run, "
        "a folder holding it, or any other folder.",
    ),
    trust_checkpoint: bool = typer.Option(
        False,
        "--trust-checkpoint",
        help="Load a checkpoint the run did not write itself (copied or linked in); only for folders you trust. "
        "Its DCP .metadata is unpickled admitting only checkpoint types: a forged pickle is refused, never run.",
    ),
    output_dir: Path | None = hidden_alias("--output-dir"),
    force: bool = hidden_alias("--force", flag=True),
) -> None:
    """Export a run's checkpoint as a safetensors folder that transformers and vLLM load with no changes.

    The folder holds config.json, the weights, the tokenizer and processor files, the chat template and the
    generation config of the run's model; it can start a new run too (model.model_name_or_path = that folder).
    A LoRA run gives the base with its adapters merged (and the adapter alone in the `adapter` subfolder), or
    with --adapter-only the PEFT adapter folder only. Checkpoints still being written (step_<n>.tmp) never count.

    Exit codes: 0 written, 2 a usage error (no such run, step or checkpoint, a non-empty --out, ...).
    """
    from physreason.train.export_run import export_run

    out = one_path("--out", out, {"--output-dir": output_dir})
    if out is None:
        raise typer.BadParameter("give the folder to write the model into", param_hint="'--out'")
    folder = export_run(run_dir, out, step, adapter_only, dtype, overwrite or force, trust_checkpoint)
    typer.echo(f"wrote {'the LoRA adapter' if adapter_only else 'the Hugging Face model'} to {folder}")
