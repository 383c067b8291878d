"""Batch result files, JSONL or Parquet: append results as they finish, read back what is done, drop failures.

A JSONL output is one file, one record per line, flushed per record: a killed run loses at most the
line being written, which the next run cuts off and redoes. A Parquet output (`--out NAME.parquet`) is a
folder of part files `part-NNNNN.parquet`; each is written under a hidden temporary name and renamed
when complete, so a killed run loses only the results not yet written to a part (they are redone).
Either way a rerun skips every id already written, so each id is in the output once.
"""

from __future__ import annotations

import errno
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from physreason.errors import InputError
from physreason.files import atomic_writer

PARQUET_SUFFIX = ".parquet"
_PART_GLOB = "part-*.parquet"


def is_parquet(path: str | Path) -> bool:
    """Whether an input or output path names Parquet (a `.parquet` file or folder)."""
    return Path(path).suffix.lower() == PARQUET_SUFFIX


def _parquet_schema():
    import pyarrow as pa

    output = pa.struct([
        ("text", pa.string()),
        ("reasoning", pa.string()),
        ("answer", pa.string()),
        ("format_problems", pa.list_(pa.string())),
        ("finish_reason", pa.string()),
        ("completion_tokens", pa.int64()),
    ])
    return pa.schema([
        ("id", pa.string()),
        ("error", pa.string()),
        ("prompt_tokens", pa.int64()),
        ("outputs", pa.list_(output)),
    ])


class ResultSink(Protocol):
    """Where a batch writes its result records."""

    def write(self, record: dict[str, Any]) -> None:
        """Add one result record ({"id", "outputs", ...} or {"id", "error"})."""

    def close(self) -> None:
        """Make every record written so far durable."""


