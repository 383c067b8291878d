"""The shell every training job runs its steps in: output folder, resume, metrics and progress, checkpoints and exports.

SFT, colocated GRPO and disaggregated GRPO (the Ray controller logs, its policy ranks resume and save)
share these pieces; each trainer only writes its step. A trainer's run reads:

    prepare_output(config, runtime)                     # the folder and the resolved recipe in it
    checkpointer = Checkpointer(config, trained)        # [train] resume, [train.ckpt]
    resumed = checkpointer.resume()                     # trainer state of the latest checkpoint, or None
    with StepLog(config, total_steps, step, "sft", runtime.is_main) as step_log:
        while step < total_steps:
            ...                                         # the trainer's own step
            step_log.step(step, metrics, postfix)       # progress bar; metrics every log_freq steps
            if checkpoint_due(config, step, total_steps):
                saved = checkpointer.save(step, state)  # DCP checkpoint, then the safetensors export
            stop.after_step(checkpointer, step, saved, state)  # Ctrl-C/SIGTERM: save, then stop
        checkpointer.finish()                           # the async write in flight completes ([train.ckpt] save_mode),
                                                        # then final uploads (upload_s3, upload_hf), bounded wait

The checkpointer is closed when the run ends, finished or not (contextlib.closing): uploads still queued stay in
<output_dir>/uploads.json, and a resume sends them.

Metrics: logs/metrics.jsonl holds one run's history. A resumed run keeps the records up to its checkpoint's
step and drops later ones (steps the interrupted run made after its last checkpoint, which the resumed run
makes again); a fresh run starts the file anew.
"""

from __future__ import annotations

import logging
import math
import shlex
import signal
import sys
import threading
import time
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import torch.distributed as dist

from physreason.config import Config, dump_config
from physreason.errors import ConfigError, Interrupted, TrainingDiverged
from physreason.overwrite import holds
from physreason.train.build import TrainingModel
from physreason.train.checkpoint import (
    PendingCheckpoint,
    ReusingStager,
    begin_export,
    checkpoint_dirs,
    later_steps,
    load_checkpoint,
    read_record,
    reapply_retention,
    record_export,
    refuse_foreign_step,
    refuse_stale_checkpoints,
    resolve_resume,
    save_checkpoint,
    set_aside_later_steps,
    start_checkpoint,
    written_by_run,
)
from physreason.train.metrics import MetricLogger
from physreason.train.runlock import lock_output
from physreason.train.runtime import Runtime, all_reduce_sum
from physreason.train.upload import Uploads, check_upload_settings, s3_target

log = logging.getLogger(__name__)


@dataclass
class TrainingResult:
    """The folders a training run leaves, which every trainer's result carries (and the CLI prints)."""

    last_checkpoint: Path | None = None
    export_dir: Path | None = None
    finished_before: Path | None = None  # the checkpoint of a run resumed at its last step: nothing was left to train


def prepare_output(config: Config, runtime: Runtime | None = None) -> Path:
    """Create train.output_dir and write the fully resolved recipe there as config.toml (main process only).

    Raises ConfigError, before anything is written, when another run holds the folder (physreason.train.runlock),
    when the model or data lies where the run's saves rotate (see refuse_inputs_in_rotation), when a fresh run would
    reuse a folder holding checkpoints, when train.resume names a checkpoint it may not load (see resolve_resume),
    and when an upload ([train.ckpt] upload_s3, upload_hf) lacks its library or credentials. The main process holds
    the folder's run lock from here until the run's entry point (decorated with runlock.releases_output_lock) ends.
    """
    output = Path(config.train.output_dir)
    main = runtime is None or runtime.is_main
    if main and output.is_dir():
        lock_output(output)  # before the checks: another run in the folder may be changing what they read
    refuse_inputs_in_rotation(config, output)
    refuse_stale_checkpoints(output, config.train.resume)
    check_upload_settings(config)
    resumed = resolve_resume(config.train.resume, output, config.train.trust_checkpoint)
    changed = resume_changes(output / "config.toml", config) if resumed is not None else []
    if changed and not config.train.resume_allow_changes:
        raise ConfigError(
            f"train.resume: this run's {output / 'config.toml'} has other {', '.join(changed)}; resuming would "
            "silently continue with new data, model or optimizer settings. Restore them, start a fresh run in "
            "another train.output_dir, or pass --set train.resume_allow_changes=true to change them on purpose"
        )
    if main:
        output.mkdir(parents=True, exist_ok=True)
        lock_output(output)  # held until the run returns or raises (runlock.releases_output_lock)
        if changed:
            kept = _keep_earlier_config(output / "config.toml")
            log.warning("resuming with changed %s; the earlier settings are kept in %s", ", ".join(changed), kept)
        if resumed is not None:
            set_aside_abandoned_steps(output, resumed)
        else:
            kept_files = _keep_earlier_run_files(output)
            if kept_files:
                log.warning("%s held an earlier run's %s (no checkpoint to resume from): kept as %s",
                            output, " and ".join(name for name, _ in kept_files),
                            ", ".join(str(path) for _, path in kept_files))  # fmt: skip
        dump_config(config, output / "config.toml")
    return output


