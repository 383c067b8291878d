"""Turn chat messages plus sampled frames into Qwen2.5-VL model inputs, without torchvision.

transformers' Qwen2.5-VL processor needs torchvision for videos; physreason's `vision` layer already
samples and resizes frames, so the remaining steps (patchify, placeholder expansion) live here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from physreason.errors import InputError
from physreason.vision import CLIP_MEAN, CLIP_STD, VideoFrames, num_visual_tokens, patchify

IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"


@dataclass(frozen=True)
class ProcessorParams:
    """Patch geometry and normalisation of a Qwen2-VL-family processor."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, float, float] = CLIP_MEAN
    image_std: tuple[float, float, float] = CLIP_STD


def _resolve_file(model_name_or_path: str, filename: str, revision: str | None = None) -> Path | None:
    folder = Path(model_name_or_path)
    if folder.is_dir():
        candidate = folder / filename
        return candidate if candidate.is_file() else None
    from transformers.utils import cached_file

    path = cached_file(model_name_or_path, filename, revision=revision, _raise_exceptions_for_missing_entries=False)
    return Path(path) if path else None


def load_processor_params(model_name_or_path: str, revision: str | None = None) -> ProcessorParams:
    """Read patch size, temporal patch, merge size and mean/std from a model's preprocessor_config.json."""
    path = _resolve_file(model_name_or_path, "preprocessor_config.json", revision)
    if path is None:
        return ProcessorParams()
    raw = json.loads(path.read_text())
    return ProcessorParams(
        patch_size=int(raw.get("patch_size", 14)),
        temporal_patch_size=int(raw.get("temporal_patch_size", 2)),
        merge_size=int(raw.get("merge_size", 2)),
        image_mean=tuple(raw.get("image_mean", CLIP_MEAN)),
        image_std=tuple(raw.get("image_std", CLIP_STD)),
    )


@dataclass
class VisualInputs:
    """Model-ready pixels for one request (or a batch, after `concat_visuals`) and their token counts."""

    pixel_values: torch.Tensor | None = None  # [n_image_patches, 3 * temporal_patch * patch^2]
    image_grid_thw: torch.Tensor | None = None  # [n_images, 3]
    pixel_values_videos: torch.Tensor | None = None  # [n_video_patches, 3 * temporal_patch * patch^2]
    video_grid_thw: torch.Tensor | None = None  # [n_videos, 3]
    second_per_grid_ts: torch.Tensor | None = None  # [n_videos] seconds spanned by one temporal patch
    image_token_counts: list[int] = field(default_factory=list)
    video_token_counts: list[int] = field(default_factory=list)

    def model_kwargs(self) -> dict[str, torch.Tensor]:
        """The keyword arguments Qwen2_5_VLForConditionalGeneration.forward takes (only those present)."""
        names = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}


def encode_visuals(
    images: list[np.ndarray] = (), videos: list[VideoFrames] = (), params: ProcessorParams | None = None
) -> VisualInputs:
    """Patchify resized images ([H, W, 3] uint8) and sampled videos in prompt order."""
    params = params or ProcessorParams()
    geometry = dict(
        patch_size=params.patch_size,
        temporal_patch_size=params.temporal_patch_size,
        merge_size=params.merge_size,
        mean=params.image_mean,
        std=params.image_std,
    )
    out = VisualInputs()
    if images:
        patches, grids = [], []
        for image in images:
            pixels, grid = patchify(image[None], **geometry)
            patches.append(pixels)
            grids.append(grid)
            out.image_token_counts.append(num_visual_tokens(grid, params.merge_size))
        out.pixel_values = torch.cat(patches)
        out.image_grid_thw = torch.tensor(grids, dtype=torch.long)
    if videos:
        patches, grids, seconds = [], [], []
        for video in videos:
            pixels, grid = patchify(video.frames, **geometry)
            patches.append(pixels)
            grids.append(grid)
            seconds.append(params.temporal_patch_size / video.sample_fps)
            out.video_token_counts.append(num_visual_tokens(grid, params.merge_size))
        out.pixel_values_videos = torch.cat(patches)
        out.video_grid_thw = torch.tensor(grids, dtype=torch.long)
        out.second_per_grid_ts = torch.tensor(seconds, dtype=torch.float32)
    return out


def concat_visuals(parts: list[VisualInputs]) -> VisualInputs:
    """Join the visual inputs of several requests in batch order (the model consumes them in token order)."""
    out = VisualInputs()
    for name in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts"):
        tensors = [getattr(p, name) for p in parts if getattr(p, name) is not None]
        setattr(out, name, torch.cat(tensors) if tensors else None)
    for p in parts:
        out.image_token_counts += p.image_token_counts
        out.video_token_counts += p.video_token_counts
    return out


def expand_vision_placeholders(text: str, image_token_counts: list[int], video_token_counts: list[int]) -> str:
    """Repeat each <|image_pad|> / <|video_pad|> of a rendered prompt to its visual token count, in order."""
    for pad, counts, kind in ((IMAGE_PAD, image_token_counts, "image"), (VIDEO_PAD, video_token_counts, "video")):
        pieces = text.split(pad)
        if len(pieces) - 1 != len(counts):
            raise InputError(
                f"the prompt has {len(pieces) - 1} {kind} placeholder(s) but {len(counts)} {kind}(s) were given: "
                f"pass one {kind} per {{'type': '{kind}'}} entry in the message content"
            )
        text = pieces[0] + "".join(pad * n + rest for n, rest in zip(counts, pieces[1:], strict=True))
    return text
