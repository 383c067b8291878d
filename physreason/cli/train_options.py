"""Options and messages that `physreason sft` and `physreason grpo` share."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from physreason.config import Config

CONFIG_HELP = "TOML recipe (see configs/{example})."
MODEL_HELP = "Model to train: hub id or local model folder (sets model.model_name_or_path)."
OUTPUT_DIR_HELP = "Folder for checkpoints, exports and logs (sets train.output_dir)."
TRUST_HELP = (
    "Allow resuming a checkpoint this run did not write (outside train.output_dir, or linked or copied into it). "
    "Resuming unpickles the checkpoint's DCP "
    ".metadata, which can run code: only for checkpoint folders you trust as you trust code."
)


def option_values(model: str | None, output_dir: Path | None, trust_checkpoint: bool) -> dict[str, object]:
    """The recipe keys the shared options set (only those given)."""
    values: dict[str, object] = {}
    if model is not None:
        values["model.model_name_or_path"] = model
    if output_dir is not None:
        values["train.output_dir"] = str(output_dir)
    if trust_checkpoint:
        values["train.trust_checkpoint"] = True
    return values


def echo_finished_before(checkpoint: Path) -> None:
    """Say that a resumed run had no step left."""
    typer.echo(
        f"nothing to do: the run already finished at {checkpoint}; raise train.max_steps or train.epoch to train further"
    )


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
