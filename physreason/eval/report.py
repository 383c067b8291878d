"""Accuracy reports from result folders: per data set mean ± std over repeats, as a rich table, markdown and CSV.

Accuracy of a repeat = correct / scored, where scored samples are those with a completion; samples
that failed (corrupt clip, path outside the data root, engine error) are counted in their own column,
and samples with no result yet (a run that stopped early) in `missing`. `unparsed` counts scored
completions from which no option could be read, or no JSON in the reference's layout (scored wrong; many of them mean a format problem, not
a reasoning one). Chance is the mean over questions of 1 / options, recorded in run.json by the run. The `average` row of a model is
the mean over data sets of each repeat's accuracy (macro average, as the Cosmos-Reason1 paper reports),
then mean ± std over the repeats that every data set has.

Structured data sets (Cosmos-Reason2's JSON answers: boxes, points, time spans) also report the mean IoU
(temporal IoU for time spans; a point scores 1 inside the body's box, else 0), and their accuracy is the
share of answers with IoU >= 0.5: accuracy at IoU 0.5 for boxes, R@0.5 for time spans.

Every report names, above each model's table, the settings that made its results (from each run's run.json):
model and revision, prompt style and mode, fps and resolved pixel budgets, sampling, seeds, physreason version.
"""

from __future__ import annotations

import csv
import io
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from physreason.errors import InputError
from physreason.eval.pai_bench import BoardReport, board_markdown
from physreason.eval.results import MERGED_FILE, RUN_FILE, read_run, read_run_info
from physreason.eval.scoring import accuracy, mean_std

AVERAGE = "average"
CSV_COLUMNS = (
    "model",
    "answer_type",
    "dataset",
    "repeats",
    "seeds",
    "samples",
    "scored",
    "correct",
    "failed",
    "missing",
    "unparsed",
    "unparsed_pct",
    "chance_pct",
    "accuracy_pct_mean",
    "accuracy_pct_std",
    "accuracy_pct_per_repeat",
    "mean_iou_pct_mean",
    "mean_iou_pct_std",
)


@dataclass(frozen=True)
class RepeatScore:
    """Counts of one repeat (one seed) of one data set."""

    seed: str
    total: int  # questions in the data set (from run.json; else scored + failed)
    scored: int
    correct: int
    failed: int
    unparsed: int = 0  # scored completions with no readable option
    chance: float | None = None  # mean of 1 / options over the questions (run.json; None in older results)
    iou_sum: float = 0.0  # structured answers: sum of the scored samples' IoU
    iou_count: int = 0

    @property
    def mean_iou(self) -> float | None:
        """Mean IoU of the scored structured answers; None when the data set has none."""
        return self.iou_sum / self.iou_count if self.iou_count else None

    @property
    def missing(self) -> int:
        """Questions with no result yet."""
        return max(self.total - self.scored - self.failed, 0)

    @property
    def accuracy(self) -> float | None:
        """correct / scored; None when nothing was scored."""
        return accuracy(self.correct, self.scored)


@dataclass
class DatasetReport:
    """One model's results on one data set in one answer mode, over its repeats (ordered by seed)."""

    model: str
    answer_type: str
    dataset: str
    repeats: list[RepeatScore] = field(default_factory=list)
    settings: list[dict[str, Any]] = field(default_factory=list)  # each repeat's run.json "settings", when recorded

    def accuracies(self) -> list[float]:
        """Each repeat's accuracy, leaving out repeats with nothing scored."""
        return [r.accuracy for r in self.repeats if r.accuracy is not None]

    def mean_std(self) -> tuple[float | None, float | None]:
        """Mean and sample std of the per-repeat accuracies (std None with one repeat)."""
        return mean_std(self.accuracies())

    def iou_mean_std(self) -> tuple[float | None, float | None]:
        """Mean and sample std over repeats of the per-repeat mean IoU (None for a letter data set)."""
        return mean_std([r.mean_iou for r in self.repeats if r.mean_iou is not None])


