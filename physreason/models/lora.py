"""LoRA adapters through PEFT: inject them into a transformers model, read them out, merge them for export and engines.

`apply_lora` wraps the model in a `peft.PeftModel` whose `base_model.model` is the same transformers
model object with LoRA layers injected in place, so trainers, FSDP2 and exports keep working on that
object; PEFT freezes every base weight. The adapter math (scaling, delta weights, merging on load) is
PEFT's; this module only chooses the target layers and maps parameter names:

- training names: `...q_proj.base_layer.weight`, `...q_proj.lora_A.default.weight`,
  `...lm_head.modules_to_save.default.weight` (PEFT's injected layout);
- adapter folder names: PEFT's own (`base_model.model.<...>.q_proj.lora_A.weight`), as `save_pretrained` writes;
- merged names: the plain Hugging Face names (`...q_proj.weight` = base + delta), as a full export has.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from physreason.config import LoraConfig
from physreason.errors import ConfigError
from physreason.models.loading import decoder_layers, vision_tower

ADAPTER_NAME = "default"  # PEFT's adapter name; saved files drop it


def _require_peft() -> Any:
    try:
        import peft
    except ImportError as exc:
        raise ConfigError(
            "train.lora.enable = true (or --lora) needs PEFT: pip install 'peft>=0.21,<0.22'"
        ) from exc
    return peft


def _module_path(model: nn.Module, module: nn.Module) -> str:
    for name, candidate in model.named_modules():
        if candidate is module:
            return name
    raise ValueError("module is not part of the model")


def target_pattern(model: nn.Module, lora: LoraConfig) -> str:
    """A regular expression (PEFT matches it against whole module names) for the layers that get adapters.

    Language: `lora.target_modules` inside the decoder blocks only, so a vision MLP with the same layer
    names (Qwen2.5-VL's gate/up/down_proj) stays without adapters unless `lora.vision` asks for them.
    Raises ConfigError when no linear layer of the model matches.
    """
    groups = [(_module_path(model, decoder_layers(model)), lora.target_modules)]
    tower = vision_tower(model)
    if lora.vision:
        if tower is None:
            raise ConfigError("train.lora.vision = true but the model has no vision tower: set it to false")
        groups.append((_module_path(model, tower.blocks), lora.vision_target_modules))
    alternatives = [
        rf"{re.escape(prefix)}\.\d+\.(?:[^.]+\.)*(?:{'|'.join(re.escape(name) for name in names)})"
        for prefix, names in groups
    ]
    pattern = alternatives[0] if len(alternatives) == 1 else "(?:" + "|".join(alternatives) + ")"
    matched = [
        name for name, module in model.named_modules() if isinstance(module, nn.Linear) and re.fullmatch(pattern, name)
    ]
    if not matched:
        raise ConfigError(
            f"train.lora.target_modules = {lora.target_modules} matches no linear layer of the decoder blocks: "
            "name the last part of their names (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)"
        )
    return pattern


def read_adapter_config(path: str | Path) -> dict[str, Any]:
    """The adapter_config.json of a PEFT adapter folder; ConfigError naming the folder when it is not one."""
    from physreason.files import read_json_object

    file = Path(path) / "adapter_config.json"
    if not file.is_file():
        raise ConfigError(
            f"LoRA adapter {path} has no adapter_config.json: pass a PEFT adapter folder, such as "
            "<output_dir>/safetensors/step_<n>/adapter of a [train.lora] run"
        )
    fix = "save the adapter again (physreason export, or PEFT's save_pretrained) or point at a complete adapter folder"
    config = read_json_object(file, fix)
    if config.get("peft_type") != "LORA":
        raise ConfigError(f"{file} describes a {config.get('peft_type')!r} adapter; only LoRA adapters are served")
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= 65536:
        raise ConfigError(f"{file}: the LoRA rank r = {rank!r} is not a positive whole number; {fix}")
    return config


def _base_model_type(adapter: Path, config: dict[str, Any]) -> tuple[str | None, str]:
    """The model_type of the model an adapter was trained on, and where it was read; (None, "") when unknown.

    A physreason export holds the merged model's config.json beside its `adapter` folder; otherwise the adapter's
    base_model_name_or_path is read when it is a local folder (absolute, or relative to the adapter or here).
    """
    import json

    candidates = [adapter.parent / "config.json"]
    base = config.get("base_model_name_or_path")
    if isinstance(base, str) and base:
        candidates += [Path(base) / "config.json", adapter / base / "config.json"]
    for candidate in candidates:
        if candidate.is_file():
            try:
                model_type = json.loads(candidate.read_text(encoding="utf-8")).get("model_type")
            except (ValueError, RecursionError, AttributeError):  # not JSON, not UTF-8, too deep, not an object
                continue
            if model_type:
                return str(model_type), str(candidate.parent)
    return None, ""


def check_adapter_base(path: str | Path, model_config: Any, model_name: str) -> None:
    """Refuse a LoRA adapter trained on another model family than `model_config` (the model it would load onto).

    Raises ConfigError naming both families; an adapter whose base cannot be read here is taken as it is.
    """
    adapter = Path(path)
    trained_on, where = _base_model_type(adapter, read_adapter_config(adapter))
    target = getattr(model_config, "model_type", None)
    if trained_on is None or target is None or trained_on == target:
        return
    raise ConfigError(
        f"LoRA adapter {path} was trained on a {trained_on} model ({where}), but model.model_name_or_path = "
        f"{model_name!r} is a {target} model: its layers differ, so the adapter would not fit; load it onto the "
        "model it was trained from (or one of the same family)"
    )


@contextlib.contextmanager
def quiet_peft_wrap() -> Iterator[None]:
    """Silence transformers' FutureWarning that PEFT's PeftModel() causes by probing `is_gradient_checkpointing`.

    PEFT reads that deprecated property of the model it wraps (transformers >= 5 warns on every read); the probe
    is PEFT's, not ours, so only that one message is filtered, only while PEFT wraps a model.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def apply_lora(model: nn.Module, lora: LoraConfig) -> nn.Module:
    """Inject LoRA adapters into `model` in place (PEFT) and freeze every other weight; returns the PeftModel.

    The returned PeftModel's `base_model.model` is `model` itself. Call before activation checkpointing,
    sharding and compiling, which then wrap the injected layers like any other.
    """
    peft = _require_peft()
    config = peft.LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=target_pattern(model, lora),
        modules_to_save=list(lora.modules_to_save) or None,
        bias="none",
    )
    with quiet_peft_wrap():
        return peft.get_peft_model(model, config, adapter_name=ADAPTER_NAME)


def lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The model's PEFT LoRA layers by module name ({} for a model without adapters)."""
    from peft.tuners.lora import LoraLayer

    return {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}


def has_lora(model: nn.Module) -> bool:
    """True when PEFT LoRA layers are injected in `model`."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return False
    return any(isinstance(module, LoraLayer) for module in model.modules())


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def hf_name(name: str) -> str | None:
    """The Hugging Face name of a parameter of a LoRA-injected model, or None for adapter-only ones.

    `x.base_layer.weight` -> `x.weight`; `x.modules_to_save.default.weight` -> `x.weight`; lora_A/lora_B and the
    untrained original copy of a modules_to_save layer -> None.
    """
    if ".lora_" in name or ".original_module." in name:
        return None
    return name.replace(".base_layer.", ".").replace(f".modules_to_save.{ADAPTER_NAME}.", ".")


@torch.no_grad()
def merged_named_tensors(model: nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (Hugging Face name, full tensor) of the model with its adapters merged: base + (alpha / r) B A.

    The training weights are not touched (the sum is a new tensor), so the frozen base stays bit-exact. Works on
    a plain or FSDP2-sharded model: sharded tensors are gathered one parameter at a time (a collective, so every
    rank must iterate in step). The sum is taken in float32 and then cast to `dtype` (None keeps float32).
    """
    layers = lora_layers(model)
    for name, parameter in model.named_parameters():
        target = hf_name(name)
        if target is None:
            continue
        tensor = _full(parameter.detach())
        owner = name.removesuffix(".base_layer.weight")
        if owner != name and owner in layers:
            delta = _full(layers[owner].get_delta_weight(ADAPTER_NAME))  # [out, in]
            tensor = tensor.float() + delta.float()
        yield target, tensor if dtype is None else tensor.to(dtype)


@torch.no_grad()
def adapter_state(peft_model: nn.Module) -> dict[str, torch.Tensor]:
    """The trained tensors (adapters, modules_to_save) under their PeftModel names, full and on the CPU.

    Every rank must call this under FSDP2 (gathers are collective); every rank gets the whole adapter.
    """
    return {
        name: _full(parameter.detach()).cpu()
        for name, parameter in peft_model.named_parameters()
        if parameter.requires_grad
    }


def save_adapter(peft_model: nn.Module, out_dir: str | Path, state: dict[str, torch.Tensor] | None = None) -> Path:
    """Write a PEFT adapter folder (adapter_config.json + adapter_model.safetensors) that PeftModel and vLLM load.

    state: adapter_state(peft_model), if already gathered; otherwise gathered here (every rank must call then).
    Writes from this process only: callers under torchrun pass the gathered state on rank 0 alone.
    """
    out_dir = Path(out_dir)
    if state is None:
        state = adapter_state(peft_model)
    # PEFT renames the state to its saved layout (adapter name dropped) and writes the config beside it.
    peft_model.save_pretrained(str(out_dir), state_dict=state, safe_serialization=True)
    _absolute_base_path(out_dir)
    return out_dir


def _absolute_base_path(out_dir: Path) -> None:
    """Store a local base model's path absolute: relative, it names the base only from the folder training ran in."""
    import json

    file = out_dir / "adapter_config.json"
    config = json.loads(file.read_text(encoding="utf-8"))
    base = config.get("base_model_name_or_path")
    if isinstance(base, str) and base and Path(base).is_dir() and not Path(base).is_absolute():
        config["base_model_name_or_path"] = str(Path(base).resolve())
        file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
