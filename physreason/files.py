"""Writing files and folders a later run reads back, so that a kill at any moment leaves the old or the new, never
half."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to a temporary file beside `path`, flush it to disk and rename it over `path`.

    A link at `path` or at the temporary's name is replaced, never written through into its target."""
    temporary = path.with_name(path.name + ".tmp")
    try:
        temporary.unlink()  # a stale temporary, or a link someone put there: never written through
    except FileNotFoundError:
        pass
    # O_EXCL: the file is created here, never one that appeared at that name since (a link is not followed)
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def replace_folder(staging: Path, final: Path) -> None:
    """Put the complete folder `staging` in place of `final`: an existing `final` is renamed aside (`.<name>.old`)
    first and deleted only after the rename, so a kill while a large old folder is being deleted never leaves `final`
    half deleted beside a finished staging folder nothing loads. A link at `final` is removed, its target left alone.
    """
    aside = final.with_name(f".{final.name}.old")
    shutil.rmtree(aside, ignore_errors=True)  # left by a kill in an earlier call
    if final.is_symlink():
        final.unlink()
    elif final.exists():
        final.rename(aside)
    staging.rename(final)
    shutil.rmtree(aside, ignore_errors=True)
