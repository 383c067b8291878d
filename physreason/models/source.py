"""Check where a model comes from before anything loads it: a local folder that is a model, or a hub id that resolves.

transformers answers a wrong folder with a repo-id OSError or "Unrecognized model", and an unreachable hub
with five backed-off retries per file (48-72 s for one model). Every command checks its model here first,
so a bad `--model` costs one clear line and an offline machine one failed request, not a minute.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from physreason.errors import ConfigError

# What a model folder holds, named in every error about one.
MODEL_FOLDER_NEEDS = (
    "a model folder needs config.json (with model_type), the weights (*.safetensors) and the tokenizer files; "
    "`physreason models tiny DIR` writes a small one to try"
)
PROBE_TIMEOUT_S = 10.0
# Sources already found usable in this process: an engine, a trainer and a reference model each read the config.
_checked: set[tuple[str, str | None]] = set()


def looks_like_path(name: str) -> bool:
    """Whether `name` is meant as a local folder rather than a hub id (owner/name or name)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if name.startswith(("/", "./", "../", "~", ".\\")) or name in (".", "..") or name.count("/") > 1:
        return True
    if Path(name).exists():
        return True
    try:
        validate_repo_id(name)
    except HFValidationError:
        return True
    return False


def check_model_folder(name: str, key: str) -> None:
    """Raise ConfigError naming the folder `name` (as the user wrote it) when it is not a Hugging Face model folder."""
    folder = Path(name).expanduser()
    if not folder.exists():
        raise ConfigError(f"{key} = {name!r}: no such folder; {MODEL_FOLDER_NEEDS}")
    if not folder.is_dir():
        raise ConfigError(f"{key} = {name!r} is a file, not a folder; {MODEL_FOLDER_NEEDS}")
    config = folder / "config.json"
    if not config.is_file():
        raise ConfigError(f"{key} = {name!r} has no config.json, so it is not a model folder; {MODEL_FOLDER_NEEDS}")
    try:
        raw = json.loads(config.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{config} is not valid JSON ({exc}); {MODEL_FOLDER_NEEDS}") from exc
    if not isinstance(raw, dict) or not raw.get("model_type"):
        raise ConfigError(f"{config} names no model_type, so it is not a model's config; {MODEL_FOLDER_NEEDS}")


def hub_offline() -> bool:
    """Whether the hub is off for this process (HF_HUB_OFFLINE, as huggingface_hub read it, or set since)."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def go_offline() -> None:
    """Serve every hub lookup of this process and its children from the local cache (no request, no retry)."""
    from huggingface_hub import constants

    os.environ["HF_HUB_OFFLINE"] = "1"
    constants.HF_HUB_OFFLINE = True


def _cached(repo_id: str, revision: str | None) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo_id, "config.json", revision=revision), str)


def probe_hub(repo_id: str, revision: str | None) -> tuple[int | None, str]:
    """One request for the repo's config.json, without retries: (HTTP status, "") or (None, why it failed)."""
    from huggingface_hub import constants, hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session

    url = hf_hub_url(repo_id, "config.json", revision=revision)
    try:
        response = get_session().head(url, headers=build_hf_headers(), timeout=PROBE_TIMEOUT_S)
    except Exception as exc:  # httpx or httpx2 by huggingface_hub version: their errors share no importable base
        return None, f"cannot reach {constants.ENDPOINT}: {exc}"
    return response.status_code, ""


def check_model_source(name: str, revision: str | None = None, *, key: str = "model.model_name_or_path") -> None:
    """Fail fast, with one line naming `name`, when the model can be neither read here nor fetched from the hub.

    A local folder must be a model folder. A hub id is fine when the hub answers for it, or when it is in the
    local cache (an unreachable hub then switches this process to offline mode, so nothing waits on retries).
    With HF_HUB_OFFLINE set no request is made.
    """
    if (name, revision) in _checked:
        return
    if looks_like_path(name):
        check_model_folder(name, key)
    else:
        _check_hub_id(name, revision, key)
    _checked.add((name, revision))


def _check_hub_id(name: str, revision: str | None, key: str) -> None:
    cached = _cached(name, revision)
    if hub_offline():
        if not cached:
            raise ConfigError(
                f"{key} = {name!r} is a hub id that is not in the local cache, and HF_HUB_OFFLINE is set: download "
                f"it where there is network (hf download {name}), or pass a local model folder"
            )
        return
    status, why = probe_hub(name, revision)
    if status is None:
        if cached:
            go_offline()
            return
        raise ConfigError(
            f"{key} = {name!r}: {why}, and it is not in the local cache. Connect to the network, download it "
            f"elsewhere (hf download {name}) and copy the cache, or pass a local model folder"
        )
    if status in (401, 403):
        raise ConfigError(
            f"{key} = {name!r}: the hub refused access (HTTP {status}); accept the model's licence on its page and "
            "log in (hf auth login), or pass a local model folder"
        )
    if status == 404:
        raise ConfigError(
            f"{key} = {name!r}: no such model on the hub (HTTP 404){f' at revision {revision}' if revision else ''}; "
            f"check the id, or pass a local model folder ({MODEL_FOLDER_NEEDS})"
        )


# Where transformers finds a checkpoint's weights: sharded (an index naming its files) or one file.
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def check_model_weights(name: str, key: str = "model.model_name_or_path") -> None:
    """Raise ConfigError naming the folder and what is missing when a local model folder lacks its weights.

    A folder with config.json but no weight file (an interrupted copy or download, a config-only folder) would
    otherwise fail deep in transformers. Hub ids are left to the hub: their files are fetched as they are needed.
    """
    if not looks_like_path(name):
        return
    folder = Path(name).expanduser()
    for index_name in _WEIGHT_INDEXES:
        index = folder / index_name
        if not index.is_file():
            continue
        try:
            files = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"{index} is not a weight index (no readable weight_map: {exc}); {MODEL_FOLDER_NEEDS}") from exc
        missing = [file for file in files if not (folder / file).is_file()]
        if missing:
            shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
            raise ConfigError(
                f"{key} = {name!r}: {index_name} names {len(files)} weight files and {len(missing)} are missing "
                f"({shown}): finish the copy or download of that folder"
            )
        return
    if any((folder / file).is_file() for file in _WEIGHT_FILES) or any(folder.glob("*.safetensors")):
        return
    raise ConfigError(
        f"{key} = {name!r} has config.json but no weights (model.safetensors, a sharded *.safetensors set with its "
        "index, or pytorch_model.bin): finish the copy or download of that folder, or point at a complete one"
    )


