"""The training command that `physreason sft` and `physreason grpo` are made from: options, help, run and report.

Each command gives only its own parts (first help line, example recipe, trainer, summary line) to training_command.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import typer

from physreason.cli.output_options import hidden_alias, one_path

if TYPE_CHECKING:
    from physreason.config import Config
    from physreason.train.loop import TrainingResult

Result = TypeVar("Result", bound="TrainingResult")

# The --help paragraphs after each command's own first line; {resumes} says which runs print their resume command.
RUN_HELP = """A rerun into a train.output_dir that has checkpoints is refused: continue it with --set train.resume=true,
or choose a new or empty folder. Ctrl-C (or SIGTERM) saves a checkpoint after the current step and prints the command
that resumes{resumes} (a second one stops at once, without a checkpoint); a resumed run keeps logs/metrics.jsonl
up to its checkpoint's step. Resuming reads a checkpoint's pickles admitting only checkpoint types (a forged one is refused, never run); a checkpoint folder this run did not
write (outside output_dir, or linked or copied into it) needs --trust-checkpoint. --set train.ckpt.save_mode=async writes checkpoints in the background while
training goes on; `physreason export RUN_DIR --out DIR` turns any checkpoint into a Hugging Face folder
(docs/checkpoints.md).

Exit codes: 0 done (or nothing left to do), 1 done but uploads ([train.ckpt] upload_s3 / upload_hf) still queued,
2 a usage or configuration error, 130 stopped by Ctrl-C or SIGTERM after saving a checkpoint."""


def training_command(
    title: str,
    example: str,
    set_example: str,
    train: Callable[[Config], Result],
    summary: Callable[[Result], str | None],
    resumes: str = "",
) -> Callable[..., None]:
    """A typer command that reads a recipe with the shared options, runs `train` on it and reports the run.

    title: the help's first line; example: the recipe under configs/ the --config help points at; set_example: a
    KEY=VALUE the --set help shows; summary: the result's progress line (None: nothing to say); resumes: which runs
    print a resume command on Ctrl-C, after "prints the command that resumes" in the help.
    """

    def command(
        config: Path = typer.Option(..., "--config", "-c", help=f"TOML recipe (see configs/{example})."),
        model: str | None = typer.Option(
            None, "--model", "-m", help="Model to train: hub id or local model folder (sets model.model_name_or_path)."
        ),
        out: Path | None = typer.Option(
            None, "--out", help="Folder for checkpoints, exports and logs (sets train.output_dir)."
        ),
        overrides: list[str] = typer.Option(
            [], "--set", metavar="KEY=VALUE", help=f"Override a key, e.g. --set {set_example} (repeatable)."
        ),
        trust_checkpoint: bool = typer.Option(
            False,
            "--trust-checkpoint",
            help="Allow resuming a checkpoint this run did not write (outside train.output_dir, or linked or copied "
            "into it); only for checkpoint folders you trust. Resuming unpickles the checkpoint's DCP .metadata, "
            "admitting only checkpoint types: a forged pickle is refused, never run.",
        ),
        output_dir: Path | None = hidden_alias("--output-dir"),  # the older name of --out: scripts keep working
    ) -> None:
        import torch.distributed as dist

        from physreason.config import load_config

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        values: dict[str, object] = {}
        if model is not None:
            values["model.model_name_or_path"] = model
        output_dir = one_path("--out", out, {"--output-dir": output_dir})
        if output_dir is not None:
            values["train.output_dir"] = str(output_dir)
        if trust_checkpoint:
            values["train.trust_checkpoint"] = True
        recipe = load_config(config, overrides, values)
        try:
            result = train(recipe)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        if os.environ.get("RANK", "0") != "0":
            exit_if_uploads_left(recipe)  # every torchrun rank exits with the same code; rank 0 prints the summary
            return
        if result.finished_before is not None:
            typer.echo(
                f"nothing to do: the run already finished at {result.finished_before}; raise train.max_steps or "
                "train.epoch to train further"
            )
            exit_if_uploads_left(recipe)
            return
        line = summary(result)
        if line is not None:
            typer.echo(line)
        if result.last_checkpoint is not None:
            typer.echo(f"checkpoint: {result.last_checkpoint}")
        if result.export_dir is not None:
            typer.echo(f"Hugging Face export: {result.export_dir}")
        exit_if_uploads_left(recipe)

    command.__doc__ = f"{title}\n\n{RUN_HELP.format(resumes=resumes)}"
    return command


def window_means(values: list[float]) -> tuple[int, float, float]:
    """(k, mean of the first k values, mean of the last k): k is a quarter of the run, 1 to 10 steps."""
    k = max(1, min(10, len(values) // 4))
    return k, sum(values[:k]) / k, sum(values[-k:]) / k


def exit_if_uploads_left(recipe: Config) -> None:
    """After a run: exit 1, in one line naming them and the resume, when uploads it was asked for are still queued.

    Training did its work, but the uploads did not: `physreason sft ... && next` must not go on as if they had.
    """
    from physreason.train.upload import RECORD, pending_uploads

    ckpt = recipe.train.ckpt
    if not (ckpt.upload_s3 or ckpt.upload_hf):
        return
    output = Path(recipe.train.output_dir)
    left = pending_uploads(output)
    if not left:
        return
    if os.environ.get("RANK", "0") == "0":
        jobs = ", ".join(f"{folder} ({'S3' if kind == 's3' else 'Hub'})" for kind, folder in left)
        print(
            f"error: training finished, but {len(left)} upload(s) did not: {jobs}. They stay queued in "
            f"{output / RECORD}; fix the cause above, then run the same command with --set train.resume=true "
            "to send them",
            file=sys.stderr,
        )
    raise typer.Exit(1)