class JsonlSink:
    """Appends one JSON line per record and flushes it at once."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        truncate_torn_tail(path)
        self._handle = open_for_append(path)

    def write(self, record: dict[str, Any]) -> None:
        """Append the record as one line and flush it to the operating system."""
        self._handle.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._handle.flush()

    def close(self) -> None:
        """Close the file."""
        self._handle.close()


class ParquetSink:
    """Buffers records and writes a new part file every `rows_per_file` records or `flush_s` seconds."""

    def __init__(self, folder: Path, rows_per_file: int, flush_s: float) -> None:
        if folder.exists() and not folder.is_dir():
            raise InputError(f"{folder} is a file: a Parquet output is a folder of part files; give a new name")
        folder.mkdir(parents=True, exist_ok=True)
        for unfinished in folder.glob(".part-*.tmp"):  # a part file a killed run was writing: its rows are redone
            unfinished.unlink()
        self.folder = folder
        self.rows_per_file = rows_per_file
        self.flush_s = flush_s
        self._rows: list[dict[str, Any]] = []
        self._since = time.monotonic()
        self._next = 1 + max((int(p.stem.split("-")[1]) for p in _part_files(folder)), default=-1)

    def write(self, record: dict[str, Any]) -> None:
        """Buffer the record; write a part file when the buffer is full or old enough."""
        self._rows.append(record)
        if len(self._rows) >= self.rows_per_file or time.monotonic() - self._since >= self.flush_s:
            self.flush()

    def flush(self) -> None:
        """Write the buffered records as the next part file (temporary name, then an atomic rename)."""
        if self._rows:
            _write_parquet(self.folder / f"part-{self._next:05d}{PARQUET_SUFFIX}", self._rows)
            self._next += 1
            self._rows = []
        self._since = time.monotonic()

    def close(self) -> None:
        """Write what is still buffered."""
        self.flush()


def _write_parquet(path: Path, rows: list[dict[str, Any]]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    # A leading dot hides the unfinished file from readers (pyarrow skips '.' and '_' names).
    with atomic_writer(path, path.with_name(f".{path.name}.tmp")) as handle:
        pq.write_table(pa.Table.from_pylist(rows, schema=_parquet_schema()), handle)


def _part_files(folder: Path) -> list[Path]:
    return sorted(folder.glob(_PART_GLOB))


def open_sink(out: Path, *, rows_per_file: int = 1000, flush_s: float = 60.0) -> ResultSink:
    """A sink for `out`: Parquet part files in a folder when it ends in .parquet, else one JSONL file."""
    if is_parquet(out):
        return ParquetSink(out, rows_per_file, flush_s)
    return JsonlSink(out)


_RESULT_FILE = "a result file is cut back to its last complete line and appended to in place"


def _refuse_link(path: Path, what: str = _RESULT_FILE) -> None:
    try:
        target = os.readlink(path)
    except OSError:
        target = "?"
    raise InputError(
        f"{path} is a symbolic link (to {target}): {what}, never through a link into another file; delete the link "
        "(or move the real file there) and rerun"
    ) from None


def check_not_link(path: Path) -> None:
    """InputError when `path` is a symbolic link: a result file is never cut or appended to through one."""
    if path.is_symlink():
        _refuse_link(path)


def _open_no_link(path: Path, flags: int, what: str = _RESULT_FILE) -> int:
    try:
        return os.open(path, flags | os.O_NOFOLLOW, 0o666)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            _refuse_link(path, what)
        raise


def open_for_append(path: Path, what: str = _RESULT_FILE):
    """`path` opened to append UTF-8 text (created if missing); InputError when it is a symbolic link (never
    written through into the link's target). `what` says in that error what the file is and how it is written."""
    return os.fdopen(_open_no_link(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, what), "a", encoding="utf-8")


def truncate_torn_tail(out: Path) -> None:
    """Drop a partial last line left by a killed run, so appended records start on a fresh line. InputError when
    `out` is a symbolic link: a result file is cut in place, never a file the link names."""
    check_not_link(out)
    if not out.is_file() or out.stat().st_size == 0:
        return
    descriptor = _open_no_link(out, os.O_RDWR)
    with os.fdopen(descriptor, "r+b") as handle:
        data = handle.read()
        if not data.endswith(b"\n"):
            handle.truncate(data.rfind(b"\n") + 1)


RESULT_KEYS = {"outputs", "error", "prompt_tokens"}  # one of them beside "id" in every result record (result_record)


def holds_only_results(out: Path) -> bool:
    """Whether `out` holds nothing but what physreason infer writes (its settings file aside): a Parquet folder of
    part files, or a JSONL file of result records ({"id", "prompt_tokens", "outputs"} or {"id", "error"}) in which the only other
    lines are ones a kill or a full disk broke (not JSON; a torn last line), at least one record among them. The test
    before results are added to an output with no settings file beside it: any other file (a recipe, a data set, a
    requests file, notes) named as --out is refused, never repaired into a results file."""
    if not out.exists():
        return True
    if is_parquet(out):
        return out.is_dir() and all(
            path.match(_PART_GLOB) or (path.name.startswith(".part-") and path.name.endswith(".tmp"))
            for path in out.iterdir() if path.name != "_settings.json"
        )  # fmt: skip
    if not out.is_file():
        return False
    if out.stat().st_size == 0:
        return True
    records = 0
    with out.open("rb") as handle:
        for line in handle:
            if not line.endswith(b"\n"):
                continue  # a torn tail: the repair cuts it
            try:
                record = json.loads(line.decode("utf-8"))
            except (ValueError, RecursionError):  # not UTF-8, not JSON, a 5,000-digit number, too deep
                continue  # a broken line: the repair drops it
            if not (isinstance(record, dict) and "id" in record and RESULT_KEYS & record.keys()):
                return False
            records += 1
    return records > 0


def _broken_line(line: bytes) -> bool:
    """A complete line that is not a JSON value (torn by a kill, or garbled): readers of the file fail on it."""
    try:
        json.loads(line.decode("utf-8"))
    except (ValueError, RecursionError):  # not UTF-8, not JSON, a number of more than 4,300 digits, too deep
        return True
    return False


def drop_broken_lines(out: Path) -> list[int]:
    """Rewrite a JSONL result file without its lines that are not JSON (atomic; every other line kept as is).

    A torn last line is cut as before (truncate_torn_tail); this is for one in the middle, which left the file
    unreadable to JSONL readers while its request was redone. Returns the 1-based numbers of the lines dropped.
    """
    truncate_torn_tail(out)
    if not out.is_file():
        return []
    with out.open("rb") as handle:
        broken = [number for number, line in enumerate(handle, 1) if _broken_line(line)]
    if not broken:
        return []
    skip = set(broken)
    with out.open("rb") as source, atomic_writer(out, out.with_name(f".{out.name}.tmp")) as target:
        for number, line in enumerate(source, 1):
            if number not in skip:
                target.write(line)
    return broken


def _jsonl_status(out: Path) -> Iterator[tuple[str, bool]]:
    with out.open(encoding="utf-8", errors="replace") as handle:
        for line in handle:
            if not line.endswith("\n"):
                # A kill can stop a write just before its newline: the record parses, but truncate_torn_tail
                # cuts it before the next append, so it is not done and its request must run again.
                continue
            try:
                record = json.loads(line)
                yield str(record["id"]), record.get("error") is None
            except (ValueError, RecursionError, KeyError, TypeError, AttributeError):
                continue  # a torn last line of a killed run (or a line no JSON reader takes): its request is redone


def _parquet_status(folder: Path) -> Iterator[tuple[str, bool]]:
    import pyarrow.parquet as pq

    for part in _part_files(folder):
        try:
            table = pq.read_table(part, columns=["id", "error"])
        except Exception as exc:  # pyarrow raises several types for an unreadable file
            raise InputError(f"{part} cannot be read as Parquet ({exc}): delete it and rerun to redo its ids") from exc
        yield from zip(table["id"].to_pylist(), (e is None for e in table["error"].to_pylist()))


def finished_ids(out: Path) -> set[str]:
    """Ids already written to a JSONL result file, failed or not; a last line without its newline (killed run) is ignored."""
    return {request_id for request_id, _ in _jsonl_status(out)} if out.is_file() else set()


def result_status(out: Path) -> dict[str, bool]:
    """Ids already in a result file or folder, each mapped to whether it was answered (False: it failed)."""
    if is_parquet(out):
        return dict(_parquet_status(out)) if out.is_dir() else {}
    return dict(_jsonl_status(out)) if out.is_file() else {}


def drop_results(out: Path, ids: set[str]) -> None:
    """Remove the records of `ids` from a result file or folder, each file rewritten atomically."""
    if not ids:
        return
    if is_parquet(out):
        import pyarrow.parquet as pq

        for part in _part_files(out):
            table = pq.read_table(part)
            rows = [row for row in table.to_pylist() if row["id"] not in ids]
            if len(rows) == table.num_rows:
                continue
            if rows:
                _write_parquet(part, rows)
            else:
                part.unlink()
        return
    truncate_torn_tail(out)
    temporary = out.with_name(f".{out.name}.tmp")
    # bytes in, bytes out: a line that is not UTF-8 or not JSON is kept exactly as it was
    with out.open("rb") as source, atomic_writer(out, temporary) as target:
        for line in source:
            try:
                drop = str(json.loads(line)["id"]) in ids
            except (ValueError, RecursionError, KeyError, TypeError):
                drop = False
            if not drop:
                target.write(line)
