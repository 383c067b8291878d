"""Load an image file as RGB uint8 pixels, resized to a Qwen-VL model's image pixel budget."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from physreason.config.schema import VisionConfig
from physreason.errors import InputError
from physreason.vision.paths import local_media_file
from physreason.vision.resize import MAX_ASPECT_RATIO, PATCH_FACTOR, pixel_budgets, smart_resize


def load_image(source: str | Path, config: VisionConfig | None = None, factor: int = PATCH_FACTOR) -> np.ndarray:
    """Return the image at `source` (path or file:// URL; jpg, png, webp, ...) as uint8 [H, W, 3], resized.

    Sides become multiples of `factor` (patch x merge: 28 for Qwen2.5-VL, 32 for Qwen3-VL) with an area in
    the image budget [config.image_min_pixels, config.image_max_pixels] (pixel_budgets fills unset ones)
    (smart_resize), using PIL's bicubic filter as qwen-vl-utils and transformers' PIL processor do.
    Transparent images are composited on white (as both references do). Raises InputError naming the file
    when it is missing, unreadable or too flat.
    """
    config = config or VisionConfig()
    budgets = pixel_budgets(config, factor)
    path = local_media_file(source, "image")
    try:
        with Image.open(path) as image:
            image.load()
            rgb = _to_rgb(image)
    except Image.DecompressionBombError as error:
        raise InputError(
            f"image {path}: too many pixels for PIL's safety limit ({error}); downscale it before use"
        ) from error
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as error:
        raise InputError(
            f"image {path}: cannot be read as an image ({error}); check that it is a complete jpg/png/webp file "
            "and re-save it with an image editor if it is damaged"
        ) from error
    width, height = rgb.size
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise InputError(
            f"image {path}: {width}x{height} is flatter than 1:{MAX_ASPECT_RATIO}, which Qwen-VL models cannot take; "
            "crop it into pieces"
        )
    new_height, new_width = smart_resize(
        height, width, factor, min_pixels=budgets.image_min_pixels, max_pixels=budgets.image_max_pixels
    )
    if (new_height, new_width) != (height, width):
        rgb = rgb.resize((new_width, new_height), Image.Resampling.BICUBIC)
    return np.asarray(rgb, dtype=np.uint8)  # [H, W, 3]


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB copy of `image`; transparency is flattened onto white."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")
