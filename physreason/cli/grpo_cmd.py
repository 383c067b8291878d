"""`physreason grpo`: GRPO reinforcement learning from a TOML recipe (one process, or many under torchrun)."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import typer

from physreason.cli.train_options import (
    CONFIG_HELP,
    MODEL_HELP,
    OUTPUT_DIR_HELP,
    TRUST_HELP,
    echo_finished_before,
    exit_if_uploads_left,
    option_values,
    window_means,
)


def grpo(
    config: Path = typer.Option(..., "--config", "-c", help=CONFIG_HELP.format(example="grpo_tiny.toml")),
    model: str | None = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    output_dir: Path | None = typer.Option(None, "--output-dir", help=OUTPUT_DIR_HELP),
    overrides: list[str] = typer.Option(
        [], "--set", metavar="KEY=VALUE", help="Override a key, e.g. --set grpo.kl_beta=0.01 (repeatable)."
    ),
    trust_checkpoint: bool = typer.Option(False, "--trust-checkpoint", help=TRUST_HELP),
) -> None:
    """Train a model with GRPO on multiple-choice prompts: colocated (shared GPUs) or disaggregated on Ray.

    A rerun into a train.output_dir that has checkpoints is refused: continue it with --set train.resume=true,
    or choose a new or empty folder. Ctrl-C (or SIGTERM) saves a checkpoint after the current step and prints
    the command that resumes (colocated runs); a resumed run keeps logs/metrics.jsonl up to its checkpoint's step.
    Resuming loads a checkpoint with pickle (it can run code): a checkpoint folder this run
    did not write (outside output_dir, or linked or copied into it) needs --trust-checkpoint.
    --set train.ckpt.save_mode=async writes checkpoints in the background while training goes on; `physreason
    export RUN_DIR --out DIR` turns any checkpoint into a Hugging Face folder (docs/checkpoints.md).

    Exit codes: 0 done (or nothing left to do), 2 a usage or configuration error, 130 stopped by Ctrl-C or
    SIGTERM after saving a checkpoint.
    """
    import torch.distributed as dist

    from physreason.config import load_config
    from physreason.train.grpo import run_grpo

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    recipe = load_config(config, overrides, option_values(model, output_dir, trust_checkpoint))
    try:
        if recipe.grpo.mode == "disaggregated":
            from physreason.distributed.controller import run_disaggregated

            result = run_disaggregated(recipe)
        else:
            result = run_grpo(recipe)
    finally:
        if "physreason.engines.vllm" in sys.modules and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            from physreason import vllm_compat

            vllm_compat.release_distributed()  # vLLM's groups live inside torchrun's: they go first
        if dist.is_initialized():
            dist.destroy_process_group()
    if os.environ.get("RANK", "0") != "0":
        exit_if_uploads_left(recipe)  # every torchrun rank exits with the same code; rank 0 prints the summary
        return
    if getattr(result, "finished_before", None) is not None:
        echo_finished_before(result.finished_before)
        exit_if_uploads_left(recipe)
        return
    if result.rewards:
        # Single steps are noisy (a few prompt groups each): compare the means of the first and last windows.
        k, first, last = window_means(result.rewards)
        typer.echo(
            f"finished {len(result.rewards)} steps, mean reward {first:.3f} over the first {k} -> {last:.3f} "
            f"over the last {k}"
        )
    if result.last_checkpoint is not None:
        typer.echo(f"checkpoint: {result.last_checkpoint}")
    if result.export_dir is not None:
        typer.echo(f"Hugging Face export: {result.export_dir}")
    exit_if_uploads_left(recipe)
