"""Reading a DCP checkpoint without running code put in it.

torch.distributed.checkpoint reads a checkpoint's `.metadata` with pickle.load and each non-tensor entry of its
shards with torch.load(weights_only=False), so a forged folder runs whatever its pickles name. Here the
`.metadata` goes through an unpickler that admits only what DCP's metadata holds (its dataclasses, torch.Size,
dtypes, layouts, the memory-format enum, paths, plain containers) and the non-tensor entries through
torch.load(weights_only=True). Anything else is refused with a ConfigError naming the folder, before DCP reads a
byte of its shards; nothing in the pickle runs. A damaged `.metadata` or shard gives the same kind of one-line
error, saying to resume from an earlier step or delete the folder.

Checked against torch 2.11 (the GPU image) and 2.13: the .metadata either writes names only these (older pickles name
TensorProperties under torch.distributed._shard.sharded_tensor.metadata, which resolves to the same class).
"""

from __future__ import annotations

import io
import pathlib
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo

from physreason.errors import ConfigError

_METADATA = ".metadata"


def _allowed_objects() -> dict[tuple[str, str], Any]:
    """(module, name) -> the object a checkpoint's .metadata may name; looked up once per read."""
    allowed: dict[tuple[str, str], Any] = {}
    md = "torch.distributed.checkpoint.metadata"
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    ):
        if hasattr(dcp_metadata, name):
            allowed[(md, name)] = getattr(dcp_metadata, name)
    allowed[("torch.distributed._shard.sharded_tensor.metadata", "TensorProperties")] = dcp_metadata.TensorProperties
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = _StorageInfo
    allowed[("torch", "Size")] = torch.Size
    # dtypes, layouts and memory formats pickle as the name of a torch attribute (torch.float32, torch.strided);
    # layouts also through torch.serialization._get_layout("torch.strided"), which only looks the name up.
    for name, value in vars(torch).items():
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            allowed[("torch", name)] = value
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    # StorageMeta.checkpoint_id: the folder DCP wrote to, a str or a path (pathlib._local on Python 3.13).
    for module in ("pathlib", "pathlib._local"):
        for cls in (pathlib.PosixPath, pathlib.PurePosixPath, pathlib.WindowsPath, pathlib.PureWindowsPath):
            allowed[(module, cls.__name__)] = cls
    allowed[("collections", "OrderedDict")] = __import__("collections").OrderedDict
    allowed[("builtins", "set")] = set
    allowed[("builtins", "frozenset")] = frozenset
    return allowed


class ForbiddenGlobal(pickle.UnpicklingError):
    """A pickle names something a checkpoint's metadata never holds."""

    def __init__(self, module: str, name: str) -> None:
        super().__init__(f"{module}.{name}")
        self.qualified = f"{module}.{name}"


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BufferedIOBase) -> None:
        super().__init__(file)
        self._allowed = _allowed_objects()

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allowed[(module, name)]
        except KeyError:
            raise ForbiddenGlobal(module, name) from None

    def persistent_load(self, pid: Any) -> Any:
        raise ForbiddenGlobal("persistent_id", type(pid).__name__)


def _what_to_do(folder: Path) -> str:
    return (
        f"resume from an earlier step (--set train.resume=<run>/checkpoints/step_N) or delete {folder} "
        "(train.resume=true then continues from the checkpoint before it)"
    )


def _check_shape(folder: Path, metadata: Any) -> None:
    """ConfigError unless `metadata` is a DCP Metadata whose entries point at files inside `folder`."""
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise ConfigError(f"checkpoint {folder} is damaged: its {_METADATA} holds a {type(metadata).__name__}, not "
                          f"DCP's Metadata; {_what_to_do(folder)}")  # fmt: skip
    entries = getattr(metadata, "state_dict_metadata", None)
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise ConfigError(f"checkpoint {folder} is damaged: its {_METADATA} lists no entries or no files; "
                          f"{_what_to_do(folder)}")  # fmt: skip
    for info in storage.values():
        name = getattr(info, "relative_path", None)
        # DCP names its shards __<rank>_<n>.distcp beside the .metadata: never a path leading elsewhere.
        if not isinstance(info, _StorageInfo) or not isinstance(name, str) or Path(name).name != name or name in {"", ".", ".."}:
            raise ConfigError(f"checkpoint {folder}: its {_METADATA} points at {name!r}, not a shard file inside the "
                              f"folder; it was not loaded: {_what_to_do(folder)}")  # fmt: skip


def read_metadata(folder: str | Path) -> Any:
    """The DCP Metadata of the checkpoint in `folder`, unpickled with only the classes a checkpoint's metadata holds.

    Raises ConfigError naming the folder when the file is missing, damaged, or names anything else (a forged
    pickle: refused before any of it runs).
    """
    folder = Path(folder)
    path = folder / _METADATA
    try:
        with open(path, "rb") as file:
            metadata = _MetadataUnpickler(file).load()
    except ForbiddenGlobal as exc:
        raise ConfigError(
            f"checkpoint {folder}: its {_METADATA} names {exc.qualified}, which a checkpoint never holds (a forged or "
            f"foreign file); it was refused and nothing in it ran: {_what_to_do(folder)}"
        ) from None
    except FileNotFoundError:
        raise ConfigError(f"checkpoint {folder} has no {_METADATA}: it is incomplete; {_what_to_do(folder)}") from None
    except Exception as exc:  # the restricted unpickler runs no code: any failure is a damaged file
        raise ConfigError(
            f"checkpoint {folder} is damaged: its {_METADATA} cannot be read ({type(exc).__name__}: "
            f"{_one_line(exc)}); {_what_to_do(folder)}"
        ) from None
    _check_shape(folder, metadata)
    return metadata


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:200] + ("..." if len(text) > 200 else "")


class SafeReader(FileSystemReader):
    """DCP's file reader, reading `.metadata` with read_metadata (once, when made) instead of pickle.load."""

    def __init__(self, folder: str | Path) -> None:
        super().__init__(folder)
        # Read and checked here, on every rank before any collective: all refuse alike, none waits on another.
        self._metadata = read_metadata(folder)

    def read_metadata(self) -> Any:  # no rank keyword: DCP then never falls back to per-rank metadata files
        metadata = self._metadata
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, reading non-tensor entries with torch.load(weights_only=True) instead of full pickle."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element  # as DefaultLoadPlanner does

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def damaged(folder: Path, exc: BaseException) -> ConfigError:
    """The one-line error for a checkpoint whose shards cannot be read as its metadata describes."""
    first = _one_line(exc).split(". ")[0]
    said = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return ConfigError(
        f"checkpoint {folder} is damaged: its shard files cannot be read as its {_METADATA} describes ({said}); "
        f"{_what_to_do(folder)}"
    )