# Weight files are sampled (their first and last FINGERPRINT_SAMPLE bytes and their size) rather than read whole, so
# fingerprinting a 16 GB folder takes milliseconds; every other file (config, tokenizer, processor) is read whole.
FINGERPRINT_SAMPLE = 4 << 20
_WHOLE_FILE_LIMIT = 16 << 20


# Files beside a model that cannot change its answers: documentation, licences, pictures and dot files (version control
# metadata, locks). Editing a model card must not stop an evaluation or a batch from resuming.
_NOT_MODEL_FILE = re.compile(
    r"(?i)^(\..*|(readme|license|licence|notice|citation|model_card)(\.[^.]*)?|.*\.(md|rst|png|jpe?g|gif|svg|webp|pdf))$"
)


def folder_content_hash(folder: str | Path, *, every_file: bool = False) -> str:
    """A short content hash of a local model folder (12 hex digits): which weights a result was made with.

    Covers every file directly in the folder that can change the model's answers, by name: small files (config,
    tokenizer, processor, chat template) whole, large ones (weights) by size and their first and last
    FINGERPRINT_SAMPLE bytes; documentation, licences, pictures and dot files are left out (_NOT_MODEL_FILE). The same
    folder path holding another model gets another hash. `every_file`: the hash as results recorded it before
    2026-11-29, which covered those files too (eval's legacy_fingerprint; such results still resume).
    """
    import hashlib

    digest = hashlib.sha256()
    files = (p for p in Path(folder).expanduser().iterdir() if p.is_file())
    for path in sorted(p for p in files if every_file or not _NOT_MODEL_FILE.match(p.name)):
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        with path.open("rb") as handle:
            if size <= _WHOLE_FILE_LIMIT:
                digest.update(handle.read())
            else:
                digest.update(handle.read(FINGERPRINT_SAMPLE))
                handle.seek(size - FINGERPRINT_SAMPLE)
                digest.update(handle.read(FINGERPRINT_SAMPLE))
    return digest.hexdigest()[:12]


def model_fingerprint(name: str, revision: str | None = None) -> dict[str, str]:
    """What identifies the model `name` names now, for outputs that must not mix two models' answers.

    A local folder: its resolved path (so `m` and `m/` agree) and its content hash (folder_content_hash: another
    model saved at the same path differs, the same files copied there again or a model card edited do not). A hub
    id: the commit its cached config.json belongs to, else the revision asked for.
    """
    if looks_like_path(name):
        folder = Path(name).expanduser().resolve()
        return {"model.model_name_or_path": str(folder), "model.fingerprint": f"content {folder_content_hash(folder)}"}
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(name, "config.json", revision=revision)
    commit = Path(cached).parent.name if isinstance(cached, str) else None
    return {"model.model_name_or_path": name, "model.fingerprint": f"revision {commit or revision or 'main'}"}


def legacy_model_fingerprint(folder: Path) -> str:
    """A local folder's "model.fingerprint" as infer recorded it before 2026-11-29 (config.json's hash and the weight
    files' names, sizes and modification times): results stored with it still resume when it still matches."""
    import hashlib

    config = folder / "config.json"
    config_hash = hashlib.sha256(config.read_bytes()).hexdigest()[:16] if config.is_file() else "none"
    weights = hashlib.sha256()
    for path in sorted(p for pattern in ("*.safetensors", "*.bin") for p in folder.glob(pattern)):
        stat = path.stat()
        weights.update(f"{path.name}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return f"config {config_hash}, weights {weights.hexdigest()[:16]}"
