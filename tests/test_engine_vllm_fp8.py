"""FP8 rollouts on a real vLLM engine (GPU): block-FP8 layers, pushes quantized by the policy path, log-probs close
to the bf16 model's. Run on a GPU machine with vLLM: pytest -m "gpu and vllm" tests/test_engine_vllm_fp8.py."""

from __future__ import annotations

import pytest
import torch

from physreason.config import EngineConfig, LoraConfig, ModelConfig, SamplingConfig
from physreason.engines.base import GenerationRequest
from physreason.errors import PhysReasonError
from physreason.models.fp8 import expected_fp8_layers
from physreason.models.tiny import save_tiny_model
from physreason.train.weight_sync import PolicySync

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]
vllm = pytest.importorskip("vllm")
if not torch.cuda.is_available():
    pytest.skip("FP8 rollouts need a CUDA GPU", allow_module_level=True)

GREEDY = SamplingConfig(temperature=1.0, top_p=1.0, repetition_penalty=1.0, max_tokens=16, seed=0)
REQUEST = GenerationRequest(messages=[{"role": "user", "content": "Is the ball falling?"}], request_id="text")


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def kind_and_folder(request, tmp_path_factory):
    # scale 2: every language-model linear side is a multiple of 128 (q 256, k/v 128, hidden 256, mlp 512)
    folder = save_tiny_model(request.param, tmp_path_factory.mktemp(request.param), scale=2)
    return request.param, folder


@pytest.fixture(scope="module")
def fp8_engine(kind_and_folder):
    from physreason.engines.vllm import VLLMEngine

    _, folder = kind_and_folder
    model = ModelConfig(model_name_or_path=str(folder), dtype="bfloat16", model_max_length=1024)
    return VLLMEngine(model, EngineConfig(enforce_eager=True, gpu_memory_utilization=0.3), quantization="fp8")


def policy(folder, seed: int) -> torch.nn.Module:
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    if seed:
        torch.manual_seed(seed)
        for parameter in model.parameters():
            parameter.data.add_(0.05 * torch.randn_like(parameter))
    return model


def hf_logprobs(model, prompt_ids: list[int], token_ids: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt_ids + token_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float()  # [T, V]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(token_ids).unsqueeze(-1))[:, 0]


def test_only_the_language_models_linears_are_fp8(fp8_engine):
    from physreason import vllm_compat

    names = vllm_compat.fp8_module_names(fp8_engine.llm)
    assert len(names) == expected_fp8_layers(fp8_engine.hf_config.get_text_config().num_hidden_layers)
    assert not [n for n in names if "visual" in n or "lm_head" in n]


def test_each_push_replaces_the_weights_and_log_probs_follow_the_policy(fp8_engine, kind_and_folder):
    _, folder = kind_and_folder
    for seed in (0, 1):  # the second push must replace the first in place
        model = policy(folder, seed)
        PolicySync(fp8_engine, model, None, LoraConfig(), torch.bfloat16, "fp8").push()
        result = fp8_engine.generate([REQUEST], GREEDY)[0]
        assert result.error is None
        completion = result.completions[0]
        reference = hf_logprobs(model, result.prompt_token_ids, completion.token_ids)
        gap = (torch.tensor(completion.logprobs) - reference).abs().mean()
        assert float(gap) < 0.05, f"seed {seed}: mean |log-prob gap| {float(gap):.4f}"


def test_a_bf16_push_into_fp8_layers_is_refused(fp8_engine, kind_and_folder):
    _, folder = kind_and_folder
    model = policy(folder, 0)
    with pytest.raises(PhysReasonError, match="without FP8 quantization"):
        fp8_engine.update_weights((n, p.detach().to(torch.bfloat16)) for n, p in model.named_parameters())
