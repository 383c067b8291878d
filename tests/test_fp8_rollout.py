"""FP8 rollouts on CPU: block and per-channel quantization against a plain reference, and the weight push path."""

from __future__ import annotations

import math

import pytest
import torch

from physreason.config import Config, EngineConfig, LoraConfig, ModelConfig
from physreason.engines.factory import create_engine
from physreason.errors import ConfigError, PhysReasonError
from physreason.models.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    SCALE_SUFFIX,
    dequantize_fp8_blockwise,
    expected_fp8_layers,
    fp8_rollout_weights,
    is_fp8_weight,
    quantize_fp8_blockwise,
    quantize_fp8_per_channel,
    unquantized_linear_names,
    vllm_fp8_quantization_config,
)
from physreason.models.tiny import build_tiny_model, build_tiny_tokenizer
from physreason.train.weight_sync import PolicySync


def reference_blockwise(weight: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block by block with Python loops: scale_inv = amax / 448 (1 for zeros), q = fp8(clamp(W / scale_inv))."""
    rows, cols = weight.shape
    nr, nc = math.ceil(rows / block), math.ceil(cols / block)
    q = torch.empty(rows, cols, dtype=FP8_DTYPE)
    scales = torch.empty(nr, nc, dtype=torch.float32)
    for i in range(nr):
        for j in range(nc):
            tile = weight[i * block : (i + 1) * block, j * block : (j + 1) * block].to(torch.float32)
            amax = float(tile.abs().max())
            scale = amax / 448.0 if amax > 0 else 1.0
            scales[i, j] = scale
            q[i * block : (i + 1) * block, j * block : (j + 1) * block] = (
                (tile / torch.tensor(scale, dtype=torch.float32)).clamp(-448.0, 448.0).to(FP8_DTYPE)
            )
    return q, scales


@pytest.mark.parametrize("shape", [(256, 384), (130, 200), (5, 7), (128, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blockwise_quantization_equals_the_loop_reference(shape, dtype):
    torch.manual_seed(0)
    weight = (torch.randn(shape) * torch.logspace(-3, 1, shape[1])).to(dtype)  # columns of very different sizes
    q, scale_inv = quantize_fp8_blockwise(weight, block=128)
    ref_q, ref_scale = reference_blockwise(weight, 128)
    assert q.dtype == FP8_DTYPE and q.shape == weight.shape
    assert scale_inv.dtype == torch.float32 and scale_inv.shape == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    assert torch.equal(scale_inv, ref_scale)
    assert torch.equal(q.to(torch.float32), ref_q.to(torch.float32))


def test_blockwise_scales_map_each_blocks_largest_entry_to_448_and_bound_the_error():
    torch.manual_seed(1)
    weight = torch.randn(300, 260) * 0.02
    weight[:128, :128] *= 100.0  # one block far larger than its neighbours keeps its own scale
    q, scale_inv = quantize_fp8_blockwise(weight, block=128)
    assert float(q.to(torch.float32).abs().max()) == FP8_MAX
    assert scale_inv[0, 0] == pytest.approx(float(weight[:128, :128].abs().max()) / 448.0, rel=1e-6)
    assert scale_inv[0, 1] < scale_inv[0, 0] / 10
    restored = dequantize_fp8_blockwise(q, scale_inv, 128)
    expanded = scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)[:300, :260]
    # e4m3 keeps 3 mantissa bits: relative rounding error <= 2^-4 on normals, <= 2^-10 x scale on subnormals
    bound = weight.abs() * 2.0**-4 + expanded * 2.0**-10
    assert bool(((restored - weight).abs() <= bound + 1e-12).all())


def test_all_zero_blocks_get_scale_one_and_stay_zero():
    weight = torch.zeros(200, 300)
    weight[150:, 200:] = 3.0
    q, scale_inv = quantize_fp8_blockwise(weight)
    assert scale_inv.tolist() == [[1.0, 1.0, 1.0], [1.0, pytest.approx(3.0 / 448.0), pytest.approx(3.0 / 448.0)]]
    restored = dequantize_fp8_blockwise(q, scale_inv)
    assert torch.equal(restored[:128], torch.zeros(128, 300))
    assert torch.allclose(restored, weight)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("quantize", [quantize_fp8_blockwise, quantize_fp8_per_channel])
def test_non_finite_weights_are_refused_with_the_parameter_name(bad, quantize):
    weight = torch.ones(4, 4)
    weight[2, 3] = bad
    with pytest.raises(PhysReasonError, match="model.layers.0.mlp.up_proj.weight.*inf or NaN"):
        quantize(weight, name="model.layers.0.mlp.up_proj.weight")


def test_per_channel_scale_is_each_rows_amax_over_448():
    torch.manual_seed(2)
    weight = torch.randn(6, 50) * torch.tensor([1e-3, 1e-1, 1.0, 10.0, 0.0, 2.0]).unsqueeze(1)
    q, scale = quantize_fp8_per_channel(weight)
    assert scale.shape == (6, 1) and q.dtype == FP8_DTYPE
    amax = weight.abs().amax(dim=1, keepdim=True)
    expected = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    assert torch.equal(scale, expected)
    restored = q.to(torch.float32) * scale
    assert bool(((restored - weight).abs() <= weight.abs() * 2.0**-4 + scale * 2.0**-10 + 1e-12).all())
    assert torch.equal(restored[4], torch.zeros(50))


@pytest.fixture(scope="module")
def tiny_models():
    tokenizer = build_tiny_tokenizer()
    return {kind: build_tiny_model(kind, tokenizer) for kind in ("qwen2_5_vl", "qwen3_vl")}


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl"])
def test_only_the_language_models_block_linears_are_fp8(tiny_models, kind):
    model = tiny_models[kind]
    chosen = [name for name, _ in model.named_parameters() if is_fp8_weight(name)]
    layers = model.config.get_text_config().num_hidden_layers
    assert len(chosen) == 7 * layers  # q, k, v, o, gate, up, down
    assert not [name for name in chosen if "visual" in name or "lm_head" in name or "embed" in name]
    assert not [name for name in chosen if name.endswith("bias")]
    linears = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    ignored = unquantized_linear_names(linears)
    assert "lm_head" in ignored and any("visual" in name for name in ignored)
    assert set(ignored) | {name.removesuffix(".weight") for name in chosen} == set(linears)
    config = vllm_fp8_quantization_config(ignored)
    assert config["weight_block_size"] == [128, 128] and config["quant_method"] == "fp8"
    assert config["ignored_layers"] == sorted(ignored)
    assert expected_fp8_layers(layers) == 4 * layers


class RecordingEngine:
    """Stands in for the rollout engine: keeps what each update_weights call received."""

    serves_adapters = False
    quantization = "fp8"

    def __init__(self) -> None:
        self.pushes: list[dict[str, torch.Tensor]] = []

    def update_weights(self, named_tensors):
        self.pushes.append({name: tensor.clone() for name, tensor in named_tensors})


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl"])
def test_fp8_push_sends_quantized_language_linears_with_scales_and_the_rest_in_the_model_dtype(tiny_models, kind):
    model = tiny_models[kind]
    engine = RecordingEngine()
    PolicySync(engine, model, None, LoraConfig(), torch.bfloat16, "fp8").push()
    received = engine.pushes[0]
    params = dict(model.named_parameters())
    assert set(received) == set(params) | {n + SCALE_SUFFIX for n in params if is_fp8_weight(n)}
    for name, tensor in params.items():
        got = received[name]
        assert got.shape == tensor.shape
        if is_fp8_weight(name):
            scale_inv = received[name + SCALE_SUFFIX]
            assert got.dtype == FP8_DTYPE
            assert scale_inv.shape == (math.ceil(tensor.shape[0] / 128), math.ceil(tensor.shape[1] / 128))
            expected_q, expected_scale = quantize_fp8_blockwise(tensor.detach().to(torch.bfloat16))
            assert torch.equal(scale_inv, expected_scale)
            assert torch.equal(got.to(torch.float32), expected_q.to(torch.float32))
            restored = dequantize_fp8_blockwise(got, scale_inv)
            assert torch.allclose(restored, tensor.detach(), rtol=2.0**-3, atol=float(scale_inv.max()) * 2.0**-9)
        else:
            assert got.dtype == torch.bfloat16
            assert torch.equal(got, tensor.detach().to(torch.bfloat16))


def test_without_quantization_the_push_is_unchanged(tiny_models):
    model = tiny_models["qwen2_5_vl"]
    engine = RecordingEngine()
    PolicySync(engine, model, None, LoraConfig(), torch.bfloat16).push()
    assert set(engine.pushes[0]) == {name for name, _ in model.named_parameters()}
    assert {t.dtype for t in engine.pushes[0].values()} == {torch.bfloat16}


def test_the_quantized_stream_is_drawn_one_tensor_at_a_time():
    drawn = []

    def source():
        for i in range(3):
            drawn.append(i)
            yield f"model.language_model.layers.{i}.mlp.down_proj.weight", torch.ones(4, 4)

    stream = fp8_rollout_weights(source())
    name, _ = next(stream)
    assert drawn == [0] and name.endswith("down_proj.weight")
    assert next(stream)[0].endswith("down_proj.weight" + SCALE_SUFFIX) and drawn == [0]


def test_fp8_rollouts_need_the_vllm_engine(tmp_path):
    with pytest.raises(ConfigError, match="rollout.quantization = 'fp8' runs on the vLLM engine"):
        create_engine(ModelConfig(model_name_or_path=str(tmp_path)), EngineConfig(backend="hf"), quantization="fp8")


def test_fp8_rollouts_turn_on_truncated_importance_sampling_unless_told_otherwise():
    from physreason.train.grpo import UpdateSettings

    assert UpdateSettings.from_config(Config()).tis_cap is None
    fp8 = Config.model_validate({"rollout": {"quantization": "fp8"}})
    assert fp8.tis_enabled and UpdateSettings.from_config(fp8).tis_cap == 2.0
    off = Config.model_validate({"rollout": {"quantization": "fp8"}, "grpo": {"use_tis": False}})
    assert UpdateSettings.from_config(off).tis_cap is None
    on = Config.model_validate({"grpo": {"use_tis": True, "tis_imp_ratio_cap": 3.0}})
    assert UpdateSettings.from_config(on).tis_cap == 3.0
    with pytest.raises(ValueError, match="rollout.sampling_config.temperature = 0.7: set it to 1.0, or grpo.use_tis"):
        Config.model_validate({"rollout": {"quantization": "fp8", "sampling_config": {"temperature": 0.7}}})


def test_disaggregated_grpo_refuses_fp8_rollouts():
    from physreason.distributed.controller import Controller

    config = Config.model_validate({"rollout": {"quantization": "fp8"}, "grpo": {"mode": "disaggregated"}})
    with pytest.raises(ConfigError, match="colocated GRPO only"):
        Controller(config)


def test_an_fp8_engine_refuses_to_generate_before_the_first_push():
    from physreason.config import SamplingConfig
    from physreason.engines.base import GenerationRequest
    from physreason.engines.vllm import VLLMEngine

    engine = VLLMEngine.__new__(VLLMEngine)  # the check runs before any vLLM call
    engine._weights_loaded = False
    request = GenerationRequest(messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(PhysReasonError, match="push the policy's weights"):
        engine.generate([request], SamplingConfig())


def test_an_fp8_engine_refuses_language_weights_that_were_not_quantized():
    from physreason.engines.vllm import _check_fp8_push

    name = "model.language_model.layers.0.mlp.up_proj.weight"
    q, scale_inv = quantize_fp8_blockwise(torch.ones(128, 128))
    _check_fp8_push([(name, q), (name + SCALE_SUFFIX, scale_inv), ("lm_head.weight", torch.ones(4, 4))])
    with pytest.raises(PhysReasonError, match="without FP8 quantization.*up_proj"):
        _check_fp8_push([(name, torch.ones(128, 128, dtype=torch.bfloat16))])
    with pytest.raises(PhysReasonError, match="without FP8 quantization"):
        _check_fp8_push([(name, q)])  # its scale missing


def test_fp8_rollouts_refuse_shapes_whose_fused_shards_split_a_block():
    """vLLM fuses q/k/v and gate/up with one scale per 128 x 128 block: k/v of 64 rows failed deep inside vLLM's
    weight loader on an H100 (gpu_check, 2026-11-26); the engine now refuses such shapes before starting vLLM."""
    from types import SimpleNamespace

    from physreason.engines.vllm import VLLMEngine
    from physreason.models.fp8 import fp8_block_misfits

    tiny = SimpleNamespace(num_attention_heads=4, head_dim=32, hidden_size=128, num_key_value_heads=2, intermediate_size=256)
    assert fp8_block_misfits(tiny) == ["k_proj / v_proj has 64 output rows, not a multiple of 128"]
    wider = SimpleNamespace(num_attention_heads=8, head_dim=32, hidden_size=256, num_key_value_heads=4, intermediate_size=512)
    assert fp8_block_misfits(wider) == []
    # Qwen2.5-VL-3B's decoder: 16 heads of 128 (no head_dim key), 2 key/value heads, 11,008 MLP rows
    qwen = SimpleNamespace(num_attention_heads=16, hidden_size=2048, num_key_value_heads=2, intermediate_size=11008)
    assert fp8_block_misfits(qwen) == []
    assert fp8_block_misfits(qwen, tensor_parallel_size=2) == []
    assert fp8_block_misfits(qwen, tensor_parallel_size=4) == [
        "k_proj / v_proj has 256 output rows / 4 ranks, not a multiple of 128",
        "gate_proj / up_proj has 11008 output rows / 4 ranks, not a multiple of 128",
    ]

    engine = VLLMEngine.__new__(VLLMEngine)  # the refusal comes before any vLLM call
    engine.quantization = "fp8"
    engine.hf_config = SimpleNamespace(get_text_config=lambda: tiny)
    engine.engine_config = EngineConfig(backend="vllm")
    engine.model_config = ModelConfig(model_name_or_path="/models/tiny")
    with pytest.raises(PhysReasonError, match="/models/tiny: k_proj / v_proj has 64 output rows.*quantization = 'none'"):
        engine._quantized_kwargs()


def test_an_fp8_kv_cache_needs_the_vllm_engine(tmp_path):
    with pytest.raises(ConfigError, match="engine.kv_cache_dtype = 'fp8' runs on the vLLM engine.*kv_cache_dtype = 'auto'"):
        create_engine(ModelConfig(model_name_or_path=str(tmp_path)), EngineConfig(backend="hf", kv_cache_dtype="fp8"))
