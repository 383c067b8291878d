"""Generation engines behind one interface: `hf` (transformers) everywhere, `vllm` where installed."""

from physreason.engines.base import Completion, Engine, GenerationRequest, GenerationResult
from physreason.engines.factory import create_engine

__all__ = ["Completion", "Engine", "GenerationRequest", "GenerationResult", "create_engine"]
