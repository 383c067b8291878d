"""Options and messages that `physreason sft` and `physreason grpo` share."""

from __future__ import annotations

from pathlib import Path

import typer

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
