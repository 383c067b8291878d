"""Training records of generated tasks: letter-answer and JSON-answer SFT conversations, and GRPO prompts.

Each builder reads the benchmark records `generate_task` wrote under a data root
(`<data_root>/<task>/<task>_benchmark_qa_pairs.json`) and writes one JSONL whose video paths are relative to that
root (`<task>/clips/<id>.mp4`), so several tasks train from one file. The demo and the benches call them alike.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from physreason.chat.mcq import format_mcq
from physreason.chat.prompts import MCQ_SYSTEM_PROMPT, REASON2_SYSTEM_PROMPT
from physreason.chat.structured import COORDS_KEY, NEUTRAL_GRID, grounds_2d
from physreason.data.synth.tasks import JSON_TASK_NAMES, LETTER_TASK_NAMES


def write_records(out_file: Path, rows: Sequence[dict]) -> int:
    """Write `rows` as JSONL to `out_file` through a temporary file of this process's own, renamed over it; returns
    the count. Processes that write the same records at once (the benches' seeds run side by side) each replace the
    file whole, so none of them ever reads a partly written one."""
    handle, temporary = tempfile.mkstemp(dir=out_file.parent, prefix=f".{out_file.name}.", suffix=".tmp")
    with os.fdopen(handle, "w", encoding="utf-8") as sink:
        sink.writelines(json.dumps(row) + "\n" for row in rows)
    os.replace(temporary, out_file)
    return len(rows)


def _benchmark_entries(data_root: Path, tasks: Sequence[str]) -> Iterator[tuple[str, dict]]:
    """Every benchmark entry of `tasks` under `data_root`, task by task in file order, with its task's name."""
    for task in tasks:
        entries = json.loads((data_root / task / f"{task}_benchmark_qa_pairs.json").read_text(encoding="utf-8"))
        for entry in entries:
            yield task, entry


def _answer_only_records(
    data_root: Path, tasks: Sequence[str], system_prompt: str, user_text: Callable[[dict], str]
) -> list[dict]:
    """One conversation per benchmark entry: `system_prompt`, `user_text(qa_pairs)`, and the reference answer alone."""
    rows = []
    for task, entry in _benchmark_entries(data_root, tasks):
        qa = entry["qa_pairs"]
        conversation = [
            {"role": "system", "content": system_prompt},
            {"role": "user", "content": user_text(qa)},
            {"role": "assistant", "content": qa["answer"]},
        ]
        row = {"video": f"{task}/{entry['video']}", "conversations": conversation}
        if "index2ans" not in qa and grounds_2d(qa["answer"]):
            row[COORDS_KEY] = NEUTRAL_GRID  # SFT writes the box in the model's family's grid
        rows.append(row)
    return rows


def letter_sft_records(data_root: Path, out_file: Path, tasks: Sequence[str] = LETTER_TASK_NAMES) -> int:
    """Write one SFT file of letter-answer conversations from every task's benchmark records under `data_root`.

    A tiny model on CPU cannot write the generated reasoning traces (hundreds of tokens each) in a
    demo's time, so the demo trains and evaluates the benchmark's `letter` answer type: the same
    prompt the evaluation builds, answered with the option letter.
    """
    rows = _answer_only_records(
        data_root, tasks, MCQ_SYSTEM_PROMPT, lambda qa: format_mcq(qa["question"], qa["index2ans"], "letter")
    )
    return write_records(out_file, rows)


def json_sft_records(data_root: Path, out_file: Path, tasks: Sequence[str] = JSON_TASK_NAMES) -> int:
    """Write one SFT file of answer-only conversations from the JSON-answer tasks' benchmark records under `data_root`.

    The prompt is the one evaluation and GRPO send for a structured question (Cosmos-Reason2's: "You are a helpful
    assistant." and the task prompt as written, no reasoning instruction); the assistant turn is the JSON answer
    alone, without the generated reasoning, for a model too small to write it. Box and point records carry
    `"coords": "norm1000"`: SFT rewrites them, and their question, for a model that grounds in pixels.
    """
    rows = _answer_only_records(data_root, tasks, REASON2_SYSTEM_PROMPT, lambda qa: qa["question"])
    return write_records(out_file, rows)


def rl_records(data_root: Path, out_file: Path, tasks: Sequence[str] = LETTER_TASK_NAMES) -> int:
    """Join the tasks' benchmark records under `data_root` into one JSONL of GRPO prompts."""
    rows = [{**entry, "video": f"{task}/{entry['video']}"} for task, entry in _benchmark_entries(data_root, tasks)]
    return write_records(out_file, rows)