def _number(value: Any) -> bool:
    """Whether `value` is a finite int or float (not a bool)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def score_run(run: Path) -> RepeatScore:
    """Count one run folder's results: scored (with a boolean is_correct), correct, failed (anything else), unparsed."""
    records = read_run(run)
    scored_records = [r for r in records.values() if isinstance(r.get("is_correct"), bool)]
    correct = sum(1 for r in scored_records if r["is_correct"] is True)
    unparsed = sum(1 for r in scored_records if r.get("prediction") is None)
    # a results line is the model's output scored: an iou that is not a finite number in [0, 1] is no score
    ious = [float(r["iou"]) for r in scored_records if _number(r.get("iou")) and 0 <= r["iou"] <= 1]
    info = read_run_info(run)
    chance = info.get("chance")
    total = info.get("total")
    return RepeatScore(
        seed=run.name.removeprefix("seed_"),
        total=total if isinstance(total, int) and not isinstance(total, bool) and total >= 0 else len(records),
        scored=len(scored_records),
        correct=correct,
        failed=len(records) - len(scored_records),
        unparsed=unparsed,
        chance=float(chance) if isinstance(chance, int | float) and not isinstance(chance, bool) else None,
        iou_sum=sum(ious),
        iou_count=len(ious),
    )


def _run_folders(results_dir: Path) -> list[Path]:
    """Every run folder (holding run.json or result files) at or below `results_dir`."""
    marks = [RUN_FILE, MERGED_FILE, "shard-*-of-*.jsonl"]
    return sorted({path.parent for mark in marks for path in results_dir.rglob(mark)})


def collect_reports(results_dir: str | Path) -> list[DatasetReport]:
    """Score every run under `results_dir` (any level of `<results>/<model>/<answer_type>/<dataset>/seed_<s>`)."""
    root = Path(results_dir).expanduser().resolve()
    if not root.is_dir():
        raise InputError(
            f"results folder {root} does not exist: pass the eval.results_dir of a finished or running evaluation"
        )
    groups: dict[tuple[str, str, str], list[RepeatScore]] = defaultdict(list)
    settings: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for run in _run_folders(root):
        dataset_dir = run.parent
        answer_dir = dataset_dir.parent
        key = (answer_dir.parent.name, answer_dir.name, dataset_dir.name)
        groups[key].append(score_run(run))
        recorded = read_run_info(run).get("settings")
        if isinstance(recorded, dict):
            settings[key].append(recorded)
    if not groups:
        raise InputError(
            f"no results under {root}: expected <model>/<answer_type>/<dataset>/seed_<seed>/results.jsonl; "
            "run `physreason eval --config ...` first"
        )
    reports = []
    for (model, answer_type, dataset), repeats in sorted(groups.items()):
        repeats.sort(key=lambda r: (len(r.seed), r.seed))
        reports.append(DatasetReport(model, answer_type, dataset, repeats, settings[(model, answer_type, dataset)]))
    return reports


def macro_average(reports: list[DatasetReport]) -> tuple[float | None, float | None, int]:
    """Mean ± std over repeats of the per-repeat mean accuracy across data sets; also how many repeats were used.

    Only seeds present (and scored) in every data set enter, so each average covers the same data sets.
    """
    per_dataset = [{r.seed: r.accuracy for r in rep.repeats if r.accuracy is not None} for rep in reports]
    if not per_dataset:
        return None, None, 0
    common = set.intersection(*(set(d) for d in per_dataset))
    averages = [sum(d[seed] for d in per_dataset) / len(per_dataset) for seed in sorted(common)]
    mean, std = mean_std(averages)
    return mean, std, len(averages)


@dataclass(frozen=True)
class ReportRow:
    """One line of the report, ready to print."""

    model: str
    answer_type: str
    dataset: str
    repeats: int
    seeds: str
    samples: int | None
    scored: int | None
    correct: int | None
    failed: int | None
    missing: int | None
    mean: float | None
    std: float | None
    per_repeat: list[float]
    unparsed: int | None = None
    chance: float | None = None

    @property
    def unparsed_fraction(self) -> float | None:
        """unparsed / scored; None when nothing was scored or the row has no counts (an average row)."""
        return accuracy(self.unparsed, self.scored) if self.unparsed is not None and self.scored else None
    iou_mean: float | None = None
    iou_std: float | None = None


