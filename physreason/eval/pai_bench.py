"""Physical AI Bench (Reason): its board's columns from per-sample results, by documented keyword rules.

The board Cosmos-Reason2 reports on has the columns Overall, Embodied Reasoning, Common Sense, AV, Physical World,
Time, Space, Agibot, HoloAssist, RoboFail, RoboVQA, BridgeData V2. Its reference scorer (SHI-Labs/physical-ai-bench,
reason/run.py) counts accuracy per `category` string and maps categories that start with "space" to Space and
"time" to Time. The other category strings of the released data set could not be checked offline, so each column
is matched by keywords in the category, case-insensitive (words are split at anything not a letter or digit):

| column | a category matches when |
|---|---|
| Space | it starts with "space" (the reference's rule) |
| Time | it starts with "time" (the reference's rule) |
| Agibot / HoloAssist / RoboFail / RoboVQA | it contains "agibot" / "holoassist" / "robofail" / "robovqa" with separators removed |
| BridgeData V2 | it contains "bridge" |
| AV | a word is "av", or it contains "autonomous" or "driving" |
| Physical World | it contains "physic" (physical world, physics) |

Rules are tried in that order; a category that matches none is tried again with the subcategory, and one that
still matches none gets a column of its own (its category string). Groups pool their columns' samples:
Common Sense = Space + Time + Physical World, Embodied Reasoning = AV + Agibot + HoloAssist + RoboFail + RoboVQA +
BridgeData V2. Overall = every scored sample, unknown categories included (sample-weighted, as the reference's
total). Accuracy = correct / scored, as every physreason report: failed samples are counted apart.
"""

from __future__ import annotations

import csv
import io
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.table import Table

from physreason.eval.benchmark import PAI_BENCH
from physreason.eval.results import RUN_FILE, read_run, read_run_info
from physreason.eval.scoring import accuracy, mean_std

OVERALL = "Overall"
EMBODIED = "Embodied Reasoning"
COMMON_SENSE = "Common Sense"
COMMON_SENSE_COLUMNS = ("Space", "Time", "Physical World")
EMBODIED_COLUMNS = ("AV", "Agibot", "HoloAssist", "RoboFail", "RoboVQA", "BridgeData V2")
BOARD_COLUMNS = (OVERALL, EMBODIED, COMMON_SENSE, "AV", "Physical World", "Time", "Space", "Agibot", "HoloAssist",
                 "RoboFail", "RoboVQA", "BridgeData V2")  # the board's published order
NO_CATEGORY = "(no category)"


def _rule_column(text: str) -> str | None:
    """The board column a category (or subcategory) string names by the module's keyword rules; None if none."""
    lowered = text.strip().lower()
    words = [w for w in re.split(r"[^a-z0-9]+", lowered) if w]
    squashed = "".join(words)
    if lowered.startswith("space"):
        return "Space"
    if lowered.startswith("time"):
        return "Time"
    for keyword, column in (("agibot", "Agibot"), ("holoassist", "HoloAssist"), ("robofail", "RoboFail"),
                            ("robovqa", "RoboVQA"), ("bridge", "BridgeData V2")):
        if keyword in squashed:
            return column
    if "av" in words or "autonomous" in squashed or "driving" in squashed:
        return "AV"
    if "physic" in squashed:
        return "Physical World"
    return None


def board_column(category: str | None, subcategory: str | None = None) -> str:
    """The column of one sample: its category's rule, else its subcategory's, else its category as its own column."""
    for text in (category, subcategory):
        if text:
            column = _rule_column(text)
            if column is not None:
                return column
    return category or NO_CATEGORY


@dataclass(frozen=True)
class ColumnCount:
    """Correct and scored samples of one column in one repeat."""

    correct: int = 0
    scored: int = 0


def board_counts(records: list[dict[str, Any]]) -> dict[str, ColumnCount]:
    """Per-column counts of one repeat's result records (the board's groups and Overall included).

    Only records with a boolean is_correct are scored; failed ones count nowhere, as in every physreason report.
    """
    tally: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for record in records:
        if not isinstance(record.get("is_correct"), bool):
            continue
        category, subcategory = (value if isinstance(value, str) else None
                                 for value in (record.get("category"), record.get("subcategory")))  # fmt: skip
        column = board_column(category, subcategory)
        groups = [OVERALL, column]
        if column in COMMON_SENSE_COLUMNS:
            groups.append(COMMON_SENSE)
        elif column in EMBODIED_COLUMNS:
            groups.append(EMBODIED)
        for name in groups:
            tally[name][0] += record["is_correct"]
            tally[name][1] += 1
    return {name: ColumnCount(correct, scored) for name, (correct, scored) in tally.items()}


