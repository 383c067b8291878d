"""Resumable checkpoints with torch.distributed.checkpoint (DCP), written atomically and rotated.

Layout: <output_dir>/checkpoints/step_<n>/ holds the DCP shards of model + optimizer + scheduler and
one `trainer_rank<r>.pt` per rank (data position, RNG states). A save goes to `step_<n>.tmp` and is
renamed only when every rank has finished, so a crash never leaves a checkpoint that looks complete.
DCP reshards on load, so a run can resume on another number of processes. start_checkpoint is the asynchronous
save ([train.ckpt] save_mode = "async"): DCP writes the files in a background thread, and the folder is recorded
and renamed only once every file is written, exactly as a synchronous save does it.

Trust: DCP would read a checkpoint's `.metadata` (and non-tensor entries of its shards) with full pickle, which
runs code put there; physreason reads both with unpicklers that admit only the types a checkpoint holds
(physreason.train.checkpoint_read), for every checkpoint it resumes from or exports, trusted or not: a forged
pickle is refused naming the folder, and nothing in it runs. On top of that a run loads, unasked, only the
checkpoints it wrote itself: before each rename it adds the folder to `checkpoints/written.json`, with every file's
size, modification time and inode. A folder that does not match its entry (copied or linked into output_dir,
changed, or from elsewhere) needs `train.trust_checkpoint = true`: its weights and state come from elsewhere. The entry also records whether the checkpoint promised a safetensors export,
so a resume can finish an export that a kill between checkpoint and export left undone.
With `trainable_only` (LoRA) the checkpoint holds the trained tensors (adapters) and their optimizer
state only: the frozen base is the model the run loads from model.model_name_or_path.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import random
import shutil
import threading
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from physreason.errors import ConfigError
from physreason.files import replace_folder, write_atomic
from physreason.train.checkpoint_read import SafeLoadPlanner, SafeReader, damaged, read_metadata

_PREFIX = "step_"
# The record of the checkpoints this run wrote, beside them (a file, so checkpoint_dirs never lists it); its
# safetensors exports have one of their own beside them.
_RECORD = "written.json"
_WRITTEN = {"checkpoints": "checkpoints", "safetensors": "safetensors exports"}


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def rng_state() -> dict[str, Any]:
    """Python, numpy and torch (CPU and CUDA) generator states, as types torch.load(weights_only=True) reads."""
    name, key, pos, has_gauss, cached = np.random.get_state()
    numpy_state = (name, torch.from_numpy(key.astype(np.int64)), pos, has_gauss, cached)
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what rng_state returned."""
    random.setstate(state["python"])
    name, key, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, key.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def checkpoint_dirs(output_dir: str | Path, under: str = "checkpoints") -> list[Path]:
    """Complete checkpoints under output_dir, oldest first (`under`: their folder; "safetensors" lists the exports)."""
    root = Path(output_dir) / under
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX) and p.name[len(_PREFIX) :].isdigit()]
    return sorted(done, key=lambda p: int(p.name[len(_PREFIX) :]))


def _fingerprint(folder: Path) -> dict[str, list[int]]:
    """Every file under `folder` (relative path) with its size, modification time (ns) and inode.

    A copy gets new inodes and a link resolves elsewhere, so neither matches the folder the run wrote; a
    rename within the filesystem (staging to final, moving the whole run) keeps all three.
    """
    found = {}
    for path in sorted(folder.rglob("*")):
        info = path.lstat()
        found[path.relative_to(folder).as_posix()] = [info.st_size, info.st_mtime_ns, info.st_ino]
    return found


def read_record(output_dir: str | Path, under: str = "checkpoints") -> dict[str, dict[str, Any]]:
    """The checkpoints this run wrote (`checkpoints/written.json`): step folder name -> {"files": fingerprint,
    "export": bool}; with under="safetensors" its exports (`safetensors/written.json`, {"files": fingerprint}, or {"pending": true}
    for one begun and not yet recorded: begin_export)."""
    path = Path(output_dir) / under / _RECORD
    if not path.is_file():
        return {}
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as exc:  # not JSON, not UTF-8, too deep
        raise ConfigError(f"{path} is not valid JSON ({exc}): it lists the {_WRITTEN[under]} this run wrote") from exc
    return record if isinstance(record, dict) else {}


