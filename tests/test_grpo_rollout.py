"""GRPO rollouts and policy scoring: dynamic sampling, micro-batch weighting, log-probs on prompt + completion."""

from __future__ import annotations

import pytest
import torch
from media import write_clip

from physreason.config import EngineConfig, ModelConfig, SamplingConfig, VisionConfig
from physreason.data.mcq import MCQPrompt, PromptStream
from physreason.engines import Completion, Engine, GenerationResult
from physreason.models import loading
from physreason.models.family import read_vision_tokens
from physreason.models.inputs import concat_visuals, load_processor_params
from physreason.train.grpo import aggregation_count
from physreason.train.grpo_loss import policy_loss
from physreason.train.policy import PolicyScorer, build_completion_batch
from physreason.train.rollout import RolloutSettings, collect_rollouts

OPTIONS = {"A": "yes", "B": "no"}
SAMPLED = SamplingConfig(temperature=1.0, top_p=1.0, repetition_penalty=1.0, n=4, max_tokens=10)


class ScriptedEngine(Engine):
    """Answers by the prompt's id: 'right' prompts always correctly, 'wrong' never, 'mixed' half the time."""

    def generate(self, requests, sampling):
        results = []
        for request in requests:
            kind = request.request_id.split("-")[0]
            letters = {"right": ["A"] * sampling.n, "wrong": ["B"] * sampling.n}.get(kind, ["A", "B"] * (sampling.n // 2))
            completions = [Completion(f"<answer>{x}</answer>", [1, 2], [-0.5, -0.5], "stop") for x in letters]
            results.append(GenerationResult(request.request_id, [7, 8, 9], completions))
        return results

    def update_weights(self, named_tensors):
        raise AssertionError("rollouts never push weights")


def settings(groups: int, dynamic: bool) -> RolloutSettings:
    return RolloutSettings(
        groups_needed=groups, prompts_per_round=2, sampling=SAMPLED, vision=VisionConfig(),
        reward_weights={"accuracy": 1.0}, dynamic_sampling=dynamic,
    )


def prompts(*kinds: str) -> list[MCQPrompt]:
    return [MCQPrompt(f"{kind}-{i}", "Is it falling?", dict(OPTIONS), "A") for i, kind in enumerate(kinds)]


def test_dynamic_sampling_drops_equal_reward_groups_and_draws_more_prompts():
    stream = PromptStream(prompts("right", "mixed", "wrong", "mixed", "right", "mixed"), seed=0, shuffle=False,
                          shuffle_options=False)
    batch = collect_rollouts(ScriptedEngine(), stream, settings(3, dynamic=True), step=0)
    assert batch.num_groups == 3
    assert {s.prompt.id.split("-")[0] for s in batch.samples} == {"mixed"}
    assert batch.counts["groups_dropped"] == 3 and batch.counts["prompts_drawn"] == 6
    assert len(batch.scored) == 6 * 4  # every completion is scored and logged, dropped ones too
    advantages = torch.tensor([s.advantage for s in batch.samples]).reshape(3, 4)
    assert torch.allclose(advantages.sum(1), torch.zeros(3), atol=1e-6) and bool((advantages != 0).all())


def test_dynamic_sampling_gives_up_after_max_rounds_with_fewer_groups():
    stream = PromptStream(prompts("right", "wrong"), seed=0, shuffle=False, shuffle_options=False)
    rollout = settings(2, dynamic=True)
    rollout.max_rounds = 3
    batch = collect_rollouts(ScriptedEngine(), stream, rollout, step=0)
    assert batch.num_groups == 0 and batch.counts["rounds"] == 3 and stream.cursor == 6


def test_without_dynamic_sampling_equal_groups_stay_with_zero_advantage():
    stream = PromptStream(prompts("right", "mixed", "wrong"), seed=0, shuffle=False, shuffle_options=False)
    batch = collect_rollouts(ScriptedEngine(), stream, settings(3, dynamic=False), step=0)
    assert batch.num_groups == 3 and stream.cursor == 3
    by_group = {g: [s.advantage for s in batch.samples if s.group == g] for g in range(3)}
    assert by_group[0] == [0.0] * 4 and by_group[2] == [0.0] * 4 and any(by_group[1])


def test_each_rank_takes_its_own_slice_of_the_shared_prompt_order():
    kinds = ("mixed",) * 8
    seen = []
    for rank in range(2):
        stream = PromptStream(prompts(*kinds), seed=0, shuffle=False, shuffle_options=False)
        batch = collect_rollouts(ScriptedEngine(), stream, settings(2, dynamic=False), step=0, rank=rank, world_size=2)
        seen.append(sorted({s.prompt.id for s in batch.samples}))
        assert stream.cursor == 4
    assert seen == [["mixed-0", "mixed-1"], ["mixed-2", "mixed-3"]]


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_weighted_micro_batch_losses_add_up_to_the_whole_batch_loss(mode):
    generator = torch.Generator().manual_seed(0)
    logprobs = torch.randn(6, 5, generator=generator, dtype=torch.float64).requires_grad_()
    old = logprobs.detach() + 0.1 * torch.randn(6, 5, generator=generator, dtype=torch.float64)
    advantages = torch.randn(6, generator=generator, dtype=torch.float64)
    mask = torch.rand(6, 5, generator=generator) > 0.3
    mask[2] = False  # a sequence with no counted token
    whole, _ = policy_loss(logprobs, old, advantages, mask, agg_mode=mode, norm_length=8)
    (whole_grad,) = torch.autograd.grad(whole, logprobs)
    total = aggregation_count(mask, mode)
    pieces = 0.0
    for rows in (slice(0, 2), slice(2, 5), slice(5, 6)):
        loss, _ = policy_loss(logprobs[rows], old[rows], advantages[rows], mask[rows], agg_mode=mode, norm_length=8)
        pieces = pieces + loss * aggregation_count(mask[rows], mode) / total
    (pieces_grad,) = torch.autograd.grad(pieces, logprobs)
    assert float(pieces.detach()) == pytest.approx(float(whole.detach()), abs=1e-12)
    assert torch.allclose(pieces_grad, whole_grad, atol=1e-12)


def test_policy_scores_of_a_video_prompt_equal_the_model_with_its_own_mrope(tiny_model_dir, tmp_path):
    """Prompt + completion with a video: positions, pixels and the completion slice line up with transformers."""
    from physreason.engines.hf import HFEngine

    clip = write_clip(tmp_path / "a.mp4", n_frames=8)
    model_config = ModelConfig(model_name_or_path=str(tiny_model_dir), dtype="float32")
    engine = HFEngine(model_config, EngineConfig(batch_size=4))
    vision = VisionConfig(min_pixels=28 * 28 * 4, max_pixels=56 * 84, total_pixels=56 * 84 * 8)
    rollout = RolloutSettings(
        groups_needed=2, prompts_per_round=2, sampling=SAMPLED.model_copy(update={"n": 2}), vision=vision,
        reward_weights={"accuracy": 1.0}, processor_params=load_processor_params(str(tiny_model_dir)),
    )
    stream = PromptStream([MCQPrompt("p", "Is the square falling?", dict(OPTIONS), "A", videos=(clip,))], seed=0)
    batch = collect_rollouts(engine, stream, rollout, step=0)
    vision_tokens = read_vision_tokens(loading.load_model_config(model_config))
    completion_batch = build_completion_batch(batch.samples, 0, vision_tokens)
    model = loading.load_model(model_config, dtype=torch.float32).eval()
    with torch.no_grad():
        scores = PolicyScorer(model)(completion_batch, 0.7, diagnostics=True)
        inputs = completion_batch.model_batch
        ids = inputs.input_ids
        token_types = (ids == vision_tokens.image_token_id).long() + 2 * (ids == vision_tokens.video_token_id).long()
        pixels = concat_visuals([s.visuals for s in batch.samples]).model_kwargs()  # every row's own copy
        logits = model(input_ids=ids, attention_mask=inputs.attention_mask, mm_token_type_ids=token_types,
                       **pixels).logits  # [B, L, V]
    picked = logits.reshape(-1, logits.shape[-1])[completion_batch.positions]  # [B, T, V]: positions index the rows
    tokens = completion_batch.tokens[..., None]
    mask = completion_batch.mask
    expected_raw = torch.log_softmax(picked, -1).gather(-1, tokens)[..., 0]
    expected_tempered = torch.log_softmax(picked / 0.7, -1).gather(-1, tokens)[..., 0]
    assert mask.sum() == sum(len(s.completion.token_ids) for s in batch.samples)
    assert torch.allclose(scores.raw_logprobs[mask], expected_raw[mask], atol=1e-5)
    assert torch.allclose(scores.logprobs[mask], expected_tempered[mask], atol=1e-5)


def test_policy_scores_equal_the_engine_logprobs_on_text_prompts(tiny_model_dirs):
    from physreason.engines.hf import HFEngine

    model_config = ModelConfig(model_name_or_path=str(tiny_model_dirs["qwen2"]), dtype="float32")
    engine = HFEngine(model_config, EngineConfig(batch_size=8))
    rollout = settings(2, dynamic=False)
    stream = PromptStream([MCQPrompt(f"q{i}", "Which way" + "?" * i, dict(OPTIONS), "A") for i in range(2)], seed=0)
    batch = collect_rollouts(engine, stream, rollout, step=0)
    completion_batch = build_completion_batch(batch.samples, engine.pad_token_id, None)
    with torch.no_grad():
        scores = PolicyScorer(loading.load_model(model_config, dtype=torch.float32))(completion_batch, 1.0, True)
    gap = (scores.raw_logprobs - completion_batch.engine_logprobs).abs()[completion_batch.mask]
    assert float(gap.max()) < 1e-4
    assert torch.equal(scores.logprobs, scores.raw_logprobs)  # temperature 1: the same distribution


def test_a_nan_reward_stops_the_rollout_naming_the_reward_and_the_sample(monkeypatch):
    from physreason.errors import InputError
    from physreason.rewards import registry

    monkeypatch.setattr(registry, "_REWARDS", dict(registry._REWARDS))
    registry.register_reward("test_nan")(lambda completion, **sample: float("nan"))
    rollout = settings(1, dynamic=False)
    rollout.reward_weights = {"accuracy": 1.0, "test_nan": 0.1}
    stream = PromptStream(prompts("mixed"), seed=0, shuffle=False, shuffle_options=False)
    with pytest.raises(InputError, match=r"sample 'mixed-0': Reward 'test_nan' .* returned nan"):
        collect_rollouts(ScriptedEngine(), stream, rollout, step=0)


def test_reward_options_of_the_recipe_are_checked_and_shape_the_rollout_rewards():
    import json

    from physreason.config import load_config
    from physreason.errors import ConfigError
    from physreason.train.rollout import completion_rewards, rollout_settings

    bad = load_config(values={"grpo.reward_function": {"localization": 1.0},
                              "grpo.reward_options": {"localization": {"hit_weight": 1.5}}})  # fmt: skip
    with pytest.raises(ConfigError, match="hit_weight = 1.5"):
        rollout_settings(bad, groups_needed=1, prompts_per_round=1, max_rounds=1, processor_params=None)
    reference = json.dumps([{"box_2d": [100, 200, 300, 400], "label": "the ball"}])
    prompt = MCQPrompt("box-0", "Where is the ball?", {}, reference)
    half = json.dumps({"box_2d": [200, 200, 300, 400]})  # IoU 0.5
    weights = {"localization": 1.0}
    assert completion_rewards(half, prompt, weights, "reason2")["total"] == pytest.approx(0.5)
    hit = {"localization": {"hit_weight": 1.0}}
    assert completion_rewards(half, prompt, weights, "reason2", hit)["total"] == 1.0