def refuse_inputs_in_rotation(config: Config, output: Path) -> None:
    """Raise ConfigError when the model, reference model or data the run reads lies in `output`'s checkpoints/ or
    safetensors/: the run's saves replace step_<n> folders there and train.ckpt.max_keep deletes the older ones, so
    it would delete what it trains from (a second stage started from its own export in the same train.output_dir)."""
    data = [config.data.dataset, *([config.data.val_dataset] if config.data.val_dataset else [])]
    inputs = [("model.model_name_or_path", config.model.model_name_or_path),
              ("grpo.reference_model_path", config.grpo.reference_model_path)]  # fmt: skip
    for key, section in zip(("data.dataset", "data.val_dataset"), data):
        inputs += [(f"{key}.name", section.name), (f"{key}.media_root", section.media_root)]
    for key, value in inputs:
        if not value or not Path(value).expanduser().exists():
            continue  # unset, or a hub name
        for area in (output / "checkpoints", output / "safetensors"):
            if holds(area, value):
                raise ConfigError(
                    f"{key} = {value!r} lies in {area}, where this run's saves replace step_<n> folders and "
                    "train.ckpt.max_keep deletes older ones: copy it out of there first, or set another "
                    "train.output_dir"
                )


# What a resume may not change without train.resume_allow_changes: what the run learns from and how.
_RESUME_FIXED = ("data.", "model.", "train.optm_")


def resume_changes(stored_path: Path, config: Config) -> list[str]:
    """The [data], [model] and train.optm_* keys whose value in `config` differs from the run's stored config.toml."""
    if not stored_path.is_file():
        return []
    # A key the stored file lacks (None then, or added to physreason since) had its default value.
    try:
        written = tomllib.loads(stored_path.read_text(encoding="utf-8"))
        why = "" if written else "it is empty"
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        written, why = {}, f"{type(exc).__name__}: {exc}"
    if why:  # cut short by a kill while an older physreason rewrote it in place
        raise ConfigError(
            f"train.resume: {stored_path} cannot be read ({why}); it records this run's settings. Delete it and "
            "resume with the settings the run was started with (the checkpoints stay)"
        )
    stored = _flat(type(config)().model_dump(mode="json", exclude_none=True))
    stored |= _flat(written)
    current = _flat(config.model_dump(mode="json", exclude_none=True))
    return sorted(
        key for key in set(stored) | set(current) if key.startswith(_RESUME_FIXED) and stored.get(key) != current.get(key)
    )


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _keep_earlier_config(path: Path) -> Path:
    """Rename the run's config.toml to the first free config.before-resume-N.toml beside it; return that path."""
    number = 1
    while (kept := path.with_name(f"config.before-resume-{number}.toml")).exists():
        number += 1
    path.rename(kept)
    return kept


