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
    float8_all_gather,
    float8_linear_filter,
    precompute_scales_after_steps,
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

    def converter(m, recipe, all_gather, module_filter_fn, emulate):
        seen.extend(name for name, module in m.named_modules() if module_filter_fn(module, name))

    chosen = convert_to_float8(model, "rowwise", convert=converter, skip_small=False)
    assert chosen == seen
    layers = model.config.get_text_config().num_hidden_layers
    assert len(chosen) == 7 * layers
    assert all(".layers." in name and "visual" not in name for name in chosen)
    assert "lm_head" not in chosen


def test_a_model_too_small_for_float8_to_pay_converts_nothing(tokenizer):
    model = build_tiny_model("qwen2_5_vl", tokenizer)
    calls = []
    assert convert_to_float8(model, "tensorwise", convert=lambda *a: calls.append(a)) == []
    assert calls == []  # torchao is not even called: the model trains in bf16


def test_a_linear_with_a_side_not_multiple_of_16_stays_as_it_is():
    up = "model.language_model.layers.0.mlp.up_proj"
    assert float8_linear_filter(up, torch.nn.Linear(64, 48), skip_small=False)
    assert not float8_linear_filter(up, torch.nn.Linear(64, 40), skip_small=False)
    assert not float8_linear_filter("model.visual.blocks.0.mlp.up_proj", torch.nn.Linear(64, 64), skip_small=False)
    assert not float8_linear_filter("lm_head", torch.nn.Linear(64, 64), skip_small=False)
    assert not float8_linear_filter("model.language_model.embed_tokens", torch.nn.Embedding(64, 64), skip_small=False)
    big = torch.nn.Linear(4096, 12296, device="meta")  # large enough, but 12,296 is not a multiple of 16
    assert not float8_linear_filter(up, big, "tensorwise")


def _block(hidden: int, intermediate: int, kv: int) -> dict[str, torch.nn.Linear]:
    """One decoder block's linears (on the meta device: shapes only)."""
    sides = {"q_proj": (hidden, hidden), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (hidden, hidden),
             "gate_proj": (hidden, intermediate), "up_proj": (hidden, intermediate), "down_proj": (intermediate, hidden)}
    return {leaf: torch.nn.Linear(i, o, device="meta") for leaf, (i, o) in sides.items()}


QWEN25_VL_3B = (2048, 11008, 256)
QWEN3_VL_8B = (4096, 12288, 1024)


