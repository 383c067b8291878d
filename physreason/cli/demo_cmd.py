"""`physreason demo`: the whole loop on a tiny model and generated clips, CPU only, no downloads."""

from __future__ import annotations

from pathlib import Path

import typer


def demo(
    out: Path = typer.Option(
        Path("demo-out"), help="Folder for the model, data, checkpoints and results (reruns reuse it)."
    ),
    train_per_task: int = typer.Option(60, help="Generated training clips per task (the tower's; see --sft-task-clips)."),
    test_per_task: int = typer.Option(
        48, help="Generated held-out clips per task (a multiple of 8 balances every task's classes exactly)."
    ),
    sft_task_clips: int = typer.Option(240, help="Generated training clips of each task SFT trains on."),
    control_clips: int = typer.Option(
        16, help="Training clips of each other task in SFT's and GRPO's data (so they learn those tasks' letters)."
    ),
    val_per_task: int = typer.Option(
        96, help="Generated validation clips of each SFT task: GRPO's weights are kept only if they do better there."
    ),
    tower_steps: int = typer.Option(150, help="Vision-tower pre-training steps (batches of 32 clips) before SFT."),
    sft_steps: int = typer.Option(150, help="SFT optimizer steps."),
    sft_task: list[str] = typer.Option(
        [], "--sft-task", metavar="<task>", help="Train SFT on this task's clips (repeatable; all three for every task) [default: spatial_puzzle]."
    ),
    grpo_steps: int = typer.Option(12, help="GRPO steps."),
    seed: int = typer.Option(0, min=0, help="Seed of the clips, the tower and the training runs (use one --out per seed)."),
) -> None:
    """Tiny model + generated intuitive-physics clips: evaluate, pre-train the tower, fine-tune, GRPO, print the table."""
    from physreason.data.synth.tasks import LETTER_TASK_NAMES as TASK_NAMES
    from physreason.demo import DemoSizes, run_demo
    from physreason.errors import InputError

    unknown = sorted(set(sft_task) - set(TASK_NAMES))
    if unknown:
        raise InputError(f"--sft-task {', '.join(unknown)}: choose among {', '.join(TASK_NAMES)}")

    run_demo(
        out,
        DemoSizes(
            train_per_task=train_per_task,
            test_per_task=test_per_task,
            tower_steps=tower_steps,
            sft_steps=sft_steps,
            grpo_steps=grpo_steps,
            sft_task_clips=sft_task_clips,
            control_clips=control_clips,
            val_per_task=val_per_task,
            **({"sft_tasks": tuple(sft_task)} if sft_task else {}),
        ),
        seed=seed,
    )
