"""Build the configured generation engine (`[engine] backend`): the one place that chooses between vLLM and hf."""

from __future__ import annotations

import importlib.util
from typing import Literal

from physreason.config import EngineConfig, ModelConfig
from physreason.engines.base import Engine
from physreason.errors import ConfigError


def vllm_installed() -> bool:
    """True when vLLM can be imported in this environment."""
    return importlib.util.find_spec("vllm") is not None


def resolve_backend(engine: EngineConfig) -> Literal["vllm", "hf"]:
    """The backend `engine.backend` names; 'auto' is vLLM when it is installed, else transformers (hf)."""
    if engine.backend == "auto":
        return "vllm" if vllm_installed() else "hf"
    return engine.backend


def create_engine(
    model: ModelConfig,
    engine: EngineConfig,
    *,
    vllm_executor: Literal["uni", "mp"] | None = None,
    lora_rank: int | None = None,
    quantization: str = "none",
) -> Engine:
    """Build the configured engine; 'auto' picks vLLM when it is importable, else transformers.

    vllm_executor: vLLM's distributed executor backend ("uni": in this process, "mp": local worker
    processes); None leaves the choice to vLLM. Ignored by the hf engine. lora_rank: give a vLLM engine a
    runtime LoRA adapter slot of this rank (GRPO pushes its adapters there); the hf engine takes merged weights.
    quantization: the rollout engine's weights ([rollout] quantization); "fp8" needs vLLM.
    """
    vllm_only = {"rollout.quantization": (quantization, "none"), "engine.kv_cache_dtype": (engine.kv_cache_dtype, "auto")}
    for key, (value, default) in vllm_only.items():
        if value != default and resolve_backend(engine) != "vllm":
            raise ConfigError(
                f"{key} = {value!r} runs on the vLLM engine, but the engine is 'hf' (engine.backend, or vLLM not "
                f"installed): install vLLM and set engine.backend = 'vllm', or {key} = '{default}'"
            )
    if resolve_backend(engine) == "vllm":
        if not vllm_installed():
            raise ConfigError("engine.backend = 'vllm' but vLLM is not installed: install vllm, or use --engine hf")
        try:
            from physreason.engines.vllm import VLLMEngine
        except ImportError as exc:
            raise ConfigError(f"the vllm engine is not available in this build of physreason ({exc}); use --engine hf") from exc
        overrides: dict = {"distributed_executor_backend": vllm_executor} if vllm_executor is not None else {}
        if lora_rank is not None:
            overrides["lora_rank"] = lora_rank
        if quantization != "none":
            overrides["quantization"] = quantization
        return VLLMEngine(model, engine, **overrides)
    from physreason.engines.hf import HFEngine

    return HFEngine(model, engine, static_cache=engine.hf_static_cache)
