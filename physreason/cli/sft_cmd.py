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
    trained = [loss for loss in result.losses if loss == loss]  # steps whose every sample was skipped log nan
    line = f"finished {len(result.losses)} steps"
    if trained:
        line += f", last loss {trained[-1]:.4f}"
    if result.truncated:
        line += f"; {result.truncated} samples were cut at model.model_max_length (their ends did not train)"
    if result.empty_steps:
        line += f"; {len(result.empty_steps)} had every sample skipped and made no update (steps {_steps(result.empty_steps)})"
    return line


def _steps(steps: list[int], shown: int = 5) -> str:
    """The first `shown` step numbers, then how many more."""
    more = f" and {len(steps) - shown} more" if len(steps) > shown else ""
    return ", ".join(str(s) for s in steps[:shown]) + more


sft = training_command(
    "Fine-tune a model on conversation records; launch with torchrun for FSDP2 over several GPUs.",
    example="sft_tiny.toml",
    set_example="train.optm_lr=2e-6",
    train=_train,
    summary=_summary,
)