def set_aside_abandoned_steps(output: Path, resumed: Path) -> None:
    """A resume from an earlier step: the later steps' checkpoints and exports go aside (set_aside_later_steps) and
    their queued uploads and Hub records with them (upload.forget_folders), before the run's uploads start."""
    from physreason.train.upload import forget_folders

    later = [path for paths in later_steps(output, resumed).values() for path in paths]
    if not later:
        return
    try:  # first: a kill after the move must not leave their uploads queued with nothing later left to set aside
        forgotten = forget_folders(output, {f"{path.parent.name}/{path.name}" for path in later})
    except ConfigError as exc:  # a damaged uploads.json: the resume goes on, the run's uploads will name it
        log.warning("could not drop the set-aside steps' uploads: %s", exc)
        forgotten = []
    set_aside = set_aside_later_steps(output, resumed)
    if set_aside is None:
        return
    folder, moved = set_aside
    steps = sorted({path.name for path in moved}, key=lambda name: int(name.removeprefix("step_")))
    log.warning("resuming from %s: the checkpoints and exports of the steps after it (%s) are no longer this run's; "
                "moved to %s (delete it when you no longer need them)%s", resumed.name, ", ".join(steps), folder,
                f"; their queued uploads were dropped ({', '.join(f'{k} {f}' for k, f in forgotten)})" if forgotten
                else "")  # fmt: skip


def _keep_earlier_run_files(output: Path) -> list[tuple[str, Path]]:
    """A fresh run in a folder with an earlier run's config.toml or logs/metrics.jsonl (a run without checkpoints,
    or one whose checkpoints were deleted) renames them to the first free config.earlier-N.toml and
    logs/metrics.earlier-N.jsonl (one N for both) instead of writing over them. Returns (name, kept path) of each."""
    found = [("config.toml", output / "config.toml"), ("logs/metrics.jsonl", output / "logs" / "metrics.jsonl")]
    found = [(name, path) for name, path in found if path.is_file() and not path.is_symlink() and path.stat().st_size]
    if not found:
        return []
    number = 1
    while any(_earlier_name(path, number).exists() for _, path in found):
        number += 1
    kept = []
    for name, path in found:
        path.rename(_earlier_name(path, number))
        kept.append((name, _earlier_name(path, number)))
    return kept


def _earlier_name(path: Path, number: int) -> Path:
    """config.toml -> config.earlier-<number>.toml (the same for metrics.jsonl)."""
    return path.with_name(f"{path.stem}.earlier-{number}{path.suffix}")


def checkpoint_due(config: Config, step: int, total_steps: int) -> bool:
    """True when `step` writes a checkpoint: every [train.ckpt] save_freq steps and the last, if checkpoints are on."""
    ckpt = config.train.ckpt
    return ckpt.enable_checkpoint and (step % ckpt.save_freq == 0 or step == total_steps)


# A loss is in range while it is finite and at most this many times the first loss of the process (at least 1.0,
# so that a run starting near zero has room): past that the weights have blown up even if nothing is NaN yet.
LOSS_RANGE_FACTOR = 10.0


