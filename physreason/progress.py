"""Progress displays: a live bar on a terminal, a plain text line every so often in a log file or pipe.

A bar redrawn in place is noise in a log (tqdm writes every redraw, carriage returns and all; rich draws
nothing until the end). Off a terminal, each task is written as one line such as
`sft: 120/1000 (12%), 0:04:10 elapsed, 0:30:35 left, loss=0.4321` at most every `LINE_INTERVAL_S` seconds,
and once more when the display stops.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

LINE_INTERVAL_S = 30.0
# Line width off a terminal (a log file, a pipe, a cluster job's output): rich's 80 would break plan and report lines.
LOG_WIDTH = 200


def make_console(*, stderr: bool = False) -> Console:
    """A rich Console for physreason's output: the terminal's width on a terminal (or $COLUMNS), else LOG_WIDTH."""
    stream = sys.stderr if stderr else sys.stdout
    on_terminal = getattr(stream, "isatty", lambda: False)()
    return Console(stderr=stderr, width=None if on_terminal or "COLUMNS" in os.environ else LOG_WIDTH)


def _clock(seconds: float | None) -> str:
    return "?" if seconds is None else str(timedelta(seconds=int(seconds)))


def _count(value: float) -> str:
    """A count as written in a line: whole numbers in full with separators (1,000,000, not 1e+06)."""
    return f"{int(value):,}" if float(value).is_integer() else f"{value:g}"


class LoggedProgress(Progress):
    """A rich `Progress` that, on a console that is not a terminal, writes periodic text lines instead of a bar.

    Used exactly like `rich.progress.Progress` (add_task, advance, update, as a context manager).
    `interval_s` defaults to LINE_INTERVAL_S; a task's `postfix` field, if any, ends its line.
    """

    def __init__(
        self, *columns: str | ProgressColumn, interval_s: float | None = None, disable: bool = False, **kwargs: Any
    ) -> None:
        console = kwargs.pop("console", None) or make_console()
        self._lines = not disable and not console.is_terminal
        # Off a terminal rich's own display would draw the bar once, at the end: lines replace it.
        super().__init__(*columns, console=console, disable=disable or self._lines, **kwargs)
        self._interval_s = LINE_INTERVAL_S if interval_s is None else interval_s
        self._last_line = time.monotonic()
        self._started_at: dict[TaskID, float] = {}  # completed count when each task was added (a resumed run)
        # (time, completed count) when each task first counted work: its rate is measured from there, so model
        # loading, compilation and data start-up before the first step do not inflate the time left.
        self._first_done: dict[TaskID, tuple[float, float]] = {}

    def add_task(self, description: str, *args: Any, **kwargs: Any) -> TaskID:
        """Add a task (see rich's Progress.add_task)."""
        task_id = super().add_task(description, *args, **kwargs)
        self._started_at[task_id] = self._tasks[task_id].completed
        return task_id

    def advance(self, task_id: TaskID, advance: float = 1) -> None:
        """Advance a task and, off a terminal, write the progress lines when they are due."""
        super().advance(task_id, advance)
        self._note_first_done(task_id)
        self._lines_if_due()

    def update(self, task_id: TaskID, **kwargs: Any) -> None:  # type: ignore[override]
        """Update a task (see rich's Progress.update) and, off a terminal, write the progress lines when due.

        Off a terminal, a new description (eval's next data set or seed) first writes the line of the part that ended
        under the old one, so every part has its line however short it was.
        """
        task = self._tasks.get(task_id)
        renamed = task is not None and "description" in kwargs and kwargs["description"] != task.description
        if self._lines and renamed and task.completed > self._started_at.get(task_id, 0.0):
            self._write_lines()
        super().update(task_id, **kwargs)
        self._note_first_done(task_id)
        self._lines_if_due()

    def stop(self) -> None:
        """Stop the display; off a terminal, write each task's final line."""
        if self._lines and self.tasks:
            self._write_lines()
        super().stop()

    def _note_first_done(self, task_id: TaskID) -> None:
        task = self._tasks.get(task_id)
        if task is not None and task_id not in self._first_done and task.completed > self._started_at.get(task_id, 0.0):
            self._first_done[task_id] = (self.get_time(), task.completed)

    def _lines_if_due(self) -> None:
        if self._lines and time.monotonic() - self._last_line >= self._interval_s:
            self._write_lines()

    def _write_lines(self) -> None:
        self._last_line = time.monotonic()
        for task in self.tasks:
            done = f"{_count(task.completed)}/{_count(task.total)}" if task.total else _count(task.completed)
            percent = f" ({100 * task.completed / task.total:.0f}%)" if task.total else ""
            left = ", done" if task.finished else f", {_clock(self._time_left(task))} left"
            postfix = task.fields.get("postfix")
            line = f"{task.description}: {done}{percent}, {_clock(task.elapsed)} elapsed{left}"
            self.console.print(line + (f", {postfix}" if postfix else ""), markup=False, highlight=False,
                               soft_wrap=True)


    def _time_left(self, task: Task) -> float | None:
        """Seconds left at the pace since the task's first counted work (None until work after it is counted).

        The time before the first step (loading a model, compiling, starting loader workers) is start-up, not
        pace: counting it made a 90 s run's first line say hours. rich's own estimate needs a step per 30 s.
        """
        first = self._first_done.get(task.id)
        if task.total is None or first is None:
            return None
        since, done_then = first
        done = task.completed - done_then
        if done <= 0:
            return None
        return (task.total - task.completed) * (self.get_time() - since) / done


def progress_display(
    *, disable: bool = False, postfix: bool = False, interval_s: float | None = None, console: Console | None = None
) -> LoggedProgress:
    """The standard display of physreason's long loops: description, bar, done/total, elapsed, time left.

    With `postfix`, every task must carry a `postfix` field (text shown after the bar).
    """
    columns: list[ProgressColumn] = [
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    ]
    if postfix:
        columns.append(TextColumn("{task.fields[postfix]}"))
    return LoggedProgress(*columns, disable=disable, interval_s=interval_s, console=console)


class StepBar:
    """Progress of a training loop's steps with its latest metrics (tqdm's update / set_postfix / close API)."""

    def __init__(
        self, total: int, *, initial: int = 0, desc: str, interval_s: float | None = None, console: Console | None = None
    ) -> None:
        self._progress = progress_display(postfix=True, interval_s=interval_s, console=console)
        self._task = self._progress.add_task(desc, total=total, completed=initial, postfix="")
        self._progress.start()

    def set_postfix(self, **values: Any) -> None:
        """Show `key=value` pairs after the bar (and at the end of each text line)."""
        # The base update: a text line is due only when a step is counted, so it never shows the new metrics
        # beside the previous step's count.
        Progress.update(self._progress, self._task, postfix=" ".join(f"{k}={v}" for k, v in values.items()))

    def update(self, n: int = 1) -> None:
        """Count `n` more steps done."""
        self._progress.advance(self._task, n)

    def close(self) -> None:
        """Stop the display (off a terminal: write the final line)."""
        self._progress.stop()
