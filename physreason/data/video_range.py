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


def record_video_range(record: Mapping[str, Any], where: str) -> dict[str, float]:
    """Return the record's video_start / video_end (only the keys it sets), each a number of seconds >= 0.

    Raises InputError naming `where` for a value that is not a finite number >= 0, or a start not before the end.
    """
    found: dict[str, float] = {}
    for key in RANGE_KEYS:
        value = record.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
            raise InputError(f"{where}: {key} must be a number of seconds >= 0, got {value!r}")
        found[key] = float(value)
    if len(found) == 2 and found["video_start"] >= found["video_end"]:
        raise InputError(
            f"{where}: video_start ({found['video_start']}) must be before video_end ({found['video_end']})"
        )
    return found
