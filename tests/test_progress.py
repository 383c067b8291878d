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
    assert lines[0].startswith("infer: 1/4 (25%), 0:00:10 elapsed, 0:00:30 left")
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
    bar.close()
    first, last = buffer.getvalue().splitlines()
    assert first.startswith("sft: 7/10 (70%)") and first.endswith("left, loss=0.5000")
    assert "? left" not in first  # estimated from the one step this run took, not from steps 1-6
    assert last.startswith("sft: 7/10 (70%)")


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
