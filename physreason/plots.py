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
from physreason.files import atomic_writer

# Panels of `physreason plot`, each with the test a metric name must pass to be drawn in it. A `_std` metric is
# the spread of a `_mean` one: drawn as a band around it, never as a curve of its own (GRPO logs
# reward/accuracy_std beside reward/accuracy_mean, and "accuracy" in its name must not put it in that panel).
CURVE_PANELS: dict[str, Any] = {
    "loss": lambda key: key == "loss" or key.endswith(("/loss", "_loss")),
    "reward": lambda key: key.startswith("reward/") and key.endswith("_mean"),
    "learning rate": lambda key: key == "lr" or key.endswith("/lr"),
    "accuracy": lambda key: "accuracy" in key and not key.startswith("reward/") and not key.endswith("_std"),
}
# Series that share a panel cycle through these, so one that lies on another still shows at its markers.
_LINESTYLES = ("-", "--", ":", "-.")
_MARKERS = ("o", "s", "^", "D", "v")
# Up to this many points a curve marks every point; above it, markers would hide the line.
_MARKED_POINTS = 60
# Fewer logged steps than this get a note saying how to log more.
_FEW_POINTS = 5


def accuracy_chart(rows: list[ReportRow], path: str | Path) -> Path:
    """Write `accuracy_figure(rows)` as a PNG at `path` and return the path."""
    out = Path(path)
    save_figure(accuracy_figure(rows), out)
    return out


def save_figure(figure: Any, out: Path) -> None:
    """Write a matplotlib Figure to `out` (format from its suffix, PNG without one) through a temporary beside it,
    renamed over `out`: a link at `out` is replaced, never written through into its target."""
    kind = out.suffix.removeprefix(".").lower() or "png"
    supported = figure.canvas.get_supported_filetypes()
    if kind not in supported:
        raise InputError(f"{out}: cannot write a .{kind} figure; end the file name with one of "
                         f"{', '.join('.' + name for name in sorted(supported))}")  # fmt: skip
    with atomic_writer(out, out.with_name(f".{out.name}.tmp")) as handle:
        figure.savefig(handle, format=kind, dpi=120)