def _write_record(output_dir: Path, record: dict[str, dict[str, Any]], under: str = "checkpoints") -> None:
    write_atomic(output_dir / under / _RECORD, json.dumps(record, indent=1))


def written_by_run(path: Path, output_dir: str | Path, under: str = "checkpoints") -> bool:
    """True when `path` is a checkpoint folder this run wrote, unchanged: listed in its record, files identical
    (under="safetensors": an export folder)."""
    root = Path(output_dir) / under
    if path.is_symlink() or path.parent.resolve() != root.resolve() or not path.is_dir():
        return False
    entry = read_record(output_dir, under).get(path.name)
    return isinstance(entry, dict) and entry.get("files") == _fingerprint(path)


def begin_export(output_dir: str | Path, name: str) -> None:
    """Note in the run's export record that it is writing safetensors/<name>: a kill between that folder's rename and
    record_export leaves it marked as the run's own ("pending"), so the resume that redoes the step may replace it."""
    record = read_record(output_dir, "safetensors")
    if name not in record:
        record[name] = {"pending": True}
        (Path(output_dir) / "safetensors").mkdir(parents=True, exist_ok=True)
        _write_record(Path(output_dir), record, "safetensors")


def step_replaceable(path: Path, output_dir: str | Path, under: str = "checkpoints") -> bool:
    """Whether the run's save (under="checkpoints") or export (under="safetensors") of a step may replace what is at
    its step_<n> folder `path`: nothing or a link there (the link goes, its target stays), a folder the run recorded
    (written_by_run) or began writing (an export's begin_export), or any folder of a run that keeps no record there
    yet (written before physreason kept one)."""
    if not path.exists() or path.is_symlink() or written_by_run(path, output_dir, under):
        return True
    if not (Path(output_dir) / under / _RECORD).is_file():
        return True
    entry = read_record(output_dir, under).get(path.name)
    return isinstance(entry, dict) and entry.get("pending") is True


def record_export(output_dir: str | Path, folder: Path) -> None:
    """Add `folder`, a safetensors export the run has just written under <output_dir>/safetensors, to its record."""
    record = read_record(output_dir, "safetensors")
    record[folder.name] = {"files": _fingerprint(folder)}
    _write_record(Path(output_dir), record, "safetensors")


def resolve_resume(resume: bool | str, output_dir: str | Path, trust: bool = False) -> Path | None:
    """The checkpoint to resume from: None for a fresh run, the latest for `true`, else the given path.

    Unless `trust`, a checkpoint this run did not write (see written_by_run) is refused with ConfigError. Either
    way its .metadata is read (restricted, see checkpoint_read.read_metadata): ConfigError when forged or damaged.
    """
    if resume is False:
        return None
    if resume is True:
        found = checkpoint_dirs(output_dir)
        if not found:
            return None
        path = found[-1]
    else:
        path = Path(resume)
        if not (path / ".metadata").is_file():
            raise ConfigError(f"train.resume = {resume!r} is not a complete checkpoint folder (no .metadata inside)")
    if not trust and not written_by_run(path, output_dir):
        if path.is_symlink():
            where = f"is a link to {path.resolve()}, not a folder this run wrote"
        elif not path.resolve().is_relative_to(Path(output_dir).resolve()):
            where = "is outside train.output_dir"
        else:
            where = (
                f"was not written by the run in {output_dir}: it was copied in or changed since, or is missing from "
                f"{Path(output_dir) / 'checkpoints' / _RECORD}"
            )
        raise ConfigError(
            f"checkpoint {path} {where}. Loading a checkpoint unpickles its .metadata and state (only the types a "
            "checkpoint holds are admitted, so no code in it runs, but its weights and optimizer state come from "
            "elsewhere): if you trust that folder, set train.trust_checkpoint = true (--trust-checkpoint). To start "
            "from that run's weights alone, set model.model_name_or_path to its safetensors export "
            "(<run>/safetensors/step_N) and start a fresh run"
        )
    read_metadata(path)  # a forged or damaged .metadata is refused here, naming the folder, before anything is written
    return path


