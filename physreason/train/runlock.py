"""One training run at a time in a train.output_dir.

Two runs writing one folder (a job requeued by its scheduler while the first still runs, the same command started in
two terminals) replace each other's step_<n> folders, written.json, config.toml and logs/metrics.jsonl. The run's
main process holds an exclusive lock on `<output_dir>/.physreason.lock` from prepare_output until the run returns or
raises; a second run that finds it held stops with one ConfigError line naming the holder (pid, host, start time)
before it writes anything.

The lock is a POSIX record lock (fcntl.lockf, which NFS servers honour too): it belongs to the process, not to the
file, and the kernel releases it when the process ends, however it ends (kill -9, a crash). A run that failed never
locks its folder against the corrected rerun; the file left behind is only a note of the last holder. Processes the
run forks (data-loader workers) do not inherit it, so it is free again the moment the run's entry point returns.
On a filesystem without locks the run goes on with a warning, unprotected.

A lock held only for a moment (an evaluation choosing its model's results folder: eval.launch) is waited for: given
`wait_s`, lock_file tries again until it is free or that many seconds have passed.

A lock file is never deleted while held (a process that opened it just before would lock the deleted file while a
third one creates and locks a new one: two holders). Should one be deleted or replaced all the same, lock_file
notices once it holds the lock (the file it locked is no longer the one at the path) and locks the new file instead.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, TypeVar

from physreason.errors import ConfigError

log = logging.getLogger(__name__)


class LockHeld(ConfigError):
    """The lock is held by another process (the message names it)."""


LOCK_NAME = ".physreason.lock"
_ATTEMPTS = 10  # locks of a file found deleted or replaced once locked, before lock_file gives up
_HELD: dict[Path, IO[str]] = {}  # resolved lock file -> its open handle, for the locks this process holds
F = TypeVar("F", bound=Callable[..., Any])


def lock_output(output: Path) -> bool:
    """Hold `output`'s run lock for this process (again: nothing to do); True when held, False when the filesystem
    has no locks. ConfigError when another process holds it. `output` must exist."""
    return lock_file(
        Path(output) / LOCK_NAME,
        f"train.output_dir {output}",
        "two runs in one folder replace each other's checkpoints and logs. Wait for that run to end (or stop it), or "
        "set another train.output_dir",
    )


def lock_file(path: Path, what: str, why: str, wait_s: float = 0.0) -> bool:
    """Hold the lock on the file `path` (created if missing; its folder must exist) for this process; True when held
    (also when already held here), False when the filesystem has no locks. LockHeld (a ConfigError) `<what> is in use
    by another run (<holder>): <why>` when another process holds it, after trying again for up to `wait_s` seconds."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return _lock_file(path, what, why)
        except LockHeld:
            if time.monotonic() >= deadline:
                raise
        time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))


def _lock_file(path: Path, what: str, why: str) -> bool:
    key = _key(path)
    if key in _HELD:
        return True
    try:
        import fcntl
    except ImportError:  # not a POSIX system
        return False
    for _ in range(_ATTEMPTS):
        handle = _open_locked(key, fcntl, what, why)
        if handle is None:
            return False
        if _still_at(handle, key):
            break
        # Locked a file that is no longer the one at `key` (deleted or replaced between our open and our lock, e.g.
        # by the holder that was finishing): a lock on it keeps no one out. Open the file now there and lock that.
        handle.close()
    else:
        raise ConfigError(
            f"{what} cannot be locked: its lock file {key} was deleted or replaced each of {_ATTEMPTS} times it was "
            "locked (something keeps removing it); stop whatever removes it and rerun"
        )
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    handle.flush()
    _HELD[key] = handle
    return True


def _open_locked(key: Path, fcntl: Any, what: str, why: str) -> IO[str] | None:
    """The lock file `key` opened (created if missing) and locked by this process; None when the filesystem has no
    locks. ConfigError when another process holds it."""
    try:  # never through a link: the pid line below would replace whatever file the link names
        descriptor = os.open(key, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise ConfigError(
            f"{key} is a symbolic link, and a run lock is written: delete the link (a plain file is made in its place)"
        ) from None
    handle = os.fdopen(descriptor, "r+", encoding="utf-8")  # held open until release
    try:
        fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EACCES, errno.EAGAIN):
            handle.close()
            log.warning("%s cannot be locked (%s): nothing stops a second run from writing there at once", key, exc)
            return None
        handle.seek(0)
        holder = handle.read().strip() or "its process is not named in the file"
        handle.close()
        raise LockHeld(f"{what} is in use by another run ({holder}): {why}") from None
    return handle


def _still_at(handle: IO[str], key: Path) -> bool:
    """Whether the locked file `handle` is still the file at `key` (same device and inode, not deleted)."""
    held = os.fstat(handle.fileno())
    try:
        now = os.stat(key, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return held.st_nlink > 0 and (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino)


def _key(path: Path) -> Path:
    """The lock file's path with its folder resolved and its own name kept (a link there is not followed)."""
    path = Path(path)
    return path.parent.resolve() / path.name


@contextlib.contextmanager
def holding(path: Path, what: str, why: str, wait_s: float = 0.0) -> Iterator[None]:
    """lock_file(path, what, why, wait_s) for the `with` block; released when it ends, however it ends."""
    taken = _key(path) not in _HELD and lock_file(path, what, why, wait_s)
    try:
        yield
    finally:
        if taken:
            release_file(path)


def release_file(path: Path) -> None:
    """Let go of the lock on `path` if this process holds it."""
    handle = _HELD.pop(_key(path), None)
    if handle is not None:
        handle.close()  # closing the file releases the lock


def release_output(output: Path) -> None:
    """Let go of `output`'s run lock if this process holds it."""
    release_file(Path(output) / LOCK_NAME)


def release_all() -> None:
    """Let go of every run lock this process holds."""
    for key in list(_HELD):
        release_file(key)


def releases_output_lock(function: F) -> F:
    """Decorate a run's entry point: the run locks it took (prepare_output) are released when it returns or raises,
    so the next run in the same process (a resume, the next stage of an experiment) may take the folder."""

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        before = set(_HELD)
        try:
            return function(*args, **kwargs)
        finally:
            for key in set(_HELD) - before:
                release_file(key)

    return run  # type: ignore[return-value]
