"""PNG charts: `physreason eval report` writes accuracy bars; `physreason plot RUN_DIR` draws training curves."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_eval_report import write_run

from physreason.errors import InputError
from physreason.eval import collect_reports, report_rows
from physreason.plots import accuracy_figure, curves_figure, read_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "physreason", *args], capture_output=True, text=True, timeout=120)


def two_models(tmp_path: Path) -> Path:
    results = tmp_path / "results"
    for model, right in (("base", 1), ("tuned", 3)):
        for seed in (1, 2):
            write_run(results / model / "reasoning", "robovqa", seed, correct=right, wrong=4 - right, total=4)
            write_run(results / model / "reasoning", "av", seed, correct=seed, wrong=4 - seed, total=4)
    return results


def test_eval_report_writes_an_accuracy_png(tmp_path):
    results = two_models(tmp_path)
    result = cli("eval", "report", str(results))
    assert result.returncode == 0, result.stderr
    chart = results / "accuracy.png"
    assert chart.read_bytes().startswith(PNG_MAGIC) and str(chart) in result.stdout


def test_accuracy_bars_are_mean_percent_per_dataset_and_model_with_std_error_bars(tmp_path):
    figure = accuracy_figure(report_rows(collect_reports(two_models(tmp_path))))
    axes = figure.axes[0]
    assert [t.get_text() for t in axes.get_xticklabels()] == ["av", "robovqa", "average"]
    heights = [round(bar.get_height(), 6) for bar in axes.patches]
    # base: av 37.5, robovqa 25, average 31.25; tuned: av 37.5, robovqa 75, average 56.25
    assert heights == [37.5, 25.0, 31.25, 37.5, 75.0, 56.25]
    assert [text.get_text() for text in axes.get_legend().get_texts()] == ["base", "tuned"]


def write_metrics(run: Path, lines: list[dict]) -> Path:
    (run / "logs").mkdir(parents=True)
    path = run / "logs" / "metrics.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"step": 9, "train/lo')
    return path


def test_plot_command_draws_loss_reward_lr_and_accuracy_curves(tmp_path):
    run = tmp_path / "run"
    write_metrics(run, [{"step": s, "time": 0.0, "loss": 1.0 / s, "reward/total_mean": 0.1 * s, "train/lr": 1e-3,
                         "rollout/accuracy": 0.2 * s, "rollout/queue": 3} for s in range(1, 5)])
    result = cli("plot", str(run))
    assert result.returncode == 0, result.stderr
    assert (run / "curves.png").read_bytes().startswith(PNG_MAGIC)
    assert "loss, reward, learning rate, accuracy" in result.stdout


def test_curves_keep_the_last_value_of_a_step_logged_twice(tmp_path):
    path = write_metrics(tmp_path / "run", [{"step": 1, "train/loss": 5.0}, {"step": 2, "train/loss": 4.0},
                                            {"step": 2, "train/loss": 3.0}, {"step": 3, "val/loss": 3.5}])
    metrics = read_metrics(path)
    assert metrics["train/loss"] == [(1, 5.0), (2, 3.0)]
    figure, panels = curves_figure(metrics, str(path))
    assert panels == ["loss"]
    lines = {line.get_label(): list(line.get_ydata()) for line in figure.axes[0].get_lines()}
    assert lines == {"train/loss": [5.0, 3.0], "val/loss": [3.5]}


def test_plot_without_metrics_is_a_clear_error(tmp_path):
    result = cli("plot", str(tmp_path))
    assert result.returncode == 2 and "logs/metrics.jsonl does not exist" in result.stderr
    assert "Traceback" not in result.stderr
    write_metrics(tmp_path / "run", [{"step": 1, "rollout/queue": 2}])
    with pytest.raises(InputError, match="no loss, reward, learning-rate or accuracy metrics"):
        curves_figure(read_metrics(tmp_path / "run" / "logs" / "metrics.jsonl"), "m")