def refuse_stale_checkpoints(output_dir: str | Path, resume: bool | str) -> None:
    """Raise ConfigError when a fresh run (train.resume false) would write into a folder that has checkpoints, or a
    run that starts from step 0 (nothing to resume) into one that has safetensors exports.

    Such a run would start again from step 0, append duplicate steps to logs/metrics.jsonl and replace or rotate
    the earlier run's checkpoints and exports together with its own.
    """
    found = checkpoint_dirs(output_dir)
    if resume is False and found:
        names = ", ".join(p.name for p in found)
        raise ConfigError(
            f"train.output_dir {output_dir} already holds checkpoints of an earlier run ({names}). Continue that run "
            "with --set train.resume=true, or start a new one in a new or empty folder with --set train.output_dir=..."
        )
    exports = checkpoint_dirs(output_dir, under="safetensors")
    if exports and (resume is False or (resume is True and not found)):
        # Checkpoints deleted to save space, the exports kept: the new run's exports would replace them step by step
        # and train.ckpt.max_keep would rotate them away.
        names = ", ".join(p.name for p in exports)
        raise ConfigError(
            f"train.output_dir {output_dir} holds safetensors exports of an earlier run ({names}) and no checkpoint "
            "to resume from: a new run there would replace and delete them. Start it in a new or empty folder with "
            "--set train.output_dir=..."
        )


def _step_of(name: str) -> int | None:
    """n of a step_<n> folder name, else None."""
    digits = name[len(_PREFIX) :]
    return int(digits) if name.startswith(_PREFIX) and digits.isdigit() and digits.isascii() else None


def later_steps(output_dir: str | Path, resumed: Path) -> dict[str, list[Path]]:
    """The run's checkpoints and exports ({"checkpoints": [...], "safetensors": [...]}, oldest first) of steps after
    `resumed` (a step_<n> folder; none when its name is not one)."""
    step = _step_of(resumed.name)
    if step is None:
        return {under: [] for under in _WRITTEN}
    return {under: [p for p in checkpoint_dirs(output_dir, under) if (_step_of(p.name) or 0) > step]
            for under in _WRITTEN}  # fmt: skip


def set_aside_later_steps(output_dir: str | Path, resumed: Path) -> tuple[Path, list[Path]] | None:
    """Move the checkpoints and safetensors exports of steps after `resumed` (a step_<n> folder) out of the run's
    rotation, into <output_dir>/superseded/after-step_<n>[-k]/{checkpoints,safetensors}/, newest first (a kill part
    way leaves the earliest in place, never a later one as the run's latest), and move their entries of the run's
    records to a written.json beside them (put both back to make them the run's again).

    Resuming from an earlier step abandons the steps after it (the metrics log drops their records too): left in
    place, the latest of them stayed the run's "latest" checkpoint for `train.resume = true` and for `physreason
    export` after the resumed run stopped early, bringing back the very weights the resume turned away from. Nothing
    is deleted. Returns the folder they went to and what moved, or None when there was nothing after `resumed`.
    """
    step = _step_of(resumed.name)
    output = Path(output_dir)
    later = later_steps(output, resumed)
    if step is None or not any(later.values()):
        return None
    aside = output / "superseded" / f"after-{resumed.name}"
    for k in range(2, 10_000):
        if not aside.exists() and not aside.is_symlink():
            break
        aside = output / "superseded" / f"after-{resumed.name}-{k}"
    else:
        raise ConfigError(f"{output / 'superseded'} holds too many earlier set-asides: move or delete them")
    moved = []
    for under, paths in later.items():
        if not paths:
            continue
        (aside / under).mkdir(parents=True, exist_ok=False)
        record = read_record(output, under)
        later_entries = {name: entry for name, entry in record.items() if (_step_of(name) or 0) > step}
        write_atomic(aside / under / _RECORD, json.dumps(later_entries, indent=1))
        for path in reversed(paths):
            target = aside / under / path.name
            os.replace(path, target)
            moved.append(target)
        if later_entries:
            _write_record(output, {name: entry for name, entry in record.items() if name not in later_entries}, under)
    return aside, moved