class DivergenceWatch:
    """Which saved steps are known good, and the stop when the loss or gradient norm stops being finite.

    A checkpoint holds the weights after its step's update, so the loss of the *next* step (computed from those
    weights) tells whether they are good: an update with a learning rate of 1e30 gives a finite loss at its own step
    and weights of 1e30 in its checkpoint. A step's checkpoint is known good when the next step's loss is in range
    (finite, at most LOSS_RANGE_FACTOR times the process's first loss) and that step's gradient norm finite; a
    checkpoint whose next step this process did not make (one saved before a resume) is not known good.
    """

    def __init__(self, output_dir: str | Path) -> None:
        self.output_dir = Path(output_dir)
        self.reference: float | None = None  # |loss| of the first step this process made
        self.next_loss: dict[int, tuple[float, bool]] = {}  # step -> (loss of the step after it, in range)
        self.judged_by: dict[int, int] = {}  # step -> the step whose loss judged its weights (the next one that updated)
        self.without_update: set[int] = set()  # steps that changed no weight (every sample skipped or dropped)

    def in_range(self, loss: float, grad_norm: float) -> bool:
        """Whether a step's loss and gradient norm show sound weights (see the class docstring)."""
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            return False
        return self.reference is None or abs(loss) <= LOSS_RANGE_FACTOR * max(self.reference, 1.0)

    def check(self, step: int, loss: float, grad_norm: float) -> None:
        """Record step `step`'s loss and norm (judging the weights of step - 1); raise TrainingDiverged when either is
        not finite, naming `step` and the last checkpoint known good.

        Called before the step's checkpoint and weight sync: a NaN or infinite loss has already written NaN into the
        weights, and saving them would rotate a good checkpoint out for a useless one.
        """
        judged = (loss, self.in_range(loss, grad_norm))
        previous = step - 1
        self.next_loss[previous], self.judged_by[previous] = judged, step
        while previous in self.without_update:  # its weights were the step's before it: the same loss judges them
            previous -= 1
            self.next_loss[previous], self.judged_by[previous] = judged, step
        if self.reference is None and math.isfinite(loss):
            self.reference = abs(loss)
        if math.isfinite(loss) and math.isfinite(grad_norm):
            return
        raise TrainingDiverged(
            f"step {step}: the loss is {loss} and the gradient norm {grad_norm}: training diverged and stopped before "
            f"saving this step. {self.last_good_text()}. Look for what changed at this step (its data, the learning "
            "rate of train.optm_lr and its warm-up, train.optm_grad_norm_clip)"
        )

    def no_update(self, step: int) -> None:
        """Step `step` changed no weight (every sample skipped or dropped): its weights are the step's before it, so
        the next loss judges both (a checkpoint saved just before such a step is vouched for by that loss)."""
        self.without_update.add(step)

    def last_good_text(self) -> str:
        """The sentence naming the last checkpoint on disk known good, or saying that none is and why."""
        found = checkpoint_dirs(self.output_dir)
        if not found:
            return "No checkpoint was saved before it"
        steps = {path: int(path.name.removeprefix("step_")) for path in found}
        good = [path for path in found if self.next_loss.get(steps[path], (0.0, False))[1]]
        after = [path for path in found if not good or steps[path] > steps[good[-1]]]
        judged = [
            f"{path.name}'s weights gave step {self.judged_by.get(steps[path], steps[path] + 1)} a loss of "
            f"{self.next_loss[steps[path]][0]:.4g}"
            for path in after
            if steps[path] in self.next_loss
        ]
        unjudged = [path.name for path in after if steps[path] not in self.next_loss]
        why = "; ".join(
            judged + ([f"{', '.join(unjudged)} predate this process, which did not see a loss from them"] if unjudged else [])
        )
        if not good:
            return f"No checkpoint is known good ({why}): start again from an earlier model, or with a lower train.optm_lr"
        last = good[-1]
        resume = "train.resume=true" if last == found[-1] else f"train.resume='{last}'"
        later = f"; not the later ones ({why})" if why else ""
        return (
            f"The last good checkpoint is {last} (the loss of step {self.judged_by[steps[last]]}, computed from its "
            f"weights, {self.next_loss[steps[last]][0]:.4g}, was in range{later}); {resume} continues from it"
        )


@dataclass
class Resumed:
    """The checkpoint a run resumed from and the trainer state saved in it (its "step" and the trainer's own keys)."""

    path: Path
    state: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.state["step"])


@dataclass
class Saved:
    """What one save wrote: the DCP checkpoint folder, the safetensors export and its PEFT adapter (None when off)."""

    checkpoint: Path
    export: Path | None = None
    adapter: Path | None = None  # with [train.lora]: <export>/adapter, the PEFT adapter folder


