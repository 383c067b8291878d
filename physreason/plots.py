"""PNG charts: accuracy per data set and model from an eval report, training curves from a run's metrics.jsonl.

matplotlib draws on a `Figure` of its own (no pyplot, no display), so plotting works on a headless machine
and leaves no global state behind.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from physreason.errors import InputError
from physreason.eval.report import AVERAGE, ReportRow

# Panels of `physreason plot`, each with the test a metric name must pass to be drawn in it.
CURVE_PANELS: dict[str, Any] = {
    "loss": lambda key: key == "loss" or key.endswith(("/loss", "_loss")),
    "reward": lambda key: key.startswith("reward/") and key.endswith("_mean"),
    "learning rate": lambda key: key == "lr" or key.endswith("/lr"),
    "accuracy": lambda key: "accuracy" in key,
}


def accuracy_chart(rows: list[ReportRow], path: str | Path) -> Path:
    """Write `accuracy_figure(rows)` as a PNG at `path` and return the path."""
    out = Path(path)
    accuracy_figure(rows).savefig(out, dpi=120)
    return out


def accuracy_figure(rows: list[ReportRow]) -> Any:
    """A bar chart (matplotlib Figure) of mean accuracy (%) per data set, one bar per model and answer type.

    The std over repeats is the error bar; the `average` rows come last. Structured data sets (boxes, time
    spans) add their mean IoU as a black diamond on their bar (accuracy there is at IoU 0.5). Raises
    InputError when no row has an accuracy yet.
    """
    from matplotlib.figure import Figure

    scored = [row for row in rows if row.mean is not None]
    if not scored:
        raise InputError("no data set has a scored sample yet: nothing to chart")
    datasets = list(dict.fromkeys(row.dataset for row in scored if row.dataset != AVERAGE))
    if any(row.dataset == AVERAGE for row in scored):
        datasets.append(AVERAGE)
    series = list(dict.fromkeys((row.model, row.answer_type) for row in scored))
    by_key = {(row.model, row.answer_type, row.dataset): row for row in scored}
    figure = Figure(figsize=(max(6.0, 1.2 * len(datasets) * max(1, len(series)) ** 0.5 + 2), 4.5), layout="constrained")
    axes = figure.subplots()
    width = 0.8 / len(series)
    iou_label = "mean IoU"
    for k, (model, answer_type) in enumerate(series):
        positions, heights, errors = [], [], []
        iou_positions, iou_heights, iou_errors = [], [], []
        for d, dataset in enumerate(datasets):
            row = by_key.get((model, answer_type, dataset))
            if row is None:
                continue
            positions.append(d - 0.4 + width * (k + 0.5))
            heights.append(100 * row.mean)  # type: ignore[operator]
            errors.append(100 * row.std if row.std is not None else 0.0)
            if row.iou_mean is not None:
                iou_positions.append(positions[-1])
                iou_heights.append(100 * row.iou_mean)
                iou_errors.append(100 * row.iou_std if row.iou_std is not None else 0.0)
        label = model if len({s[1] for s in series}) == 1 else f"{model} ({answer_type})"
        axes.bar(positions, heights, width, yerr=errors, capsize=3, label=label)
        if iou_positions:
            axes.errorbar(iou_positions, iou_heights, yerr=iou_errors, fmt="D", color="black", capsize=2, label=iou_label)
            iou_label = "_"  # one legend entry for every series' diamonds
    axes.set_xticks(range(len(datasets)), datasets, rotation=20, ha="right")
    axes.set_ylabel("accuracy %")
    axes.set_ylim(0, 100)
    axes.grid(axis="y", alpha=0.3)
    axes.legend(fontsize="small")
    axes.set_title("accuracy per data set (mean ± std over repeats)")
    return figure


def read_metrics(path: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Return each metric's (step, value) points from a metrics.jsonl, sorted by step.

    A step logged twice (a run resumed over logged steps) keeps its last value; torn or non-JSON lines and
    non-numeric values are skipped. Raises InputError naming the file when it does not exist.
    """
    file = Path(path)
    if not file.is_file():
        raise InputError(f"{file} does not exist: give a run's output_dir (with logs/metrics.jsonl) or the file")
    points: dict[str, dict[int, float]] = defaultdict(dict)
    with file.open(encoding="utf-8") as handle:
        for line in handle:
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(entry, dict) or not isinstance(entry.get("step"), int):
                continue
            for key, value in entry.items():
                if key in ("step", "time") or isinstance(value, bool) or not isinstance(value, int | float):
                    continue
                if math.isfinite(value):
                    points[key][entry["step"]] = float(value)
    return {key: sorted(steps.items()) for key, steps in points.items()}


def metrics_file(run: str | Path) -> Path:
    """The metrics.jsonl of a run folder (`<output_dir>/logs/metrics.jsonl`), or `run` itself when it is a file."""
    run = Path(run)
    return run if run.is_file() else run / "logs" / "metrics.jsonl"


def training_curves(run: str | Path, path: str | Path) -> tuple[Path, list[str]]:
    """Write loss, reward, learning-rate and accuracy curves of a run to a PNG; return it and the panels drawn.

    Only panels with metrics are drawn. Raises InputError when the run logged none of them.
    """
    source = metrics_file(run)
    figure, panels = curves_figure(read_metrics(source), str(source))
    out = Path(path)
    figure.savefig(out, dpi=120)
    return out, panels


def curves_figure(metrics: dict[str, list[tuple[int, float]]], source: str) -> tuple[Any, list[str]]:
    """A matplotlib Figure with one panel per CURVE_PANELS group that has metrics, and the panel names.

    Raises InputError naming `source` when no metric belongs to any panel.
    """
    from matplotlib.figure import Figure

    panels = {
        name: sorted(key for key in metrics if wanted(key)) for name, wanted in CURVE_PANELS.items()
    }
    panels = {name: keys for name, keys in panels.items() if keys}
    if not panels:
        raise InputError(
            f"{source} has no loss, reward, learning-rate or accuracy metrics: is logging.logger missing 'jsonl'?"
        )
    figure = Figure(figsize=(6.5, 2.6 * len(panels)), layout="constrained")
    axes_list = figure.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for axes, (name, keys) in zip(axes_list, panels.items(), strict=True):
        for key in keys:
            steps, values = zip(*metrics[key], strict=True)
            axes.plot(steps, values, label=key, marker="." if len(steps) < 30 else None)
        axes.set_ylabel(name)
        axes.grid(alpha=0.3)
        axes.legend(fontsize="small")
    axes_list[-1].set_xlabel("step")
    figure.suptitle(source)
    return figure, list(panels)