def reapply_retention(output_dir: str | Path, max_keep: int, keep: Path, under: str = "checkpoints") -> list[Path]:
    """Delete this run's own checkpoints beyond the newest `max_keep`; never `keep` (the one just written or resumed
    from). under="safetensors" rotates the run's safetensors exports (recorded by record_export) the same way.

    Every save rotates with it; a kill between a save's rename and its rotation leaves one checkpoint too many, so a
    resume calls it first too. Only folders the run wrote, unchanged (written_by_run), are counted and deleted: never
    a folder copied or linked in (a checkpoint of another run, one resumed from with train.trust_checkpoint), nor one
    changed since. Returns the folders deleted (their entries leave the record too).
    """
    own = [path for path in checkpoint_dirs(output_dir, under) if written_by_run(path, output_dir, under)]
    surplus = [path for path in own[: max(len(own) - max_keep, 0)] if path.resolve() != keep.resolve()]
    for path in surplus:
        shutil.rmtree(path)
    if surplus:
        record = read_record(output_dir, under)
        kept = {k: v for k, v in record.items() if k not in {p.name for p in surplus}}
        _write_record(Path(output_dir), kept, under)
    return surplus


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """Silence DCP's warning that it assumes one process, when there is no process group: that is the intent."""
    with warnings.catch_warnings():
        if not dist.is_initialized():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _step_paths(output_dir: str | Path, step: int) -> tuple[Path, Path]:
    """(final, staging) folders of the checkpoint of `step`."""
    root = Path(output_dir) / "checkpoints"
    return root / f"{_PREFIX}{step}", root / f"{_PREFIX}{step}.tmp"


def refuse_foreign_step(output_dir: str | Path, path: Path, step: int, under: str = "checkpoints") -> None:
    """ConfigError, before anything is written, when the run's save (under="checkpoints") or export
    (under="safetensors") of `step` would replace a step_<n> folder `path` the run did not write (copied in, or
    changed since; see step_replaceable). Every rank checks."""
    if not step_replaceable(path, output_dir, under):
        kind, listed = ("export", "exports") if under == "safetensors" else ("checkpoint", "checkpoints")
        raise ConfigError(
            f"{path} was not written by this run (copied in, or changed since; the run's {listed} are listed in "
            f"{Path(output_dir) / under / _RECORD}), so its {kind} of step {step} does not replace it: move that folder "
            "out of the run and resume with --set train.resume=true" + (", which writes the export" if kind == "export" else "")
        )


def _fresh_staging(staging: Path) -> None:
    """Rank 0 empties the staging folder; every rank returns once it exists."""
    if _rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    _barrier()


def _commit(output_dir: Path, staging: Path, final: Path, max_keep: int, export: bool) -> None:
    """Rank 0, once every rank's files are in `staging`: record it as this run's, rename it to `final`, rotate."""
    # Recorded before the rename: a kill in between leaves only the .tmp folder, which nothing loads.
    record = read_record(output_dir)
    record[final.name] = {"files": _fingerprint(staging), "export": export}
    _write_record(output_dir, record)
    replace_folder(staging, final)  # a link someone put in place of this step: replaced, its target left alone
    reapply_retention(output_dir, max_keep, keep=final)  # this run's own checkpoints only


