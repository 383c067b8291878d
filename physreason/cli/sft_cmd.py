"""`physreason sft`: supervised fine-tuning from a TOML recipe (one process, or many under torchrun)."""

from __future__ import annotations

import logging
from pathlib import Path

import typer


def sft(
    config: Path = typer.Option(..., "--config", "-c", help="TOML recipe (see configs/sft_tiny.toml)."),
    overrides: list[str] = typer.Option(
        [], "--set", help="Override a key, e.g. --set train.optm_lr=2e-6 (repeatable)."
    ),
    trust_checkpoint: bool = typer.Option(
        False,
        "--trust-checkpoint",
        help="Allow resuming a checkpoint this run did not write (outside train.output_dir, or linked or copied into "
        "it). Resuming unpickles the checkpoint's DCP "
        ".metadata, which can run code: only for checkpoint folders you trust as you trust code.",
    ),
) -> None:
    """Fine-tune a model on conversation records; launch with torchrun for FSDP2 over several GPUs.

    A rerun into a train.output_dir that has checkpoints is refused: continue it with --set train.resume=true,
    or choose a new or empty folder. Resuming loads a checkpoint with pickle (it can run code): a checkpoint
    folder this run did not write (outside output_dir, or linked or copied into it) needs --trust-checkpoint.
    """
    import torch.distributed as dist

    from physreason.config import load_config
    from physreason.train.sft import run_sft

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    recipe = load_config(config, overrides, {"train.trust_checkpoint": True} if trust_checkpoint else None)
    try:
        result = run_sft(recipe)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if result.losses:
        typer.echo(f"finished {len(result.losses)} steps, last loss {result.losses[-1]:.4f}")
    if result.last_checkpoint is not None:
        typer.echo(f"checkpoint: {result.last_checkpoint}")
    if result.export_dir is not None:
        typer.echo(f"Hugging Face export: {result.export_dir}")
