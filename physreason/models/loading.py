"""Load a Hugging Face checkpoint (local folder or hub id) and its tokenizer for training."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from physreason.config import ModelConfig
from physreason.errors import ConfigError
from physreason.models.family import model_family
from physreason.models.patch_embed import use_linear_patch_embed
from physreason.models.source import check_model_source, check_model_weights
from physreason.models.vision_attention import use_grouped_vision_attention

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

# The largest value each kind of config.json size may take: far above any released model (hundreds of layers,
# hidden sizes in the tens of thousands, vocabularies of a few hundred thousand tokens), low enough that a typo
# cannot make building the model, even on the meta device, run for minutes or take gigabytes.
MAX_CONFIG_SIZES = {"layers": 10_000, "width": 1_000_000, "heads": 100_000, "vocab": 10_000_000, "patch": 10_000}
# The sizes of config.json that the model build and the memory plan use (the text model's, then the vision tower's).
_TEXT_SIZES = {
    "num_hidden_layers": "layers",
    "hidden_size": "width",
    "intermediate_size": "width",
    "num_attention_heads": "heads",
    "num_key_value_heads": "heads",
    "head_dim": "width",
    "vocab_size": "vocab",
}
_VISION_SIZES = {
    "depth": "layers",
    "hidden_size": "width",
    "embed_dim": "width",
    "intermediate_size": "width",
    "num_heads": "heads",
    "patch_size": "patch",
    "spatial_merge_size": "patch",
    "temporal_patch_size": "patch",
}


def load_model_config(config: ModelConfig) -> Any:
    """Read the transformers config of the checkpoint; ConfigError naming it when it is no model or unreachable,
    when transformers cannot parse it, or when a size the model is built from is not a sane positive integer."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    check_model_source(config.model_name_or_path, config.revision)
    try:
        hf_config = AutoConfig.from_pretrained(
            config.model_name_or_path, revision=config.revision, trust_remote_code=config.trust_remote_code
        )
    except OSError as exc:
        raise ConfigError(
            f"model.model_name_or_path = {config.model_name_or_path!r} is neither a model folder nor a reachable "
            f"hub id ({exc}); pass a local folder with config.json or a hub id"
        ) from exc
    except (ValueError, TypeError, StrictDataclassError) as exc:  # a field of the wrong type or value
        raise _unreadable_config(config, exc) from exc
    check_config_sizes(hf_config, _config_file(config))
    return hf_config


def check_config_sizes(hf_config: Any, where: str) -> None:
    """Raise ConfigError naming `where`, the key and its value when a size of _TEXT_SIZES or _VISION_SIZES that the
    config sets is not an integer from 1 to its MAX_CONFIG_SIZES bound (a 0 divides by zero in transformers, a
    negative makes a tensor fail, millions of layers build for minutes)."""
    text = hf_config.get_text_config()
    # transformers moves the text model's keys of a flat config.json (Qwen2.5-VL's, Cosmos-Reason1's) into
    # text_config: name the key as the file has it
    nested = text is not hf_config and _file_has_section(where, "text_config")
    sections = [("text_config." if nested else "", text, _TEXT_SIZES)]
    vision = getattr(hf_config, "vision_config", None)
    if vision is not None:
        sections.append(("vision_config.", vision, _VISION_SIZES))
    for prefix, section, sizes in sections:
        for key, kind in sizes.items():
            value = getattr(section, key, None)
            if value is None:
                continue
            bound = MAX_CONFIG_SIZES[kind]
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= bound:
                raise ConfigError(
                    f"{where}: {prefix}{key} = {value!r} is not a whole number from 1 to {bound:,}; correct it "
                    "(the model's published config.json has the value)"
                )


