"""Resumable batch inference: JSONL requests in, one JSONL result line per request out, as each finishes."""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from physreason.config import DatasetConfig, SamplingConfig, VisionConfig
from physreason.data.loaders import load_records, media_path_in_root
from physreason.data.video_range import record_video_range
from physreason.engines.base import Engine, GenerationRequest, GenerationResult
from physreason.errors import PhysReasonError
from physreason.infer.request import build_request, result_record
from physreason.progress import LoggedProgress

log = logging.getLogger(__name__)


@dataclass
class BatchSummary:
    """Counts of one batch run."""

    total: int
    skipped: int  # already in the output from an earlier run
    done: int
    failed: int


def _as_list(value: Any) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def finished_ids(out: Path) -> set[str]:
    """Ids already written to a result file; a torn last line (killed run) is ignored and redone."""
    done: set[str] = set()
    if not out.is_file():
        return done
    with out.open(encoding="utf-8") as handle:
        for line in handle:
            try:
                done.add(str(json.loads(line)["id"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
    return done


def truncate_torn_tail(out: Path) -> None:
    """Drop a partial last line left by a killed run, so appended records start on a fresh line."""
    if not out.is_file() or out.stat().st_size == 0:
        return
    data = out.read_bytes()
    if not data.endswith(b"\n"):
        out.write_bytes(data[: data.rfind(b"\n") + 1])


def _request_from_record(
    record: dict[str, Any], request_id: str, root: Path, vision: VisionConfig, reasoning: bool, factor: int
) -> GenerationRequest:
    where = f"request {request_id}"
    question = record.get("question")
    if not isinstance(question, str):
        raise PhysReasonError(f"{where}: no 'question' text; each JSONL line needs \"question\" and \"video\" or \"image\"")
    videos = [media_path_in_root(root, v, where) for v in _as_list(record.get("video"))]
    images = [media_path_in_root(root, i, where) for i in _as_list(record.get("image"))]
    vision = vision.model_copy(update=record_video_range(record, where))
    return build_request(
        question, videos=videos, images=images, vision=vision, reasoning=reasoning,
        system_prompt=record.get("system_prompt"), request_id=request_id, factor=factor,
    )


def _pending(
    records: list[dict[str, Any]], done: set[str], root: Path, vision: VisionConfig, reasoning: bool, factor: int
) -> Iterator[GenerationRequest | GenerationResult]:
    """Yield a request per unfinished record, or an error result for a record whose media cannot be used."""
    for index, record in enumerate(records):
        request_id = str(record.get("id", index))
        if request_id in done:
            continue
        try:
            yield _request_from_record(record, request_id, root, vision, reasoning, factor)
        except PhysReasonError as exc:
            yield GenerationResult(request_id=request_id, error=str(exc))


def run_batch(
    engine: Engine,
    requests_path: str | Path,
    out_path: str | Path,
    *,
    sampling: SamplingConfig,
    vision: VisionConfig,
    reasoning: bool = True,
    media_root: str | Path | None = None,
    batch_size: int = 8,
    show_progress: bool = True,
) -> BatchSummary:
    """Answer every JSONL request not yet in `out_path`, appending one result line each as it finishes.

    Each input line is {"id"?, "question", "video"?: path or list, "image"?: path or list, "system_prompt"?,
    "video_start"?, "video_end"? (seconds; they replace vision.video_start/video_end for that line)};
    media paths are relative to the JSONL's folder (or media_root) and may not leave it. Failures are
    recorded as {"id", "error"} lines and the batch goes on; rerunning skips ids already written.
    """
    records, root = load_records(
        DatasetConfig(name=str(requests_path), media_root=str(media_root) if media_root else None)
    )
    ids = [str(r.get("id", i)) for i, r in enumerate(records)]
    duplicate, times = Counter(ids).most_common(1)[0] if ids else (None, 0)
    if times > 1:
        raise PhysReasonError(f"{requests_path}: id {duplicate!r} appears more than once; ids must be unique to resume")
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    truncate_torn_tail(out)
    done = finished_ids(out) & set(ids)
    summary = BatchSummary(total=len(records), skipped=len(done), done=0, failed=0)
    columns = (TextColumn("infer"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn())
    with LoggedProgress(*columns, disable=not show_progress) as progress, out.open("a", encoding="utf-8") as sink:
        task = progress.add_task("infer", total=len(records) - len(done))

        def write(result: GenerationResult) -> None:
            sink.write(json.dumps(result_record(result), ensure_ascii=False) + "\n")
            sink.flush()
            summary.done += 1
            summary.failed += result.error is not None
            progress.advance(task)

        batch: list[GenerationRequest] = []
        for item in _pending(records, done, root, vision, reasoning, engine.vision_factor):
            if isinstance(item, GenerationResult):
                write(item)
                continue
            batch.append(item)
            if len(batch) == batch_size:
                for result in engine.generate(batch, sampling, logprobs=False):
                    write(result)
                batch = []
        if batch:
            for result in engine.generate(batch, sampling, logprobs=False):
                write(result)
    return summary