def _checkpoint_state(model: nn.Module, optimizer, scheduler, trainable_only: bool) -> dict[str, Any]:
    model_state, optim_state = get_state_dict(
        model, optimizer, options=StateDictOptions(ignore_frozen_params=trainable_only)
    )
    return {"model": model_state, "optim": optim_state, "scheduler": scheduler.state_dict()}


def save_checkpoint(
    output_dir: str | Path,
    step: int,
    model: nn.Module,
    optimizer,
    scheduler,
    trainer_state: dict[str, Any],
    max_keep: int,
    trainable_only: bool = False,
    export: bool = False,
) -> Path:
    """Save every rank's shards to step_<n>.tmp, record and rename it when complete, keep the newest max_keep.

    trainable_only: save only parameters that require gradients (LoRA adapters), not the frozen base.
    export: the caller exports this step next; recorded so a resume finishes an export a kill cut short.
    """
    final, staging = _step_paths(output_dir, step)
    refuse_foreign_step(output_dir, final, step)
    _fresh_staging(staging)
    state = _checkpoint_state(model, optimizer, scheduler, trainable_only)
    with _single_process_quiet():
        dcp.save(state, checkpoint_id=staging)
    torch.save({**trainer_state, "rng": rng_state()}, staging / f"trainer_rank{_rank()}.pt")
    _barrier()
    if _rank() == 0:
        _commit(Path(output_dir), staging, final, max_keep, export)
    _barrier()
    return final


class ReusingStager:
    """DCP's async stager for physreason's saves: copies the state into host buffers kept from save to save.

    torch's DefaultStager (2.11) releases its copier after every stage, which empties the copier's table of atomic
    types: the second async save of a run then raised `KeyError: <class 'type'>` on the first class object in the
    state, and every save paid the host allocation (and pinning) again. This stager keeps torch's copier and its
    buffers open until close(): from the second save on, staging is one device-to-host copy into the same buffers.
    On a GPU the buffers are pinned and the copy runs on its own stream; on a CPU they are plain host memory.
    The caller must not stage again before the previous write finished (the trainer waits for it first).
    """

    _synchronize_after_execute = False

    def __init__(self, pin_memory: bool) -> None:
        from torch.distributed.checkpoint._state_dict_stager import StateDictStager

        self._copier = StateDictStager(pin_memory=pin_memory, share_memory=False)
        self._stream = torch.cuda.Stream() if pin_memory and torch.cuda.is_available() else None
        self.stages = 0

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: dict[str, Any], **_: Any) -> dict[str, Any]:
        self.stages += 1
        if self._stream is None:
            return self._copier.stage(state_dict, non_blocking=False)
        self._stream.wait_stream(torch.cuda.current_stream())  # the step's last writes land before the copy
        with torch.cuda.stream(self._stream):
            staged = self._copier.stage(state_dict, non_blocking=True)
        self._stream.synchronize()  # the host copy is complete: training may change the tensors again
        return staged

    def synchronize_staging(self) -> None:
        """Staging is complete when stage() returns."""

    def close(self) -> None:
        """Free the host buffers (and unpin them); the stager is not used again."""
        self._copier.close()


