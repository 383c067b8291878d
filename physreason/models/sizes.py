"""The tensor shapes of a checkpoint's model, read from its config alone: the model is built on torch's meta device.

No weight is read and no memory is taken, so the exact parameter count and layout of any size (a 32B model
included) is known in seconds, before a job starts. The memory plan (physreason.train.memory) works from these.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from physreason.config import ModelConfig
from physreason.errors import ConfigError
from physreason.models.family import model_family
from physreason.models.loading import decoder_layers, load_model_config, vision_tower

log = logging.getLogger(__name__)

# Which FSDP2 unit a parameter belongs to (apply_fsdp2 shards each decoder block and vision block on its own and
# everything else with the root), and how tensor parallelism splits it (apply_tensor_parallel's plan).
Unit = Literal["decoder", "vision", "root"]
TpSplit = Literal["column", "row", "none"]

_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW = ("o_proj", "down_proj")


@dataclass(frozen=True)
class ParamShape:
    """One parameter: its name, shape, FSDP2 unit, block index within the unit (-1 for root) and TP split."""

    name: str
    shape: tuple[int, ...]
    unit: Unit
    block: int
    tp: TpSplit

    @property
    def numel(self) -> int:
        """Number of elements."""
        count = 1
        for size in self.shape:
            count *= size
        return count


@dataclass(frozen=True)
class LinearShape:
    """A linear layer of a decoder or vision block that LoRA may target: last name part, in and out features."""

    unit: Unit
    block: int
    leaf: str
    in_features: int
    out_features: int


@dataclass(frozen=True)
class ModelShape:
    """What the memory plan needs to know of a model: every parameter's shape and the sizes activations scale with."""

    params: tuple[ParamShape, ...]
    linears: tuple[LinearShape, ...]
    hidden: int  # decoder hidden size h
    layers: int  # decoder blocks L
    intermediate: int  # MLP width i of a decoder block
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    vision_hidden: int = 0  # 0 for text-only models
    vision_depth: int = 0
    vision_intermediate: int = 0
    vision_merge: int = 1  # spatial merge: patches per visual token = merge**2
    vision_factor: int = 1  # pixels per visual token side (patch x merge)
    vision_temporal: int = 2  # frames per temporal patch of a video
    vision_gated: bool = False  # vision blocks with a gated MLP (Qwen2.5-VL's SwiGLU; Qwen3-VL's is GELU)
    vision_deepstack: int = 0  # Qwen3-VL's extra mergers (deepstack_visual_indexes), each on its block's output
    vision_patch_values: int = 0  # pixel values per patch: channels x temporal patch x patch side^2

    @property
    def total_params(self) -> int:
        """All parameters, vision tower included (tied weights counted once)."""
        return sum(p.numel for p in self.params)

    def unit_params(self, unit: Unit) -> int:
        """Parameters of one kind of FSDP2 unit, all blocks together."""
        return sum(p.numel for p in self.params if p.unit == unit)


def _tp_split(name: str, unit: Unit, module: nn.Module | None) -> TpSplit:
    leaf = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else name
    if unit != "decoder" or not isinstance(module, nn.Linear) or not name.endswith("weight"):
        return "none"
    if leaf in _COLUMN:
        return "column"
    return "row" if leaf in _ROW else "none"


def shape_from_hf_config(hf_config: Any) -> ModelShape:
    """Build the model of `hf_config` on the meta device and record its parameter shapes (no memory, no weights)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    family = model_family(hf_config)
    cls = AutoModelForImageTextToText if family.is_vision_language else AutoModelForCausalLM
    with torch.device("meta"):
        model = cls.from_config(hf_config)
    units: dict[int, tuple[Unit, int]] = {}
    for index, block in enumerate(decoder_layers(model)):
        for parameter in block.parameters():
            units[id(parameter)] = ("decoder", index)
    tower = vision_tower(model)
    if tower is not None:
        for index, block in enumerate(tower.blocks):
            for parameter in block.parameters():
                units[id(parameter)] = ("vision", index)
    owners = {f"{name}.{leaf}": module for name, module in model.named_modules() for leaf, _ in module.named_parameters(recurse=False)}
    params = []
    for name, parameter in model.named_parameters():  # tied weights appear once
        unit, block = units.get(id(parameter), ("root", -1))
        params.append(ParamShape(name, tuple(parameter.shape), unit, block, _tp_split(name, unit, owners.get(name))))
    linears = []
    for unit, blocks in (("decoder", decoder_layers(model)), ("vision", tower.blocks if tower is not None else [])):
        for index, block in enumerate(blocks):
            for name, module in block.named_modules():
                if isinstance(module, nn.Linear):
                    linears.append(LinearShape(unit, index, name.rsplit(".", 1)[-1], module.in_features, module.out_features))
    text = getattr(hf_config, "text_config", hf_config)
    heads = int(text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    shape = ModelShape(
        params=tuple(params),
        linears=tuple(linears),
        hidden=int(text.hidden_size),
        layers=int(text.num_hidden_layers),
        intermediate=int(text.intermediate_size),
        heads=heads,
        kv_heads=int(getattr(text, "num_key_value_heads", heads)),
        head_dim=head_dim,
        vocab=int(text.vocab_size),
    )
    if tower is not None:
        vision = hf_config.vision_config
        merge = int(getattr(vision, "spatial_merge_size", 2))
        hidden = int(getattr(vision, "hidden_size", 0) or vision.embed_dim)
        shape = replace(
            shape,
            vision_hidden=hidden,
            vision_depth=int(vision.depth),
            vision_intermediate=int(getattr(vision, "intermediate_size", 4 * hidden)),
            vision_merge=merge,
            vision_factor=int(vision.patch_size) * merge,
            vision_temporal=int(getattr(vision, "temporal_patch_size", 2) or 2),
            vision_gated=any(linear.unit == "vision" and linear.leaf == "gate_proj" for linear in linears),
            vision_deepstack=len(getattr(vision, "deepstack_visual_indexes", None) or ()),
            vision_patch_values=int(getattr(vision, "in_channels", 3) or 3)
            * int(getattr(vision, "temporal_patch_size", 2) or 2)
            * int(vision.patch_size) ** 2,
        )
    return shape


# The architecture fields of the models the shipped recipes name (configs/*.toml), for planning them offline.
RECIPE_SHAPES = Path(__file__).with_name("recipe_shapes.json")


def shipped_config(name: str) -> Any | None:
    """The transformers config of a model a shipped recipe names, from RECIPE_SHAPES; None for any other model."""
    from transformers import AutoConfig

    fields = json.loads(RECIPE_SHAPES.read_text(encoding="utf-8")).get(name)
    if not isinstance(fields, dict):
        return None
    fields = dict(fields)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def read_model_shape(model_config: ModelConfig) -> ModelShape:
    """The shape of model.model_name_or_path, from its config.json only (ConfigError when it cannot be read).

    A model a shipped recipe names (nvidia/Cosmos-Reason1-7B, Cosmos-Reason2-2B and -8B) whose config cannot be
    read here (no network, not in the cache) is planned from its published shape in RECIPE_SHAPES, with a warning.
    """
    try:
        hf_config = load_model_config(model_config)
    except ConfigError as exc:
        shipped = shipped_config(model_config.model_name_or_path) if model_config.revision is None else None
        if shipped is None:
            raise
        log.warning(
            "%s: config.json can be read neither from the hub nor from the local cache; planning with the published "
            "shape physreason ships for it",
            model_config.model_name_or_path,
        )
        log.debug("why the config could not be read: %s", exc)
        hf_config = shipped
    return shape_from_hf_config(hf_config)
