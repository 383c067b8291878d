"""GRPO with [train.lora]: merged pushes to the hf engine, adapter pushes to engines with runtime adapters."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from setups import grpo_recipe

from physreason.config import LoraConfig, ModelConfig
from physreason.engines.hf import HFEngine
from physreason.models import loading
from physreason.train.grpo import run_grpo
from physreason.train.weight_sync import PolicySync

pytest.importorskip("peft")


def grpo_config(model: Path, data: Path, out: Path, *extra: str):
    return grpo_recipe(model, data, out, "logging.logger=['jsonl']", "train.lora.enable=true", "train.lora.rank=8",
                       *extra, lr="5e-2")  # fmt: skip


def next_token_logprobs(engine: HFEngine) -> torch.Tensor:
    ids = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Which way does ball 1 go?"}], add_generation_prompt=True, tokenize=True,
        return_dict=False,
    )
    with torch.no_grad():
        logits = engine.model(input_ids=torch.tensor([ids])).logits[0, -1]  # [vocab]
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.mark.slow
def test_lora_grpo_pushes_merged_weights_that_move_the_engine(tiny_text, mcq_file, tmp_path):
    config = grpo_config(tiny_text, mcq_file, tmp_path / "out", "train.max_steps=2", "train.ckpt.save_freq=2",
                         "train.ckpt.export_safetensors=true")
    engine = HFEngine(config.model, config.engine)  # the recipe's engine, built here to look at it before and after
    before = next_token_logprobs(engine)
    lm_head = engine.model.lm_head.weight.detach().clone()
    result = run_grpo(config, engine=engine)
    assert len(result.rewards) == 2 and "time/sync_s" in result.metrics[-1]
    after = next_token_logprobs(engine)
    kl = torch.sum(before.exp() * (before - after))
    assert kl > 1e-4  # the pushed weights changed the engine's distribution
    assert torch.equal(engine.model.lm_head.weight, lm_head)  # only adapter-carrying layers moved
    # What the engine holds is the policy merged: the export of the same step, tensor for tensor.
    exported = exported_weights(result.export_dir)
    for name, parameter in engine.model.named_parameters():
        assert torch.allclose(parameter, exported[name], atol=1e-6), name
    assert (result.export_dir / "adapter" / "adapter_config.json").is_file()


def exported_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The exported model's parameters under its module names (the file may store some under older names)."""
    model = loading.load_model(ModelConfig(model_name_or_path=str(folder), dtype="float32"))
    return {name: p.detach() for name, p in model.named_parameters()}


class AdapterEngine:
    """An engine that serves runtime adapters: records each folder it is told to load, and what was in it."""

    serves_adapters = True

    def __init__(self) -> None:
        self.loaded: list[tuple[str, dict[str, torch.Tensor]]] = []

    def load_adapter(self, path: str) -> None:
        self.loaded.append((path, load_file(Path(path) / "adapter_model.safetensors")))

    def update_weights(self, named_tensors) -> None:
        raise AssertionError("an adapter-serving engine gets the adapter, not merged weights")


def test_policy_sync_sends_only_the_adapter_to_an_engine_that_serves_adapters(tiny_text):
    from physreason.models.lora import apply_lora, lora_layers

    model = loading.load_model(ModelConfig(model_name_or_path=str(tiny_text)), dtype=torch.float32)
    settings = LoraConfig(enable=True, rank=4)
    peft_model = apply_lora(model, settings)
    engine = AdapterEngine()
    sync = PolicySync(engine, model, peft_model, settings, torch.bfloat16)
    assert sync.mode == "adapter"
    sync.push()
    for layer in lora_layers(model).values():
        torch.nn.init.normal_(layer.lora_B["default"].weight)
    sync.push()
    (first, _), (second, tensors) = engine.loaded
    assert first != second and not Path(first).exists()  # a new folder per version; the old one is gone
    assert all(".lora_A." in k or ".lora_B." in k for k in tensors)
    layer_b = model.model.layers[0].self_attn.q_proj.lora_B["default"].weight
    assert torch.equal(tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"], layer_b)
    sync.close()
    assert not Path(second).exists()
    # Vision or fully trained modules cannot ride on vLLM's runtime adapters: merged weights instead.
    assert PolicySync(engine, model, peft_model, LoraConfig(enable=True, modules_to_save=["lm_head"]), None).mode == "merged"
    assert PolicySync(engine, model, peft_model, LoraConfig(enable=True, sync="merged"), None).mode == "merged"


def test_grpo_refuses_a_fixed_inference_adapter_on_its_engine(tiny_text, mcq_file, tmp_path):
    from physreason.errors import ConfigError
    from physreason.train.grpo import build_policy
    from physreason.train.runtime import init_runtime

    config = grpo_config(tiny_text, mcq_file, tmp_path, f"engine.lora='{tmp_path}'")
    with pytest.raises(ConfigError, match="unset engine.lora"):
        build_policy(config, init_runtime(), 1)