class PendingCheckpoint:
    """A checkpoint whose files DCP writes in a background thread; complete (recorded, renamed) once `wait` returns.

    Rank 0 commits it (record, rename, rotation) as soon as its own write finishes, also when nobody waits (a run that
    failed later still keeps it): DCP's rank 0 finishes only after every rank has written its shards and the
    .metadata, and every rank wrote its trainer file before its write began.
    """

    def __init__(self, future: Future, output_dir: Path, staging: Path, final: Path, max_keep: int, export: bool) -> None:
        self.path, self.staging = final, staging
        self._committed = threading.Event()
        self._commit_error: BaseException | None = None
        self._future = future
        if _rank() != 0:
            self._committed.set()
            return

        def commit(done: Future) -> None:
            try:
                if done.exception() is None:
                    _commit(output_dir, staging, final, max_keep, export)
            except BaseException as exc:  # kept for wait(): an exception in a done-callback would only be logged
                self._commit_error = exc
            finally:
                self._committed.set()

        future.add_done_callback(commit)

    def wait(self) -> Path:
        """Block until this rank's write and rank 0's commit are done; returns the complete checkpoint folder.

        Raises what the write raised (the files stay in the .tmp folder, which no resume loads).
        """
        try:
            self._future.result()
        except (Exception, CheckpointException) as exc:  # DCP's error derives from BaseException; a Ctrl-C is no write error
            exc.add_note(_not_completed(self.path.parent.parent, self.path, self.staging))
            raise
        self._committed.wait()
        if self._commit_error is not None:
            raise self._commit_error
        return self.path


def _not_completed(output_dir: str | Path, final: Path, staging: Path) -> str:
    """The note on a failed async save: which step, where its partial files are, what a resume loads instead."""
    earlier = [p for p in checkpoint_dirs(output_dir) if p != final]
    resume = (
        f"train.resume=true continues from {earlier[-1]}, the last complete checkpoint"
        if earlier
        else "no earlier checkpoint is complete: train.resume=true would start from step 0"
    )
    return (
        f"checkpoint {final} (step {final.name.removeprefix(_PREFIX)}) was not completed: its partial files stay in "
        f"{staging}, which resume never loads; {resume}"
    )


def start_checkpoint(
    output_dir: str | Path,
    step: int,
    model: nn.Module,
    optimizer,
    scheduler,
    trainer_state: dict[str, Any],
    max_keep: int,
    trainable_only: bool = False,
    export: bool = False,
    process_group: dist.ProcessGroup | None = None,
    stager: Any = None,
) -> PendingCheckpoint:
    """save_checkpoint, asynchronous: returns once the state is copied to host memory; DCP writes it in a thread.

    The trained tensors may change as soon as this returns. process_group: a gloo group for the background write's
    collectives, apart from the ones training uses (required under torchrun). stager: DCP's async stager (pinned
    host buffers reused from save to save), or None for DCP's default copy.
    """
    final, staging = _step_paths(output_dir, step)
    refuse_foreign_step(output_dir, final, step)
    _fresh_staging(staging)
    state = _checkpoint_state(model, optimizer, scheduler, trainable_only)
    # Before the write starts: once rank 0's write is done, every rank's trainer file is on disk (see PendingCheckpoint).
    torch.save({**trainer_state, "rng": rng_state()}, staging / f"trainer_rank{_rank()}.pt")
    single = not dist.is_initialized()
    if single:
        # The write runs in DCP's thread, outside any catch_warnings here; its "assuming one process" note is the
        # intent. (filterwarnings replaces an equal filter, so repeated saves add none.)
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
    try:
        response = dcp.async_save(
            state, checkpoint_id=staging, process_group=process_group, async_stager=stager, no_dist=single
        )
    except BaseException as exc:  # staging (the copy to host memory) failed before the write began
        if isinstance(exc, Exception | CheckpointException):
            exc.add_note(_not_completed(output_dir, final, staging))
        raise
    # torch returns an AsyncSaveResponse (staging and upload futures) for stagers that stage in the background.
    future = getattr(response, "upload_completion", response)
    return PendingCheckpoint(future, Path(output_dir), staging, final, max_keep, export)


def _dcp_load(path: Path, state: dict[str, Any], allow_partial_load: bool = False) -> None:
    """dcp.load `state` in place from `path`, without running code put in the checkpoint (see checkpoint_read).

    ConfigError naming the folder for a forged or damaged .metadata, or shards that do not match it.
    """
    reader = SafeReader(path)  # reads and checks .metadata first: ConfigError before any collective
    try:
        with _single_process_quiet():
            dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(allow_partial_load=allow_partial_load))
    except (RuntimeError, CheckpointException, AssertionError, OSError, EOFError, pickle.UnpicklingError) as exc:
        cause = _read_failure(exc)
        if cause is None:
            raise
        raise damaged(path, cause) from exc


