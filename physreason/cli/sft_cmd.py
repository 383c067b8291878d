"""`physreason sft`: supervised fine-tuning from a TOML recipe (one process, or many under torchrun)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from physreason.cli.train_options import training_command

if TYPE_CHECKING:
    from physreason.config import Config
    from physreason.train.sft import SFTResult


def _train(recipe: Config) -> SFTResult:
    from physreason.train.sft import run_sft

    return run_sft(recipe)


def _summary(result: SFTResult) -> str | None:
    if not result.losses:
        return None
    return f"finished {len(result.losses)} steps, last loss {result.losses[-1]:.4f}"


sft = training_command(
    "Fine-tune a model on conversation records; launch with torchrun for FSDP2 over several GPUs.",
    example="sft_tiny.toml",
    set_example="train.optm_lr=2e-6",
    train=_train,
    summary=_summary,
)