class Checkpointer:
    """Resume a trained model from, and save it to, <output_dir>/checkpoints; exports go to <output_dir>/safetensors.

    Every rank calls resume and save (DCP is collective); the files are written once. With [train.ckpt] upload_s3 or
    upload_hf the main process also uploads them in the background (physreason.train.upload); finish() at the end
    of a finished run, close() whenever the run ends.
    """

    def __init__(self, config: Config, trained: TrainingModel) -> None:
        self.config = config
        self.trained = trained
        self.output = Path(config.train.output_dir)
        ckpt = config.train.ckpt
        self.uploads: Uploads | None = None
        if (ckpt.upload_s3 or ckpt.upload_hf) and (not dist.is_initialized() or dist.get_rank() == 0):
            self.uploads = Uploads(self.output, s3_target(config), ckpt.hf_repo_name if ckpt.upload_hf else None)
            self.uploads.start(ckpt.upload_wait_s)  # an earlier process's queued uploads start again now
        self._pending: PendingCheckpoint | None = None  # [train.ckpt] save_mode = "async": the write in flight
        self._async_group: dist.ProcessGroup | None = None
        self._stager: Any = None

    def resume(self, resume: bool | str | None = None) -> Resumed | None:
        """Load the checkpoint `resume` names ([train] resume when None) into model, optimizer and schedule.

        Returns the checkpoint and its trainer state, or None for a fresh run. RNG states are restored too.
        First, every safetensors export that a checkpoint of this run promised but a kill left unwritten is
        written from its checkpoint (see missing_exports), so a resume that has no step left still exports.
        """
        train = self.config.train
        path = resolve_resume(train.resume if resume is None else resume, self.output, train.trust_checkpoint)
        if path is None:
            return None
        self._reapply_retention(path)
        missing = self.missing_exports()
        for checkpoint in missing:
            if checkpoint.resolve() != path.resolve():
                # Loaded only if it passes the same trust test as the checkpoint resumed from.
                self._load(resolve_resume(str(checkpoint), self.output, train.trust_checkpoint))
                self._finish_export(checkpoint)
        state = self._load(path)
        if any(checkpoint.resolve() == path.resolve() for checkpoint in missing):
            self._finish_export(path)
        return Resumed(path, state)

    def _reapply_retention(self, resumed: Path) -> None:
        """[train.ckpt] max_keep over this run's own checkpoints (a kill right after a save skipped its rotation)."""
        if not dist.is_initialized() or dist.get_rank() == 0:
            for folder in reapply_retention(self.output, self.config.train.ckpt.max_keep, keep=resumed):
                log.info("deleted %s: beyond train.ckpt.max_keep = %d", folder, self.config.train.ckpt.max_keep)
            left = sorted(p for area in ("checkpoints", "safetensors") for p in (self.output / area).glob(".step_*.old-*")
                          if p.is_dir() and not p.is_symlink())  # fmt: skip
            if left:
                # files.replace_folder deletes only the folder it set aside itself; a kill while it did leaves it
                log.warning("%d folder(s) a kill left while an older step folder was being replaced: %s (each holds "
                            "the replaced step folder; delete them to free the disk)", len(left),
                            ", ".join(str(p) for p in left))  # fmt: skip
        if dist.is_initialized():
            dist.barrier()  # no rank lists the checkpoints while rank 0 deletes

    def missing_exports(self) -> list[Path]:
        """This run's checkpoints, oldest first, whose promised safetensors export is not on disk.

        A kill between a checkpoint's rename and the end of its export leaves exactly this.
        """
        record = read_record(self.output)
        missing = [
            path for path in checkpoint_dirs(self.output)
            if record.get(path.name, {}).get("export") and not (self.output / "safetensors" / path.name).is_dir()
        ]
        if dist.is_initialized():
            dist.barrier()  # every rank has looked before rank 0 writes the first export
        return missing

    def _load(self, path: Path) -> dict[str, Any]:
        trained = self.trained
        trained.wait_for_step()  # train.cpu_offload_overlap: no step may write what the load replaces
        return load_checkpoint(
            path, trained.module, trained.optimizer, trained.scheduler, trainable_only=trained.peft is not None
        )

    def _finish_export(self, checkpoint: Path) -> None:
        step = int(checkpoint.name.removeprefix("step_"))
        folder = self.export(step)
        if not dist.is_initialized() or dist.get_rank() == 0:
            # Said on stdout, not only in the log: the run's output now holds a folder this run did not announce.
            print(f"finished the safetensors export {folder} that checkpoint {checkpoint} promised (cut short before)")

    def save(self, step: int, state: dict[str, Any]) -> Saved:
        """Write the checkpoint of `step` with the trainer's state (keeping [train.ckpt] max_keep), then export.

        With [train.ckpt] save_mode = "async" the checkpoint's files are still being written when this returns
        (Saved.checkpoint is where it will be once complete): call wait() before relying on it. The export is
        written here either way, from the weights of this step, while the checkpoint's files are written.
        """
        trained, ckpt = self.trained, self.config.train.ckpt
        trained.wait_for_step()  # train.cpu_offload_overlap: the checkpoint holds the stepped weights and state
        args = (self.output, step, trained.module, trained.optimizer, trained.scheduler, {"step": step, **state},
                ckpt.max_keep)  # fmt: skip
        options = {"trainable_only": trained.peft is not None, "export": ckpt.export_safetensors}
        if ckpt.save_mode == "async":
            # One write in flight: the previous one completes (and rotates) before this one starts, so rotation
            # never meets a folder being written.
            self.wait()
            self._pending = start_checkpoint(
                *args, **options, process_group=self._background_group(), stager=self._pinned_stager()
            )
            checkpoint = self._pending.path
        else:
            checkpoint = save_checkpoint(*args, **options)
        saved = Saved(checkpoint)
        if ckpt.export_safetensors:
            saved.export = self.export(step)
            if trained.peft is not None:
                saved.adapter = saved.export / "adapter"
        if self.uploads is not None and ckpt.upload_s3 == "all":
            # an async checkpoint is submitted by wait(), once its files are complete
            for folder in (None if self._pending is not None else saved.checkpoint, saved.export):
                if folder is not None:
                    self.uploads.submit(folder, "s3")
        return saved

    def wait(self) -> Path | None:
        """Block until the checkpoint written in the background (save_mode "async") is complete; its folder, or None.

        Every rank calls it (a barrier follows). Raises what the write raised: that checkpoint stays incomplete.
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        path = pending.wait()
        if dist.is_initialized():
            dist.barrier()
        if self.uploads is not None and self.config.train.ckpt.upload_s3 == "all":
            self.uploads.submit(path, "s3")  # an async checkpoint is uploaded once complete, never half-written
        return path

    def finish(self) -> None:
        """At the end of a finished run: wait for the checkpoint in flight (save_mode "async") and free the pinned host
        buffers of async saves; then queue the final uploads and wait for all of them (upload_wait_s at most).

        upload_s3 = 'final' sends the last checkpoint and its export, upload_hf the last export. What is not
        uploaded by then is listed; it stays queued in <output_dir>/uploads.json for a resume to send.
        """
        self.wait()
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        if self.uploads is None:
            return
        ckpt = self.config.train.ckpt
        found = checkpoint_dirs(self.output)
        if found:
            last = found[-1]
            export = self.output / "safetensors" / last.name
            if ckpt.upload_s3 == "final":
                if written_by_run(last, self.output):
                    self.uploads.submit(last, "s3")
                else:
                    log.warning("not uploading %s: this run did not write it (see train.trust_checkpoint)", last)
                if export.is_dir():
                    self.uploads.submit(export, "s3")
            if ckpt.upload_hf and export.is_dir():
                self.uploads.submit(export, "hf")
        left = self.uploads.wait(ckpt.upload_wait_s)
        if left:
            print(
                f"uploads not finished after waiting up to {ckpt.upload_wait_s:g} s (train.ckpt.upload_wait_s): "
                f"{_jobs(left)}. They stay queued in {self.output / 'uploads.json'}; a resume "
                "(--set train.resume=true) uploads them",
                file=sys.stderr,
            )

    def close(self) -> None:
        """Stop the background uploads without waiting; name what is left queued for a resume to send."""
        if self.uploads is None:
            return
        self.uploads.close()
        left = self.uploads.pending()
        for line in self.uploads.failed:
            print(f"upload failed: {line}", file=sys.stderr)
        if left:
            log.warning("uploads left queued in %s for a resume: %s", self.output / "uploads.json", _jobs(left))
        self.uploads = None

    def _background_group(self) -> dist.ProcessGroup | None:
        """A gloo group for the background writes' collectives, apart from training's (created once, on every rank)."""
        if dist.is_initialized() and self._async_group is None:
            self._async_group = dist.new_group(backend="gloo")
        return self._async_group

    def _pinned_stager(self) -> Any:
        """The stager of async saves, made once: host buffers kept from save to save, pinned on a GPU (the copy into
        them is the step's stall)."""
        if self._stager is None:
            self._stager = ReusingStager(pin_memory=_on_cuda(self.trained.module))
        return self._stager

    def export(self, step: int) -> Path:
        """Write the model of `step` as a Hugging Face safetensors folder that transformers and vLLM load as is.

        With [train.lora] the folder holds the merged model (base + adapters, under the plain Hugging Face names)
        and, in its `adapter` subfolder, the PEFT adapter alone (adapter_config.json + adapter_model.safetensors).
        Older exports beyond [train.ckpt] max_keep are deleted, as checkpoints are: only those the run wrote, unchanged
        (recorded in safetensors/written.json), never a step_<n> folder copied or linked in. Nor is one replaced: a
        step_<n> folder already there that the run did not write stops the run with ConfigError (a link in its place
        is replaced, its target left alone, as a checkpoint's is; a folder the run began and was killed before
        recording, and any folder of a run from before the record existed, are the run's: see checkpoint.step_replaceable).
        """
        from physreason.models.export import export_trained

        model_cfg, trained = self.config.model, self.trained
        trained.wait_for_step()
        out_dir = self.output / "safetensors" / f"step_{step}"
        try:
            refuse_foreign_step(self.output, out_dir, step, "safetensors")
        except ConfigError:
            self.wait()  # an async checkpoint of this step completes first: the resume that writes the export needs it
            raise
        if not dist.is_initialized() or dist.get_rank() == 0:
            begin_export(self.output, out_dir.name)  # a kill before record_export leaves it the run's own
        folder = export_trained(trained.model, trained.peft, model_cfg.model_name_or_path, out_dir, model_cfg.dtype)
        if not dist.is_initialized() or dist.get_rank() == 0:
            record_export(self.output, folder)  # rotation deletes only exports the run recorded, never one put there
            reapply_retention(self.output, self.config.train.ckpt.max_keep, keep=folder, under="safetensors")
        return folder


def _jobs(jobs: list[tuple[str, str]]) -> str:
    return ", ".join(f"{folder} ({'S3' if kind == 's3' else 'Hub'})" for kind, folder in jobs)


class StepLog:
    """Each step's progress-bar line, and its metrics to the [logging] sinks every [train] log_freq steps and the last.

    Disabled (enabled=False) on every process but the main one. A context manager: leaving it closes the sinks.
    """

    def __init__(self, config: Config, total_steps: int, initial_step: int, desc: str, enabled: bool = True) -> None:
        self.total_steps = total_steps
        self.log_freq = config.train.log_freq
        self.metrics = MetricLogger(
            config.train.output_dir,
            config.logging,
            enabled=enabled,
            run_config=config.model_dump(mode="json"),
            resumed_step=initial_step,
        )
        self.progress: Any = None
        if enabled:
            from physreason.progress import StepBar

            self.progress = StepBar(total_steps, initial=initial_step, desc=desc)

    def step(self, step: int, metrics: dict[str, float], postfix: dict[str, str]) -> None:
        """Advance the progress bar by one step showing `postfix`; log `metrics` if `step` is a logging step."""
        if self.progress is not None:
            self.progress.set_postfix(**postfix)
            self.progress.update(1)
        if step % self.log_freq == 0 or step == self.total_steps:
            self.metrics.log(step, metrics)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Log metrics of `step` now, whatever the logging frequency (validation results)."""
        self.metrics.log(step, metrics)

    def close(self) -> None:
        """Close the progress bar and the metric sinks."""
        if self.progress is not None:
            self.progress.close()
        self.metrics.close()

    def __enter__(self) -> StepLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def resume_command(argv: Sequence[str] | None = None) -> str:
    """The command line that continues this run: the one given, with `--set train.resume=true` in place of any resume."""
    args = list(sys.argv[1:] if argv is None else argv)
    kept: list[str] = []
    skip = False
    for index, arg in enumerate(args):
        if skip:
            skip = False
            continue
        following = args[index + 1] if index + 1 < len(args) else ""
        if arg == "--set" and following.replace(" ", "").startswith("train.resume="):
            skip = True
            continue
        if arg.replace(" ", "").startswith("--set=train.resume="):
            continue
        kept.append(arg)
    return shlex.join(["physreason", *kept, "--set", "train.resume=true"])


class TrainingInterrupted(Interrupted):
    """A run stopped on SIGINT or SIGTERM after saving a checkpoint (or with checkpoints off); exit code 130."""

    def __init__(self, signal_name: str, step: int, checkpoint: Path | None, command: str) -> None:
        self.step, self.checkpoint, self.command = step, checkpoint, command
        if checkpoint is not None:
            text = f"{signal_name}: stopped after step {step}, checkpoint saved to {checkpoint}. Resume with:\n  {command}"
        else:
            text = (
                f"{signal_name}: stopped after step {step}; checkpoints are off (train.ckpt.enable_checkpoint = false), "
                f"so nothing was saved and a rerun starts from step 0:\n  {command}"
            )
        super().__init__(text)


class StoppedAtOnce(KeyboardInterrupt):
    """A second stop signal: the run ends now, mid-step, without a checkpoint (exit 130, as Ctrl-C does).

    A KeyboardInterrupt so that no `except Exception` in library code catches it on its way out."""


SAME_REQUEST_S = 1.0
"""Stop signals within this many seconds of the first are one request reaching the process by several routes: GNU
timeout signals its child and then the child's process group, and torchrun forwards a signal its group also got."""


class StopOnSignal:
    """SIGINT (Ctrl-C) or SIGTERM (schedulers) asks the training loop to finish its step, save a checkpoint and stop.

    The handler only sets a flag: a step half done (a collective in flight, an optimizer step) is never cut. Every
    rank learns of a request through one all-reduce per step, so all ranks save the same step together (DCP is
    collective). A second signal, SIGINT or SIGTERM, more than SAME_REQUEST_S after the first stops at once without a
    checkpoint (StoppedAtOnce): a person pressing Ctrl-C again, or a scheduler whose grace period is running out. A
    context manager that restores the handlers. `saves`: whether the stop saves a checkpoint (train.ckpt), for the
    message.
    """

    def __init__(self, runtime: Runtime | None = None, saves: bool = True) -> None:
        self.runtime, self.saves = runtime, saves
        self.signal_name: str | None = None
        self._first_at = 0.0
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signal_name is not None:
            if time.monotonic() - self._first_at <= SAME_REQUEST_S:
                return
            raise StoppedAtOnce(f"{name} again: stopped at once, mid-step, without a checkpoint")
        self.signal_name, self._first_at = name, time.monotonic()
        # The message goes out now: a step can take minutes, and the person pressing Ctrl-C wants to know it was heard.
        if self.runtime is None or self.runtime.is_main:
            then = "saving a checkpoint after this step" if self.saves else "stopping after this step (checkpoints are off)"
            again = "Ctrl-C" if signum == signal.SIGINT else name
            print(f"\n{name}: {then} ({again} again stops at once, without a checkpoint)", file=sys.stderr)

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]

    def requested(self) -> bool:
        """Whether any rank got a stop signal (collective when distributed: every rank calls it each step)."""
        local = float(self.signal_name is not None)
        if self.runtime is None or not self.runtime.distributed:
            return bool(local)
        return all_reduce_sum(local, self.runtime) > 0

    def after_step(self, checkpointer: Checkpointer, step: int, saved: Saved | None, state: dict[str, Any]) -> None:
        """At the end of `step`: if a stop was asked for, save `state` (unless `saved` is this step's), then raise.

        Raises TrainingInterrupted naming the checkpoint and the command that resumes from it.
        """
        if not self.requested():
            return
        checkpoint = None
        if checkpointer.config.train.ckpt.enable_checkpoint:
            checkpoint = (saved or checkpointer.save(step, state)).checkpoint
        checkpointer.wait()  # the command printed below resumes from that checkpoint: it must be complete
        raise TrainingInterrupted(self.signal_name or "SIGINT", step, checkpoint, resume_command())


def _on_cuda(module: Any) -> bool:
    return any(parameter.device.type == "cuda" for parameter in module.parameters())


def parameter_counts(module: object) -> tuple[int, int]:
    """(trainable, all) parameter counts of a model; sharded (DTensor) parameters count at their full size."""
    trainable = total = 0
    for parameter in module.parameters():  # type: ignore[attr-defined]
        total += parameter.numel()
        trainable += parameter.numel() if parameter.requires_grad else 0
    return trainable, total


def run_summary(title: str, items: dict[str, object]) -> str:
    """The start-up summary a run prints (as TRL's trainer does): one aligned `name = value` line per item."""
    width = max(len(name) for name in items)
    lines = [f"***** {title} *****"]
    for name, value in items.items():
        shown = f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)
        lines.append(f"  {name:<{width}} = {shown}")
    return "\n".join(lines)


def nothing_to_do(resumed: Resumed | None, total_steps: int) -> bool:
    """Whether the run resumed from a checkpoint at (or past) its last step, so no step is left to train."""
    if resumed is None or resumed.step < total_steps:
        return False
    log.info(
        "nothing to do: %s is at step %d of %d; raise train.max_steps or train.epoch to train further",
        resumed.path, resumed.step, total_steps,
    )
    return True