def _read_failure(exc: BaseException) -> BaseException | None:
    """The error of reading a checkpoint's files behind `exc` (DCP wraps each rank's), or None for any other error."""
    if isinstance(exc, CheckpointException):
        # each rank's failure: (exception, its traceback) as DCP wraps it
        causes = [failure[0] if isinstance(failure, tuple) else failure for failure in exc.failures.values()]
        found = [_read_failure(cause) for cause in causes]
        return found[0] if found and all(isinstance(cause, BaseException) for cause in found) else None
    if isinstance(exc, (AssertionError, OSError, EOFError, pickle.UnpicklingError)):
        return exc  # DCP asserts shard sizes against .metadata; a missing or short shard file; a garbled entry
    if isinstance(exc, RuntimeError) and ("PytorchStreamReader" in str(exc) or "Weights only load failed" in str(exc)):
        return exc  # a shard entry that is not the tensor or plain value .metadata says
    return None


def _load_strict(path: Path, state: dict[str, Any], trainable_only: bool) -> None:
    """dcp.load every entry of `state` in place; ConfigError naming the checkpoint when it lacks one of the model's."""
    try:
        _dcp_load(path, state)
    except (RuntimeError, CheckpointException) as exc:  # one process raises the first, several the second
        if "Missing key" not in str(exc):
            raise
        kind = "LoRA adapters" if trainable_only else "full model weights"
        missing = str(exc)[str(exc).index("Missing key") :].splitlines()[0]
        raise ConfigError(
            f"checkpoint {path} does not hold the {kind} this run trains ({missing}): resume a checkpoint written with "
            "the same [train.lora] settings (enable, rank, target modules), or start a fresh output_dir"
        ) from exc


def load_model_weights(path: Path, module: nn.Module, trainable_only: bool = False) -> None:
    """Load only the model weights of a checkpoint into `module` (the trainer's wrapper, or one laid out like it).

    trainable_only: as in load_checkpoint, the checkpoint holds the parameters that require gradients only.
    """
    options = StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)
    state = {"model": get_model_state_dict(module, options=options)}
    _load_strict(path, state, trainable_only)
    set_model_state_dict(module, state["model"], options=options)


def load_checkpoint(path: Path, model: nn.Module, optimizer, scheduler, trainable_only: bool = False) -> dict[str, Any]:
    """Load model, optimizer and scheduler in place and restore RNG; returns the saved trainer state.

    trainable_only: the checkpoint holds only the parameters that require gradients (save_checkpoint's flag);
    frozen ones keep the values they were loaded with.
    """
    model_state, optim_state = get_state_dict(
        model, optimizer, options=StateDictOptions(ignore_frozen_params=trainable_only)
    )
    state = {"model": model_state, "scheduler": scheduler.state_dict()}
    _load_strict(path, state, trainable_only)
    # Parameters that never received a gradient (e.g. an unused vision tower) have no AdamW state in
    # the checkpoint; the fresh optimizer's zero state for them is equivalent, so the optimizer part
    # may be partial while model weights must be complete.
    optim = {"optim": optim_state}
    _dcp_load(path, optim, allow_partial_load=True)
    # strict=False lets the frozen base keep its loaded values; every trained tensor was read above (DCP is strict).
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=optim["optim"],
        options=StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only),
    )
    scheduler.load_state_dict(state["scheduler"])
    own = path / f"trainer_rank{_rank()}.pt"
    trainer_file = own if own.is_file() else path / "trainer_rank0.pt"
    try:
        trainer_state = torch.load(trainer_file, weights_only=True)
    except (RuntimeError, OSError, EOFError, pickle.UnpicklingError) as exc:
        raise damaged(path, exc) from exc
    set_rng_state(trainer_state.pop("rng"))
    return trainer_state
