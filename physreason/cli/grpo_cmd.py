"""`physreason grpo`: GRPO reinforcement learning from a TOML recipe (one process, or many under torchrun)."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import typer


def grpo(
    config: Path = typer.Option(..., "--config", "-c", help="TOML recipe (see configs/grpo_tiny.toml)."),
    overrides: list[str] = typer.Option([], "--set", help="Override a key, e.g. --set grpo.kl_beta=0.01 (repeatable)."),
    trust_checkpoint: bool = typer.Option(
        False,
        "--trust-checkpoint",
        help="Allow resuming a checkpoint this run did not write (outside train.output_dir, or linked or copied into "
        "it). Resuming unpickles the checkpoint's DCP "
        ".metadata, which can run code: only for checkpoint folders you trust as you trust code.",
    ),
) -> None:
    """Train a model with GRPO on multiple-choice prompts: colocated (shared GPUs) or disaggregated on Ray.

    A rerun into a train.output_dir that has checkpoints is refused: continue it with --set train.resume=true,
    or choose a new or empty folder. Resuming loads a checkpoint with pickle (it can run code): a checkpoint
    folder this run did not write (outside output_dir, or linked or copied into it) needs --trust-checkpoint.
    """
    import torch.distributed as dist

    from physreason.config import load_config
    from physreason.train.grpo import run_grpo

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    recipe = load_config(config, overrides, {"train.trust_checkpoint": True} if trust_checkpoint else None)
    try:
        if recipe.grpo.mode == "disaggregated":
            from physreason.distributed.controller import run_disaggregated

            result = run_disaggregated(recipe)
        else:
            result = run_grpo(recipe)
    finally:
        if "physreason.engines.vllm" in sys.modules and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            from physreason.engines import vllm_compat

            vllm_compat.release_distributed()  # vLLM's groups live inside torchrun's: they go first
        if dist.is_initialized():
            dist.destroy_process_group()
    if result.rewards:
        typer.echo(
            f"finished {len(result.rewards)} steps, mean reward {result.rewards[0]:.3f} -> {result.rewards[-1]:.3f}"
        )
    if result.last_checkpoint is not None:
        typer.echo(f"checkpoint: {result.last_checkpoint}")
    if result.export_dir is not None:
        typer.echo(f"Hugging Face export: {result.export_dir}")
