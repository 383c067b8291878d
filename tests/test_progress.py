"""Progress off a terminal: periodic plain lines instead of a bar drawn once at the end or redrawn with \\r."""

from __future__ import annotations

import io
import subprocess
import sys
from collections.abc import Callable

from rich.console import Console

from physreason.progress import StepBar, progress_display


def log_console(clock: Callable[[], float] | None = None) -> tuple[Console, io.StringIO]:
    buffer = io.StringIO()
    return Console(file=buffer, force_terminal=False, width=80, get_time=clock), buffer


class Clock:
    """rich's clock under the test's control: elapsed and left times that do not depend on how busy the machine is."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_off_a_terminal_each_due_update_is_one_plain_line():
    clock = Clock()
    console, buffer = log_console(clock)  # a Progress takes its console's clock
    with progress_display(interval_s=0.0, console=console) as progress:
        task = progress.add_task("infer", total=4)
        for _ in range(4):
            clock.now += 10
            progress.advance(task)
    lines = buffer.getvalue().splitlines()
    # one step gives no pace yet (its time is mostly start-up); from the second on, the pace since the first
    assert lines[0].startswith("infer: 1/4 (25%), 0:00:10 elapsed, ? left")
    assert lines[1].startswith("infer: 2/4 (50%), 0:00:20 elapsed, 0:00:20 left")
    assert lines[-1].startswith("infer: 4/4 (100%)") and lines[-1].endswith("done")
    assert len(lines) == 5  # one per advance and the final line
    assert "\r" not in buffer.getvalue() and "━" not in buffer.getvalue()


def test_lines_wait_for_the_interval_and_the_last_is_always_written():
    console, buffer = log_console()
    with progress_display(interval_s=3600.0, console=console) as progress:
        task = progress.add_task("eval", total=10)
        for _ in range(10):
            progress.advance(task)
    assert buffer.getvalue().splitlines() == [buffer.getvalue().splitlines()[-1]]
    assert buffer.getvalue().startswith("eval: 10/10 (100%)")


def test_step_bar_line_shows_the_step_count_with_its_metrics_and_time_left_from_the_resume_point():
    console, buffer = log_console()
    bar = StepBar(10, initial=6, desc="sft", interval_s=0.0, console=console)
    bar.set_postfix(loss="0.5000")
    bar.update(1)
    bar.update(1)
    bar.close()
    first, second, last = buffer.getvalue().splitlines()
    assert first.startswith("sft: 7/10 (70%)") and first.endswith("? left, loss=0.5000")
    assert second.startswith("sft: 8/10 (80%)") and second.endswith("left, loss=0.5000")
    assert "? left" not in second  # estimated from the steps this run took, not from steps 1-6
    assert last.startswith("sft: 8/10 (80%)")


def test_time_left_is_the_pace_after_the_first_step_not_the_start_up():
    # a run that spends 1000 s loading and compiling before its first step, then takes 10 s a step: 8 steps left
    # are 80 s, not (1010 s / 2 steps) * 8 = 4040 s as an average since the start said
    clock = Clock()
    clock.now = 0.0
    console, buffer = log_console(clock)  # the progress measures with its console's clock
    with progress_display(interval_s=0.0, console=console) as progress:
        task = progress.add_task("sft", total=10)
        clock.now = 1000.0
        progress.advance(task)
        clock.now = 1010.0
        progress.advance(task)
        clock.now = 1030.0
        progress.advance(task)
    lines = buffer.getvalue().splitlines()
    assert ", ? left" in lines[0]
    assert ", 0:01:20 left" in lines[1]  # (10 - 2) steps x 10 s
    assert ", 0:01:45 left" in lines[2]  # (10 - 3) steps x (30 s / 2 steps since the first)


def test_on_a_terminal_the_bar_is_drawn():
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, width=80)
    with progress_display(interval_s=0.0, console=console) as progress:
        task = progress.add_task("infer", total=2)
        progress.advance(task, 2)
    assert "━" in buffer.getvalue() and "infer: " not in buffer.getvalue()


def test_data_synth_in_a_log_prints_lines_not_a_bar_and_library_bars_stay_quiet(tmp_path):
    command = [sys.executable, "-m", "physreason", "data", "synth", "--task", "arrow_of_time", "--n", "2",
               "--workers", "1", "--out", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "arrow_of_time: 2/2 (100%)" in result.stdout
    assert "━" not in result.stdout and "\r" not in result.stdout
    tiny = subprocess.run([sys.executable, "-m", "physreason", "models", "tiny", str(tmp_path / "m")],
                          capture_output=True, text=True, timeout=300)
    assert tiny.returncode == 0 and "\r" not in tiny.stderr  # transformers' "Writing model shards" bar


def test_a_large_count_is_written_in_full_not_in_exponent_notation():
    # a million synthetic samples, or the bytes of an upload
    console, buffer = log_console()
    with progress_display(interval_s=0.0, console=console) as progress:
        task = progress.add_task("uploads", total=23_066_200)
        progress.advance(task, 1_500_000)
    assert buffer.getvalue().startswith("uploads: 1,500,000/23,066,200 (7%)"), buffer.getvalue()


def test_off_a_terminal_long_lines_stay_whole_and_columns_is_honoured(monkeypatch, capsys):
    from physreason.progress import LOG_WIDTH, make_console

    monkeypatch.delenv("COLUMNS", raising=False)
    console = make_console()  # pytest's captured stdout is not a terminal, as a log file or a pipe is not
    assert console.width == LOG_WIDTH
    line = "memory plan: " + "x" * 150
    console.print(line)
    assert capsys.readouterr().out == line + "\n"  # rich's default off a terminal (80 columns) broke it in two
    monkeypatch.setenv("COLUMNS", "100")
    assert make_console().width == 100


def test_each_part_of_a_renamed_task_gets_its_own_line_off_a_terminal():
    # eval renames its task per data set and seed: a short repeat must not vanish between two 30 s lines
    console, buffer = log_console()
    with progress_display(interval_s=3600.0, console=console) as progress:
        task = progress.add_task("eval", total=4)
        for seed in (1, 2):
            progress.update(task, description=f"av seed {seed}")
            progress.advance(task, 2)
    lines = buffer.getvalue().splitlines()
    assert lines[0].startswith("av seed 1: 2/4 (50%)")
    assert lines[-1].startswith("av seed 2: 4/4 (100%)") and len(lines) == 2