@pytest.mark.parametrize(
    ("shape", "recipe", "converted"),
    [
        (QWEN25_VL_3B, "tensorwise", {"q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}),
        (QWEN25_VL_3B, "rowwise", {"gate_proj", "up_proj"}),  # rowwise's per-row scales need wider outputs
        (QWEN3_VL_8B, "tensorwise", {"q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}),
        (QWEN3_VL_8B, "rowwise", {"q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}),
    ],
)
def test_the_filter_keeps_the_layers_too_small_to_pay_in_bf16(shape, recipe, converted):
    """torchao's H100 thresholds: GQA's narrow k_proj / v_proj never pay; rowwise also skips the 3B shape's N = 2048."""
    block = _block(*shape)
    chosen = {leaf for leaf, linear in block.items()
              if float8_linear_filter(f"model.language_model.layers.3.self_attn.{leaf}", linear, recipe)}  # fmt: skip
    assert chosen == converted
    # with skip_small off every side multiple of 16 converts
    assert all(float8_linear_filter(f"model.layers.0.{leaf}", m, recipe, skip_small=False) for leaf, m in block.items())


def test_float8_all_gather_is_tensorwise_over_more_than_one_rank_only():
    assert float8_all_gather("tensorwise", 2) and float8_all_gather("tensorwise", 8)
    assert not float8_all_gather("tensorwise", 1)  # a one-rank "all-gather" is a copy: the compiled block casts
    assert not float8_all_gather("rowwise", 8)  # a scale per row cannot be cast shard by shard
    with pytest.raises(ConfigError, match="needs one scale per weight"):
        convert_to_float8(torch.nn.Linear(16, 16), "rowwise", all_gather=True, convert=lambda *a: None)


def test_scales_are_precomputed_after_every_optimizer_step_and_only_then():
    module = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    seen = []  # the weight each precompute saw: the stepped one
    handle = precompute_scales_after_steps(optimizer, module, precompute=lambda m: seen.append(m.weight.detach().clone()))
    for _ in range(3):
        module(torch.ones(2, 4)).sum().backward()
        assert len(seen) == _  # not before the step
        optimizer.step()
        assert torch.equal(seen[-1], module.weight.detach())  # after it, on the new weights
        optimizer.zero_grad()
    assert len(seen) == 3
    handle.remove()
    optimizer.step()
    assert len(seen) == 3


def test_an_unknown_recipe_is_a_config_error(tokenizer):
    with pytest.raises(ConfigError, match="quant_recipe = 'blockwise'"):
        convert_to_float8(build_tiny_model("qwen2", tokenizer), "blockwise", convert=lambda *a: None)


@pytest.mark.parametrize(("recipe", "fsdp"), [("rowwise", False), ("tensorwise", True)])
def test_torchao_conversion_keeps_every_state_dict_key_and_dtype(tokenizer, recipe, fsdp):
    pytest.importorskip("torchao")
    model = build_tiny_model("qwen2_5_vl", tokenizer)
    before = {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}
    chosen = convert_to_float8(model, recipe, all_gather=fsdp, skip_small=False)
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
    config = Config.model_validate({"train": {"fp8": {"enable_fp8": True, "skip_small_linears": False}}})
    runtime = Runtime(rank=0, world_size=1, device=torch.device("cpu"))
    with emulated_float8_on_cpu(), caplog.at_level("WARNING", logger="physreason.train.build"):
        check_float8_support(torch.device("cpu"))
        model = build_tiny_model("qwen2", tokenizer)
        apply_float8(model, config, runtime)
    # the start-up says float8 cannot pay on matmuls this small, instead of slowing down silently
    assert "float8 is expected to be slower than bf16 here" in caplog.text
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


@pytest.mark.parametrize(
    ("recipe", "distributed", "world", "gathers"),
    [("tensorwise", True, 2, True), ("tensorwise", True, 1, False), ("tensorwise", False, 1, False),
     ("rowwise", True, 2, False)],
)
def test_apply_float8_all_gathers_in_float8_only_for_tensorwise_over_two_ranks_or_more(
    tokenizer, monkeypatch, recipe, distributed, world, gathers
):
    import physreason.models.float8 as float8

    calls = []
    monkeypatch.setattr(float8, "check_float8_support", lambda device: None)
    monkeypatch.setattr(float8, "_torchao_convert", lambda model, r, all_gather, f, emulate: calls.append(all_gather))
    config = Config.model_validate({"train": {"fp8": {"enable_fp8": True, "quant_recipe": recipe,
                                                      "skip_small_linears": False}}})  # fmt: skip
    runtime = Runtime(rank=0, world_size=world, device=torch.device("cpu"), distributed=distributed)
    assert apply_float8(build_tiny_model("qwen2", tokenizer), config, runtime) is gathers
    assert calls == [gathers]
    # nothing large enough to convert: no float8 all-gather, so no scales to precompute
    small = config.model_copy(deep=True)
    small.train.fp8.skip_small_linears = True
    assert apply_float8(build_tiny_model("qwen2", tokenizer), small, runtime) is False


@pytest.mark.parametrize("all_gather", [True, False])
def test_the_build_converts_before_fsdp2_and_compile_and_precomputes_scales_only_with_float8_all_gather(
    tokenizer, monkeypatch, all_gather
):
    """torchtitan's order: float8 conversion of the plain model first, then FSDP2 and the per-block compile; the
    precompute hook goes on the optimizer exactly when the weights all-gather in float8."""
    import physreason.models.float8 as float8
    import physreason.train.build as build
    from physreason.models import loading
    from physreason.train.model import CausalLMLoss

    events = []
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: build_tiny_model("qwen2_5_vl", tokenizer))

    def convert(model, config, runtime):
        assert not any(type(m).__name__.startswith("FSDP") for m in model.modules())  # not wrapped yet
        events.append("convert")
        return all_gather

    def record(name, real):
        def call(*args, **kwargs):
            events.append(name)
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(build, "apply_float8", convert)
    monkeypatch.setattr(build, "shard", record("shard", build.shard))
    monkeypatch.setattr(build, "compile_blocks", record("compile", lambda model, **parts: None))
    monkeypatch.setattr(build, "build_optimizer", record("optimizer", build.build_optimizer))
    monkeypatch.setattr(float8, "precompute_scales_after_steps", record("precompute after steps", lambda o, m: None))
    config = Config.model_validate({"train": {"fp8": {"enable_fp8": True}, "compile": True}})
    runtime = Runtime(rank=0, world_size=1, device=torch.device("cpu"))
    build.build_training_model(config, runtime, CausalLMLoss, 4)
    wanted = ["convert", "shard", "compile", "optimizer"] + (["precompute after steps"] if all_gather else [])
    assert events == wanted


def test_compile_blocks_leaves_room_for_every_compiled_variant_of_the_block(tokenizer, monkeypatch):
    """checkpointed or not, static then dynamic length, training and no-grad: 7 variants on a CPU trace; past dynamo's
    default limit of 8 the blocks would silently run eagerly."""
    from physreason.models import loading
    from physreason.train.build import BLOCK_RECOMPILE_LIMIT, compile_blocks

    # config.patch, not monkeypatch: monkeypatch's undo left recompile_limit deleted from dynamo's config (an alias
    # there), so a later test's torch.compile in the same process failed
    with torch._dynamo.config.patch(recompile_limit=8):
        model = build_tiny_model("qwen2", tokenizer)
        compile_blocks(model)  # compiles lazily, at the first call
        assert torch._dynamo.config.recompile_limit == BLOCK_RECOMPILE_LIMIT >= 32
        assert all(block._compiled_call_impl is not None for block in loading.decoder_layers(model))


def test_torchaos_precompute_sets_the_scale_of_every_float8_all_gather_weight_after_a_step(tokenizer, tmp_path):
    """The real torchao path on physreason's FSDP2 layout (a gloo world of one, float8 all-gather forced on): after
    optimizer.step() every converted weight's shard carries the scale of its new weights, float8 max / amax."""
    pytest.importorskip("torchao")
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from physreason.models import parallelize
    from physreason.train.model import CausalLMLoss

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        model = build_tiny_model("qwen2", tokenizer)
        chosen = convert_to_float8(model, "tensorwise", all_gather=True, emulate=True, skip_small=False)
        wrapper = CausalLMLoss(model)
        parallelize.apply_fsdp2(wrapper, model, init_device_mesh("cpu", (1,)), torch.float32, torch.float32)
        optimizer = torch.optim.SGD(wrapper.parameters(), lr=0.5)
        precompute_scales_after_steps(optimizer, wrapper)
        modules = dict(model.named_modules())
        shards = [modules[name].weight._local_tensor for name in chosen]
        assert all(s._precomputed_scale is None for s in shards)
        for p in wrapper.parameters():
            p.grad = torch.ones_like(p)
        optimizer.step()
        for shard in shards:
            amax = shard._tensor.abs().max().clamp(min=1e-12).double()
            wanted = (torch.finfo(torch.float8_e4m3fn).max / amax).float()
            assert torch.allclose(shard._precomputed_scale, wanted)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_float8_layers_train_on_the_one_rank_cast_path(tokenizer, recipe):
    """One process runs float8 on the cast path (build.compute_cast): each float8 layer gets the bf16 copy of its
    float32 master for the forward, and the master gets a float32 gradient back; outside the step the slots hold the
    float32 Parameters again. Emulated float8 on CPU."""
    pytest.importorskip("torchao")
    from torch import nn

    from physreason.models.parallelize import apply_compute_cast

    config = Config.model_validate({"train": {"fp8": {"enable_fp8": True, "quant_recipe": recipe,
                                                      "skip_small_linears": False}}})  # fmt: skip
    runtime = Runtime(rank=0, world_size=1, device=torch.device("cpu"))
    torch.manual_seed(0)
    model = build_tiny_model("qwen2", tokenizer)
    with emulated_float8_on_cpu():
        check_float8_support(torch.device("cpu"))
        apply_float8(model, config, runtime)
    converted = [m for m in model.modules() if type(m).__name__ == "Float8Linear"]
    assert converted
    seen = []
    converted[0].register_forward_pre_hook(lambda module, args: seen.append(module.weight.dtype))

    class Loss(nn.Module):  # the wrapper the trainer casts around the model (embedding, norm, lm_head)
        def __init__(self, inner):
            super().__init__()
            self.model = inner

        def forward(self, ids):
            return self.model(input_ids=ids, labels=ids).loss

    wrapper = Loss(model)
    apply_compute_cast(wrapper, model, torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    loss = wrapper(ids)
    loss.backward()
    assert torch.isfinite(loss) and seen == [torch.bfloat16]
    for module in converted:
        assert type(module.weight) is nn.Parameter and module.weight.dtype == torch.float32
        assert module.weight.grad is not None and module.weight.grad.dtype == torch.float32
        assert module.weight.grad.abs().sum() > 0
