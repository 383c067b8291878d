"""Engine.close(): the model is freed, a closed engine refuses work, `with` closes it, and after a vLLM engine's
close a second one starts in the same process (the `vllm` test runs in the vLLM CI stage: make test-vllm).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from physreason.config import EngineConfig, ModelConfig, SamplingConfig
from physreason.engines.base import GenerationRequest
from physreason.engines.hf import HFEngine
from physreason.errors import PhysReasonError

GREEDY = SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_tokens=4)
HELLO = GenerationRequest(
    messages=[{"role": "user", "content": [{"type": "text", "text": "Say hello."}]}], request_id="0"
)


def build(model_dir) -> HFEngine:
    return HFEngine(ModelConfig(model_name_or_path=str(model_dir), dtype="float32"), EngineConfig())


def assert_refuses_work(engine) -> None:
    """generate, update_weights and load_adapter of a closed engine each raise the error that names it."""
    for work in (
        lambda: engine.generate([HELLO], GREEDY),
        lambda: engine.update_weights([("lm_head.weight", torch.zeros(1))]),
        lambda: engine.load_adapter("adapter"),
    ):
        with pytest.raises(PhysReasonError, match=f"this {type(engine).__name__} was closed"):
            work()


def test_a_closed_hf_engine_frees_its_model_and_refuses_work(tiny_model_dir):
    engine = build(tiny_model_dir)
    assert engine.generate([HELLO], GREEDY)[0].completions[0].token_ids
    model = weakref.ref(engine.model)
    engine.close()
    engine.close()  # a second close is a no-op
    gc.collect()
    assert model() is None  # nothing else held the weights
    assert_refuses_work(engine)


def test_the_with_block_closes_the_engine_on_exit_and_on_an_error(tiny_model_dir):
    with build(tiny_model_dir) as engine:
        assert engine.generate([HELLO], GREEDY)[0].error is None
    with pytest.raises(PhysReasonError, match="closed"):
        engine.generate([HELLO], GREEDY)

    with pytest.raises(RuntimeError, match="mid-run"), build(tiny_model_dir) as failing:  # the error is not swallowed
        raise RuntimeError("mid-run")
    with pytest.raises(PhysReasonError, match="closed"):
        failing.generate([HELLO], GREEDY)


@pytest.mark.vllm
def test_after_a_vllm_engine_closes_a_second_one_in_the_process_answers_the_same(tiny_model_dir):
    pytest.importorskip("vllm")
    from vllm.distributed import parallel_state

    from physreason.engines.vllm import VLLMEngine

    def build() -> VLLMEngine:
        return VLLMEngine(
            ModelConfig(model_name_or_path=str(tiny_model_dir), dtype="float32", model_max_length=512),
            EngineConfig(enforce_eager=True),
        )

    # Engines of earlier tests, dropped without close, shut vLLM's process groups down whenever they are collected
    # (vLLM 0.32's finalizer): collected now, not under the engines below.
    gc.collect()
    first = build()
    before = first.generate([HELLO], GREEDY)[0]
    (model,) = first.llm.apply_model(weakref.ref)  # the in-process worker's model
    kept = first.llm  # a caller's reference: close stops the engine core all the same, not only when collected
    first.close()
    first.close()  # a second close is a no-op
    gc.collect()
    assert model() is None  # weights and KV cache gone with the engine core
    assert not parallel_state.model_parallel_is_initialized() and not torch.distributed.is_initialized()
    del kept
    assert_refuses_work(first)

    with build() as second:
        after = second.generate([HELLO], GREEDY)[0]
    assert after.error is None and before.error is None
    assert after.prompt_token_ids == before.prompt_token_ids
    assert after.completions[0].token_ids == before.completions[0].token_ids
    assert after.completions[0].logprobs == pytest.approx(before.completions[0].logprobs, abs=1e-5)
    with pytest.raises(PhysReasonError, match="closed"):
        second.generate([HELLO], GREEDY)


@pytest.mark.vllm
def test_shutdown_llm_lets_go_of_the_compiled_model_and_every_layers_kv_cache(monkeypatch):
    """The holders that kept 42 GiB after close on an H200 with vLLM 0.26 (the engine's weakref.finalize held the
    model, the model's attention layers their KV cache), on stand-ins: the finalizer runs once, each layer's cache is
    cut (found in the forward context before the shutdown clears it), the CUDA graph pool handle is forgotten."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from vllm.platforms import current_platform

    from physreason import vllm_compat

    calls = []
    tensor_layer, list_layer = SimpleNamespace(kv_cache=torch.zeros(4, 2)), SimpleNamespace(kv_cache=[torch.zeros(4)])
    context = {"attn.0": tensor_layer, "attn.1": list_layer, "mlp.0": SimpleNamespace()}
    class Anchor:  # what a weakref.finalize watches (vLLM 0.26: the LLMEngine)
        pass

    anchor = Anchor()
    engine = SimpleNamespace(
        vllm_config=SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context=context)),
        engine_core=SimpleNamespace(shutdown=lambda: (calls.append("shutdown"), context.clear())),
        _finalizer=weakref.finalize(anchor, calls.append, "finalizer"),
    )
    monkeypatch.setattr(type(current_platform), "_global_graph_pool", ("pool", 1), raising=False)

    vllm_compat.shutdown_llm(SimpleNamespace(llm_engine=engine))
    assert calls == ["shutdown", "finalizer"]
    assert tensor_layer.kv_cache.numel() == 0 and tensor_layer.kv_cache.dtype == torch.float32
    assert list_layer.kv_cache == []
    assert not hasattr(context.get("mlp.0", SimpleNamespace()), "kv_cache")
    assert type(current_platform)._global_graph_pool is None
    del anchor
    gc.collect()
    assert calls == ["shutdown", "finalizer"]  # the finalizer ran once, not again when its object went
