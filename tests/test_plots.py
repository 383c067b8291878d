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
from physreason.plots import accuracy_chart, accuracy_figure, curves_figure, read_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "physreason", *args], capture_output=True, text=True, timeout=300)


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


def test_each_bar_shows_its_value_and_each_data_set_its_chance_line(tmp_path):
    from physreason.eval.results import write_run_info

    results = tmp_path / "results"
    for model, right in (("base", 1), ("tuned", 3)):
        for dataset, options in (("two_way", 2), ("four_way", 4)):
            run = write_run(results / model / "letter", dataset, 1, correct=right, wrong=4 - right)
            write_run_info(run, {"dataset": dataset, "seed": 1, "total": 4, "chance": 1 / options})
    figure = accuracy_figure(report_rows(collect_reports(results)))
    axes = figure.axes[0]
    assert [t.get_text() for t in axes.get_xticklabels()] == ["four_way", "two_way", "average"]
    assert [text.get_text() for text in axes.texts] == ["25.0", "25.0", "25.0", "75.0", "75.0", "75.0"]
    segments = [seg for c in axes.collections if c.get_gid() == "chance" for seg in c.get_segments()]
    assert [(round(seg[0][0], 2), round(seg[1][0], 2), seg[0][1]) for seg in segments] == [
        (-0.45, 0.45, 25.0), (0.55, 1.45, 50.0), (1.55, 2.45, 37.5)  # the average's chance is the mean of both
    ]
    legend = [text.get_text() for text in axes.get_legend().get_texts()]
    assert legend == ["chance (1 / options)", "base", "tuned"]


def test_results_without_a_recorded_chance_draw_no_chance_line(tmp_path):
    figure = accuracy_figure(report_rows(collect_reports(two_models(tmp_path))))
    assert [text.get_text() for text in figure.axes[0].get_legend().get_texts()] == ["base", "tuned"]
    assert not [c for c in figure.axes[0].collections if c.get_gid() == "chance"]


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


def grpo_metrics(steps: list[int]) -> list[dict]:
    """What a GRPO run with only the accuracy reward logs: total equals accuracy, rollout/accuracy repeats it."""
    lines = []
    for s in steps:
        accuracy = 0.25 + 0.05 * s / 10
        lines.append({"step": s, "loss": 0.1 / s, "policy/pg_loss": 0.1 / s, "train/lr": 5e-4,
                      "reward/accuracy_mean": accuracy, "reward/accuracy_std": 0.4, "reward/format_mean": 0.0,
                      "reward/format_std": 0.0, "reward/total_mean": accuracy, "reward/total_std": 0.4,
                      "rollout/accuracy": accuracy})
    return lines


def panel(figure, name):
    return next(axes for axes in figure.axes if axes.get_ylabel() == name)


def test_accuracy_panel_plots_the_mean_never_the_std(tmp_path):
    path = write_metrics(tmp_path / "run", grpo_metrics([10, 20, 30]))
    figure, panels = curves_figure(read_metrics(path), str(path))
    assert panels == ["loss", "reward", "learning rate", "accuracy"]
    accuracy = panel(figure, "accuracy")
    assert [line.get_label() for line in accuracy.get_lines()] == ["rollout/accuracy"]
    assert list(accuracy.get_lines()[0].get_ydata()) == pytest.approx([0.3, 0.35, 0.4])
    every_label = [line.get_label() for axes in figure.axes for line in axes.get_lines()]
    assert not any(label.endswith("_std") for label in every_label)


def test_identical_series_are_drawn_once_under_a_joint_label_and_others_look_different(tmp_path):
    path = write_metrics(tmp_path / "run", grpo_metrics([10, 20, 30]))
    figure, _ = curves_figure(read_metrics(path), str(path))
    reward = panel(figure, "reward")
    lines = reward.get_lines()
    assert [line.get_label() for line in lines] == ["reward/accuracy_mean\n= reward/total_mean", "reward/format_mean"]
    assert lines[0].get_linestyle() != lines[1].get_linestyle() and lines[0].get_marker() != lines[1].get_marker()
    legend = [text.get_text() for text in reward.get_legend().get_texts()]
    assert legend == ["reward/accuracy_mean\n= reward/total_mean", "± std", "reward/format_mean"]
    assert [line.get_label() for line in panel(figure, "loss").get_lines()] == ["loss\n= policy/pg_loss"]


