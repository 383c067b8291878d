"""Model families: what physreason needs to know of each supported architecture, read from the checkpoint's config.

A family is detected from the config's `model_type` (else its `architectures`), never from the checkpoint's
name, so a renamed or fine-tuned folder keeps its family. Adding an architecture is adding one `ModelFamily`
to `FAMILIES`: the loaders, the data pipeline and the trainers ask the family, not the model name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from physreason.errors import ConfigError
from physreason.models.positions import mrope_position_ids
from physreason.models.qwen3_vl import QWEN3_VL_MODEL_TYPES, qwen3_vl_position_ids
from physreason.vision.patches import CLIP_MEAN, CLIP_STD, HALF_MEAN, HALF_STD


@dataclass(frozen=True)
class ProcessorParams:
    """Patch geometry and normalisation of a Qwen-VL-family processor, and how its videos are written."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, float, float] = CLIP_MEAN
    image_std: tuple[float, float, float] = CLIP_STD
    video_timestamps_as_text: bool = False
    """Qwen3-VL: each temporal patch is its own span after `<t seconds>` text (no second_per_grid_ts)."""

    @property
    def factor(self) -> int:
        """Pixels per visual token side: frame sides are multiples of patch_size * merge_size."""
        return self.patch_size * self.merge_size


QWEN2_5_VL_PARAMS = ProcessorParams()
QWEN3_VL_PARAMS = ProcessorParams(
    patch_size=16, image_mean=HALF_MEAN, image_std=HALF_STD, video_timestamps_as_text=True
)


@dataclass(frozen=True)
class VisionTokens:
    """What the data pipeline needs to know of a vision-language model's token layout."""

    image_token_id: int
    video_token_id: int
    spatial_merge_size: int = 2
    tokens_per_second: float = 2.0
    video_frame_spans: bool = False
    """Qwen3-VL: each temporal patch of a video is its own span (positions of a one-frame image, time as text)."""

    def positions(self, input_ids: torch.Tensor, visuals: Any) -> torch.Tensor:
        """[3, L] mrope position ids of one sequence with its visual inputs (VisualInputs or None)."""
        if self.video_frame_spans:
            return qwen3_vl_position_ids(
                input_ids,
                self.image_token_id,
                self.video_token_id,
                visuals.image_grid_thw if visuals else None,
                visuals.video_grid_thw if visuals else None,
                self.spatial_merge_size,
            )
        return mrope_position_ids(
            input_ids,
            self.image_token_id,
            self.video_token_id,
            visuals.image_grid_thw if visuals else None,
            visuals.video_grid_thw if visuals else None,
            visuals.second_per_grid_ts if visuals else None,
            self.spatial_merge_size,
            self.tokens_per_second,
        )


def vision_special_token_ids(config: Any) -> list[int]:
    """The placeholder and delimiter token ids of a vision-language config (image/video pads, vision start/end).

    Text configs have none. A sampled pad would ask the model for pixels nobody gave it; `[*sampling]
    suppress_vision_tokens` keeps engines from drawing any of these.
    """
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return sorted({int(value) for name in names if (value := getattr(config, name, None)) is not None})


def qwen2_5_vl_vision_tokens(config: Any) -> VisionTokens:
    """Token ids and merge geometry of a Qwen2.5-VL config (3D M-RoPE, absolute time in video positions)."""
    vision = config.vision_config
    return VisionTokens(
        image_token_id=int(config.image_token_id),
        video_token_id=int(config.video_token_id),
        spatial_merge_size=int(getattr(vision, "spatial_merge_size", 2)),
        tokens_per_second=float(getattr(vision, "tokens_per_second", 2)),
    )


def qwen3_vl_vision_tokens(config: Any) -> VisionTokens:
    """Token ids and merge geometry of a Qwen3-VL config (interleaved M-RoPE, video time written as text)."""
    return VisionTokens(
        image_token_id=int(config.image_token_id),
        video_token_id=int(config.video_token_id),
        spatial_merge_size=int(getattr(config.vision_config, "spatial_merge_size", 2)),
        video_frame_spans=True,
    )


@dataclass(frozen=True)
class ModelFamily:
    """One supported architecture: how to recognise its config and the facts training and inference need."""

    name: str
    model_types: tuple[str, ...]  # config.model_type values of the family
    architectures: tuple[str, ...]  # transformers class names in config.architectures
    # Vision-language families read their vision token layout (ids, merge size, M-RoPE) from the config;
    # None for text-only causal LMs.
    vision_tokens: Callable[[Any], VisionTokens] | None = None
    # Patch geometry, normalisation and video layout when preprocessor_config.json leaves them out.
    processor: ProcessorParams | None = None

    @property
    def is_vision_language(self) -> bool:
        """True when the family has a vision tower (loaded as an image-text-to-text model)."""
        return self.vision_tokens is not None


FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily(
        "qwen2_5_vl",
        ("qwen2_5_vl",),
        ("Qwen2_5_VLForConditionalGeneration",),
        qwen2_5_vl_vision_tokens,
        QWEN2_5_VL_PARAMS,
    ),
    ModelFamily(
        "qwen3_vl",
        QWEN3_VL_MODEL_TYPES[:1],
        ("Qwen3VLForConditionalGeneration",),
        qwen3_vl_vision_tokens,
        QWEN3_VL_PARAMS,
    ),
    ModelFamily(
        "qwen3_vl_moe",
        QWEN3_VL_MODEL_TYPES[1:],
        ("Qwen3VLMoeForConditionalGeneration",),
        qwen3_vl_vision_tokens,
        QWEN3_VL_PARAMS,
    ),
    ModelFamily("qwen2", ("qwen2",), ("Qwen2ForCausalLM",)),
    ModelFamily("qwen3", ("qwen3",), ("Qwen3ForCausalLM",)),
    ModelFamily("qwen3_moe", ("qwen3_moe",), ("Qwen3MoeForCausalLM",)),
)


def model_family(config: Any) -> ModelFamily:
    """The family of a transformers config, by its model_type, else by its architectures.

    Raises ConfigError naming the checkpoint's model_type and architectures and the supported families.
    """
    model_type = getattr(config, "model_type", None)
    architectures = tuple(getattr(config, "architectures", None) or ())
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    for family in FAMILIES:
        if any(name in family.architectures for name in architectures):
            return family
    source = getattr(config, "_name_or_path", "") or "the checkpoint"
    supported = ", ".join(family.name for family in FAMILIES)
    raise ConfigError(
        f"{source}: model_type {model_type!r} (architectures {list(architectures)}) is not a supported model family; "
        f"physreason supports {supported}: use a checkpoint of one of these architectures"
    )


def read_vision_tokens(config: Any) -> VisionTokens | None:
    """The vision token layout of a transformers config's family; None for text-only families."""
    family = model_family(config)
    return family.vision_tokens(config) if family.vision_tokens is not None else None
