"""What `--overwrite` may remove: only what the same command wrote there before, never what it reads or works in.

Each command that replaces an earlier output marks its output with a file of its own (`physreason export`: an
export manifest in the folder; `physreason infer`: the settings file beside the results; `physreason models tiny`:
a marker in the model folder). Before it removes anything it checks, with check_replace, that the target

- is not one of the paths the command reads or works in (the run being exported, a model, the requests file) and
  does not hold one of them (an ancestor: `--out runs/` or `--out .` would take the run with it), and
- is new, empty, or carries the command's own mark: an unrelated folder, or a folder of the run other than an
  earlier export, is never emptied.

A refusal is one ConfigError line (exit 2) naming the folder and why; nothing has been removed by then.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from physreason.errors import ConfigError


def _resolved(path: str | Path) -> Path:
    return Path(path).expanduser().resolve()


def holds(folder: str | Path, path: str | Path) -> bool:
    """Whether `folder` is `path` or one of its ancestors (both resolved: links and `..` followed)."""
    return _resolved(path).is_relative_to(_resolved(folder))


def holds_more_than_locks(folder: Path) -> bool:
    """Whether `folder` holds anything but the lock files physreason leaves beside what it writes (`.<name>.lock`,
    e.g. by an export into a subfolder that then failed): such a folder counts as empty."""
    return any(not (p.name.startswith(".") and p.name.endswith(".lock") and p.is_file()) for p in folder.iterdir())


def check_replace(
    target: str | Path,
    *,
    option: str,
    protected: Iterable[tuple[str | Path, str]] = (),
    marked: bool,
    mark: str,
    remedy: str,
) -> None:
    """Refuse (ConfigError) to replace `target` unless it is new, empty or marked, and holds none of `protected`.

    option: the flag that named target (`--out`); protected: (path, what it is) pairs, e.g. (run, "the run being
    exported"); marked: whether target carries the command's mark; mark: what that mark is, for the message;
    remedy: what to do instead (ends the message).
    """
    target = Path(target)
    for path, what in protected:
        if holds(target, path):
            where = "is" if _resolved(target) == _resolved(path) else f"holds {path}:"
            raise ConfigError(
                f"{option} {target} {where} {what}; replacing it would delete it, so it is never replaced: {remedy}"
            )
    if target.is_dir():
        if holds_more_than_locks(target) and not marked:
            raise ConfigError(
                f"{option} {target} is not empty and is not an earlier output of this command (it has no {mark}); "
                f"only such a folder is replaced: {remedy}"
            )
    elif target.exists() and not marked:
        raise ConfigError(f"{option} {target} is not an earlier output of this command (no {mark}): {remedy}")
