"""Qwen3-VL (Cosmos-Reason2) facts: video timestamps written as text per frame group, and its 3D positions.

Qwen3-VL drops Qwen2.5-VL's time-scaled temporal positions. Its processor writes each temporal patch (a
pair of frames) as its own visual span, preceded by the pair's time as text:

    <|vision_start|><0.5 seconds><|vision_start|>{pads}<|vision_end|><1.5 seconds><|vision_start|>...<|vision_end|><|vision_end|>

(the chat template's outer `<|vision_start|>`/`<|vision_end|>` stay around the expansion: transformers >= 5.10
and vLLM replace only the `<|video_pad|>`), and every span gets the positions of a one-frame image: temporal
row = the span's start, height/width rows = start + grid offsets. The decoder applies them with interleaved
M-RoPE (its own business, given [3, L] positions).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from physreason.models.positions import mrope_position_ids

# config.json model_type values of the Qwen3-VL family (dense and mixture-of-experts decoders).
QWEN3_VL_MODEL_TYPES = ("qwen3_vl", "qwen3_vl_moe")

VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
VIDEO_PAD = "<|video_pad|>"


def frame_group_seconds(indices: Sequence[int], source_fps: float, temporal_patch_size: int = 2) -> list[float]:
    """Seconds of each temporal patch: the mean time of its first and last frame, from source frame indices.

    Same rule as transformers' Qwen3VLProcessor and vLLM: frame i is at indices[i] / source_fps; the index list
    is padded with its last index to whole temporal patches.
    """
    if source_fps <= 0:
        raise ValueError(f"source_fps must be positive, got {source_fps}")
    padded = list(indices)
    if pad := -len(padded) % temporal_patch_size:
        padded += [padded[-1]] * pad
    times = [index / source_fps for index in padded]
    return [
        (times[start] + times[start + temporal_patch_size - 1]) / 2
        for start in range(0, len(times), temporal_patch_size)
    ]


def video_placeholder(group_seconds: Sequence[float], tokens_per_group: int) -> str:
    """The text one `<|video_pad|>` becomes: `<t seconds><|vision_start|>` + pads + `<|vision_end|>` per group."""
    return "".join(
        f"<{seconds:.1f} seconds>{VISION_START}{VIDEO_PAD * tokens_per_group}{VISION_END}" for seconds in group_seconds
    )


def split_video_grids(video_grid_thw: torch.Tensor | None) -> torch.Tensor | None:
    """[n_videos, 3] (t, h, w) -> [sum t, 3] rows (1, h, w): one visual span per temporal patch."""
    if video_grid_thw is None or len(video_grid_thw) == 0:
        return video_grid_thw
    grids = torch.repeat_interleave(video_grid_thw, video_grid_thw[:, 0], dim=0)  # [sum t, 3]
    grids[:, 0] = 1
    return grids


def qwen3_vl_position_ids(
    input_ids: torch.Tensor,  # [L]
    image_token_id: int,
    video_token_id: int,
    image_grid_thw: torch.Tensor | None,  # [n_images, 3]
    video_grid_thw: torch.Tensor | None,  # [n_videos, 3]
    spatial_merge_size: int = 2,
) -> torch.Tensor:
    """Return [3, L] Qwen3-VL positions of one sequence: text +1 per token, each image / frame group a span.

    Each run of pad tokens is one span, consumed in order: an image's grid, or one (1, h, w) temporal patch of
    a video (the timestamp text between a video's patches separates the runs). A span's temporal row is its
    start; it advances the next position by max(h, w) / merge, as in transformers' get_rope_index.
    """
    # A one-frame span's temporal offsets are all 0, so the Qwen2.5-VL walk with split grids computes it.
    return mrope_position_ids(
        input_ids,
        image_token_id,
        video_token_id,
        image_grid_thw,
        split_video_grids(video_grid_thw),
        None,
        spatial_merge_size,
    )
