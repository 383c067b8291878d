"""`physreason grpo`: GRPO reinforcement learning from a TOML recipe (one process, or many under torchrun)."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from physreason.cli.train_options import training_command, window_means

if TYPE_CHECKING:
    from physreason.config import Config
    from physreason.train.grpo import GRPOResult


def _train(recipe: Config) -> GRPOResult:
    from physreason.train.grpo import run_grpo

    try:
        if recipe.grpo.mode == "disaggregated":
            from physreason.distributed.controller import run_disaggregated

            return run_disaggregated(recipe)
        return run_grpo(recipe)
    finally:
        if "physreason.engines.vllm" in sys.modules and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            from physreason import vllm_compat

            vllm_compat.release_distributed()  # vLLM's groups live inside torchrun's: they go first


def _summary(result: GRPOResult) -> str | None:
    if not result.rewards:
        return None
    # Single steps are noisy (a few prompt groups each): compare the means of the first and last windows.
    k, first, last = window_means(result.rewards)
    return (
        f"finished {len(result.rewards)} steps, mean reward {first:.3f} over the first {k} -> {last:.3f} "
        f"over the last {k}"
    )


grpo = training_command(
    "Train a model with GRPO on multiple-choice prompts: colocated (shared GPUs) or disaggregated on Ray.",
    example="grpo_tiny.toml",
    set_example="grpo.kl_beta=0.01",
    train=_train,
    summary=_summary,
    resumes=" (colocated runs)",
)
