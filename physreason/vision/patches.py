"""Qwen-VL vision input: uint8 frames -> normalized flat patches and their (t, h, w) grid.

The layout is shared by Qwen2-VL, Qwen2.5-VL (patch 14, CLIP mean/std) and Qwen3-VL (patch 16, mean/std 0.5).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

# OpenAI CLIP statistics, the normalization of every Qwen2/2.5-VL processor.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# ImageNet's "standard" 0.5 statistics, the normalization of Qwen3-VL's processors.
HALF_MEAN = (0.5, 0.5, 0.5)
HALF_STD = (0.5, 0.5, 0.5)


def _normalization_table(mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """float32 [3, 256]: the normalized value of each uint8 level per channel.

    Computed in the order and precision of transformers' PIL processor (rescale by 1/255 in float64, cast to
    float32, then (x - mean) / std in float32), so a table lookup reproduces its output bit for bit.
    """
    levels = (np.arange(256, dtype=np.float64) * (1 / 255)).astype(np.float32)  # [256]
    mean32 = np.asarray(mean, dtype=np.float32)[:, None]  # [3, 1]
    std32 = np.asarray(std, dtype=np.float32)[:, None]  # [3, 1]
    return torch.from_numpy((levels[None, :] - mean32) / std32)  # [3, 256]


def patchify(
    frames: np.ndarray,
    patch_size: int = 14,
    temporal_patch_size: int = 2,
    merge_size: int = 2,
    mean: Sequence[float] = CLIP_MEAN,
    std: Sequence[float] = CLIP_STD,
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Return (pixel_values float32 [grid_t * grid_h * grid_w, 3 * temporal_patch_size * patch_size**2],
    (grid_t, grid_h, grid_w)) for uint8 frames [T, H, W, 3] (or one image [H, W, 3]).

    Layout and order are those of transformers' Qwen2-VL image and video processors, so the result goes to the
    model as pixel_values / pixel_values_videos with image_grid_thw / video_grid_thw. T is padded to a whole
    temporal patch by repeating the last frame (an image is repeated `temporal_patch_size` times). Rows run over
    merge windows (2x2 patches) in raster order, so each run of merge_size**2 rows is one visual token.
    """
    if frames.dtype != np.uint8:
        raise ValueError(f"frames must be uint8, got {frames.dtype}")
    if frames.ndim == 3:
        frames = frames[None]
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames must be [T, H, W, 3] or [H, W, 3], got shape {frames.shape}")
    num_frames, height, width, channels = frames.shape
    side = patch_size * merge_size
    if height % side or width % side:
        raise ValueError(f"frame sides must be multiples of {side}, got {height}x{width}; resize with smart_resize")
    if pad := -num_frames % temporal_patch_size:
        frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)])
        num_frames += pad
    grid_t, grid_h, grid_w = num_frames // temporal_patch_size, height // patch_size, width // patch_size

    pixels = torch.from_numpy(np.ascontiguousarray(frames)).view(
        grid_t,
        temporal_patch_size,
        grid_h // merge_size,
        merge_size,
        patch_size,
        grid_w // merge_size,
        merge_size,
        patch_size,
        channels,
    )
    # Reorder the uint8 pixels first (4x less to move than floats), then normalize by table lookup.
    # -> [grid_t, blocks_h, blocks_w, merge_h, merge_w, C, temporal, patch_h, patch_w]
    pixels = pixels.permute(0, 2, 5, 3, 6, 8, 1, 4, 7).reshape(
        grid_t * grid_h * grid_w, channels, temporal_patch_size * patch_size**2
    )
    table = _normalization_table(mean, std)  # [C, 256]
    pixel_values = torch.empty(pixels.shape, dtype=torch.float32)  # [patches, C, temporal * patch**2]
    for channel in range(channels):
        pixel_values[:, channel] = table[channel][pixels[:, channel].long()]
    pixel_values = pixel_values.view(grid_t * grid_h * grid_w, channels * temporal_patch_size * patch_size**2)
    return pixel_values, (grid_t, grid_h, grid_w)


def num_visual_tokens(grid_thw: Sequence[int] | torch.Tensor, merge_size: int = 2) -> int:
    """Return how many tokens one <|image_pad|> / <|video_pad|> placeholder expands to for a (t, h, w) grid."""
    grid_t, grid_h, grid_w = (int(v) for v in grid_thw)
    return grid_t * grid_h * grid_w // merge_size**2
