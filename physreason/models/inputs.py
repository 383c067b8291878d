"""Turn chat messages plus sampled frames into Qwen2.5-VL / Qwen3-VL model inputs, without torchvision.

transformers' Qwen-VL processors need torchvision for videos; physreason's `vision` layer already
samples and resizes frames, so the remaining steps (patchify, placeholder expansion) live here.
The two families differ in patch size and normalisation (read from preprocessor_config.json) and in how a
video is written into the prompt (read from config.json's model_type): Qwen2.5-VL repeats one
`<|video_pad|>` run and passes the seconds per temporal patch to the model; Qwen3-VL writes each temporal
patch's time as text before its own span (physreason/models/qwen3_vl.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from physreason.chat.structured import finite_number
from physreason.chat.style import Prompting, resolve_prompting, resolve_sampling
from physreason.config.schema import Config, SamplingConfig
from physreason.errors import ConfigError, InputError
from physreason.files import read_json_object
from physreason.models.family import QWEN2_5_VL_PARAMS, QWEN3_VL_PARAMS, ModelFamily, ProcessorParams, model_family
from physreason.models.qwen3_vl import frame_group_seconds, video_placeholder
from physreason.models.source import check_model_source, looks_like_path
from physreason.vision import VideoFrames, num_visual_tokens, patchify

IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"


def _resolve_file(model_name_or_path: str, filename: str, revision: str | None = None) -> Path | None:
    folder = Path(model_name_or_path)
    if folder.is_dir():
        candidate = folder / filename
        return candidate if candidate.is_file() else None
    from transformers.utils import cached_file

    path = cached_file(model_name_or_path, filename, revision=revision, _raise_exceptions_for_missing_entries=False)
    return Path(path) if path else None


def checkpoint_family(model_name_or_path: str, revision: str | None = None) -> ModelFamily | None:
    """The family of a checkpoint from its config.json alone (model_type, else architectures); None without one.

    Reads one small file, so prompts and media can be prepared before the model loads.
    """
    path = _resolve_file(model_name_or_path, "config.json", revision)
    if path is None:
        return None
    raw = read_json_object(path, _CHECKPOINT_FIX)
    model_type, architectures = raw.get("model_type"), raw.get("architectures")
    if model_type is not None and not isinstance(model_type, str):
        raise ConfigError(f"{path}: model_type {model_type!r} is not a name; {_CHECKPOINT_FIX}")
    if architectures is not None and not (
        isinstance(architectures, list) and all(isinstance(name, str) for name in architectures)
    ):
        raise ConfigError(f"{path}: architectures {architectures!r} is not a list of class names; {_CHECKPOINT_FIX}")
    config = SimpleNamespace(model_type=model_type, architectures=architectures, _name_or_path=model_name_or_path)
    return model_family(config)


def _family_processor(model_name_or_path: str, revision: str | None) -> ProcessorParams:
    """The processor defaults of the checkpoint's family (config.json's model_type, else its architectures)."""
    family = checkpoint_family(model_name_or_path, revision)
    return (family.processor if family is not None else None) or QWEN2_5_VL_PARAMS


def prompting_for(config: Config) -> tuple[Prompting, SamplingConfig]:
    """The recipe's prompt style and mode for its checkpoint, and its generation settings for that mode.

    `[prompt] style = "auto"` reads the checkpoint's config.json (Qwen3-VL: reason2, else reason1); an explicit
    style reads nothing. Raises ConfigError when the checkpoint cannot be read.
    """
    family_name = ""
    if config.prompt.style == "auto":
        # One line for a wrong folder. A hub id is read below as before (None offline without a cache: the recipe's
        # rollout settings need no network); commands that run the model check its source themselves (eval, load).
        if looks_like_path(config.model.model_name_or_path):
            check_model_source(config.model.model_name_or_path, config.model.revision)
        try:
            family = checkpoint_family(config.model.model_name_or_path, config.model.revision)
        except (OSError, ValueError, ConfigError) as exc:
            raise ConfigError(
                f"model.model_name_or_path = {config.model.model_name_or_path!r}: cannot read its config.json to "
                f"choose the prompt style ({exc}); pass a model folder with config.json or a reachable hub id, or "
                "set prompt.style (--prompt-style reason1|reason2)"
            ) from exc
        family_name = family.name if family is not None else ""
    prompting = resolve_prompting(config, family_name)
    return prompting, resolve_sampling(config, prompting)


def load_processor_params(model_name_or_path: str, revision: str | None = None) -> ProcessorParams:
    """Read patch size, temporal patch, merge size and mean/std from a model's preprocessor_config.json.

    The video layout and the defaults of absent keys follow the family named by config.json's model_type
    (Qwen3-VL: patch 16, mean/std 0.5, timestamps as text; anything else: Qwen2.5-VL's).
    """
    family = _family_processor(model_name_or_path, revision)
    path = _resolve_file(model_name_or_path, "preprocessor_config.json", revision)
    if path is None:
        return family
    raw = read_json_object(path, _CHECKPOINT_FIX)
    return ProcessorParams(
        patch_size=_size(raw, "patch_size", family.patch_size, path),
        temporal_patch_size=_size(raw, "temporal_patch_size", family.temporal_patch_size, path),
        merge_size=_size(raw, "merge_size", family.merge_size, path),
        image_mean=_channels(raw, "image_mean", family.image_mean, path),
        image_std=_channels(raw, "image_std", family.image_std, path),
        video_timestamps_as_text=family.video_timestamps_as_text,
    )


_CHECKPOINT_FIX = "restore the checkpoint's file from its source, or point at a complete model folder"


def _size(raw: dict[str, Any], key: str, default: int, path: Path) -> int:
    """A positive whole number of preprocessor_config.json (a patch or merge size); ConfigError naming the key."""
    value = raw.get(key, default)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 4096:
        raise ConfigError(f"{path}: {key} = {value!r} is not a positive whole number of pixels; {_CHECKPOINT_FIX}")
    return value


def _channels(raw: dict[str, Any], key: str, default: tuple[float, ...], path: Path) -> tuple[float, float, float]:
    """Three finite numbers of preprocessor_config.json (a normalisation mean or std, the std above 0)."""
    value = raw.get(key, default)
    numbers = list(value) if isinstance(value, list | tuple) else []
    usable = len(numbers) == 3 and all(finite_number(x) is not None for x in numbers)
    if not usable or (key == "image_std" and min(numbers) <= 0):
        wanted = "three finite numbers above 0" if key == "image_std" else "three finite numbers"
        raise ConfigError(f"{path}: {key} = {value!r} is not {wanted} (one per RGB channel); {_CHECKPOINT_FIX}")
    return float(numbers[0]), float(numbers[1]), float(numbers[2])



def patch_factor(model_name_or_path: str, revision: str | None = None) -> int:
    """Pixels per visual-token side of a checkpoint (28 for Qwen2.5-VL, 32 for Qwen3-VL), from its folder's JSON.

    Reads only config.json and preprocessor_config.json, so media can be decoded before the model loads; a path
    that is no model folder, or a hub id that can be neither fetched nor found in the cache, raises ConfigError.
    """
    check_model_source(model_name_or_path, revision)
    return load_processor_params(model_name_or_path, revision).factor


def checked_vision_factor(config: Config) -> int:
    """The checkpoint's patch factor, after checking that the recipe's pixel budgets fit it (ConfigError if not).

    Commands call this before they write anything, so a bad [vision] setting fails once, not once per request.
    """
    from physreason.vision.resize import pixel_budgets

    factor = patch_factor(config.model.model_name_or_path, config.model.revision)
    pixel_budgets(config.vision, factor)
    return factor


@dataclass
class VisualInputs:
    """Model-ready pixels for one request (or a batch, after `concat_visuals`) and their token counts."""

    pixel_values: torch.Tensor | None = None  # [n_image_patches, 3 * temporal_patch * patch^2]
    image_grid_thw: torch.Tensor | None = None  # [n_images, 3]
    pixel_values_videos: torch.Tensor | None = None  # [n_video_patches, 3 * temporal_patch * patch^2]
    video_grid_thw: torch.Tensor | None = None  # [n_videos, 3]
    second_per_grid_ts: torch.Tensor | None = None  # [n_videos] seconds spanned by one temporal patch (Qwen2.5-VL)
    image_token_counts: list[int] = field(default_factory=list)
    video_token_counts: list[int] = field(default_factory=list)
    video_group_seconds: list[list[float]] | None = None  # Qwen3-VL: per video, the time of each temporal patch

    def model_kwargs(self) -> dict[str, torch.Tensor]:
        """The keyword arguments the Qwen-VL model's forward takes (only those present)."""
        names = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}

    def expand(self, text: str) -> str:
        """The rendered prompt with each vision placeholder expanded to these inputs' tokens, in order."""
        return expand_vision_placeholders(
            text, self.image_token_counts, self.video_token_counts, self.video_group_seconds
        )


