"""Write a synthetic task to disk: clips, per-sample records, benchmark QA pairs, SFT JSONL and meta.json.

Layout under `<out>/<task>/`:
  clips/<id>.mp4                       H.264 clips
  records/<id>.json                    everything about one sample (written after its clip)
  <task>_benchmark_qa_pairs.json       [{"video", "qa_pairs": {"question", "index2ans", "answer"}}] (letter tasks)
                                       [{"video", "qa_pairs": {"question", "answer", ...}}] (JSON-answer tasks:
                                       the reference JSON, and e.g. the body's "box_2d" for a point question)
  <task>_sft.jsonl                     {"video", "conversations": [user, assistant]} per line (grounding: and
                                       "coords": "norm1000", converted by SFT for the model's family)
  meta.json                            count, split, seeds, option order, generator version, class and letter balance

Generation is resumable: a sample whose clip and record exist is not generated again. Samples are
independent, so they are spread over worker processes.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import stat
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn

from physreason.chat.structured import COORDS_KEY, NEUTRAL_GRID, grounds_2d
from physreason.data.synth.sample import OPTION_ORDERS, SPLITS, Sample, balanced_slot, scene_seed, seed_rule
from physreason.data.synth.scenarios import FPS, HEIGHT_PX, N_FRAMES, WIDTH_PX
from physreason.data.synth.tasks import TASKS
from physreason.data.synth.video import write_mp4
from physreason.errors import InputError
from physreason.progress import LoggedProgress

GENERATOR_VERSION = "1"

log = logging.getLogger(__name__)

# A clip's or record's temporary file (`.<name>.<random>.partial`) older than this was left by a process that was
# killed mid-write: one being written is seconds old, also when several processes fill one folder side by side.
STALE_PARTIAL_S = 600.0


@dataclass
class TaskSummary:
    """What one `generate_task` call did."""

    task: str
    folder: Path
    count: int
    generated: int
    reused: int


def sample_id(split: str, index: int) -> str:
    """File stem of sample `index` in `split`."""
    return f"{split}_{index:06d}"


def build_sample(
    task: str, split: str, base_seed: int, index: int, option_order: str = "shuffled"
) -> tuple[int, Sample]:
    """The scene seed and the sample for position `index` of a data set; pure, so it can run anywhere."""
    seed = scene_seed(base_seed, split, task, index)
    slot = balanced_slot(base_seed, split, task, index, TASKS[task].n_slots)
    return seed, TASKS[task].make_sample(seed, slot, option_order)


def _write_json(path: Path, payload: Any, lines: bool = False) -> None:
    """Write `payload` as JSON (or JSON lines) through a temporary file of this process's own, renamed over `path`.

    Benches run seeds side by side over one clip folder, each process rewriting the same index files: with one
    shared temporary name a writer could truncate the file another had just renamed into place.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    with os.fdopen(handle, "w", encoding="utf-8") as f:
        if lines:
            f.writelines(json.dumps(item, ensure_ascii=False) + "\n" for item in payload)
        else:
            json.dump(payload, f, ensure_ascii=False, indent=1)
    os.replace(partial, path)


def write_sample(
    task: str, split: str, base_seed: int, index: int, folder: str, option_order: str = "shuffled"
) -> dict[str, Any]:
    """Generate sample `index`, write its clip and then its record under `folder`; return the record."""
    seed, sample = build_sample(task, split, base_seed, index, option_order)
    sid = sample_id(split, index)
    video = f"clips/{sid}.mp4"
    write_mp4(sample.frames, Path(folder) / video, sample.fps)
    record = {
        "id": sid,
        "task": task,
        "split": split,
        "index": index,
        "seed": seed,
        "generator_version": GENERATOR_VERSION,
        "option_order": option_order,
        "video": video,
        "label": sample.label,
        "qa_pairs": _qa_pairs(sample),
        "conversations": [
            {"role": "user", "content": sample.user_text()},
            {"role": "assistant", "content": sample.assistant_text()},
        ],
        "facts": sample.facts,
    }
    _write_json(Path(folder) / "records" / f"{sid}.json", record)
    return record


def _qa_pairs(sample: Sample) -> dict[str, Any]:
    """The benchmark question: lettered options and the letter, or the JSON answer with its ground truth fields."""
    if sample.options:
        return {"question": sample.question, "index2ans": sample.options, "answer": sample.answer}
    return {"question": sample.question, "answer": sample.answer, **sample.reference}


def _sft_line(record: dict[str, Any]) -> dict[str, Any]:
    """A record's SFT line; a box or point answer states its 0-1000 grid, which SFT converts for the model's family."""
    line = {"video": record["video"], "conversations": record["conversations"]}
    qa = record["qa_pairs"]
    if "index2ans" not in qa and grounds_2d(qa["answer"]):
        line[COORDS_KEY] = NEUTRAL_GRID
    return line


def _remove_stale_partials(folder: Path) -> None:
    """Delete the temporary files a killed run left in `folder`, its clips/ and records/ (regular files named
    `.<name>.<random>.partial` older than STALE_PARTIAL_S; never a link, never one another process is writing)."""
    removed, now = 0, time.time()
    for place in (folder, folder / "clips", folder / "records"):
        if not place.is_dir():
            continue
        for path in place.glob(".*.partial"):
            try:
                info = path.lstat()
                if stat.S_ISREG(info.st_mode) and now - info.st_mtime > STALE_PARTIAL_S:
                    path.unlink()
                    removed += 1
            except FileNotFoundError:  # renamed into place or removed by its writer meanwhile
                continue
    if removed:
        log.info("removed %d temporary file(s) a killed run left under %s", removed, folder)


