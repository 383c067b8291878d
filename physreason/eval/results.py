"""Where evaluation results live, and reading, merging and describing them.

Layout: `<results_dir>/<model>/<answer_type>/<dataset>/seed_<seed>/`, one folder per repeat, holding
`run.json` (what the run covers), `shard-<i>-of-<k>.jsonl` while shards write (one JSON line per
sample as it finishes), and `results.jsonl` once the shards are merged. A sample is finished when its
id is in any of these files, so a rerun with another shard count resumes where the last one stopped.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from physreason.errors import InputError
from physreason.files import write_atomic
from physreason.infer.results import finished_ids

MERGED_FILE = "results.jsonl"
RUN_FILE = "run.json"
CONFIG_FILE = "config.toml"
# `<results_dir>/<this>`: held by an evaluation while it chooses its model's folder and records its model there.
MODEL_FOLDERS_LOCK = ".model-folders.lock"
_SHARD_GLOB = "shard-*-of-*.jsonl"
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def model_slug(model_name_or_path: str) -> str:
    """A folder name for a model: a local folder's own name, or a hub id with '/' as '--'.

    "nvidia/Cosmos-Reason1-7B" -> "nvidia--Cosmos-Reason1-7B"; "/ckpt/run3/" -> "run3". Characters
    other than letters, digits, '.', '_' and '-' become '_'.
    """
    local = Path(model_name_or_path).expanduser()
    name = local.resolve().name if local.is_dir() else model_name_or_path.strip("/").replace("/", "--")
    return _UNSAFE.sub("_", name).strip("._") or "model"


# A checkpoint folder named only by its step ("step_20", "checkpoint-500") says nothing without its run.
_STEP_NAME = re.compile(r"(global_)?(step|checkpoint|ckpt)[-_]?\d+", re.IGNORECASE)
# Folders a trainer keeps its checkpoints in, between the run folder and the step folder.
_CHECKPOINT_PARENTS = {"safetensors", "checkpoints", "checkpoint", "ckpt", "export", "exports", "hf"}


def model_label(model_name_or_path: str) -> str:
    """A readable results folder name for a model: `model_slug`, with the run folder's name before a bare step folder.

    "/runs/sft-a/safetensors/step_20" -> "sft-a-step_20" (not "step_20", which every run has); a hub id or a
    folder with a name of its own is its slug.
    """
    slug = model_slug(model_name_or_path)
    local = Path(model_name_or_path).expanduser()
    if not (local.is_dir() and _STEP_NAME.fullmatch(slug)):
        return slug
    for parent in local.resolve().parents:
        if parent.name and parent.name.lower() not in _CHECKPOINT_PARENTS:
            return f"{_UNSAFE.sub('_', parent.name).strip('._')}-{slug}"
    return slug


def _stored_model(model_dir: Path) -> str | None:
    """The model path or id a results folder's runs were made with (from an answer type's config.toml), if any."""
    import tomllib

    for stored in sorted(model_dir.glob(f"*/{CONFIG_FILE}")):
        try:
            section = tomllib.loads(stored.read_text(encoding="utf-8")).get("model")
        except (tomllib.TOMLDecodeError, UnicodeDecodeError, OSError):
            continue  # not a config this command wrote: it names no model
        model = section.get("model_name_or_path") if isinstance(section, dict) else None
        if isinstance(model, str):
            return model
    return None


def _same_model(a: str, b: str) -> bool:
    local_a, local_b = Path(a).expanduser(), Path(b).expanduser()
    if local_a.is_dir() or local_b.is_dir():
        return local_a.resolve() == local_b.resolve()
    return a == b


def results_model_dir(results_dir: str | Path, model_name_or_path: str, name: str | None = None) -> Path:
    """`<results_dir>/<label>`: the folder of one model's results.

    `name` (eval.model_name) is used as given. Otherwise the label is `model_label`, and when that folder
    holds another model's results (two runs' "step_20"), `<label>-2`, `<label>-3`, ...: the first that holds this
    model's (its config.toml names it), else the first free one. Reruns of one model find their folder (also when a
    folder before it has been freed since), two models never share one.

    A folder's model is recorded by the config.toml an evaluation writes there (prepare_runs); `physreason eval`
    chooses the folder and writes that file while it holds MODEL_FOLDERS_LOCK, so that two evaluations started at
    once never both take one free folder. The choice alone (this function) takes no lock.
    """
    root = Path(results_dir).expanduser()
    if name:
        return root / model_slug(name)
    label = model_label(model_name_or_path)
    free = None
    for k in range(1, 1000):
        folder = root / (label if k == 1 else f"{label}-{k}")
        stored = _stored_model(folder) if folder.is_dir() else None
        if stored is None:
            free = free or folder
        elif _same_model(stored, model_name_or_path):
            return folder
    if free is not None:
        return free
    raise InputError(f"{root} holds results of 999 models labelled {label}: set eval.model_name or another results_dir")


def answer_type_dir(results_dir: str | Path, model_name_or_path: str, answer_type: str, name: str | None = None) -> Path:
    """`<results_dir>/<model>/<answer_type>`: the folder of one model's results in one answer mode."""
    return results_model_dir(results_dir, model_name_or_path, name) / answer_type


