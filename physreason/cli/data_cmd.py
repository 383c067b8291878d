"""`physreason data`: build data sets; `synth` writes procedural intuitive-physics clips with MCQ and SFT records."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from physreason.cli.output_options import one_path
from physreason.data.synth.tasks import TASK_NAMES

app = typer.Typer(
    help="Data sets: synthetic intuitive-physics clips with benchmark and SFT records, and answer-layout conversion.",
    no_args_is_help=True,
)


@app.command("synth")
def synth(
    out: Annotated[
        Path | None, typer.Option("--out", help="Folder to write into; each task gets its own sub-folder. [required]")
    ] = None,
    task: Annotated[str, typer.Option("--task", help=f"One of {', '.join(TASK_NAMES)}, or all.")] = "all",
    n: Annotated[int, typer.Option("--n", help="Samples per task.")] = 100,
    split: Annotated[
        str, typer.Option("--split", help="train, val or test: scene seeds never overlap between splits.")
    ] = "train",
    seed: Annotated[int, typer.Option("--seed", help="Base seed (>= 0); the same seed gives the same clips.")] = 0,
    workers: Annotated[int, typer.Option("--workers", help="Worker processes; 0 means min(4, CPU count).")] = 0,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show a progress bar.")] = True,
    option_order: Annotated[
        str,
        typer.Option(
            "--option-order",
            help="Letter tasks: shuffled balances the correct letter over samples (benchmark layout); "
            "fixed gives the same options in the same order in every sample.",
        ),
    ] = "shuffled",
    output_dir: Annotated[Path | None, typer.Option("--output-dir", hidden=True)] = None,
) -> None:
    """Generate intuitive-physics clips with their questions (letter tasks: arrow of time, spatial puzzle, object
    permanence; JSON answers: grounding, temporal localization); a rerun completes what is missing."""
    from physreason.data.synth.generate import generate_task
    from physreason.data.synth.tasks import TASKS
    from physreason.errors import InputError

    out = one_path("--out", out, {"--output-dir": output_dir})
    if out is None:
        raise typer.BadParameter("give the folder to write into", param_hint="'--out'")
    if task != "all" and task not in TASK_NAMES:
        raise InputError(f"--task {task!r} is not a synthetic task; choose one of {', '.join(TASK_NAMES)} or all")
    if workers < 0:
        raise InputError(f"--workers must be >= 0, got {workers}")
    if task != "all" and not TASKS[task].n_options and option_order != "shuffled":
        raise InputError(f"--option-order is for the letter tasks; {task} is answered in JSON and has no options")
    n_workers = workers or min(4, os.cpu_count() or 1)
    for name in TASK_NAMES if task == "all" else (task,):
        # a JSON task has no options to order: its folder stays the same whatever the letter tasks were given
        order = option_order if TASKS[name].n_options else "shuffled"
        summary = generate_task(name, n, out, split, seed, n_workers, show_progress=progress, option_order=order)
        typer.echo(
            f"{name}: {summary.count} samples in {summary.folder} "
            f"({summary.generated} generated, {summary.reused} already there)"
        )


@app.command("convert")
def convert(
    source: Annotated[Path, typer.Argument(help="SFT records (JSONL) with Cosmos-Reason1 replies (<answer> tags).")],
    target: Annotated[Path, typer.Argument(help="JSONL file to write; keep it beside SOURCE so media paths still resolve.")],
    style: Annotated[str, typer.Option("--style", help="The answer layout to write: reason2 (the only conversion).")],
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace TARGET if it exists (never SOURCE).")] = False,
) -> None:
    """Rewrite SFT records' assistant replies from Cosmos-Reason1's layout (<think>..</think><answer>..</answer>) to
    Cosmos-Reason2's (the answer right after </think>), for fine-tuning a Reason2 (Qwen3-VL) model."""
    from physreason.data.convert import convert_records
    from physreason.errors import InputError

    if style != "reason2":
        raise InputError(f"--style {style!r}: only reason2 is written (Reason1's layout is what synth and the demo write)")
    if not source.is_file():
        raise InputError(f"{source} does not exist: give a JSONL file of SFT records")
    converted, total = convert_records(source, target, overwrite)
    typer.echo(f"{converted} of {total} records rewritten in Cosmos-Reason2's layout into {target}")
    if source.resolve().parent != target.resolve().parent:
        typer.echo(f"media paths are relative: set data.dataset.media_root = {str(source.resolve().parent)!r}")
