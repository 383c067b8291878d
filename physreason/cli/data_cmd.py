"""`physreason data`: build data sets; `synth` writes procedural intuitive-physics clips with MCQ and SFT records."""

from __future__ import annotations

import os
from pathlib import Path

import typer

app = typer.Typer(help="Data sets: synthetic intuitive-physics clips with benchmark and SFT records.", no_args_is_help=True)

SYNTH_TASKS = ("arrow_of_time", "spatial_puzzle", "object_permanence")


@app.command("synth")
def synth(
    out: Path = typer.Option(..., "--out", help="Folder to write into; each task gets its own sub-folder."),
    task: str = typer.Option("all", "--task", help=f"One of {', '.join(SYNTH_TASKS)}, or all."),
    n: int = typer.Option(100, "--n", help="Samples per task."),
    split: str = typer.Option("train", "--split", help="train, val or test: scene seeds never overlap between splits."),
    seed: int = typer.Option(0, "--seed", help="Base seed (>= 0); the same seed gives the same clips."),
    workers: int = typer.Option(0, "--workers", help="Worker processes; 0 means min(4, CPU count)."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show a progress bar."),
) -> None:
    """Generate arrow-of-time, spatial-puzzle and object-permanence clips; a rerun completes what is missing."""
    from physreason.data.synth.generate import generate_task
    from physreason.errors import InputError

    if task != "all" and task not in SYNTH_TASKS:
        raise InputError(f"--task {task!r} is not a synthetic task; choose one of {', '.join(SYNTH_TASKS)} or all")
    if workers < 0:
        raise InputError(f"--workers must be >= 0, got {workers}")
    n_workers = workers or min(4, os.cpu_count() or 1)
    for name in SYNTH_TASKS if task == "all" else (task,):
        summary = generate_task(name, n, out, split, seed, n_workers, show_progress=progress)
        typer.echo(
            f"{name}: {summary.count} samples in {summary.folder} "
            f"({summary.generated} generated, {summary.reused} already there)"
        )
