"""Typed configuration: pydantic sections read from TOML with `--set a.b=value` overrides."""

from physreason.config.loader import dump_config, load_config, parse_override
from physreason.config.schema import (
    CheckpointConfig,
    Config,
    DataConfig,
    DatasetConfig,
    EngineConfig,
    EvalConfig,
    GRPOConfig,
    InferConfig,
    LoggingConfig,
    LoraConfig,
    ModelConfig,
    PromptConfig,
    RolloutConfig,
    SamplingConfig,
    TrainConfig,
    VisionConfig,
)

__all__ = [
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "DatasetConfig",
    "EngineConfig",
    "EvalConfig",
    "GRPOConfig",
    "InferConfig",
    "LoggingConfig",
    "LoraConfig",
    "ModelConfig",
    "PromptConfig",
    "RolloutConfig",
    "SamplingConfig",
    "TrainConfig",
    "VisionConfig",
    "dump_config",
    "load_config",
    "parse_override",
]