@dataclass
class BoardReport:
    """One model's Physical AI Bench results in one answer mode: per repeat (by seed), each column's counts."""

    model: str
    answer_type: str
    dataset: str
    repeats: dict[str, dict[str, ColumnCount]] = field(default_factory=dict)

    def columns(self) -> list[str]:
        """The board's columns, then any unknown category's, in name order."""
        seen = {name for counts in self.repeats.values() for name in counts}
        return list(BOARD_COLUMNS) + sorted(seen - set(BOARD_COLUMNS))

    def column_stats(self, column: str) -> tuple[float | None, float | None, int]:
        """Mean and std over repeats of the column's accuracy, and its scored samples per repeat (the largest)."""
        counts = [c.get(column, ColumnCount()) for c in self.repeats.values()]
        values = [a for a in (accuracy(c.correct, c.scored) for c in counts) if a is not None]
        mean, std = mean_std(values)
        return mean, std, max((c.scored for c in counts), default=0)


def collect_boards(results_dir: str | Path) -> list[BoardReport]:
    """Every Physical AI Bench data set's board under `results_dir` (runs whose run.json names the board)."""
    root = Path(results_dir).expanduser().resolve()
    boards: dict[tuple[str, str, str], BoardReport] = {}
    for info_path in sorted(root.rglob(RUN_FILE)):
        run = info_path.parent
        if read_run_info(run).get("board") != PAI_BENCH:
            continue
        dataset_dir, answer_dir = run.parent, run.parent.parent
        key = (answer_dir.parent.name, answer_dir.name, dataset_dir.name)
        board = boards.setdefault(key, BoardReport(*key))
        board.repeats[run.name.removeprefix("seed_")] = board_counts(list(read_run(run).values()))
    return [boards[key] for key in sorted(boards)]


def _cell(board: BoardReport, column: str) -> str:
    mean, std, _ = board.column_stats(column)
    if mean is None:
        return "-"
    return f"{100 * mean:.2f} ± {100 * std:.2f}" if std is not None else f"{100 * mean:.2f}"


def board_rich_tables(boards: list[BoardReport]) -> list[Table]:
    """One terminal table per board: a row per column (accuracy %, scored samples), so it fits 80 columns."""
    tables = []
    for board in boards:
        table = Table(title=f"Physical AI Bench: {board.dataset}, {board.model} ({board.answer_type})",
                      title_justify="left")
        table.add_column("column", justify="left", overflow="fold")
        table.add_column("samples", justify="right")
        table.add_column("accuracy %", justify="right", no_wrap=True)
        for column in board.columns():
            style = "bold" if column in (OVERALL, EMBODIED, COMMON_SENSE) else None
            table.add_row(column, str(board.column_stats(column)[2]), _cell(board, column), style=style)
        tables.append(table)
    return tables


def board_markdown(boards: list[BoardReport]) -> str:
    """The boards as markdown tables in the board's column order (accuracy %, mean ± std over repeats)."""
    parts = []
    for board in boards:
        columns = board.columns()
        lines = [
            f"### Physical AI Bench: {board.dataset}, {board.model} ({board.answer_type})",
            "",
            "| " + " | ".join(["repeats", *columns]) + " |",
            "|" + "---|" * (len(columns) + 1),
            "| " + " | ".join([str(len(board.repeats)), *(_cell(board, c) for c in columns)]) + " |",
            "| samples | " + " | ".join(str(board.column_stats(c)[2]) for c in columns) + " |",
        ]
        parts.append("\n".join(lines) + "\n")
    return "\n".join(parts)


def board_csv(boards: list[BoardReport]) -> str:
    """The boards as CSV, one row per board column (accuracy in percent, 4 decimals)."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["model", "answer_type", "dataset", "column", "repeats", "samples", "accuracy_pct_mean",
                     "accuracy_pct_std"])
    for board in boards:
        for column in board.columns():
            mean, std, samples = board.column_stats(column)
            writer.writerow([board.model, board.answer_type, board.dataset, column, len(board.repeats), samples,
                             "" if mean is None else f"{100 * mean:.4f}", "" if std is None else f"{100 * std:.4f}"])
    return buffer.getvalue()