def accuracy_figure(rows: list[ReportRow]) -> Any:
    """A bar chart (matplotlib Figure) of mean accuracy (%) per data set, one bar per model and answer type.

    Each bar carries its value; the std over repeats is the error bar; a dashed line over each data set marks
    chance (1 / options, from the runs' run.json) where known; the `average` rows come last. Structured data sets
    (boxes, time spans) add their mean IoU as a black diamond on their bar (accuracy there is at IoU 0.5). Raises
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
            errors.append(100 * row.std if row.std is not None else math.nan)  # nan: no error bar for one repeat
            if row.iou_mean is not None:
                iou_positions.append(positions[-1])
                iou_heights.append(100 * row.iou_mean)
                iou_errors.append(100 * row.iou_std if row.iou_std is not None else 0.0)
        label = model if len({s[1] for s in series}) == 1 else f"{model} ({answer_type})"
        axes.bar(positions, heights, width, yerr=errors, capsize=3, label=label)
        for x, height, error in zip(positions, heights, errors, strict=True):
            top = height + (0.0 if math.isnan(error) else error)  # above the error bar, where it can be read
            axes.annotate(f"{height:.1f}", (x, top), textcoords="offset points", xytext=(0, 2), ha="center",
                          va="bottom", fontsize="small")
        if iou_positions:
            axes.errorbar(iou_positions, iou_heights, yerr=iou_errors, fmt="D", color="black", capsize=2, label=iou_label)
            iou_label = "_"  # one legend entry for every series' diamonds
    chance_label = "chance (1 / options)"
    for d, dataset in enumerate(datasets):
        chance = next((row.chance for row in scored if row.dataset == dataset and row.chance is not None), None)
        if chance is not None:
            axes.hlines(100 * chance, d - 0.45, d + 0.45, colors="black", linestyles="--", linewidth=1.2,
                        label=chance_label, zorder=3, gid="chance")
            chance_label = "_nolegend_"  # one legend entry for all the data sets' lines
    axes.set_xticks(range(len(datasets)), datasets, rotation=20, ha="right")
    axes.set_ylabel("accuracy %")
    axes.set_ylim(0, 108)  # room for a value label above a bar at 100
    axes.grid(axis="y", alpha=0.3)
    axes.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
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
    # errors="replace": a kill inside a multi-byte character leaves bytes that are not UTF-8; that line is skipped
    with file.open(encoding="utf-8", errors="replace") as handle:
        for line in handle:
            try:
                entry = json.loads(line)
            except (ValueError, RecursionError):
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
    save_figure(figure, out)
    return out, panels


def curves_figure(metrics: dict[str, list[tuple[int, float]]], source: str) -> tuple[Any, list[str]]:
    """A matplotlib Figure with one panel per CURVE_PANELS group that has metrics, and the panel names.

    Every logged point is drawn as a line with markers (a run with one logged step still shows a dot with its
    value), series that are identical point for point are drawn once under a joint label, the others get their
    own line style and marker, and a `_mean` curve with a `_std` metric beside it gets a ± std band. When the
    run logged fewer than 5 steps, a note says which steps and how to log more. Raises InputError naming
    `source` when no metric belongs to any panel.
    """
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    panels = {
        name: sorted(key for key in metrics if wanted(key)) for name, wanted in CURVE_PANELS.items()
    }
    panels = {name: keys for name, keys in panels.items() if keys}
    if not panels:
        raise InputError(
            f"{source} has no loss, reward, learning-rate or accuracy metrics: is logging.logger missing 'jsonl'?"
        )
    steps_logged = sorted({step for keys in panels.values() for key in keys for step, _ in metrics[key]})
    note = _few_points_note(steps_logged)
    figure = Figure(figsize=(6.5, 2.6 * len(panels) + (0.4 if note else 0.0)), layout="constrained")
    axes_list = figure.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for axes, (name, keys) in zip(axes_list, panels.items(), strict=True):
        banded = False
        for k, (names, points) in enumerate(_distinct_series(metrics, keys)):
            steps, values = zip(*points, strict=True)
            marked = len(points) <= _MARKED_POINTS
            (line,) = axes.plot(
                steps,
                values,
                # one name a line: five identical rewards on one line made the legend wider than the figure
                label="\n= ".join(names),
                linestyle=_LINESTYLES[k % len(_LINESTYLES)],
                marker=_MARKERS[k % len(_MARKERS)] if marked else None,
                markersize=6 if len(points) == 1 else 4,
                fillstyle="full" if k == 0 else "none",  # a hollow marker over a full one shows both
            )
            spread = metrics.get(names[0].removesuffix("_mean") + "_std") if names[0].endswith("_mean") else None
            if spread:
                _std_band(axes, points, dict(spread), line.get_color(), None if banded else "± std")
                banded = True
            if len(points) == 1:
                axes.annotate(f"{values[0]:.4g}", (steps[0], values[0]), textcoords="offset points", xytext=(6, 6),
                              fontsize="small")
        axes.set_ylabel(name)
        axes.grid(alpha=0.3)
        axes.legend(fontsize="small")
    axes_list[-1].set_xlabel("step")
    axes_list[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    if len(steps_logged) == 1:  # one step alone would sit at the edge of a zero-width axis
        axes_list[-1].set_xlim(steps_logged[0] - 1, steps_logged[0] + 1)
    figure.suptitle(source, fontsize="medium")
    if note:
        figure.supxlabel(note, fontsize="small", color="dimgray")
    return figure, list(panels)


def _distinct_series(
    metrics: dict[str, list[tuple[int, float]]], keys: list[str]
) -> list[tuple[list[str], list[tuple[int, float]]]]:
    """The panel's series with identical ones merged: (names, points), the names of metrics that agree at every point."""
    merged: dict[tuple[tuple[int, float], ...], list[str]] = {}
    for key in keys:
        merged.setdefault(tuple(metrics[key]), []).append(key)
    return [(names, list(points)) for points, names in merged.items()]


def _std_band(
    axes: Any, points: list[tuple[int, float]], spread: dict[int, float], color: Any, label: str | None
) -> None:
    """Shade mean ± std at the steps that logged both."""
    shared = [(step, value, spread[step]) for step, value in points if step in spread]
    if not shared:
        return
    steps = [s for s, _, _ in shared]
    axes.fill_between(steps, [v - d for _, v, d in shared], [v + d for _, v, d in shared], color=color, alpha=0.15,
                      linewidth=0, label=label)


def _few_points_note(steps: list[int]) -> str:
    """A line for a figure with fewer than _FEW_POINTS logged steps: which ones, and how to log every step."""
    if len(steps) >= _FEW_POINTS:
        return ""
    shown = ", ".join(str(step) for step in steps)
    # The last step always logs; the others are multiples of log_freq.
    every = math.gcd(*steps[:-1]) if len(steps) > 1 else None
    cadence = f" (every {every} steps, train.log_freq)" if every and every > 1 else " (train.log_freq)"
    return (
        f"{len(steps)} logged step{'s' if len(steps) > 1 else ''}: {shown}{cadence}; "
        "train with --set train.log_freq=1 to log every step"
    )
