"""`physreason eval`: run a benchmark evaluation from a recipe, or `physreason eval report DIR` to tabulate results."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from physreason.cli.output_options import hidden_alias, one_path
from physreason.progress import make_console

if TYPE_CHECKING:
    from physreason.eval.launch import EvalPlan

console = make_console()

app = typer.Typer(
    help="Benchmark evaluation: `physreason eval --config eval.toml` runs it, `physreason eval report DIR` scores it.",
    invoke_without_command=True,
)


@app.callback()
def run(
    ctx: typer.Context,
    config: Path | None = typer.Option(
        None, "--config", "-c", help="TOML recipe with [eval], [model], [engine], [vision], [generation]."
    ),
    overrides: list[str] = typer.Option(
        [], "--set", metavar="KEY=VALUE", help="Override a config key: --set eval.num_repeats=5 (repeatable)."
    ),
    model: str | None = typer.Option(None, "--model", "-m", help="Hub id or local model folder."),
    engine: str | None = typer.Option(None, help="Engine: auto (vLLM when installed), vllm or hf."),
    benchmark_root: Path | None = typer.Option(None, help="Folder holding <name>/<name>_benchmark_qa_pairs.json."),
    dataset: list[str] = typer.Option(
        [],
        "--dataset",
        "-d",
        metavar="<name|file>",
        help="Data set name, JSON/JSONL/parquet file, dataset folder or Hub id (repeatable; replaces eval.datasets).",
    ),
    answer_type: str | None = typer.Option(
        None, help="reasoning (think, then answer) or letter; unset it follows --reasoning/--no-reasoning."
    ),
    reasoning: bool | None = typer.Option(
        None,
        "--reasoning/--no-reasoning",
        help="Ask for <think> reasoning before the answer (prompt.reasoning) [default: the prompt style's].",
    ),
    prompt_style: str | None = typer.Option(
        None, help="Prompt style (prompt.style): auto (from the checkpoint's family), reason1 or reason2."
    ),
    num_repeats: int | None = typer.Option(None, help="Runs with seeds seed, seed+1, ...; mean ± std is reported."),
    seed: int | None = typer.Option(None, help="Seed of the first repeat."),
    out: Path | None = typer.Option(
        None, "--out", help="Results go under OUT / model / answer type / data set / seed_N (sets eval.results_dir)."
    ),
    num_gpus: int | None = typer.Option(None, help="GPUs in all; shards = num_gpus / tensor-parallel size."),
    tensor_parallel_size: int | None = typer.Option(
        None, "--tensor-parallel-size", "--tp", help="GPUs per engine (vLLM's name; sets eval.tp_size)."
    ),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show a progress bar."),
    results_dir: Path | None = hidden_alias("--results-dir"),  # the older name of --out: scripts keep working
    output_dir: Path | None = hidden_alias("--output-dir"),
) -> None:
    """Evaluate a model on Cosmos-Reason1-layout benchmarks or Physical AI Bench; rerunning resumes from saved results."""
    if ctx.invoked_subcommand is not None:
        return
    from physreason.config import load_config
    from physreason.eval import board_rich_tables, collect_boards, collect_reports, report_rows, rich_table, run_eval

    results_dir = one_path("--out", out, {"--results-dir": results_dir, "--output-dir": output_dir})
    flags = {
        "model.model_name_or_path": model,
        "engine.backend": engine,
        "eval.benchmark_root": str(benchmark_root) if benchmark_root else None,
        "eval.datasets": list(dataset) or None,
        "eval.answer_type": answer_type,
        "prompt.reasoning": reasoning,
        "prompt.style": prompt_style,
        "eval.num_repeats": num_repeats,
        "eval.seed": seed,
        "eval.results_dir": str(results_dir) if results_dir else None,
        "eval.num_gpus": num_gpus,
        "eval.tp_size": tensor_parallel_size,
    }
    cfg = load_config(config, overrides, {key: value for key, value in flags.items() if value is not None})
    outcome = run_eval(cfg, show_progress=progress, on_start=_startup)
    answered = sum(r.answered for r in outcome.runs)
    failed = sum(r.failed for r in outcome.runs)
    console.print(f"{answered} answered, {failed} failed ({outcome.resumed} were already saved) in {outcome.base}")
    if failed:
        console.print(f'[yellow]{failed} sample(s) failed; each result line with an "error" key says why[/]')
    reports = collect_reports(outcome.base)
    console.print(rich_table(report_rows(reports), title=str(outcome.base), reports=reports))
    for table in board_rich_tables(collect_boards(outcome.base)):
        console.print(table)


def _startup(plan: EvalPlan) -> None:
    """eval's start-up summary, before any model loads: what the report's header will say, and the work ahead."""
    from physreason.engines.factory import resolve_backend
    from physreason.eval.launch import chance_accuracy
    from physreason.eval.settings import model_fingerprint, system_prompt_text
    from physreason.startup import (
        describe_device,
        describe_family,
        describe_model,
        describe_prompting,
        describe_sampling,
        print_startup,
    )

    cfg, setup = plan.config, plan.setup
    model = describe_model(cfg.model)
    local = Path(cfg.model.model_name_or_path).expanduser()
    if local.is_dir():
        model = f"{local.resolve()} (local folder, content hash {model_fingerprint(local)})"
    prompt = describe_prompting(setup.prompting)
    if setup.prompting.system_prompt is None:
        prompt += f", system prompt {system_prompt_text(setup.prompting, setup.answer_type)!r} (the style's)"
    data = []
    for benchmark in plan.benchmarks:
        chance = chance_accuracy(benchmark)
        data.append(
            f"{benchmark.name} ({len(benchmark.samples)} questions"
            + (f", chance {100 * chance:.1f}%" if chance is not None else "")
            + ")"
        )
    shards = plan.num_shards
    items: dict[str, object] = {
        "model": model,
        "family": describe_family(cfg.model),
        "prompt": prompt,
        "device": describe_device(cfg.model.dtype, resolve_backend(cfg.engine), cfg.eval.tp_size),
        # each repeat's seed replaces the sampling seed
        "sampling": describe_sampling(setup.sampling, seed=False),
        "seeds": ", ".join(map(str, plan.seeds)),
        "data sets": "; ".join(data),
        "shards": shards if shards > 1 else None,
        "results": plan.base,
    }
    print_startup("physreason eval", items, console=console)


# What `eval report` writes into its folder; with --out, none of them is replaced without --overwrite. Those an
# earlier report left that this one does not write (board.csv of a results folder without Physical AI Bench now,
# accuracy.png before any sample is scored) are removed, so the folder holds one report; no other file is touched.
REPORT_FILES = ("report.md", "report.csv", "board.csv", "accuracy.png")
# Beside them: the names the last report wrote. In RESULTS_DIR (no --out) only those are replaced or removed without
# --overwrite: a report.md or accuracy.png of the user's own there is refused, not replaced.
REPORT_RECORD = ".physreason-report.json"


def _recorded_report_files(folder: Path) -> set[str]:
    """The report files an earlier `eval report` recorded writing into `folder` (none when unrecorded or unreadable)."""
    try:
        names = json.loads((folder / REPORT_RECORD).read_text(encoding="utf-8")).get("files", [])
    except (OSError, ValueError, AttributeError):
        return set()
    return {name for name in names if name in REPORT_FILES} if isinstance(names, list) else set()


@app.command("report")
def report(
    results_dir: Path = typer.Argument(..., help="An eval.results_dir, or any folder below it."),
    out: Path | None = typer.Option(
        None, help="Folder for report.md, report.csv and accuracy.png [default: RESULTS_DIR]."
    ),
    overwrite: bool = typer.Option(
        False,
        "--overwrite",
        help="Replace the report files in --out if they exist, removing those this report does not write (never "
        "the results or any other file).",
    ),
    force: bool = hidden_alias("--force", flag=True),
) -> None:
    """Print per-data-set accuracy (mean ± std over repeats, samples, failures) under the settings that made it;
    write report.md, report.csv (board.csv for Physical AI Bench) and a chart."""
    from physreason.errors import InputError
    from physreason.eval import (
        board_csv,
        board_rich_tables,
        collect_boards,
        collect_reports,
        csv_text,
        markdown_report,
        report_rows,
        rich_table,
    )
    from physreason.files import write_atomic
    from physreason.plots import accuracy_chart

    if out is not None and out.exists() and not out.is_dir():
        raise InputError(f"--out {out} is a file: give the folder to write report.md, report.csv and accuracy.png into")
    if out is not None and not (overwrite or force):
        existing = [name for name in REPORT_FILES if (out / name).exists() or (out / name).is_symlink()]
        if existing:
            raise InputError(
                f"{out} already holds {', '.join(existing)}: give a new folder, or pass --overwrite to replace them"
            )
    if out is None and not (overwrite or force):
        recorded = _recorded_report_files(results_dir)
        foreign = [name for name in REPORT_FILES if name not in recorded
                   and ((results_dir / name).exists() or (results_dir / name).is_symlink())]  # fmt: skip
        if foreign:
            raise InputError(
                f"{results_dir} holds {', '.join(foreign)}, which no earlier `physreason eval report` recorded writing "
                f"there (in {REPORT_RECORD}): pass --overwrite to replace them, or --out a folder for the report"
            )
    reports = collect_reports(results_dir)
    boards = collect_boards(results_dir)
    rows = report_rows(reports)
    console.print(rich_table(rows, title=f"accuracy: {results_dir}", reports=reports))
    for table in board_rich_tables(boards):
        console.print(table)
    folder = out or results_dir
    folder.mkdir(parents=True, exist_ok=True)
    # Each file is written to a temporary beside it and renamed over it: a link in its place is replaced, never
    # written through into its target.
    write_atomic(folder / "report.md", markdown_report(reports, boards))
    write_atomic(folder / "report.csv", csv_text(rows))
    written = [folder / "report.md", folder / "report.csv"]
    if boards:
        write_atomic(folder / "board.csv", board_csv(boards))
        written.append(folder / "board.csv")
    if any(row.mean is not None for row in rows):
        chart = folder / "accuracy.png"
        accuracy_chart(rows, chart)
        written.append(chart)
    else:
        console.print("[yellow]no scored sample yet: no accuracy.png[/]")
    for name in REPORT_FILES:  # an earlier report's file this one does not write would read as current: removed
        stale = folder / name
        if stale not in written and (stale.is_file() or stale.is_symlink()):
            stale.unlink()  # a link goes, its target stays
    write_atomic(folder / REPORT_RECORD, json.dumps({"files": [path.name for path in written]}) + "\n")
    console.print(f"wrote {', '.join(str(p) for p in written)}", soft_wrap=True)  # paths unbroken, to copy
