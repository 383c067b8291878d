"""load_image and patchify against transformers' Qwen2-VL PIL image processor, the patch layout, token counts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from fixtures.vision.media import frame_pattern
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from physreason.config.schema import VisionConfig
from physreason.errors import InputError
from physreason.vision import load_image, num_visual_tokens, patchify


def _save(image: Image.Image, path: Path) -> Path:
    image.save(path)
    return path


@pytest.mark.parametrize(
    ("name", "height", "width", "mode", "min_pixels", "max_pixels"),
    [
        ("resized_down.jpg", 333, 517, "RGB", 4 * 28 * 28, 64 * 28 * 28),
        ("resized_up.webp", 40, 60, "RGB", 16 * 28 * 28, 64 * 28 * 28),
        ("exact_fit.png", 224, 448, "RGB", 4 * 28 * 28, 16384 * 28 * 28),
        ("transparent.png", 100, 150, "RGBA", 4 * 28 * 28, 16384 * 28 * 28),
    ],
)
def test_image_pixel_values_identical_to_transformers_processor(
    tmp_path: Path, name: str, height: int, width: int, mode: str, min_pixels: int, max_pixels: int
):
    pixels = frame_pattern(3, height, width)
    if mode == "RGBA":
        alpha = np.tile(np.linspace(0, 255, width, dtype=np.uint8), (height, 1))[..., None]
        pixels = np.concatenate([pixels, alpha], axis=-1)
    path = _save(Image.fromarray(pixels, mode), tmp_path / name)
    config = VisionConfig(image_min_pixels=min_pixels, image_max_pixels=max_pixels)

    pixel_values, grid = patchify(load_image(path, config))

    processor = Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels)
    with Image.open(path) as original:
        expected = processor(images=[original], return_tensors="pt")
    assert list(grid) == expected["image_grid_thw"][0].tolist()
    assert pixel_values.dtype == torch.float32
    assert torch.equal(pixel_values, expected["pixel_values"])


def test_image_is_resized_to_multiples_of_28_within_its_budget(tmp_path: Path):
    path = _save(Image.fromarray(frame_pattern(0, 333, 517)), tmp_path / "photo.png")
    image = load_image(f"file://{path}", VisionConfig(image_min_pixels=28 * 28, image_max_pixels=64 * 28 * 28))
    height, width, channels = image.shape
    assert image.dtype == np.uint8 and channels == 3
    assert height % 28 == 0 and width % 28 == 0
    assert height * width <= 64 * 28 * 28


def test_unreadable_image_names_the_file(tmp_path: Path):
    fake = tmp_path / "photo.png"
    fake.write_text("not an image")
    with pytest.raises(InputError, match=r"photo\.png: cannot be read as an image"):
        load_image(fake)


def test_truncated_image_names_the_file(tmp_path: Path):
    noise = np.random.default_rng(0).integers(0, 256, (200, 300, 3), dtype=np.uint8)
    path = _save(Image.fromarray(noise), tmp_path / "cut.png")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(InputError, match=r"cut\.png: cannot be read"):
        load_image(path)


def test_missing_image_names_the_file(tmp_path: Path):
    with pytest.raises(InputError, match=r"not found.*absent\.jpg"):
        load_image(tmp_path / "absent.jpg")


def test_patch_rows_follow_merge_windows_in_raster_order():
    # Frame value = 10 * patch row + patch column (single channel pattern): read back from the rows.
    grid_rows, grid_cols = 4, 6
    levels = (10 * np.arange(grid_rows)[:, None] + np.arange(grid_cols)[None, :]).astype(np.uint8)
    frame = np.repeat(np.repeat(levels, 14, axis=0), 14, axis=1)  # [56, 84]
    frames = np.repeat(frame[None, :, :, None], 3, axis=-1).repeat(2, axis=0)  # [2, 56, 84, 3]
    pixel_values, grid = patchify(frames)
    assert grid == (1, 4, 6)
    assert pixel_values.shape == (24, 3 * 2 * 14 * 14)
    first_value = pixel_values[:, 0]  # channel 0, temporal 0, pixel (0, 0) of each patch
    levels_read = [round((v * 0.26862954 + 0.48145466) * 255) for v in first_value.tolist()]
    # Each 2x2 merge window's patches are consecutive; windows run left to right, then top to bottom.
    assert levels_read[:8] == [0, 1, 10, 11, 2, 3, 12, 13]
    assert levels_read[-4:] == [24, 25, 34, 35]


def test_single_image_is_repeated_over_the_temporal_patch():
    image = frame_pattern(1, 56, 84)
    pixel_values, grid = patchify(image)
    assert grid == (1, 4, 6)
    per_time = pixel_values.view(24, 3, 2, 14 * 14)
    assert torch.equal(per_time[:, :, 0], per_time[:, :, 1])


def test_odd_frame_count_repeats_the_last_frame():
    frames = np.stack([frame_pattern(i, 28, 28) for i in range(3)])
    pixel_values, grid = patchify(frames)
    assert grid == (2, 2, 2)
    padded, _ = patchify(np.concatenate([frames, frames[-1:]]))
    assert torch.equal(pixel_values, padded)


def test_patchify_rejects_sides_not_multiple_of_28():
    with pytest.raises(ValueError, match="multiples of 28"):
        patchify(np.zeros((2, 30, 56, 3), dtype=np.uint8))


def test_visual_token_count_is_patches_over_merge_area():
    assert num_visual_tokens((60, 16, 30)) == 7200
    assert num_visual_tokens(torch.tensor([1, 40, 40])) == 400


@pytest.mark.gpu
def test_video_pixel_values_match_transformers_video_processor():
    """Needs torchvision (GPU machine). Our table lookup normalizes like the PIL processor; the video processor
    fuses rescale into mean/std, so values agree to float32 rounding, not bit for bit."""
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    frames = np.stack([frame_pattern(i, 84, 140) for i in range(6)])  # [T, H, W, 3], already resized
    pixel_values, grid = patchify(frames)
    processor = Qwen2VLVideoProcessor()
    expected = processor(
        videos=[torch.from_numpy(frames).permute(0, 3, 1, 2)],
        do_sample_frames=False,
        do_resize=False,
        return_tensors="pt",
    )
    assert list(grid) == expected["video_grid_thw"][0].tolist()
    torch.testing.assert_close(pixel_values, expected["pixel_values_videos"], rtol=0, atol=1e-6)
