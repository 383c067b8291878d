"""Names of the tiny model architectures (kept import-light for the command line)."""

from typing import Literal

TinyKind = Literal["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen2", "qwen3", "qwen3_moe"]
TINY_KINDS: tuple[TinyKind, ...] = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen2", "qwen3", "qwen3_moe")
VISION_LANGUAGE_KINDS: tuple[TinyKind, ...] = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")


def normalize_kind(name: str) -> str:
    """The kind a user typed, with '-' and '.' read as '_' (`qwen3-vl` and `qwen2.5-vl` name kinds too)."""
    return name.strip().lower().replace("-", "_").replace(".", "_")