def report_rows(reports: list[DatasetReport]) -> list[ReportRow]:
    """One row per data set, and an `average` row per model and answer type when it has several data sets."""
    rows = []
    by_model: dict[tuple[str, str], list[DatasetReport]] = defaultdict(list)
    for rep in reports:
        by_model[(rep.model, rep.answer_type)].append(rep)
    for (model, answer_type), group in by_model.items():
        for rep in group:
            mean, std = rep.mean_std()
            rows.append(
                ReportRow(
                    model,
                    answer_type,
                    rep.dataset,
                    len(rep.repeats),
                    ",".join(r.seed for r in rep.repeats),
                    max(r.total for r in rep.repeats),
                    sum(r.scored for r in rep.repeats),
                    sum(r.correct for r in rep.repeats),
                    sum(r.failed for r in rep.repeats),
                    sum(r.missing for r in rep.repeats),
                    mean,
                    std,
                    rep.accuracies(),
                    sum(r.unparsed for r in rep.repeats),
                    _chance(rep.repeats),
                    *rep.iou_mean_std(),
                )
            )
        if len(group) > 1:
            mean, std, count = macro_average(group)
            chances = [_chance(rep.repeats) for rep in group]
            chance = None if None in chances else sum(chances) / len(chances)  # type: ignore[arg-type]
            rows.append(
                ReportRow(model, answer_type, AVERAGE, count, "", None, None, None, None, None, mean, std, [], None, chance)
            )
    return rows


def _chance(repeats: list[RepeatScore]) -> float | None:
    """The data set's chance accuracy as its repeats recorded it (None when one of them did not)."""
    chances = [r.chance for r in repeats]
    return None if not chances or None in chances else chances[0]


def _pct(value: float | None, digits: int = 2) -> str:
    return "" if value is None else f"{100 * value:.{digits}f}"


def _accuracy_text(row: ReportRow) -> str:
    if row.mean is None:
        return "-"
    return f"{_pct(row.mean)} ± {_pct(row.std)}" if row.std is not None else _pct(row.mean)


def _count(value: int | None) -> str:
    return "" if value is None else str(value)


def _unparsed_text(row: ReportRow) -> str:
    """"3 (12%)": completions with no readable option, and their share of the scored ones."""
    fraction = row.unparsed_fraction
    if row.unparsed is None or fraction is None:
        return _count(row.unparsed)
    return f"{row.unparsed} ({100 * fraction:.0f}%)" if row.unparsed else "0"


_DISPLAY_COLUMNS = (
    "model", "answer type", "dataset", "repeats", "samples", "failed", "missing", "unparsed", "accuracy %"
)
# Shown only when some data set has structured answers, so letter-only reports keep their columns.
_IOU_COLUMN = "mean IoU %"
# The terminal table names model and answer type once per table, so each table fits 80 columns.
_TERMINAL_COLUMNS = _DISPLAY_COLUMNS[2:]
# The markdown table (no width limit) also shows chance beside the accuracy, as the CSV and the chart do.
_CHANCE_COLUMN = "chance %"


def _accuracy_column(rows: list[ReportRow]) -> str:
    """The accuracy column's name: a structured answer (box, point, time span) counts as correct at IoU >= 0.5."""
    if not _with_iou(rows):
        return "accuracy %"
    if all(row.iou_mean is not None for row in rows if row.dataset != AVERAGE):
        return "accuracy % (IoU >= 0.5)"
    return "accuracy % (letters; IoU >= 0.5 for boxes, points, spans)"


def _iou_text(row: ReportRow) -> str:
    if row.iou_mean is None:
        return ""
    return f"{_pct(row.iou_mean)} ± {_pct(row.iou_std)}" if row.iou_std is not None else _pct(row.iou_mean)


