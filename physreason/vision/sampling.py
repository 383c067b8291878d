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


def sample_indices(total_frames: int, num_frames: int) -> list[int]:
    """Return `num_frames` source indices spread evenly from the first to the last frame (both included).

    round(linspace(0, total_frames - 1, num_frames)), ties to even, as qwen-vl-utils computes them; when
    num_frames > total_frames some indices repeat.
    """
    if total_frames <= 0 or num_frames <= 0:
        raise ValueError(f"total_frames and num_frames must be positive, got {total_frames} and {num_frames}")
    return np.round(np.linspace(0, total_frames - 1, num_frames)).astype(np.int64).tolist()
