"""Export any checkpoint of a training run, finished or interrupted, full or LoRA, as a Hugging Face folder.

The run folder (an sft or grpo train.output_dir) holds the resolved recipe (config.toml) and the DCP checkpoints
(checkpoints/step_<n>). The export rebuilds the model the recipe trained (model.model_name_or_path, with its
[train.lora] adapters when on), loads the checkpoint's weights into it and writes the same folder the run's own
safetensors exports are: config.json, model safetensors, tokenizer, processor, chat template and generation config,
which transformers' from_pretrained, vLLM and `model.model_name_or_path` of a new run load as they are.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

from torch import nn

from physreason.config import Config, load_config
from physreason.errors import ConfigError
from physreason.files import replace_folder
from physreason.models.loading import DTYPES
from physreason.overwrite import check_replace, holds_more_than_locks
from physreason.train.checkpoint import checkpoint_dirs, load_model_weights, resolve_resume

EXPORT_DTYPES = (*DTYPES, "auto")  # 'auto': the dtype the run trained in (float32 master weights)


def _run_config(run_dir: Path) -> Config:
    recipe = run_dir / "config.toml"
    if not recipe.is_file():
        # a checkpoint or export folder (<run>/checkpoints/step_<n>, <run>/safetensors/step_<n>) is what one finds
        # when looking for weights: point at its run and the --step that picks it
        run = next((parent for parent in run_dir.parents[:2] if (parent / "config.toml").is_file()), None)
        if run is not None and run_dir.exists():
            step = run_dir.name.removeprefix("step_").removesuffix(".tmp")
            pick = f" --step {step}" if run_dir.name.startswith("step_") and step.isdigit() else ""
            raise ConfigError(
                f"{run_dir} is inside the run {run}: give the run folder, e.g. physreason export {run}{pick} --out DIR"
            )
        what = "does not exist" if not run_dir.exists() else "holds no config.toml"
        raise ConfigError(
            f"{run_dir} {what}: give the train.output_dir of a physreason sft or grpo run (each run writes its "
            "resolved recipe there as config.toml)"
        )
    return load_config(recipe)


def pick_checkpoint(run_dir: Path, step: int | None) -> Path:
    """The checkpoint of `step` in run_dir, or its latest complete one for None; ConfigError listing the steps there."""
    found = checkpoint_dirs(run_dir)
    steps = [int(p.name.removeprefix("step_")) for p in found]
    if not found:
        raise ConfigError(
            f"{run_dir / 'checkpoints'} holds no complete checkpoint (step_<n> folders; a .tmp folder is a save that "
            "never finished): the run stopped before its first save"
        )
    if step is None:
        return found[-1]
    if step not in steps:
        raise ConfigError(
            f"{run_dir} has no complete checkpoint of step {step}; available steps: {', '.join(map(str, steps))}"
        )
    return found[steps.index(step)]


# The manifest every `physreason export` folder carries: the mark --overwrite looks for before it replaces a folder.
EXPORT_MANIFEST = "physreason-export.json"
WRITTEN_BY = "physreason export"


def is_export(folder: Path) -> bool:
    """Whether `folder` is a folder `physreason export` wrote (its manifest says so)."""
    try:
        manifest = json.loads((folder / EXPORT_MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and manifest.get("written_by") == WRITTEN_BY


def write_manifest(folder: Path, run_dir: Path, checkpoint: Path, adapter_only: bool, dtype: str) -> None:
    """Mark `folder` as an export of `checkpoint` of the run in run_dir (written first, so a cut-short one is marked)."""
    folder.mkdir(parents=True, exist_ok=True)
    manifest = {"written_by": WRITTEN_BY, "run": str(run_dir.resolve()), "checkpoint": checkpoint.name,
                "adapter_only": adapter_only, "dtype": dtype}  # fmt: skip
    (folder / EXPORT_MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")


def _check_out(out: Path, force: bool, run_dir: Path, config: Config) -> None:
    """Refuse an --out that is a link or a file, lies in the run's checkpoints/ or safetensors/, holds the run or the
    model it trained from, or is a non-empty folder other than an earlier export (replaced only with --overwrite);
    the same for the staging folder beside it."""
    if not out.name:  # '/': a folder with no name has no staging folder beside it
        raise ConfigError(f"--out {out}: give a folder of its own to write the model into (e.g. {out / 'exported'})")
    for path in (out, out.with_name(out.name + ".tmp")):  # --out and its staging folder
        if path.is_symlink():
            # replaced, the link's target would be written through or left behind: only a real folder is an output
            raise ConfigError(
                f"--out {out}: {path} is a symbolic link (to {path.readlink()}); physreason export neither writes "
                "through a link nor replaces one: give the folder it points to, or a new folder"
            )
    if out.is_file():
        raise ConfigError(f"--out {out} is a file: give a folder to write the model into")
    for area in ("checkpoints", "safetensors"):
        # the run's saves replace step_<n> folders there and train.ckpt.max_keep deletes the older ones; a resume would
        # stop at the step whose folder this export took
        if out.resolve().is_relative_to(run_dir.resolve() / area):
            raise ConfigError(f"--out {out} lies inside the run's {area} folder: write the export elsewhere")
    protected: list[tuple[Path, str]] = [(run_dir, "the run being exported")]
    source = Path(config.model.model_name_or_path).expanduser()
    if source.is_dir():
        protected.append((source, "the model the run trained from (model.model_name_or_path)"))
    remedy = "give a new or empty folder, or an earlier physreason export with --overwrite"
    mark = f"{EXPORT_MANIFEST}, the manifest physreason export writes"
    check_replace(out, option="--out", protected=protected, marked=is_export(out), mark=mark, remedy=remedy)
    staging = out.with_name(out.name + ".tmp")  # where the folder is written before it is renamed into place
    check_replace(staging, option=f"the staging folder of --out {out},", protected=protected,
                  marked=is_export(staging), mark=mark, remedy="move it away or give another --out")  # fmt: skip
    if staging.is_dir() and any(staging.iterdir()) and not force:
        # an export cut short, or a finished one someone named so: either way not a folder the user named here
        raise ConfigError(
            f"the staging folder of --out {out}, {staging}, holds a physreason export (cut short, or an earlier one): "
            "pass --overwrite to replace it, or move it away"
        )
    if out.is_dir() and holds_more_than_locks(out) and not force:
        raise ConfigError(
            f"--out {out} holds an earlier physreason export: pass --overwrite to replace it, or give a new or empty "
            "folder"
        )


def export_run(
    run_dir: str | Path,
    out: str | Path,
    step: int | None = None,
    adapter_only: bool = False,
    dtype: str | None = None,
    force: bool = False,
    trust: bool = False,
) -> Path:
    """Write the checkpoint of `step` (None: the latest complete one) of the run in run_dir as a Hugging Face folder.

    A LoRA run gives the merged model (with the adapter alone in its `adapter` subfolder), or with adapter_only
    just the PEFT adapter folder. dtype: the saved dtype (None: the run's model.dtype; 'auto': float32 as trained).
    A non-empty `out` is replaced only with force, and only when it is an earlier export (its EXPORT_MANIFEST says
    so) that holds neither the run nor the model the run trained from. A checkpoint the run did not write itself (its record in
    checkpoints/written.json does not match) is loaded only with trust: loading unpickles its .metadata.
    Raises ConfigError, before anything is written, for every mistake a user can fix.
    """
    run_dir, out = Path(run_dir), Path(os.path.abspath(out))  # '.' and '..' named: a staging folder goes beside
    config = _run_config(run_dir)
    checkpoint = pick_checkpoint(run_dir, step)
    resolve_resume(str(checkpoint), run_dir, trust)  # the run's own trust rule: refuses a folder it did not write
    lora = config.train.lora.enable
    if adapter_only and not lora:
        raise ConfigError(
            f"--adapter-only: the run in {run_dir} trained the full model (train.lora.enable = false), so there is "
            "no adapter; export without --adapter-only"
        )
    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise ConfigError(f"--dtype {dtype!r} is not one of {', '.join(EXPORT_DTYPES)}")
    try:
        _check_out(out, force, run_dir, config)  # before anything is written, the lock file included
    except ConfigError:
        if (out.parent / f".{out.name}.lock").is_file():
            with _out_lock(out):  # "in use by another run" when another export holds it: what it writes is why
                pass
        raise
    with _out_lock(out):
        _check_out(out, force, run_dir, config)  # again: another export may have written --out before the lock
        return _export(config, run_dir, checkpoint, out, adapter_only, dtype or config.model.dtype)


def _out_lock(out: Path) -> contextlib.AbstractContextManager[None]:
    """Hold `out` for this process while it is checked and written (a lock file `.<name>.lock` beside it, as `infer`
    holds its --out): a second export into the same folder is refused naming the first, instead of both writing one
    staging folder and each replacing the other's export without --overwrite."""
    from physreason.train.runlock import holding

    out.parent.mkdir(parents=True, exist_ok=True)
    return holding(out.parent / f".{out.name}.lock", f"--out {out}",
                   "two exports into one folder replace each other's. Wait for that export to end, or give another "
                   "--out")  # fmt: skip


def _export(config: Config, run_dir: Path, checkpoint: Path, out: Path, adapter_only: bool, saved_dtype: str) -> Path:
    """Write the checkpoint's model (or LoRA adapter) to `out` through its staging folder (see export_run)."""
    model, peft_model = _load_trained(config, checkpoint)
    if adapter_only:
        from physreason.models.lora import save_adapter

        staging = out.with_name(out.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        write_manifest(staging, run_dir, checkpoint, adapter_only, saved_dtype)
        save_adapter(peft_model, staging)
        replace_folder(staging, out)
        return out
    from physreason.models.export import export_trained

    return export_trained(
        model, peft_model, config.model.model_name_or_path, out, saved_dtype,
        mark=lambda staging: write_manifest(staging, run_dir, checkpoint, adapter_only, saved_dtype),
    )  # fmt: skip


def _load_trained(config: Config, checkpoint: Path) -> tuple[nn.Module, nn.Module | None]:
    """The recipe's model (fp32, LoRA adapters injected when on) holding the checkpoint's weights; and its PeftModel."""
    import torch

    from physreason.models.loading import load_model

    model = load_model(config.model, dtype=torch.float32)
    peft_model = None
    if config.train.lora.enable:
        from physreason.models.lora import apply_lora

        peft_model = apply_lora(model, config.train.lora)
    # Every trainer's wrapper (SFT's loss module, GRPO's policy scorer) holds the model as `.model`, which is
    # where the checkpoint's names come from; neither wrapper has weights of its own.
    wrapper = nn.Module()
    wrapper.model = model
    load_model_weights(checkpoint, wrapper, trainable_only=peft_model is not None)
    return model, peft_model