def _with_iou(rows: list[ReportRow]) -> bool:
    return any(row.iou_mean is not None for row in rows)


def _display_cells(row: ReportRow, iou: bool = False) -> list[str]:
    return [
        row.model,
        row.answer_type,
        row.dataset,
        str(row.repeats),
        _count(row.samples),
        _count(row.failed),
        _count(row.missing),
        _unparsed_text(row),
        _accuracy_text(row),
    ] + ([_iou_text(row)] if iou else [])


def _seeds_text(settings: list[dict[str, Any]]) -> str:
    seeds = sorted({int(s["seed"]) for s in settings if isinstance(s.get("seed"), int)})
    return ",".join(map(str, seeds))


def _describe(settings: dict[str, Any]) -> dict[str, str]:
    """One run's settings as the header's lines (seed apart: the header lists all repeats' seeds)."""
    get = settings.get
    if get("model_fingerprint"):  # a local folder: which weights, not a Hub branch
        model = f"{get('model')} (local folder, content hash {get('model_fingerprint')})"
    else:
        revision = get("model_revision") or "default branch"
        if get("model_commit"):
            revision += f" (commit {get('model_commit')})"
        model = f"{get('model')} @ {revision}"
    mode = "on" if get("reasoning") else "off"
    prompt = f"{get('prompt_style')}, reasoning {mode}"
    if get("system_prompt") is not None:
        prompt += f", system prompt {get('system_prompt')!r}"
    elif get("system_prompt_used") is not None:  # the style's own, as the run resolved it
        prompt += f", system prompt {get('system_prompt_used')!r} (the style's)"
    frames = f"nframes {get('nframes')}" if get("nframes") else f"fps {get('fps')}"
    vision = (
        f"{frames}, frames {get('min_frames')}-{get('max_frames')}, pixels min {get('min_pixels')} / max "
        f"{get('max_pixels')} / total {get('total_pixels')} (patch factor {get('patch_factor')})"
    )
    if get("timestamps"):
        vision += ", timestamp overlay"
    sampling = ", ".join(
        f"{name} {get(key)}"
        for name, key in (
            ("temperature", "temperature"),
            ("top_p", "top_p"),
            ("top_k", "top_k"),
            ("repetition", "repetition_penalty"),
            ("presence", "presence_penalty"),
            ("frequency", "frequency_penalty"),
            ("max_tokens", "max_tokens"),
        )
    )
    return {
        "model": model,
        "prompt": prompt,
        "vision": vision,
        "sampling": sampling,
        "engine": str(get("engine")),
        "physreason": str(get("physreason_version")),
    }


def settings_header(reports: list[DatasetReport]) -> list[tuple[str, str]]:
    """The settings behind one model's results as (name, text) lines; runs that differ show each value."""
    recorded = [s for rep in reports for s in rep.settings]
    if not recorded:
        return [("settings", "not recorded (results written by hand or by an older physreason)")]
    described = [_describe(s) for s in recorded]
    lines = [(name, " | ".join(dict.fromkeys(d[name] for d in described))) for name in described[0]]
    seed_rule = recorded[0].get("seed_rule", "")
    lines.insert(4, ("seeds", f"{_seeds_text(recorded)} ({seed_rule})" if seed_rule else _seeds_text(recorded)))
    unrecorded = sum(len(rep.repeats) for rep in reports) - len(recorded)
    if unrecorded > 0:
        lines.append(("unrecorded", f"{unrecorded} repeat(s) have no recorded settings"))
    return lines


def _group_reports(reports: list[DatasetReport]) -> dict[tuple[str, str], list[DatasetReport]]:
    groups: dict[tuple[str, str], list[DatasetReport]] = defaultdict(list)
    for rep in reports:
        groups[(rep.model, rep.answer_type)].append(rep)
    return groups


