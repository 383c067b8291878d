"""Names of the tiny model architectures (kept import-light for the command line)."""

from typing import Literal

TinyKind = Literal["qwen2_5_vl", "qwen2", "qwen3", "qwen3_moe"]
TINY_KINDS: tuple[TinyKind, ...] = ("qwen2_5_vl", "qwen2", "qwen3", "qwen3_moe")