def _existing_record(
    folder: Path, split: str, base_seed: int, task: str, index: int, option_order: str
) -> dict[str, Any] | None:
    """The record of a sample already on disk with its clip, if it is the one this run would generate."""
    sid = sample_id(split, index)
    record_path, clip_path = folder / "records" / f"{sid}.json", folder / "clips" / f"{sid}.mp4"
    if not (record_path.is_file() and clip_path.is_file()):
        return None
    try:
        record = json.loads(record_path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError):
        return None  # a torn write from an older crash: generate it again
    if not isinstance(record, dict):
        return None
    expected = (scene_seed(base_seed, split, task, index), GENERATOR_VERSION, option_order)
    found = (record.get("seed"), record.get("generator_version"), record.get("option_order", "shuffled"))
    return record if found == expected else None


def _check_meta(folder: Path, split: str, base_seed: int, option_order: str) -> None:
    meta_path = folder / "meta.json"
    if not meta_path.is_file():
        return
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as exc:
        meta = exc
    if not isinstance(meta, dict):
        raise InputError(
            f"{meta_path} is not a JSON object (an earlier run stopped while writing it?): delete it to generate this "
            "folder's data again, or give another output folder"
        )
    found = (
        meta.get("split"),
        meta.get("base_seed"),
        meta.get("generator_version"),
        meta.get("option_order", "shuffled"),
    )
    if found != (split, base_seed, GENERATOR_VERSION, option_order):
        raise InputError(
            f"{meta_path} describes split={found[0]!r}, seed={found[1]}, generator version {found[2]!r}, option order "
            f"{found[3]!r}, but this run asks for split={split!r}, seed={base_seed}, version {GENERATOR_VERSION!r}, "
            f"option order {option_order!r}; write to another --out folder (one folder per split, seed and option "
            "order) or delete that one."
        )


def _run(
    task: str, split: str, base_seed: int, indices: list[int], folder: Path, workers: int, option_order: str
) -> Iterator[dict[str, Any]]:
    """Yield records as samples finish, in any order."""
    if workers <= 1 or len(indices) <= 1:
        for index in indices:
            yield write_sample(task, split, base_seed, index, str(folder), option_order)
        return
    # spawn: workers must not inherit threads or CUDA state from a parent that may hold them.
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(workers, len(indices)), mp_context=context) as pool:
        futures = [pool.submit(write_sample, task, split, base_seed, i, str(folder), option_order) for i in indices]
        for future in as_completed(futures):
            yield future.result()


def generate_task(
    task: str,
    n: int,
    out: Path,
    split: str,
    base_seed: int = 0,
    workers: int = 1,
    show_progress: bool = True,
    option_order: str = "shuffled",
) -> TaskSummary:
    """Generate (or complete) samples 0..n-1 of `task` under `out/<task>/` and write its QA, SFT and meta files.

    option_order "shuffled" (the benchmark layout) balances the correct letter over samples; "fixed" lists
    the same options in the same order in every sample (see sample.OPTION_ORDERS).
    """
    if task not in TASKS:
        raise InputError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    if split not in SPLITS:
        raise InputError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    if option_order not in OPTION_ORDERS:
        raise InputError(f"unknown option order {option_order!r}; choose one of {', '.join(OPTION_ORDERS)}")
    if n < 1 or base_seed < 0:
        raise InputError(f"need --n >= 1 and --seed >= 0, got n={n}, seed={base_seed}")
    folder = Path(out) / task
    _check_meta(folder, split, base_seed, option_order)
    _remove_stale_partials(folder)
    records: dict[int, dict[str, Any]] = {}
    for index in range(n):
        record = _existing_record(folder, split, base_seed, task, index, option_order)
        if record is not None:
            records[index] = record
    todo = [i for i in range(n) if i not in records]
    reused = len(records)

    columns = (TextColumn(f"[bold]{task}[/]"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with LoggedProgress(*columns, disable=not show_progress, transient=False) as progress:
        bar = progress.add_task(task, total=n, completed=reused)
        for record in _run(task, split, base_seed, todo, folder, workers, option_order):
            records[record["index"]] = record
            progress.advance(bar)

    ordered = [records[i] for i in range(n)]
    _write_json(
        folder / f"{task}_benchmark_qa_pairs.json", [{"video": r["video"], "qa_pairs": r["qa_pairs"]} for r in ordered]
    )
    _write_json(folder / f"{task}_sft.jsonl", [_sft_line(r) for r in ordered], lines=True)
    seeds = [r["seed"] for r in ordered]
    meta = {
        "task": task,
        "split": split,
        "count": n,
        "base_seed": base_seed,
        "scene_seeds": {
            "min": min(seeds),
            "max": max(seeds),
            "rule": seed_rule(task),
        },
        "generator_version": GENERATOR_VERSION,
        "option_order": option_order,
        "video": {
            "fps": FPS,
            "frames": N_FRAMES,
            "width": WIDTH_PX,
            "height": HEIGHT_PX,
            "codec": "h264",
            "pix_fmt": "yuv420p",
        },
        "class_balance": dict(sorted(Counter(r["label"] for r in ordered).items())),
        # Letters only: a structured answer is different in every sample.
        "answer_balance": dict(sorted(Counter(r["qa_pairs"]["answer"] for r in ordered).items()))
        if TASKS[task].answer == "letter"
        else {},
    }
    _write_json(folder / "meta.json", meta)
    return TaskSummary(task, folder, n, len(todo), reused)