def rich_table(rows: list[ReportRow], title: str, reports: list[DatasetReport] | None = None) -> Group:
    """The report for a terminal: `title`, then one table per model and answer type (accuracy as mean ± std in %).

    Each table names its model and answer type in its title, so its columns fit an 80-column terminal;
    failures, missing results and unparsed answers are highlighted. With `reports`, each table is preceded by
    the settings that made its results (settings_header).
    """
    headers = {key: settings_header(group) for key, group in _group_reports(reports or []).items()}
    tables: list[Table | Text] = []
    groups: dict[tuple[str, str], list[ReportRow]] = defaultdict(list)
    for row in rows:
        groups[(row.model, row.answer_type)].append(row)
    for (model, answer_type), group in groups.items():
        # No vertical rules: seven columns of counts and "mean ± std" then fit 80 columns with whole names.
        table = Table(
            title=f"{model} ({answer_type})",
            title_justify="left",
            box=box.SIMPLE_HEAD,
            show_edge=False,
            pad_edge=False,
            collapse_padding=True,
        )
        iou = _with_iou(group)
        names = (*_TERMINAL_COLUMNS[:-1], _accuracy_column(group)) + ((_IOU_COLUMN,) if iou else ())
        for name in names:
            text_column = name == "dataset"
            # A long data set name folds onto more lines rather than being cut: a truncated name is ambiguous.
            table.add_column(name, justify="left" if text_column else "right", no_wrap=not text_column, overflow="fold")
        for row in group:
            cells = _display_cells(row, iou)[2:]
            if row.failed:
                cells[3] = f"[red]{cells[3]}[/]"
            if row.missing:
                cells[4] = f"[yellow]{cells[4]}[/]"
            if row.unparsed:
                cells[5] = f"[yellow]{cells[5]}[/]"
            table.add_row(*cells, style="bold" if row.dataset == AVERAGE else None)
        if (model, answer_type) in headers:
            tables.append(Text("\n".join(f"{name}: {text}" for name, text in headers[(model, answer_type)])))
        tables.append(table)
    spaced = [part for table in tables for part in (Text(""), table)]  # a blank line before each model's table
    return Group(Text(title, style="bold"), *spaced)


def markdown_table(rows: list[ReportRow]) -> str:
    """The report as a GitHub markdown table."""
    iou = _with_iou(rows)
    columns = (*_DISPLAY_COLUMNS[:-1], _CHANCE_COLUMN, _accuracy_column(rows)) + ((_IOU_COLUMN,) if iou else ())
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = _display_cells(row, iou)
        cells.insert(len(_DISPLAY_COLUMNS) - 1, _pct(row.chance))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def markdown_settings(reports: list[DatasetReport]) -> str:
    """Each model's settings header as a markdown list, one section per model and answer type."""
    parts = []
    for (model, answer_type), group in _group_reports(reports).items():
        lines = [f"### {model} ({answer_type})", ""]
        lines += [f"- {name}: {text}" for name, text in settings_header(group)]
        parts.append("\n".join(lines) + "\n")
    return "\n".join(parts)


def csv_text(rows: list[ReportRow]) -> str:
    """The report as CSV (accuracies in percent, 4 decimals; empty where not defined)."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for row in rows:
        writer.writerow(
            [
                row.model,
                row.answer_type,
                row.dataset,
                row.repeats,
                row.seeds,
                _count(row.samples),
                _count(row.scored),
                _count(row.correct),
                _count(row.failed),
                _count(row.missing),
                _count(row.unparsed),
                _pct(row.unparsed_fraction, 4),
                _pct(row.chance, 4),
                _pct(row.mean, 4),
                _pct(row.std, 4),
                ";".join(_pct(a, 4) for a in row.per_repeat),
                _pct(row.iou_mean, 4),
                _pct(row.iou_std, 4),
            ]
        )
    return buffer.getvalue()


def markdown_report(reports: list[DatasetReport], boards: list[BoardReport] = ()) -> str:
    """report.md: each model's settings, the accuracy table, then any Physical AI Bench board."""
    text = "## Settings\n\n" + markdown_settings(reports) + "\n## Accuracy\n\n" + markdown_table(report_rows(reports))
    if boards:
        text += "\n## Physical AI Bench\n\n" + board_markdown(list(boards))
    return text
