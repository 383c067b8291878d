"""Qwen-VL pixel budgets: the "smart resize" rule, a video's per-frame share of its total budget, and the
default budgets of a model whose sides are multiples of `factor` (patch x spatial merge)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from physreason.errors import ConfigError

# Qwen2.5-VL: patch 14 x spatial merge 2: every side its vision tower accepts is a multiple of this.
# (Qwen3-VL: patch 16 x merge 2 = 32; callers pass the model's factor.)
PATCH_FACTOR = 28

# qwen-vl-utils' default budgets in visual tokens, the same for Qwen2.5-VL and Qwen3-VL (one token covers
# factor**2 pixels); the video total is physreason's and Cosmos-Reason's 8,192 tokens.
IMAGE_MIN_TOKENS = 4
IMAGE_MAX_TOKENS = 16384
VIDEO_MIN_TOKENS = 128
VIDEO_MAX_TOKENS = 768
VIDEO_TOTAL_TOKENS = 8192
# qwen-vl-utils and transformers refuse images flatter than this; so do we.
MAX_ASPECT_RATIO = 200


def smart_resize(
    height: int,
    width: int,
    factor: int = PATCH_FACTOR,
    min_pixels: float = 4 * PATCH_FACTOR**2,
    max_pixels: float = 16384 * PATCH_FACTOR**2,
) -> tuple[int, int]:
    """Return (height, width) with both sides multiples of `factor`, area in [min_pixels, max_pixels], aspect kept.

    Same rule as qwen-vl-utils and transformers' Qwen2-VL processors: round each side to the nearest multiple
    (Python's round, half to even); if the area is too large scale both sides down by one factor and floor them,
    if too small scale up and ceil them. Sides never fall below `factor`.
    Raises ValueError for non-positive sides or an aspect ratio above 200 (loaders turn it into an InputError).
    """
    if height <= 0 or width <= 0:
        raise ValueError(f"height and width must be positive, got {height}x{width}")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(
            f"aspect ratio {max(height, width) / min(height, width):.1f} exceeds {MAX_ASPECT_RATIO} ({height}x{width})"
        )
    if min_pixels > max_pixels:
        raise ValueError(f"min_pixels ({min_pixels}) exceeds max_pixels ({max_pixels})")
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def video_frame_max_pixels(
    num_frames: int, min_pixels: int, max_pixels: int, total_pixels: int, temporal_patch_size: int = 2
) -> float:
    """Return the largest area one frame may have so that `num_frames` frames share `total_pixels`.

    As in qwen-vl-utils, the budget counts one pair of frames (a temporal patch) per share:
    each frame gets total_pixels / num_frames * temporal_patch_size, so total_pixels = 8192 * 28**2 means about
    8192 visual tokens per video. The share never drops below 1.05 * min_pixels (a long video then exceeds its
    budget rather than shrinking frames to nothing) and never exceeds max_pixels. The value is a float, as in
    qwen-vl-utils, so that smart_resize's comparisons agree with it to the last pixel.
    """
    if num_frames <= 0:
        raise ValueError(f"num_frames must be positive, got {num_frames}")
    share = max(total_pixels / num_frames * temporal_patch_size, int(min_pixels * 1.05))
    return min(max_pixels, share)


@dataclass(frozen=True)
class PixelBudgets:
    """Resolved pixel budgets of one model family: video frame min/max, video total, image min/max."""

    min_pixels: int
    max_pixels: int
    total_pixels: int
    image_min_pixels: int
    image_max_pixels: int


def pixel_budgets(config: Any, factor: int = PATCH_FACTOR) -> PixelBudgets:
    """The budgets of a VisionConfig for sides that are multiples of `factor`; None fields get token defaults.

    A budget the config sets is used as it is (pixels); an unset one is qwen-vl-utils' token count times
    factor**2, so one config serves Qwen2.5-VL (factor 28) and Qwen3-VL (factor 32).
    Raises ConfigError when a resolved minimum exceeds its maximum.
    """

    def pick(value: int | None, tokens: int) -> int:
        return int(value) if value is not None else tokens * factor * factor

    budgets = PixelBudgets(
        min_pixels=pick(config.min_pixels, VIDEO_MIN_TOKENS),
        max_pixels=pick(config.max_pixels, VIDEO_MAX_TOKENS),
        total_pixels=pick(config.total_pixels, VIDEO_TOTAL_TOKENS),
        image_min_pixels=pick(config.image_min_pixels, IMAGE_MIN_TOKENS),
        image_max_pixels=pick(config.image_max_pixels, IMAGE_MAX_TOKENS),
    )
    if budgets.min_pixels > budgets.max_pixels:
        raise ConfigError(
            f"vision.min_pixels ({budgets.min_pixels}) exceeds vision.max_pixels ({budgets.max_pixels}) at patch "
            f"factor {factor}: raise vision.max_pixels to at least {budgets.min_pixels}, or lower vision.min_pixels "
            "too (--set vision.min_pixels=N, or min_pixels under [vision] in the recipe)"
        )
    if budgets.image_min_pixels > budgets.image_max_pixels:
        raise ConfigError(
            f"vision.image_min_pixels ({budgets.image_min_pixels}) exceeds vision.image_max_pixels "
            f"({budgets.image_max_pixels}) at patch factor {factor}: raise vision.image_max_pixels to at least "
            f"{budgets.image_min_pixels}, or lower vision.image_min_pixels too (--set vision.image_min_pixels=N)"
        )
    return budgets
