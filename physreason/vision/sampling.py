"""Which source frames a video contributes: a target fps, bounded and rounded to whole temporal patches."""

from __future__ import annotations

import math

import numpy as np


def num_sampled_frames(
    total_frames: int,
    source_fps: float,
    fps: float,
    min_frames: int,
    max_frames: int,
    temporal_patch_size: int = 2,
) -> int:
    """Return how many frames to sample: duration * fps, clamped to [min_frames, max_frames] and to the source's
    frame count, then rounded down to a multiple of `temporal_patch_size`.

    The rule of qwen-vl-utils' `smart_nframes` (min_frames rounds up, max_frames rounds down to the patch).
    A video shorter than one temporal patch (one frame) still yields `temporal_patch_size` frames: its frames are
    repeated (qwen-vl-utils raises instead); callers should say so to the user.
    """
    if total_frames <= 0:
        raise ValueError(f"total_frames must be positive, got {total_frames}")
    if source_fps <= 0 or fps <= 0:
        raise ValueError(f"source_fps and fps must be positive, got {source_fps} and {fps}")
    low = math.ceil(min_frames / temporal_patch_size) * temporal_patch_size
    high = math.floor(max_frames / temporal_patch_size) * temporal_patch_size
    wanted = total_frames / source_fps * fps
    count = min(max(wanted, low), high, total_frames)
    count = math.floor(count / temporal_patch_size) * temporal_patch_size
    return max(count, temporal_patch_size)


def fixed_num_frames(nframes: int, available: int, temporal_patch_size: int = 2) -> int:
    """Return a requested fixed frame count rounded to the nearest multiple of `temporal_patch_size`.

    qwen-vl-utils' `round_by_factor` (Python's round, ties to even: 5 -> 4, 7 -> 8). Raises ValueError when the
    result is below one temporal patch or above `available`, the frames in the (clipped) video.
    """
    count = round(nframes / temporal_patch_size) * temporal_patch_size
    if not temporal_patch_size <= count <= available:
        raise ValueError(f"nframes {nframes} (rounded to {count}) must lie within [{temporal_patch_size}, {available}]")
    return count


def frame_range(
    total_frames: int, source_fps: float, start: float | None, end: float | None
) -> tuple[int, int]:
    """Return the first and last source frame (inclusive) of the time range [start, end] seconds.

    qwen-vl-utils' `calculate_video_frame_range`: times clamp to [0, duration]; the first frame is
    ceil(start * fps), the last floor(end * fps) within the video. Raises ValueError when the range holds
    fewer than two frames.
    """
    if start is None and end is None:
        return 0, total_frames - 1
    duration = total_frames / source_fps
    first = math.ceil(max(0.0, min(start, duration)) * source_fps) if start is not None else 0
    last = total_frames - 1
    if end is not None:
        last = min(math.floor(max(0.0, min(end, duration)) * source_fps), total_frames - 1)
    if first >= last:
        raise ValueError(
            f"the range {start if start is not None else 0}s to {end if end is not None else duration}s holds "
            f"frames {first} to {last} of a {duration:.2f} s video ({total_frames} frames at {source_fps:g} fps)"
        )
    return first, last


def sample_indices(total_frames: int, num_frames: int, first: int = 0) -> list[int]:
    """Return `num_frames` source indices spread evenly over `total_frames` frames from `first` (both ends included).

    round(linspace(first, first + total_frames - 1, num_frames)), ties to even, as qwen-vl-utils computes them;
    when num_frames > total_frames some indices repeat.
    """
    if total_frames <= 0 or num_frames <= 0:
        raise ValueError(f"total_frames and num_frames must be positive, got {total_frames} and {num_frames}")
    return np.round(np.linspace(first, first + total_frames - 1, num_frames)).astype(np.int64).tolist()
