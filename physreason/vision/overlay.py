"""Timestamp overlay: a black bar (one patch factor high) under each frame with its time, as Cosmos-Reason1 draws it."""

from __future__ import annotations

import functools
import logging

import numpy as np
from PIL import Image, ImageDraw, ImageFont

logger = logging.getLogger(__name__)

# One patch row of Qwen2.5-VL (28 px), so overlaid frames keep sides that are multiples of 28.
BAR_HEIGHT = 28
FONT_SIZE = 20
# The label alternates between the two halves of the bar, one position per frame of a temporal patch, so
# the two frames merged into one patch never put their labels on the same pixels.
LABEL_POSITIONS = 2


@functools.cache
def _label_font() -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    """DejaVu Sans Mono at 20 px (Cosmos-Reason1's font); PIL's built-in font if DejaVu is not installed."""
    try:
        return ImageFont.truetype("DejaVuSansMono.ttf", FONT_SIZE)
    except OSError:
        logger.warning(
            "DejaVu Sans Mono is not installed; timestamps use PIL's default font, which differs from the one "
            "Cosmos-Reason1 models saw in training (install fonts-dejavu-core to match)"
        )
        return ImageFont.load_default(size=FONT_SIZE)


def overlay_timestamps(frames: np.ndarray, sample_fps: float, bar_height: int = BAR_HEIGHT) -> np.ndarray:
    """Return frames uint8 [T, H + bar_height, W, 3]: each frame above a black bar reading `{i / sample_fps:.2f}s`.

    bar_height is the model's patch factor (28 for Qwen2.5-VL), so the frames keep sides it accepts.

    As in Cosmos-Reason1's inference tool, frame i is labelled i / sample_fps (time on the sampled grid, the
    clock the model was trained with), in white, centred vertically in the bar and horizontally in the left
    half for even i and the right half for odd i.
    """
    num_frames, height, width, channels = frames.shape
    out = np.zeros((num_frames, height + bar_height, width, channels), dtype=np.uint8)  # [T, H + bar, W, 3]
    out[:, :height] = frames
    font = _label_font()
    section_width = width // LABEL_POSITIONS
    for i in range(num_frames):
        bar = Image.new("RGB", (width, bar_height), "black")
        draw = ImageDraw.Draw(bar)
        text = f"{i / sample_fps:.2f}s"
        left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
        text_width, text_height = right - left, bottom - top
        centre = (i % LABEL_POSITIONS) * section_width + section_width // 2
        x = max(0, min(centre - text_width // 2, width - text_width))
        y = (bar_height - text_height) // 2
        draw.text((x, y), text, fill="white", font=font)
        out[i, height:] = np.asarray(bar)
    return out