def test_a_run_with_few_logged_steps_shows_every_point_and_says_how_to_log_more(tmp_path):
    # log_freq 10 over 12 steps logs steps 10 and the last, 12
    path = write_metrics(tmp_path / "run", grpo_metrics([10, 12]))
    figure, _ = curves_figure(read_metrics(path), str(path))
    for axes in figure.axes:
        for line in axes.get_lines():
            assert line.get_marker() not in (None, "None", "", " ") and len(line.get_xdata()) == 2
    assert figure.get_supxlabel() == (
        "2 logged steps: 10, 12 (every 10 steps, train.log_freq); train with --set train.log_freq=1 to log every step"
    )
    one = write_metrics(tmp_path / "one", [{"step": 5, "train/loss": 2.5}])
    figure, _ = curves_figure(read_metrics(one), str(one))
    (axes,) = figure.axes
    (line,) = axes.get_lines()
    assert line.get_marker() == "o" and line.get_markersize() >= 6
    assert [text.get_text() for text in axes.texts] == ["2.5"]  # the lone point's value, written beside it
    assert axes.get_xlim() == (4.0, 6.0)
    assert figure.get_supxlabel().startswith("1 logged step: 5 ")


def test_a_long_run_draws_plain_lines_without_a_note(tmp_path):
    path = write_metrics(tmp_path / "run", [{"step": s, "train/loss": 1.0 / s} for s in range(1, 201)])
    figure, _ = curves_figure(read_metrics(path), str(path))
    (line,) = figure.axes[0].get_lines()
    assert line.get_marker() in (None, "None") and len(line.get_xdata()) == 200
    assert figure.get_supxlabel() in (None, "")


def test_plot_png_has_the_figure_size_and_drawn_content(tmp_path):
    from PIL import Image

    write_metrics(tmp_path / "run", grpo_metrics([10, 12]))
    result = cli("plot", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr
    with Image.open(tmp_path / "run" / "curves.png") as image:
        assert image.size == (780, 4 * 312 + 48)  # 6.5 in wide, 2.6 in per panel plus the note, at 120 dpi
        colours = image.convert("RGB").getcolors(maxcolors=1 << 20)
    assert len(colours) > 50  # lines, markers, text: not a blank canvas


def test_plot_replaces_a_link_at_the_png_and_leaves_its_target_alone(tmp_path):
    run = tmp_path / "run"
    write_metrics(run, [{"step": s, "loss": 1.0 / s} for s in range(1, 5)])
    (tmp_path / "notes.md").write_text("my notes")
    (run / "curves.png").symlink_to("../notes.md")
    (run / ".curves.png.tmp").symlink_to("../notes.md")
    result = cli("plot", str(run))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "notes.md").read_text() == "my notes"
    assert not (run / "curves.png").is_symlink() and (run / "curves.png").read_bytes().startswith(PNG_MAGIC)
    assert sorted(p.name for p in run.iterdir()) == ["curves.png", "logs"]
    chart = tmp_path / "accuracy.png"
    chart.symlink_to("notes.md")
    accuracy_chart(report_rows(collect_reports(two_models(tmp_path))), chart)
    assert (tmp_path / "notes.md").read_text() == "my notes"
    assert not chart.is_symlink() and chart.read_bytes().startswith(PNG_MAGIC)


def test_plot_without_metrics_is_a_clear_error(tmp_path):
    result = cli("plot", str(tmp_path))
    assert result.returncode == 2 and "logs/metrics.jsonl does not exist" in result.stderr
    assert "Traceback" not in result.stderr
    write_metrics(tmp_path / "run", [{"step": 1, "rollout/queue": 2}])
    with pytest.raises(InputError, match="no loss, reward, learning-rate or accuracy metrics"):
        curves_figure(read_metrics(tmp_path / "run" / "logs" / "metrics.jsonl"), "m")
    # an --out whose suffix names no image format: one line, nothing written
    write_metrics(tmp_path / "good", [{"step": s, "loss": 1.0 / s} for s in range(1, 4)])
    result = cli("plot", str(tmp_path / "good"), "--out", str(tmp_path / "curves.toml"))
    assert result.returncode == 2 and "cannot write a .toml figure; end the file name with one of" in result.stderr
    assert ".png" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "curves.toml").exists()


def test_many_identical_series_leave_the_panels_their_width(tmp_path):
    # a GRPO run whose every reward is still 0: five identical reward series under one legend entry
    rewards = ["accuracy", "format", "json_format", "localization", "total"]
    records = [{"step": 2, "loss": 0.0, "train/lr": 1e-3, **{f"reward/{name}_mean": 0.0 for name in rewards}}]
    path = write_metrics(tmp_path / "run", records)
    figure, _ = curves_figure(read_metrics(path), str(path))
    figure.savefig(tmp_path / "curves.png")
    assert all(axes.get_position().width > 0.6 for axes in figure.axes), [a.get_position().width for a in figure.axes]
    (label,) = [line.get_label() for line in panel(figure, "reward").get_lines()]
    assert label.splitlines() == ["reward/accuracy_mean", *(f"= reward/{name}_mean" for name in rewards[1:])]
