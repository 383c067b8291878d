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


def load_model_config(config: ModelConfig) -> Any:
    """Read the transformers config of the checkpoint; ConfigError naming it when it is no model or unreachable."""
    from transformers import AutoConfig

    check_model_source(config.model_name_or_path, config.revision)
    try:
        return AutoConfig.from_pretrained(
            config.model_name_or_path, revision=config.revision, trust_remote_code=config.trust_remote_code
        )
    except OSError as exc:
        raise ConfigError(
            f"model.model_name_or_path = {config.model_name_or_path!r} is neither a model folder nor a reachable "
            f"hub id ({exc}); pass a local folder with config.json or a hub id"
        ) from exc
    except ValueError as exc:
        raise _remote_code_refused(config, exc) from exc


def _remote_code_refused(config: ModelConfig, exc: ValueError) -> Exception:
    """The ConfigError for transformers' refusal to run a folder's own code; any other ValueError unchanged."""
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
