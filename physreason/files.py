"""Writing files and folders a later run reads back, so that a kill at any moment leaves the old or the new, never
half."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from physreason.errors import ConfigError


@contextlib.contextmanager
def atomic_writer(path: Path, temporary: Path | None = None, encoding: str | None = None) -> Iterator[IO[Any]]:
    """A file to write what replaces `path`: it is `temporary` (default `<path>.tmp`), flushed to disk and renamed over
    `path` when the block ends; binary, or text in `encoding`. Nothing is renamed when the block raises.

    A link at `path` or at the temporary's name is replaced, never written through into its target."""
    temporary = temporary or path.with_name(path.name + ".tmp")
    try:
        temporary.unlink()  # a stale temporary, or a link someone put there: never written through
    except FileNotFoundError:
        pass
    # O_EXCL: the file is created here, never one that appeared at that name since (a link is not followed)
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    with os.fdopen(descriptor, "w" if encoding else "wb", encoding=encoding) as handle:
        yield handle
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to a temporary file beside `path`, flush it to disk and rename it over `path` (atomic_writer).

    A link at `path` or at the temporary's name is replaced, never written through into its target."""
    with atomic_writer(path, encoding="utf-8") as handle:
        handle.write(text)


def replace_folder(staging: Path, final: Path) -> None:
    """Put the complete folder `staging` in place of `final`: an existing `final` is renamed aside first and deleted
    only after the rename, so a kill while a large old folder is being deleted never leaves `final` half deleted beside
    a finished staging folder nothing loads. A link at `final` is removed, its target left alone.

    The folder aside is one this call creates (`.<name>.old-<random>`, beside `final`), and it is the only one deleted:
    a folder already there under any name, even `.<name>.old`, may be the user's. A kill while the old folder is
    being deleted leaves that `.<name>.old-<random>` folder behind, to be deleted by hand.
    """
    aside = None
    if final.is_symlink():
        final.unlink()
    elif final.exists():
        aside = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.old-"))
        final.rename(aside / final.name)
    staging.rename(final)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def read_json_object(path: Path, fix: str) -> dict[str, Any]:
    """The JSON object in `path`; ConfigError naming the file, what is wrong and `fix` (what the user should do) when
    it is not UTF-8, not JSON, nests past the parser's depth, holds a number past Python's digit limit, or is not an
    object. An unreadable file (OSError) is raised as it is."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start}); {fix}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON ({exc}); {fix}") from None
    except RecursionError:
        raise ConfigError(f"{path} nests deeper than the JSON parser reads; {fix}") from None
    except ValueError as exc:  # an integer past the 4,300-digit conversion limit
        raise ConfigError(f"{path} cannot be read as JSON ({exc}); {fix}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path} holds a JSON {type(value).__name__}, not an object; {fix}")
    return value
