"""The CUDA caching allocator of a training process: expandable segments, unless the user configured it otherwise.

With PyTorch's default allocator a long GRPO or SFT step leaves memory reserved in blocks too small for the next large
request: on an H200 (2026-11-29, bench/RESULTS.md "One H200 ... neither side recomputing") colocated GRPO without
recomputation ran out of memory at 118.2 GiB allocated, 19.9 GiB of the 139.8 reserved but unusable, and ran through
with a 128.0 GiB peak (its memory plan: 129.8) once `expandable_segments:True` was set; TRL's side of the same
comparison needed it too. Every training process therefore sets it (init_runtime) when neither PYTORCH_ALLOC_CONF nor
PYTORCH_CUDA_ALLOC_CONF is set, and the memory plan keeps a larger share of the GPU free for fragmentation when the
user's setting turns expandable segments off (allocator_headroom).
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

# The variables torch reads, the first set one winning (PYTORCH_CUDA_ALLOC_CONF is the older name).
ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
EXPANDABLE_SEGMENTS = "expandable_segments:True"
# Share of a GPU a plan leaves to the allocator: with expandable segments the plans measured lay within 6% of their
# peaks with this much spare; without them one run lost 14.2% of an H200 to fragmentation (the module doc).
HEADROOM_EXPANDABLE = 0.05
HEADROOM_FRAGMENTING = 0.15


def user_alloc_conf() -> tuple[str, str] | None:
    """(variable, value) of the allocator setting in this process's environment, None when there is none."""
    for name in ALLOC_CONF_VARS:
        value = os.environ.get(name)
        if value is not None and value.strip():
            return name, value
    return None


def expandable_segments(conf: str | None) -> bool:
    """Whether an allocator setting (None: unset, which training processes turn into expandable segments) leaves
    expandable segments on. torch's syntax: comma-separated `key:value` pairs; a cudaMallocAsync backend has none."""
    if conf is None:
        return True
    pairs = dict(item.split(":", 1) for item in conf.replace(" ", "").split(",") if ":" in item)
    return pairs.get("expandable_segments") == "True" and pairs.get("backend", "native") == "native"


def allocator_headroom() -> float:
    """The share of a GPU a memory plan leaves free for the allocator under this process's setting."""
    conf = user_alloc_conf()
    return HEADROOM_EXPANDABLE if expandable_segments(conf[1] if conf else None) else HEADROOM_FRAGMENTING


def headroom_reason() -> str | None:
    """Why a plan keeps the larger headroom (names the variable and its value), None with expandable segments."""
    conf = user_alloc_conf()
    if conf is None or expandable_segments(conf[1]):
        return None
    return (
        f"{conf[0]}={conf[1]} leaves expandable segments off, so {HEADROOM_FRAGMENTING:.0%} of the GPU is kept for "
        f"fragmentation instead of {HEADROOM_EXPANDABLE:.0%} (add {EXPANDABLE_SEGMENTS} to it, or unset it)"
    )


def use_expandable_segments() -> bool:
    """Turn on expandable segments for this process (and the processes it starts) unless the user set the allocator.

    Call before the first CUDA allocation; when CUDA is already initialised the setting is applied through torch's
    allocator-settings call, which affects the segments allocated from then on. Returns whether it set anything."""
    if user_alloc_conf() is not None:
        return False
    import torch

    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = EXPANDABLE_SEGMENTS
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        setter = getattr(torch.cuda.memory, "_set_allocator_settings", None)
        if setter is not None:
            setter(EXPANDABLE_SEGMENTS)
    log.debug("CUDA allocator: %s (PYTORCH_CUDA_ALLOC_CONF was unset)", EXPANDABLE_SEGMENTS)
    return True