def encode_visuals(
    images: list[np.ndarray] = (), videos: list[VideoFrames] = (), params: ProcessorParams | None = None
) -> VisualInputs:
    """Patchify resized images ([H, W, 3] uint8) and sampled videos in prompt order.

    Videos get second_per_grid_ts (Qwen2.5-VL) or, when params.video_timestamps_as_text, the time of each
    temporal patch for the prompt text (Qwen3-VL).
    """
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
            out.video_token_counts.append(num_visual_tokens(grid, params.merge_size))
            if params.video_timestamps_as_text:
                seconds.append(frame_group_seconds(video.indices, video.source_fps, params.temporal_patch_size))
            else:
                seconds.append(params.temporal_patch_size / video.sample_fps)
        out.pixel_values_videos = torch.cat(patches)
        out.video_grid_thw = torch.tensor(grids, dtype=torch.long)
        if params.video_timestamps_as_text:
            out.video_group_seconds = seconds
        else:
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
        if p.video_group_seconds is not None:
            out.video_group_seconds = (out.video_group_seconds or []) + p.video_group_seconds
    return out


def expand_vision_placeholders(
    text: str,
    image_token_counts: list[int],
    video_token_counts: list[int],
    video_group_seconds: list[list[float]] | None = None,
) -> str:
    """Repeat each <|image_pad|> / <|video_pad|> of a rendered prompt to its visual token count, in order.

    With video_group_seconds (Qwen3-VL), a video's pad becomes one `<t seconds><|vision_start|>` + pads +
    `<|vision_end|>` span per temporal patch instead of one run (qwen3_vl.video_placeholder).
    """
    for pad, counts, kind in ((IMAGE_PAD, image_token_counts, "image"), (VIDEO_PAD, video_token_counts, "video")):
        pieces = text.split(pad)
        if len(pieces) - 1 != len(counts):
            raise InputError(
                f"the prompt has {len(pieces) - 1} {kind} placeholder(s) but {len(counts)} {kind}(s) were given: "
                f"pass one {kind} per {{'type': '{kind}'}} entry in the message content"
            )
        if kind == "video" and video_group_seconds is not None:
            spans = [
                video_placeholder(groups, n // len(groups))
                for n, groups in zip(counts, video_group_seconds, strict=True)
            ]
        else:
            spans = [pad * n for n in counts]
        text = pieces[0] + "".join(span + rest for span, rest in zip(spans, pieces[1:], strict=True))
    return text


__all__ = [
    "IMAGE_PAD",
    "QWEN2_5_VL_PARAMS",
    "QWEN3_VL_PARAMS",
    "VIDEO_PAD",
    "ProcessorParams",
    "VisualInputs",
    "concat_visuals",
    "encode_visuals",
    "expand_vision_placeholders",
    "load_processor_params",
]
