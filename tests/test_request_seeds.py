"""Request seeds (GenerationRequest.seed) as the vLLM engine passes them, without vLLM: its per-request SamplingParams
seed is the one the hf engine draws the request's completions from (engines.base.sampling_seed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from physreason import vllm_compat
from physreason.config import SamplingConfig
from physreason.engines.base import GenerationRequest, request_seed, sampling_seed
from physreason.engines.vllm import VLLMEngine

SAMPLED = SamplingConfig(temperature=0.8, top_p=0.9, n=2, max_tokens=16, seed=5)


def test_request_seeds_are_stable_and_tell_identities_apart():
    assert request_seed("mini", "12") == request_seed("mini", "12")
    assert len({request_seed("mini", "12"), request_seed("mini", "1", "2"), request_seed("mini", 12),
                request_seed("mini2", "12")}) == 4  # fmt: skip
    # 62 bits: completion k draws from seed + k, still a valid torch / vLLM seed
    assert all(0 <= request_seed("x", i) < 2**62 for i in range(100))
    request = GenerationRequest(messages=[], seed=request_seed("mini", "12"))
    assert sampling_seed(SAMPLED, request) != sampling_seed(SAMPLED.model_copy(update={"seed": 6}), request)


def test_sampling_kwargs_take_a_requests_own_seed_else_the_sampling_seed():
    assert vllm_compat.sampling_kwargs(SAMPLED, 16, [7])["seed"] == 5
    assert vllm_compat.sampling_kwargs(SAMPLED, 16, [7], seed=123)["seed"] == 123


class _Tokenizer:
    def __call__(self, texts, add_special_tokens=False):
        return SimpleNamespace(input_ids=[[1, 2, 3] for _ in texts])


class _LLM:
    def __init__(self):
        self.calls = []

    def generate(self, prompts, params, use_tqdm=False, lora_request=None):
        self.calls.append((prompts, params))
        return [SimpleNamespace(prompt_token_ids=[1, 2, 3], outputs=[]) for _ in prompts]


def _engine(monkeypatch) -> VLLMEngine:
    engine = VLLMEngine.__new__(VLLMEngine)  # no vLLM: rendering and the LLM are stand-ins
    engine._weights_loaded, engine.max_model_len, engine.stop_token_ids, engine._adapter = True, 64, {7}, None
    engine.tokenizer, engine.llm = _Tokenizer(), _LLM()
    monkeypatch.setattr(engine, "_render", lambda request: "text", raising=False)
    monkeypatch.setattr(engine, "_prompt", lambda request, ids: ({"prompt_token_ids": ids}, len(ids)), raising=False)
    monkeypatch.setattr(vllm_compat, "sampling_params", lambda *args, seed=None: {"seed": seed, "args": args})
    return engine


@pytest.mark.parametrize("sampling", [SAMPLED, SAMPLED.model_copy(update={"temperature": 0.0}), SAMPLED.model_copy(
    update={"seed": None})], ids=["seeded", "greedy", "unseeded"])  # fmt: skip
def test_the_vllm_engine_gives_each_seeded_request_its_own_seed(monkeypatch, sampling):
    engine = _engine(monkeypatch)
    plain = GenerationRequest(messages=[], request_id="plain")
    mine = GenerationRequest(messages=[], request_id="a", seed=request_seed("mini", "a"))
    other = GenerationRequest(messages=[], request_id="b", seed=request_seed("mini", "b"))
    engine.generate([plain, mine, other, plain], sampling)
    ((_, params),) = engine.llm.calls
    expected = [sampling_seed(sampling, r) for r in (plain, mine, other, plain)]
    if sampling is SAMPLED:
        assert expected[0] is None and None not in expected[1:3] and expected[1] != expected[2]
        assert [p["seed"] for p in params] == expected  # plain requests keep sampling.seed (seed=None here)
    else:  # greedy or without a sampling seed the request seeds are not used: one SamplingParams for the call
        assert expected == [None] * 4 and params["seed"] is None
