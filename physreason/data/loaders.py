"""Read data records from JSON, JSONL, parquet, a `datasets.load_from_disk` folder or the Hub, and resolve media paths safely."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from physreason.config import DatasetConfig
from physreason.errors import InputError


def json_kind(value: Any) -> str:
    """The JSON name of a decoded value's type, for messages about records that are not objects."""
    names = {dict: "object", list: "list", str: "string", bool: "boolean", int: "number", float: "number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def parse_json_text(text: str, what: str, fix: str) -> Any:
    """Parse JSON text; whatever stops the parser is an InputError "<what> is not valid JSON (<why>): <fix>".

    Besides bad syntax, Python's parser raises ValueError for an integer of more than sys.get_int_max_str_digits()
    digits and RecursionError for values nested about a thousand deep; both are the text's fault, not the program's.
    """
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        why = str(exc)
    except RecursionError:
        why = "values nested deeper than the JSON reader can follow"
    except ValueError as exc:
        if "digits" not in str(exc):
            raise
        why = f"a number of more than {sys.get_int_max_str_digits()} digits"
    raise InputError(f"{what} is not valid JSON ({why}): {fix}")


def unusable_records_error(problems: list[str], total: int, what: str, shown: int = 5) -> InputError:
    """One error for every record a run refuses at start: "<n> of <total> <what> cannot be used: <the first `shown`
    problems>; and <k> more. Fix or remove them"."""
    more = f"; and {len(problems) - shown} more" if len(problems) > shown else ""
    listed = "; ".join(problems[:shown]) + more
    return InputError(f"{len(problems)} of {total} {what} cannot be used: {listed}. Fix or remove them")


# The UTF-8 byte order mark some editors (Windows Notepad, Excel's "CSV UTF-8") put before the text: not data.
_BOM = b"\xef\xbb\xbf"


def _decode_utf8(data: bytes, what: str) -> str:
    """`data` as text; bytes that are not UTF-8 are an InputError naming `what` and where the first bad byte is."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        where = f"line {line}, column {column}" if b"\n" in data.rstrip(b"\r\n") else f"column {column}"
        raise InputError(f"{what} is not UTF-8 text (byte 0x{data[exc.start]:02x} at {where}): save it as UTF-8") from None


def _long_number_line(text: str) -> str:
    """" at line N" of the first number too long for the JSON reader, or "" when there is none."""
    found = re.search(rf"\d{{{sys.get_int_max_str_digits() + 1},}}", text)
    return f" at line {text.count(chr(10), 0, found.start()) + 1}" if found else ""


def _read_json(path: Path, require_objects: bool, unreadable: list[str] | None = None) -> tuple[list[Any], list[str]]:
    """The records of a JSON file (a list, or an object holding one list) and where each is ("file record k").

    With `unreadable` given, records that are not objects (when `require_objects`) are left out and their messages
    appended there; a file that is not JSON as a whole is an InputError either way.
    """
    fix = "write a list of records, or use .jsonl with one per line"
    text = _decode_utf8(path.read_bytes().removeprefix(_BOM), str(path))
    try:
        data = parse_json_text(text, str(path), fix)
    except InputError as exc:
        line = _long_number_line(text) if "digits)" in str(exc) else ""
        if not line:
            raise
        raise InputError(str(exc).replace(f"{path} is", f"{path}{line} is", 1)) from None
    if isinstance(data, dict):
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(lists) != 1:
            raise InputError(f"{path} holds an object, not a list of records: write a JSON list of records")
        data = lists[0]
    if not isinstance(data, list):
        raise InputError(f"{path} must hold a JSON list of records, found {type(data).__name__}")
    records, locations = [], []
    for index, record in enumerate(data):
        if require_objects and not isinstance(record, dict):
            problem = (
                f"{path}: record {index} of the list is a JSON {json_kind(record)}, not an object: "
                'each record must be an object such as {"question": ..., "video": ...}'
            )
            if unreadable is None:
                raise InputError(problem)
            unreadable.append(problem)
            continue
        records.append(record)
        locations.append(f"{path} record {index}")
    return records, locations


def jsonl_lines(path: Path, unreadable: list[str] | None = None) -> Iterator[tuple[int, Any]]:
    """(line number, parsed value) of each non-blank line of a JSONL file.

    A line that cannot be read (not UTF-8, not JSON, a number or a nesting the parser refuses) is an InputError
    naming the file and line; with `unreadable` given, its message is appended there instead and the line skipped.
    """
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            where = f"{path}:{number}"
            if number == 1:
                raw = raw.removeprefix(_BOM)
            try:
                line = _decode_utf8(raw, where)
                if not line.strip():
                    continue
                value = parse_json_text(line, where, "write one JSON record per line")
            except InputError as exc:
                if unreadable is None:
                    raise
                unreadable.append(str(exc))
                continue
            yield number, value


def _read_jsonl(
    path: Path, require_objects: bool, unreadable: list[str] | None = None
) -> tuple[list[Any], list[str]]:
    """The records of a JSONL file and where each is ("file:line"), blank lines skipped (see jsonl_lines for
    `unreadable`, which also collects the lines that are not objects when `require_objects`)."""
    records = []
    locations = []
    for number, record in jsonl_lines(path, unreadable):
        if require_objects and not isinstance(record, dict):
            problem = (
                f"{path}:{number} is a JSON {json_kind(record)}, not an object: "
                'write one JSON object per line, such as {"question": ..., "video": ...}'
            )
            if unreadable is None:
                raise InputError(problem)
            unreadable.append(problem)
            continue
        records.append(record)
        locations.append(f"{path}:{number}")
    return records, locations


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    """Rows of one parquet file, read with `datasets` as the Hub's parquet data sets are."""
    import datasets

    try:
        loaded = datasets.load_dataset("parquet", data_files=str(path), split="train")
    except (ValueError, OSError, datasets.exceptions.DatasetGenerationError) as exc:  # pyarrow's errors are ValueErrors
        raise InputError(f"{path} cannot be read as parquet ({type(exc).__name__}: {exc})") from exc
    return [dict(row) for row in loaded]


def _read_datasets(name: str, config: DatasetConfig) -> list[dict[str, Any]]:
    """Rows of a `datasets.save_to_disk` folder, or of split data.dataset.split of Hub data set `name`."""
    try:
        import datasets
    except ImportError as exc:
        raise InputError(f"data set {name} needs the `datasets` package: pip install datasets") from exc
    folder = Path(name)
    if folder.is_dir():
        try:
            loaded = datasets.load_from_disk(str(folder))
        except (OSError, ValueError) as exc:  # a missing arrow file, a state.json that is not the library's
            raise InputError(
                f"data.dataset.name = {name!r}: {folder} cannot be read with datasets.load_from_disk "
                f"({type(exc).__name__}: {exc}); save it again with save_to_disk"
            ) from exc
        if isinstance(loaded, datasets.DatasetDict):
            if config.split not in loaded:
                raise InputError(f"{folder} has splits {sorted(loaded)}, not {config.split!r}: set data.dataset.split")
            loaded = loaded[config.split]
    else:
        loaded = _load_hub_dataset(name, config)
    return [dict(row) for row in loaded]


def _load_hub_dataset(name: str, config: DatasetConfig) -> Any:
    """datasets.load_dataset of a name that is no local file or folder; InputError when the Hub cannot give it."""
    import datasets
    from huggingface_hub import constants

    try:
        return datasets.load_dataset(name, config.subset, split=config.split)
    except ConnectionError as exc:
        offline = "HF_HUB_OFFLINE is set and it is not in the local cache" if constants.HF_HUB_OFFLINE else (
            "the Hugging Face Hub cannot be reached"
        )
        raise InputError(
            f"data.dataset.name = {name!r} is no local file or folder, and {offline} ({exc}): download it where "
            f"there is network (hf download --repo-type dataset {name} --local-dir DIR) and set data.dataset.name "
            "to that folder, or correct the path"
        ) from exc
    except (OSError, ValueError) as exc:  # no such data set, subset or split; an id the Hub refuses
        raise InputError(
            f"data.dataset.name = {name!r} is neither a local file or folder nor a Hub data set that can be loaded "
            f"with subset {config.subset!r} and split {config.split!r} ({type(exc).__name__}: {exc}): correct the "
            "path, or the Hub id (owner/name), data.dataset.subset and data.dataset.split"
        ) from exc


_DATA_FILE_SUFFIXES = (".parquet", ".jsonl", ".json")
_SPLIT_NAMES = ("train", "validation", "valid", "val", "dev", "test")


def _name_tokens(relative: Path) -> set[str]:
    """The words of a path relative to its data set folder ("data/test-00000-of-00001.parquet" -> data, test, ...)."""
    return {token for part in relative.parts for token in re.split(r"[^a-z0-9]+", part.lower()) if token}


def _data_files(folder: Path) -> list[Path]:
    """Every parquet, JSONL and JSON file under `folder`, sorted, hidden folders (`.cache`, `.git`) left out."""
    return sorted(
        path
        for path in folder.rglob("*")
        if path.is_file()
        and path.suffix.lower() in _DATA_FILE_SUFFIXES
        and not any(part.startswith(".") for part in path.relative_to(folder).parts)
    )


def _saved_with_datasets(folder: Path) -> bool:
    """Whether `folder` was written by `datasets`' save_to_disk (it holds state.json or dataset_dict.json)."""
    return (folder / "state.json").is_file() or (folder / "dataset_dict.json").is_file()


def snapshot_data_files(folder: Path, split: str) -> list[Path]:
    """The data files of one split in a Hugging Face dataset repository snapshot (parquet, JSONL or JSON).

    A file belongs to `split` when a word of its path is the split's name (`data/test-00000-of-00001.parquet`,
    `test.jsonl`, `test/part.json`), as the Hub names split files; when no file names any split, all data files
    form the one split. Hidden folders (`.cache`, `.git`) are left out. Raises InputError when the split has no
    file or its files mix formats.
    """
    files = _data_files(folder)
    tokens = {path: _name_tokens(path.relative_to(folder)) for path in files}
    chosen = [path for path in files if split.lower() in tokens[path]]
    if not chosen and not any(tokens[path] & set(_SPLIT_NAMES) for path in files):
        chosen = files
    if not chosen:
        named = sorted({name for path in files for name in tokens[path] & set(_SPLIT_NAMES)})
        raise InputError(
            f"{folder} has no {split!r} data file (parquet, JSONL or JSON whose path names the split); "
            f"its files name the splits {named or 'none'}"
        )
    suffixes = {path.suffix.lower() for path in chosen}
    if len(suffixes) > 1:
        raise InputError(
            f"{folder}: the {split!r} split mixes data file types {sorted(suffixes)}; keep one format per split"
        )
    return chosen


def load_snapshot_records(
    folder: Path, split: str, *, require_objects: bool = False, unreadable: list[str] | None = None
) -> tuple[list[Any], list[str]]:
    """The records of one split of a dataset folder and where each is ("file:line", "file row k", "folder row k").

    A `datasets.save_to_disk` folder (it holds state.json or dataset_dict.json) is read with load_from_disk;
    any other folder as a Hub repository snapshot (see snapshot_data_files). Records that are not objects are
    kept for the caller to report, unless `require_objects` (see load_located_records, also for `unreadable`).
    """
    if _saved_with_datasets(folder):
        records = _read_datasets(str(folder), DatasetConfig(name=str(folder), split=split))
        return records, [f"{folder} row {index}" for index in range(len(records))]
    records: list[Any] = []
    locations: list[str] = []
    for path in snapshot_data_files(folder, split):
        suffix = path.suffix.lower()
        if suffix == ".jsonl":
            part, where = _read_jsonl(path, require_objects, unreadable)
        elif suffix == ".json":
            part, where = _read_json(path, require_objects, unreadable)
        else:
            part = _read_parquet(path)
            where = [f"{path} row {index}" for index in range(len(part))]
        records += part
        locations += where
    return records, locations


def load_records(config: DatasetConfig, *, require_objects: bool = True) -> tuple[list[Any], Path]:
    """Return the records of a data set and the folder its media paths are relative to (see load_located_records)."""
    records, root, _ = load_located_records(config, require_objects=require_objects)
    return records, root


def load_located_records(
    config: DatasetConfig, *, require_objects: bool = True, unreadable: list[str] | None = None
) -> tuple[list[Any], Path, list[str]]:
    """Return the records of a data set, the folder its media paths are relative to, and where each record is.

    A location names the record as a person finds it: "data.jsonl:12" (line 12), "data.json record 3"
    (0-based list index) or "name row 3" (parquet files and `datasets` folders).

    A `.json` file holds a list of records, `.jsonl` one record per line, `.parquet` one per row (read with
    `datasets`); a `datasets.save_to_disk` folder is read with load_from_disk and any other folder as a Hub
    repository download (its data files of split data.dataset.split, see load_snapshot_records); any other name is a
    Hugging Face Hub data set.
    A JSON(L) record that is not an object is an InputError naming the file and line (or list index), unless
    `require_objects` is False: then the caller handles such records itself. With `unreadable` given, each JSON(L)
    record that cannot be read or is not an object is left out and its message (file, line or index, why) is
    appended there instead, so a caller can count and report every bad record at once.
    """
    if not config.name:
        raise InputError("no data set given: set data.dataset.name to a JSON/JSONL file or a dataset folder")
    path = Path(config.name).expanduser()
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix == ".jsonl":
            records, locations = _read_jsonl(path, require_objects, unreadable)
        elif suffix == ".json":
            records, locations = _read_json(path, require_objects, unreadable)
        elif suffix == ".parquet":
            records = _read_parquet(path)
            locations = [f"{path} row {index}" for index in range(len(records))]
        else:
            raise InputError(
                f"{path}: unknown data file type {suffix!r}; use .json, .jsonl, .parquet or a load_from_disk folder"
            )
        default_root = path.parent
    elif path.is_dir():
        if not _saved_with_datasets(path) and not _data_files(path):
            raise InputError(
                f"data.dataset.name = {config.name!r}: the folder {path} is neither a `datasets.save_to_disk` folder "
                "(it has no state.json or dataset_dict.json) nor a data set download (it holds no parquet, JSONL or "
                "JSON file): set data.dataset.name to the data file, or to the folder that holds the data files"
            )
        records, locations = load_snapshot_records(
            path, config.split, require_objects=require_objects, unreadable=unreadable
        )
        default_root = path
    elif not path.suffix:
        records = _read_datasets(config.name, config)
        locations = [f"{config.name} row {index}" for index in range(len(records))]
        default_root = Path.cwd()
    else:
        raise InputError(f"data file {path} does not exist: check data.dataset.name")
    root = Path(config.media_root).expanduser() if config.media_root else default_root
    return records, root.resolve(), locations


def media_path_in_root(root: Path, relative: str, where: str) -> Path:
    """Join a record's media path to the data root; refuse paths that leave the root (absolute or `..`)."""
    if not isinstance(relative, str):
        raise InputError(f"{where}: media path {relative!r} is not a string; write the path as text")
    if "\0" in relative:
        # The OS cannot name such a file: os calls raise ValueError, which would end the whole run.
        raise InputError(f"{where}: media path {relative!r} holds a NUL byte; no file can have that name, fix the record")
    candidate = (root / relative).resolve()
    if not candidate.is_relative_to(root):
        raise InputError(
            f"{where}: media path {relative!r} leads outside the data folder {root}; "
            "media paths must be relative to the data file's folder or data.dataset.media_root"
        )
    if not candidate.is_file():
        raise InputError(f"{where}: media file {candidate} does not exist (paths are relative to {root})")
    return candidate
