"""The settings a batch's answers depend on, stored beside its output so a rerun cannot mix two models' answers.

A rerun appends to the output and skips ids already there; with another model, prompt or sampling it would
put two kinds of answers in one file. The settings are the whole resolved recipe minus what cannot change an
answer (how many GPUs, batch sizes, Ray placement, the training sections), plus the command's own switches:
a setting added later is recorded without a change here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from physreason.config import Config
from physreason.errors import InputError
from physreason.files import write_atomic
from physreason.infer.results import is_parquet

# Sections of the recipe that no inference answer reads.
_NOT_INFERENCE = ("data", "train", "rollout", "policy", "grpo", "logging", "eval", "infer")
# Keys of the sections kept that change speed or memory, never an answer.
_NOT_ANSWERS = (
    "engine.tensor_parallel_size",
    "engine.gpu_memory_utilization",
    "engine.enforce_eager",
    "engine.cuda_graph_sizes",
    "engine.batch_size",
    "engine.hf_static_cache",
    "engine.kv_cache_memory_gib",
)
# Keys added after outputs already stored settings, with the default that reproduces those outputs: left out at that
# default, so a rerun of an older output is not refused for a key its settings file could not have had.
_NEW_KEY_DEFAULTS = {"engine.kv_cache_dtype": "auto"}


def answer_settings(cfg: Config, **switches: Any) -> dict[str, Any]:
    """Flat dotted keys -> values of everything that decides a batch's answers (`switches`: command-line ones)."""
    tree = {k: v for k, v in cfg.model_dump(mode="json").items() if k not in _NOT_INFERENCE}
    flat = _flatten(tree)
    for key in _NOT_ANSWERS:
        flat.pop(key, None)
    for key, default in _NEW_KEY_DEFAULTS.items():
        if flat.get(key) == default:
            del flat[key]
    flat.update(switches)
    return flat


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value and key not in ("limit_mm_per_prompt",):
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def settings_path(out: Path) -> Path:
    """Where the settings of `out` live: `<out>.settings.json`, or `_settings.json` in a Parquet folder."""
    return out / "_settings.json" if is_parquet(out) else out.with_name(out.name + ".settings.json")


def check_and_store_settings(out: Path, settings: Mapping[str, Any], has_results: bool) -> None:
    """Refuse to add to `out` when its results were made with other settings; else store `settings` beside it.

    Raises InputError naming each setting that differs and the two ways out (another --out, or --overwrite).
    Results without stored settings (written by an older physreason) are taken as they are.
    """
    path = settings_path(out)
    if has_results and path.is_file():
        try:
            stored = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            stored = exc
        if not isinstance(stored, dict):
            why = f"{type(stored).__name__}: {stored}" if isinstance(stored, Exception) else "not a JSON object"
            raise InputError(
                f"{path} cannot be read ({why}); it holds the settings of the results in {out}, and a run stopped "
                "while writing it leaves it so. Delete it to keep those results (they are then taken as they are), "
                "or pass --overwrite to delete them and start anew"
            )
        # The model and the prompt first: they explain the rest (another family resolves other sampling defaults).
        if "model.fingerprint" not in stored and _same_folder(stored.get("model.model_name_or_path"), settings):
            # Written before fingerprints were stored, with the path as typed: compared on the rest.
            stored = {**stored, "model.model_name_or_path": settings.get("model.model_name_or_path")}
        if _legacy_fingerprint_matches(stored.get("model.fingerprint"), settings):
            # Stored before the content hash (config.json, the weights' sizes and times), and still matching.
            stored = {**stored, "model.fingerprint": settings.get("model.fingerprint")}
        keys = (set(stored) | set(settings)) - ({"model.fingerprint"} - set(stored))
        changed = sorted(
            (k for k in keys if stored.get(k) != settings.get(k)),
            key=lambda k: (not k.startswith(("model.", "resolved.")), k),
        )
        if changed:
            shown = "; ".join(f"{k}: {stored.get(k)!r} there, {settings.get(k)!r} now" for k in changed[:6])
            more = f" and {len(changed) - 6} more" if len(changed) > 6 else ""
            raise InputError(
                f"{out} holds results made with other settings ({shown}{more}; see {path}); adding to it would mix "
                "two kinds of answers. Write to a new --out, or pass --overwrite to delete those results and start anew"
            )
    path.parent.mkdir(parents=True, exist_ok=True)
    # Written beside and renamed over: a kill mid-write leaves the old settings or the new, never half a file.
    write_atomic(path, json.dumps(dict(settings), indent=2, sort_keys=True) + "\n")


def _legacy_fingerprint_matches(stored: Any, settings: Mapping[str, Any]) -> bool:
    """Whether `stored` is a local folder's fingerprint in the form infer wrote before 2026-11-29 and the folder now
    named in `settings` still gives it (models.source.legacy_model_fingerprint)."""
    from physreason.models.source import legacy_model_fingerprint

    folder = settings.get("model.model_name_or_path")
    if not isinstance(stored, str) or not stored.startswith("config ") or not isinstance(folder, str):
        return False
    path = Path(folder)
    return path.is_dir() and stored == legacy_model_fingerprint(path)


def _same_folder(stored: Any, settings: Mapping[str, Any]) -> bool:
    current = settings.get("model.model_name_or_path")
    if not isinstance(stored, str) or not isinstance(current, str) or not Path(stored).expanduser().is_dir():
        return False
    return Path(stored).expanduser().resolve() == Path(current).expanduser().resolve()


def delete_results(out: Path) -> None:
    """Remove a batch output (JSONL file, or the Parquet folder's part files) and its settings."""
    if is_parquet(out):
        for part in out.glob("part-*.parquet"):
            part.unlink()
    elif out.is_file():
        out.unlink()
    settings_path(out).unlink(missing_ok=True)
