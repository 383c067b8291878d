"""Resumable batch inference: JSONL or Parquet requests in, one result record per request out, as each finishes.

The planning half (read the requests, see what the output already holds, decide what to run) and the
result files are shared with the Ray Data path (`physreason.infer.ray_pipeline`); this module also runs
one engine in this process.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
)
from rich.text import Text

from physreason.chat.style import Prompting
from physreason.config import DatasetConfig, SamplingConfig, VisionConfig
from physreason.cpu import decode_ahead_threads
from physreason.data.loaders import json_kind, jsonl_lines, load_records, media_path_in_root
from physreason.data.structural_tokens import structural_token_in_texts, structural_tokens
from physreason.data.video_range import record_video_range
from physreason.engines import Engine, GenerationRequest, GenerationResult
from physreason.errors import ConfigError, InputError, PhysReasonError
from physreason.infer.request import build_request, result_record
from physreason.infer.results import (
    ResultSink,
    drop_broken_lines,
    drop_results,
    holds_only_results,
    is_parquet,
    open_sink,
    result_status,
)
from physreason.infer.settings import check_and_store_settings, delete_results, settings_path
from physreason.overwrite import check_replace
from physreason.parallel import ordered_map
from physreason.progress import LoggedProgress

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])

# What a request record may hold; anything else (a typo such as "videos") is an error, not a silent skip.
REQUEST_KEYS = ("id", "question", "video", "image", "system_prompt", "video_start", "video_end")


def check_request_keys(record: dict[str, Any], where: str) -> None:
    """Raise InputError naming `where` (file:line) when the record has a key no request reads."""
    unknown = sorted(set(record) - set(REQUEST_KEYS))
    if unknown:
        raise InputError(
            f"{where}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} in a request; "
            f"allowed keys: {', '.join(REQUEST_KEYS)}"
        )


@dataclass
class BatchSummary:
    """Counts of one batch run."""

    total: int  # requests in the input
    skipped: int  # already in the output from an earlier run
    done: int  # written by this run, failures included
    failed: int  # of `done`, records with an error
    failed_before: int = 0  # of `skipped`, records with an error (left for --retry-failed)

    @property
    def answered(self) -> int:
        """Requests this run answered without an error."""
        return self.done - self.failed

    def describe(self, out: str | Path) -> str:
        """One line for people: '4 answered, 2 failed, 3 already in OUT, 9 in all' (+ how to retry failures)."""
        line = f"{self.answered} answered, {self.failed} failed, {self.skipped} already in {out}, {self.total} in all"
        if self.failed_before:
            line += f" ({self.failed_before} of those failed)"
        if self.failed or self.failed_before:
            line += "; rerun with --retry-failed to try the failed ones again"
        return line


@dataclass
class BatchPlan:
    """What a batch run has to do: the requests not yet in the output, in input order."""

    pending: list[tuple[str, dict[str, Any]]]  # (request id, input record)
    root: Path  # media paths are relative to this folder
    total: int
    skipped: int
    failed_before: int = 0  # of `skipped`, ids whose earlier result is an error

    def summary(self) -> BatchSummary:
        """A summary with nothing done yet."""
        return BatchSummary(
            total=self.total, skipped=self.skipped, done=0, failed=0, failed_before=self.failed_before
        )


def _media_paths(record: dict[str, Any], key: str, where: str) -> list[str]:
    """The paths under one media key ("video", "image"): a path or a list of paths; anything else is an InputError
    naming the request and the key (a number would stop the whole batch, an object would be read as its keys)."""
    value = record.get(key)
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        wrong = [path for path in value if not isinstance(path, str)]
        if not wrong:
            return value
        got = f"a list holding a JSON {json_kind(wrong[0])}"
    else:
        got = f"a JSON {json_kind(value)}"
    raise InputError(
        f'{where}: {key!r} must be a path or a list of paths, got {got}; write it as "clip.mp4" or '
        '["a.mp4", "b.mp4"], relative to the requests\' folder (or --media-root)'
    )


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except Exception as exc:  # pyarrow raises several types for unreadable input
        raise InputError(f"{path} cannot be read as Parquet ({exc}): give a Parquet file or a folder of them") from exc


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    """One request object per line; a line that is not a JSON object is an error naming the file and line."""
    records = []
    for number, record in jsonl_lines(path):
        if not isinstance(record, dict):
            raise InputError(
                f"{path}:{number} holds a JSON {type(record).__name__}, not an object: write one request per "
                'line as {"id": ..., "question": ..., "video": ...}'
            )
        check_request_keys(record, f"{path}:{number}")
        records.append(record)
    return records


def read_requests(path: str | Path, media_root: str | Path | None = None) -> tuple[list[dict[str, Any]], Path]:
    """Return the request records of a JSONL/JSON file or a Parquet file/folder, and their media folder.

    Every record is an object; ids (the "id" field, else the record's position) must be unique, since
    resuming matches results to requests by id.
    """
    path = Path(path)
    root = Path(media_root).expanduser() if media_root else None
    if is_parquet(path) or (path.is_dir() and any(path.glob("*.parquet"))):
        if not path.exists():
            raise InputError(f"request file {path} does not exist")
        records = _read_parquet(path)
        if records:  # every row has the file's columns: the first names them all
            check_request_keys(records[0], f"{path} (columns)")
        root = (root or (path if path.is_dir() else path.parent)).resolve()
    elif path.suffix.lower() == ".jsonl" and path.is_file():
        records = _read_jsonl(path)
        root = (root or path.parent).resolve()
    else:
        records, root = load_records(
            DatasetConfig(name=str(path), media_root=str(media_root) if media_root else None)
        )
        for number, record in enumerate(records, start=1):
            if not isinstance(record, dict):
                raise InputError(f"{path}: request {number} is a JSON {type(record).__name__}, not an object")
            check_request_keys(record, f"{path}: request {number}")
    ids = [request_id(record, index) for index, record in enumerate(records)]
    duplicate, times = Counter(ids).most_common(1)[0] if ids else (None, 0)
    if times > 1:
        raise InputError(f"{path}: id {duplicate!r} appears more than once; ids must be unique to resume")
    return records, root


def request_id(record: dict[str, Any], index: int) -> str:
    """The id results carry: the record's "id", else its position in the input."""
    value = record.get("id")
    return str(index if value is None else value)


def _repair_jsonl(out: Path) -> None:
    """Drop lines of a JSONL output that are not JSON (a torn write in the middle), saying so in one line."""
    if is_parquet(out):
        return
    dropped = drop_broken_lines(out)
    if dropped:
        numbers = ", ".join(map(str, dropped[:10])) + (f" and {len(dropped) - 10} more" if len(dropped) > 10 else "")
        print(f"{out}: dropped {len(dropped)} broken line(s) that were not JSON (line {numbers}, numbered as "
              "before); every other line is kept and their requests are run again", file=sys.stderr)  # fmt: skip


def output_lock(out: Path) -> contextlib.AbstractContextManager[None]:
    """Hold `out` for this process while a run writes it (a lock file `.<name>.lock` beside it; physreason.train.
    runlock): a second infer into the same --out is refused with one line naming the first, not interleaved.
    ConfigError when `out` is a symbolic link (its lock would not be its target's)."""
    from physreason.train.runlock import holding

    if out.is_symlink():
        # The lock is named after --out, so two names of one file (a link and its target) would take two locks and
        # both append; and results are appended through a link but rewritten (repair, --retry-failed) by renaming a
        # new file over it, which would replace the link and leave its target behind. So --out is never a link.
        raise ConfigError(
            f"--out {out} is a symbolic link (to {os.readlink(out)}): results are written only to the file or folder "
            f"itself; give --out {out.resolve()} instead"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    return holding(
        out.parent / f".{out.name}.lock",
        f"--out {out}",
        "two runs writing one output repeat and mix results. Wait for that run to end (or stop it), or give another "
        "--out",
    )


def locks_out(function: F) -> F:
    """Decorate a batch runner taking (engine or config, requests_path, out_path, ...): output_lock(out_path) held for
    the whole call."""

    @functools.wraps(function)
    def run(first: Any, requests_path: str | Path, out_path: str | Path, *args: Any, **kwargs: Any) -> Any:
        with output_lock(Path(out_path)):
            return function(first, requests_path, out_path, *args, **kwargs)

    return run  # type: ignore[return-value]


def _check_out(out: Path, requests: Path | None, overwrite: bool) -> None:
    """Refuse an --out that is, or holds, the requests; one whose results physreason infer did not write (no settings
    file beside them): --overwrite deletes only an earlier output of this command, and results are added only to a
    file that holds nothing but results (a recipe or a data set given as --out would be repaired and appended to)."""
    marker = settings_path(out)
    protected = [] if requests is None else [(requests, "the requests file it reads")]
    check_replace(out, option="--out", protected=protected,
                  marked=marker.is_file() or (not overwrite and holds_only_results(out)),
                  mark=f"{marker.name} beside it, the settings physreason infer stores with its results",
                  remedy="give another --out, or delete it yourself")  # fmt: skip


def prepare_single_out(out: Path, rid: str, settings: Mapping[str, Any], overwrite: bool = False) -> None:
    """Before one request (--video/--image/--question) runs: check that its result may go to `out`, as a batch's.

    Results made with other settings, or an earlier result of the same id, are refused unless `overwrite` deletes
    the earlier output (only one this command wrote); the settings are stored beside `out`.
    """
    _check_out(out, None, overwrite)
    if overwrite:
        delete_results(out)
    status = result_status(out)
    if rid in status:
        raise InputError(
            f"{out} already holds a result of {rid}: give another --out, or pass --overwrite to delete its results "
            "and start anew"
        )
    check_and_store_settings(out, settings, has_results=bool(status))


def write_single_result(out: Path, record: dict[str, Any]) -> None:
    """Add one request's result record to `out` (a JSONL line, or a Parquet part file), as a batch writes it."""
    sink = open_sink(out)
    try:
        sink.write(record)
    finally:
        sink.close()


def plan_batch(
    requests_path: str | Path,
    out: Path,
    *,
    retry_failed: bool = False,
    media_root: str | Path | None = None,
    settings: Mapping[str, Any] | None = None,
    overwrite: bool = False,
) -> BatchPlan:
    """Read the requests and the output so far: what is left to run.

    Ids already in the output are skipped. With `retry_failed`, the failed ones are first removed from the
    output (each file rewritten atomically) and run again, so every id stays in the output once. `settings`
    (answer_settings) are stored beside the output; results made with other settings are refused (InputError),
    unless `overwrite` deletes them first.
    """
    records, root = read_requests(requests_path, media_root)
    _check_out(Path(out), Path(requests_path), overwrite)
    if overwrite:
        delete_results(out)
    _repair_jsonl(out)
    status = result_status(out)
    if settings is not None:
        check_and_store_settings(out, settings, has_results=bool(status))
    if retry_failed:
        failed = {i for i, answered in status.items() if not answered}
        drop_results(out, failed)
        status = {i: ok for i, ok in status.items() if i not in failed}
    pending = []
    for index, record in enumerate(records):
        rid = request_id(record, index)
        if rid not in status:
            pending.append((rid, record))
    pending_ids = {rid for rid, _ in pending}
    failed_before = sum(
        1 for index, record in enumerate(records)
        if (rid := request_id(record, index)) not in pending_ids and not status.get(rid, True)
    )
    return BatchPlan(
        pending=pending, root=root, total=len(records), skipped=len(records) - len(pending), failed_before=failed_before
    )


def request_from_record(
    record: dict[str, Any],
    rid: str,
    root: Path,
    vision: VisionConfig,
    prompting: Prompting,
    factor: int,
    control_tokens: tuple[str, ...] = (),
) -> GenerationRequest:
    """Decode a record's media and build its request; a record that cannot be used raises PhysReasonError.

    factor: the model's patch factor (Engine.vision_factor, models.inputs.patch_factor). A record whose question or
    system_prompt holds one of `control_tokens` (data.structural_tokens of the model's tokenizer; () checks none)
    cannot be used: the chat template would carry it as a turn marker or vision placeholder, not as text.
    """
    where = f"request {rid}"
    question = record.get("question")
    if not isinstance(question, str):
        raise InputError(f"{where}: no 'question' text; each request needs \"question\" and \"video\" or \"image\"")
    system_prompt = record.get("system_prompt")
    if system_prompt is not None and not isinstance(system_prompt, str):
        raise InputError(f"{where}: 'system_prompt' is a {type(system_prompt).__name__}; write it as text or leave it out")
    texts = [("the question", question), *([("the system_prompt", system_prompt)] if system_prompt is not None else [])]
    problem = structural_token_in_texts(
        texts, control_tokens, where, 'images and videos go in its "video"/"image" keys; then rerun with --retry-failed'
    )
    if problem is not None:
        raise InputError(problem)
    videos = [media_path_in_root(root, v, where) for v in _media_paths(record, "video", where)]
    images = [media_path_in_root(root, i, where) for i in _media_paths(record, "image", where)]
    vision = vision.model_copy(update=record_video_range(record, where))
    return build_request(
        question, videos=videos, images=images, vision=vision, prompting=prompting,
        system_prompt=system_prompt, request_id=rid, factor=factor,
    )


def resolve_decode_workers(workers: int | None) -> int:
    """infer.decode_workers as run: None is this process's CPU share less the engine's thread, at most 8
    (cpu.decode_ahead_threads, as evaluation and rollouts decode)."""
    return decode_ahead_threads() if workers is None else workers


def _requests(
    plan: BatchPlan,
    vision: VisionConfig,
    prompting: Prompting,
    factor: int,
    workers: int = 1,
    lookahead: int = 1,
    control_tokens: tuple[str, ...] = (),
) -> Iterator[GenerationRequest | GenerationResult]:
    """Yield a request per pending record, in order, or an error result for a record whose media or text cannot be
    used (request_from_record; `control_tokens` as there).

    With `workers` > 1 the media are decoded in that many threads up to `lookahead` records ahead (parallel.
    ordered_map): the next batch decodes while the engine answers this one. Closing the iterator stops them.
    """

    def build(item: tuple[str, dict[str, Any]]) -> GenerationRequest | GenerationResult:
        rid, record = item
        try:
            return request_from_record(record, rid, plan.root, vision, prompting, factor, control_tokens)
        except ConfigError:
            raise  # a setting, not this record: every request would fail the same way
        except PhysReasonError as exc:
            return GenerationResult(request_id=rid, error=str(exc))

    yield from ordered_map(build, plan.pending, workers, lookahead)


def _rate(task: Task) -> float | None:
    """Items per second since the task started: results arrive in bursts, so a short window would jump."""
    elapsed = task.finished_time if task.finished else task.elapsed
    return task.completed / elapsed if elapsed and task.completed else None


class RateColumn(ProgressColumn):
    """Items per second of a progress task, averaged since it started."""

    def render(self, task: Task) -> Text:
        """'12.30 items/s', or '- items/s' before the first item."""
        rate = _rate(task)
        return Text("- items/s" if rate is None else f"{rate:.2f} items/s", style="progress.data.speed")


class EtaColumn(ProgressColumn):
    """Time left at the average rate so far."""

    def render(self, task: Task) -> Text:
        """'ETA 0:01:23', or 'ETA -:--:--' before the first item."""
        rate = _rate(task)
        if task.finished:
            return Text("ETA 0:00:00", style="progress.remaining")
        if rate is None or task.total is None:
            return Text("ETA -:--:--", style="progress.remaining")
        seconds = int((task.total - task.completed) / rate)
        return Text(f"ETA {seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}", style="progress.remaining")


def batch_progress(show: bool) -> Progress:
    """The progress bar of a batch run: done / total, items/s, elapsed time and ETA."""
    columns = (TextColumn("infer"), BarColumn(), MofNCompleteColumn(), RateColumn(), TimeElapsedColumn(), EtaColumn())
    return LoggedProgress(*columns, disable=not show)


def record_to(sink: ResultSink, summary: BatchSummary, record: dict[str, Any]) -> None:
    """Write one result record and count it."""
    sink.write(record)
    summary.done += 1
    summary.failed += record.get("error") is not None


@locks_out
def run_batch(
    engine: Engine | Callable[[], Engine],
    requests_path: str | Path,
    out_path: str | Path,
    *,
    sampling: SamplingConfig,
    vision: VisionConfig,
    prompting: Prompting | None = None,
    media_root: str | Path | None = None,
    batch_size: int = 8,
    retry_failed: bool = False,
    show_progress: bool = True,
    settings: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    decode_workers: int | None = 1,
) -> BatchSummary:
    """Answer every request not yet in `out_path` with one engine here, writing one result each as it finishes.

    Each input record is {"id"?, "question", "video"?: path or list, "image"?: path or list, "system_prompt"?,
    "video_start"?, "video_end"? (seconds; they replace vision.video_start/video_end for that record)}
    (JSONL/JSON lines or Parquet rows); media paths are relative to the input's folder (or media_root) and may
    not leave it. A record whose question or system_prompt holds a chat-structure token of the engine's tokenizer
    (<|im_start|>, <|vision_start|>, ...: data.structural_tokens) fails alone, as one with a missing clip does: the
    chat template would read it as that token, not as text. Failures are recorded as {"id", "error"} and the batch
    goes on; rerunning skips ids already
    written, and with `retry_failed` runs the failed ones again. `engine` may be a function that builds the
    engine: it is called after the requests are read, so a bad input fails before a model loads, and the engine it
    builds is closed when the batch ends (an engine passed in stays open for its owner). `settings` and
    `overwrite`: see plan_batch. `decode_workers` threads decode the next batch's media while the engine answers
    this one (infer.decode_workers; None: resolve_decode_workers); none when everything pending fits one batch,
    where there is nothing to overlap.
    """
    out = Path(out_path)
    prompting = prompting or Prompting()
    plan = plan_batch(
        requests_path, out, retry_failed=retry_failed, media_root=media_root, settings=settings, overwrite=overwrite
    )
    summary = plan.summary()
    if not plan.pending:
        return summary
    built = not hasattr(engine, "generate")
    if built:
        engine = engine()
    sink = open_sink(out)
    try:
        with batch_progress(show_progress) as progress:
            task = progress.add_task("infer", total=len(plan.pending))

            def write(result: GenerationResult) -> None:
                record_to(sink, summary, result_record(result, prompting.style, prompting.reasoning))
                progress.advance(task)

            workers = resolve_decode_workers(decode_workers) if len(plan.pending) > batch_size else 1
            # One batch ahead: the next batch decodes while this one generates (two batches of media held at most).
            # An engine renders its prompts with its tokenizer (HFEngine, VLLMEngine); a stand-in without one checks none.
            tokens = structural_tokens(getattr(engine, "tokenizer", None))
            decoded = _requests(plan, vision, prompting, engine.vision_factor, workers, batch_size, tokens)
            with contextlib.closing(decoded):  # an error below stops the decoding threads at once
                batch: list[GenerationRequest] = []
                for item in decoded:
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
    finally:
        sink.close()
        if built:  # built here for this batch alone: its memory goes back before run_batch returns
            engine.close()
    return summary
