"""[train.fp8] on CPU: which layers convert to float8, that parameters and state dicts keep their names and dtypes,
and the errors where float8 cannot run."""

from __future__ import annotations

import pytest
import torch

from physreason.config import Config
from physreason.errors import ConfigError
from physreason.models.float8 import (
    check_float8_support,
    convert_to_float8,
    emulated_float8_on_cpu,
    float8_linear_filter,
)
from physreason.models.tiny import build_tiny_model, build_tiny_tokenizer
from physreason.train.build import apply_float8
from physreason.train.runtime import Runtime


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl"])
def test_only_language_model_linears_with_sides_multiple_of_16_are_chosen(tokenizer, kind):
    model = build_tiny_model(kind, tokenizer)
    seen = []

    def converter(m, recipe, fsdp, module_filter_fn, emulate):
        seen.extend(name for name, module in m.named_modules() if module_filter_fn(module, name))

    chosen = convert_to_float8(model, "rowwise", convert=converter)
    assert chosen == seen
    layers = model.config.get_text_config().num_hidden_layers
    assert len(chosen) == 7 * layers
    assert all(".layers." in name and "visual" not in name for name in chosen)
    assert "lm_head" not in chosen


def test_a_linear_with_a_side_not_multiple_of_16_stays_as_it_is():
    assert float8_linear_filter("model.language_model.layers.0.mlp.up_proj", torch.nn.Linear(64, 48))
    assert not float8_linear_filter("model.language_model.layers.0.mlp.up_proj", torch.nn.Linear(64, 40))
    assert not float8_linear_filter("model.visual.blocks.0.mlp.up_proj", torch.nn.Linear(64, 64))
    assert not float8_linear_filter("lm_head", torch.nn.Linear(64, 64))
    assert not float8_linear_filter("model.language_model.embed_tokens", torch.nn.Embedding(64, 64))


def test_an_unknown_recipe_is_a_config_error(tokenizer):
    with pytest.raises(ConfigError, match="quant_recipe = 'blockwise'"):
        convert_to_float8(build_tiny_model("qwen2", tokenizer), "blockwise", convert=lambda *a: None)


@pytest.mark.parametrize(("recipe", "fsdp"), [("rowwise", False), ("tensorwise", True)])
def test_torchao_conversion_keeps_every_state_dict_key_and_dtype(tokenizer, recipe, fsdp):
    pytest.importorskip("torchao")
    model = build_tiny_model("qwen2_5_vl", tokenizer)
    before = {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}
    chosen = convert_to_float8(model, recipe, fsdp=fsdp)
    modules = dict(model.named_modules())
    assert {type(modules[name]).__name__ for name in chosen} == {"Float8Linear"}
    assert type(model.lm_head).__name__ == "Linear"
    after = {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}
    assert after == before
    assert not modules[chosen[0]].config.emulate  # real float8 matmuls unless a CPU check asks for emulation
    if fsdp:  # tensorwise under FSDP2: weights all-gather in float8
        assert modules[chosen[0]].config.enable_fsdp_float8_all_gather


def test_float8_on_cpu_is_a_config_error():
    pytest.importorskip("torchao")
    with pytest.raises(ConfigError, match="runs float8 matmuls on a CUDA GPU, but this run is on cpu"):
        check_float8_support(torch.device("cpu"))


def test_cpu_float8_runs_emulated_only_inside_the_block_that_allows_it(tokenizer, caplog):
    pytest.importorskip("torchao")
    config = Config.model_validate({"train": {"fp8": {"enable_fp8": True}}})
    runtime = Runtime(rank=0, world_size=1, device=torch.device("cpu"))
    with emulated_float8_on_cpu(), caplog.at_level("WARNING", logger="physreason.train.build"):
        check_float8_support(torch.device("cpu"))
        model = build_tiny_model("qwen2", tokenizer)
        apply_float8(model, config, runtime)
    # the start-up says float8 cannot pay on matmuls this small, instead of slowing down silently
    assert "[train.fp8] float8 is expected to be slower than bf16 here" in caplog.text
    converted = [m for m in model.modules() if type(m).__name__ == "Float8Linear"]
    assert len(converted) == 7 * model.config.num_hidden_layers and all(m.config.emulate for m in converted)
    with pytest.raises(ConfigError, match="this run is on cpu"):  # the block is over: CPU is refused again
        apply_float8(build_tiny_model("qwen2", tokenizer), config, runtime)


def test_missing_torchao_is_a_config_error_naming_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    with pytest.raises(ConfigError, match=r"needs torchao: pip install 'physreason\[fp8\]'"):
        check_float8_support(torch.device("cuda"))


def test_float8_refuses_lora_and_tensor_parallelism(tokenizer):
    model = build_tiny_model("qwen2", tokenizer)
    runtime = Runtime(rank=0, world_size=1, device=torch.device("cpu"))
    lora = Config.model_validate({"train": {"fp8": {"enable_fp8": True}, "lora": {"enable": True}}})
    with pytest.raises(ConfigError, match="train.lora.enable = true"):
        apply_float8(model, lora, runtime)
    tp = Config.model_validate({"train": {"fp8": {"enable_fp8": True}}, "policy": {"parallelism": {"tp_size": 2}}})
    with pytest.raises(ConfigError, match="tp_size > 1"):
        apply_float8(model, tp, runtime)
