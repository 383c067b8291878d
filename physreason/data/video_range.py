"""A record's own video time range: `video_start` / `video_end` in seconds, the keys qwen-vl-utils reads per video.

A record's range replaces `vision.video_start` / `vision.video_end` for the videos of that record:
`vision.model_copy(update=record_video_range(record, where))`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from physreason.errors import InputError

RANGE_KEYS = ("video_start", "video_end")


def _seconds(value: Any) -> float | None:
    """A JSON number as float; None for anything else, and for an integer too large for a float (400 digits)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        return float(value)
    except OverflowError:
        return None


def record_video_range(record: Mapping[str, Any], where: str) -> dict[str, float]:
    """Return the record's video_start / video_end (only the keys it sets), each a number of seconds >= 0.

    Raises InputError naming `where` for a value that is not a finite number >= 0, or a start not before the end.
    """
    found: dict[str, float] = {}
    for key in RANGE_KEYS:
        value = record.get(key)
        if value is None:
            continue
        seconds = _seconds(value)
        if seconds is None or not math.isfinite(seconds) or seconds < 0:
            shown = repr(value) if len(repr(value)) <= 40 else f"{repr(value)[:20]}... ({len(repr(value))} characters)"
            raise InputError(f"{where}: {key} must be a number of seconds >= 0, got {shown}")
        found[key] = seconds
    if len(found) == 2 and found["video_start"] >= found["video_end"]:
        raise InputError(
            f"{where}: video_start ({found['video_start']}) must be before video_end ({found['video_end']})"
        )
    return found