def _file_has_section(where: str, section: str) -> bool:
    """Whether the JSON file `where` has a top-level `section` (True when it cannot be read: the usual layout)."""
    import json

    try:
        raw = json.loads(Path(where).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return True
    return not isinstance(raw, dict) or section in raw


def _config_file(config: ModelConfig) -> str:
    """Where the checkpoint's config.json is: in its folder, in the hub cache, or named by the hub id."""
    from huggingface_hub import try_to_load_from_cache

    folder = Path(config.model_name_or_path).expanduser()
    if folder.is_dir():
        return str(folder / "config.json")
    cached = try_to_load_from_cache(config.model_name_or_path, "config.json", revision=config.revision)
    return cached if isinstance(cached, str) else f"config.json of {config.model_name_or_path}"


def _unreadable_config(config: ModelConfig, exc: Exception) -> Exception:
    """The ConfigError for a config.json transformers refuses: a folder's own code it will not run, or a bad field."""
    refused = _remote_code_refused(config, exc)
    if isinstance(refused, ConfigError):
        return refused
    why = " ".join(str(exc).split())  # huggingface_hub's field errors span lines
    return ConfigError(
        f"{_config_file(config)} cannot be read as a model config ({type(exc).__name__}: {why}); correct it "
        "(the model's published config.json has every value)"
    )


def _remote_code_refused(config: ModelConfig, exc: Exception) -> Exception:
    """The ConfigError for transformers' refusal to run a folder's own code; any other error unchanged."""
    # transformers' wording names its Python argument trust_remote_code=True, which a physreason user never passes.
    if "trust_remote_code" not in str(exc) or config.trust_remote_code:
        return exc
    return ConfigError(
        f"model.model_name_or_path = {config.model_name_or_path!r} needs the Python code shipped in that folder "
        "(its model_type is not one transformers knows): set model.trust_remote_code = true "
        "(--set model.trust_remote_code=true) only if you trust that code, or use a model transformers supports"
    )


def load_model(config: ModelConfig, dtype: torch.dtype | None = None, device: str | torch.device = "cpu") -> nn.Module:
    """Load the checkpoint's model class with the configured attention kernel.

    dtype None uses model.dtype ('auto' keeps the checkpoint's); trainers pass float32 for master weights.
    With sdpa or eager and model.grouped_vision_attention (the default), a Qwen2.5-VL vision tower runs them
    grouped by window length (vision_attention.py); a Qwen-VL patch embedding runs as one linear layer
    (patch_embed.py: the same weights and names, one GEMM instead of a 3-D convolution).
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    hf_config = load_model_config(config)
    check_model_weights(config.model_name_or_path)
    if dtype is None:
        dtype = "auto" if config.dtype == "auto" else DTYPES[config.dtype]
    cls = AutoModelForImageTextToText if model_family(hf_config).is_vision_language else AutoModelForCausalLM
    model = cls.from_pretrained(
        config.model_name_or_path,
        revision=config.revision,
        dtype=dtype,
        attn_implementation=config.attn_implementation,
        trust_remote_code=config.trust_remote_code,
        device_map=None,
    ).to(device)
    # transformers calls sdpa/eager once per vision window (about 1,000 launches per clip); flash is left as it is
    if config.grouped_vision_attention:
        use_grouped_vision_attention(model)
    use_linear_patch_embed(model)
    return model


def load_tokenizer(config: ModelConfig) -> Any:
    """Load the checkpoint's tokenizer (with its chat template)."""
    from transformers import AutoTokenizer

    check_model_source(config.model_name_or_path, config.revision)
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            config.model_name_or_path, revision=config.revision, trust_remote_code=config.trust_remote_code
        )
    except ValueError as exc:
        raise _remote_code_refused(config, exc) from exc
    if tokenizer.chat_template is None:
        template = Path(config.model_name_or_path) / "chat_template.jinja"
        if not template.is_file():
            raise ConfigError(
                f"{config.model_name_or_path} has no chat template (tokenizer_config.json or chat_template.jinja): "
                "physreason renders every prompt with it; use an instruct/chat checkpoint or add chat_template.jinja"
            )
        tokenizer.chat_template = template.read_text(encoding="utf-8")
    return tokenizer


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The language model's decoder blocks of a transformers causal LM or Qwen2.5-VL model."""
    inner = model.model
    return inner.language_model.layers if hasattr(inner, "language_model") else inner.layers


def vision_tower(model: nn.Module) -> nn.Module | None:
    """The vision encoder (with its merger), or None for text-only models."""
    return getattr(model.model, "visual", None)