def run_dir(base: Path, dataset: str, seed: int) -> Path:
    """The folder of one repeat (identified by its seed) of one data set under an answer-type folder."""
    return base / dataset / f"seed_{seed}"


def shard_file(run: Path, shard: int, num_shards: int) -> Path:
    """The file shard `shard` of `num_shards` appends its results to."""
    return run / f"shard-{shard}-of-{num_shards}.jsonl"


def result_files(run: Path) -> list[Path]:
    """The merged file (first) and any shard files of a run folder that exist."""
    merged = run / MERGED_FILE
    return ([merged] if merged.is_file() else []) + sorted(run.glob(_SHARD_GLOB))


def finished_in_run(run: Path) -> set[str]:
    """Ids of every sample with a result in a run folder, from all its files (torn last lines ignored)."""
    done: set[str] = set()
    for path in result_files(run):
        done |= finished_ids(path)
    return done


def read_jsonl_records(path: Path) -> list[dict[str, Any]]:
    """The complete JSON object lines of a result file; a torn line from a killed writer is skipped.

    Bytes that are not UTF-8 (a kill inside a multi-byte character, a garbled block) are read as U+FFFD, as
    finished_ids reads them: a torn line then fails to parse and is skipped, and a line finished_ids counts as
    done is read here too, so no sample is counted finished without a result.
    """
    records = []
    with path.open(encoding="utf-8", errors="replace") as handle:
        for line in handle:
            try:
                record = json.loads(line)
            except (ValueError, RecursionError):  # torn, or no JSON reader takes it (4,301 digits, deep nesting)
                continue
            if isinstance(record, dict) and "id" in record:
                records.append(record)
    return records


def read_run(run: Path) -> dict[str, dict[str, Any]]:
    """Every sample's result in a run folder, one per id (the merged file wins over shard files)."""
    records: dict[str, dict[str, Any]] = {}
    for path in result_files(run):
        for record in read_jsonl_records(path):
            records.setdefault(str(record["id"]), record)
    return records


def merge_shards(run: Path, order: Iterable[str] = ()) -> int:
    """Fold shard files into `results.jsonl` (ids in `order` first, each once) and delete them; return the count.

    The merged file is written beside and renamed over the old one, and shard files are deleted only
    after that, so a kill at any point leaves every result in at least one file and none counted twice.
    """
    shards = sorted(run.glob(_SHARD_GLOB))
    if not shards:
        return len(read_run(run)) if run.is_dir() else 0
    records = read_run(run)
    rank = {sample_id: k for k, sample_id in enumerate(order)}
    ordered = sorted(records.values(), key=lambda r: (rank.get(str(r["id"]), len(rank)), str(r["id"])))
    write_atomic(run / MERGED_FILE, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in ordered))
    for path in shards:
        path.unlink()
    return len(ordered)


def write_run_info(run: Path, info: dict[str, Any]) -> None:
    """Record what a repeat covers (data set, seed, sample count, model) as `run.json`."""
    run.mkdir(parents=True, exist_ok=True)
    write_atomic(run / RUN_FILE, json.dumps(info, indent=2, ensure_ascii=False) + "\n")


def read_run_info(run: Path) -> dict[str, Any]:
    """The `run.json` of a run folder; {} when it is absent (hand-made or copied results)."""
    path = run / RUN_FILE
    if not path.is_file():
        return {}
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as exc:  # not JSON, not UTF-8, too deep
        raise InputError(f"{path} is not valid JSON ({exc}); delete it and rerun the evaluation to rewrite it") from exc
    return info if isinstance(info, dict) else {}
