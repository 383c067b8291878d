"""Packed GRPO policy rows (a prompt once, then its completions) and micro-batches sized by tokens.

The reference is the padded path, one row per completion: packed rows must give the same log-probs and the
same gradient of every parameter, and an update over token-sized packed micro-batches the same loss, metrics
and weights as one over count-sized padded micro-batches.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from test_policy_shared_vision import group, image, load, video

from physreason.config import ModelConfig
from physreason.errors import ConfigError
from physreason.models import loading, packed_attention, parallelize
from physreason.models.family import VisionTokens, read_vision_tokens
from physreason.models.inputs import encode_visuals
from physreason.train.grpo import UpdateSettings, update_policy
from physreason.train.policy import CompletionBatch, PolicyScorer, build_completion_batch, build_micro_batches
from physreason.train.runtime import init_runtime


@pytest.fixture(scope="module")
def vision(tiny_model_dir) -> VisionTokens:
    return read_vision_tokens(loading.load_model_config(ModelConfig(model_name_or_path=str(tiny_model_dir))))


def scores_and_grads(model, batch: CompletionBatch, weights: torch.Tensor, packed_attention: str = "mask"):
    model.zero_grad(set_to_none=True)
    logprobs = PolicyScorer(model, packed_attention=packed_attention)(batch, 0.7).logprobs  # [B, T]
    (logprobs * weights * batch.mask).sum().backward()
    return logprobs.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_packed_equals_padded(model, samples, vision, spans: bool = True) -> CompletionBatch:
    """`spans`: the packed rows' attention must take packed_attention's way (their spans, not the [L, L] mask), in
    every decoder layer's forward (and again in a recomputed one); False: the model's own kernel with the mask."""
    packed = build_completion_batch(samples, 0, vision, pack=True)
    padded = build_completion_batch(samples, 0, vision)
    assert torch.equal(packed.tokens, padded.tokens) and torch.equal(packed.mask, padded.mask)
    weights = torch.randn(padded.mask.shape, generator=torch.Generator().manual_seed(1))  # [B, T]
    with mock.patch.object(packed_attention, "_varlen", wraps=packed_attention._varlen) as calls:
        got, got_grads = scores_and_grads(model, packed, weights, "spans" if spans else "mask")
    layers = model.config.get_text_config().num_hidden_layers
    # one variable-length call for the whole batch in every layer's forward (and its recomputation)
    assert (calls.call_count >= layers) if spans else calls.call_count == 0
    with mock.patch.object(packed_attention, "_varlen", wraps=packed_attention._varlen) as calls:
        want, want_grads = scores_and_grads(model, padded, weights, "spans" if spans else "mask")
    assert calls.call_count == 0  # padded rows carry no spans: transformers' sdpa as before
    mask = padded.mask
    assert torch.allclose(got[mask], want[mask], rtol=0, atol=2e-5)
    assert set(got_grads) == set(want_grads) == {name for name, p in model.named_parameters() if p.requires_grad}
    for name, want_grad in want_grads.items():
        scale = float(want_grad.abs().max()) + 1e-12
        assert float((got_grads[name] - want_grad).abs().max()) <= 1e-4 * scale, name
    return packed


@pytest.mark.parametrize("checkpointing", [False, True])
def test_packed_video_groups_match_padded_rows_in_scores_and_every_gradient(tiny_model_dir, vision, checkpointing):
    model = load(tiny_model_dir).train()
    if checkpointing:
        parallelize.enable_activation_checkpointing(model)
    first = encode_visuals(videos=[video(56, 84, 4, seed=0)])
    second = encode_visuals(videos=[video(112, 140, 4, seed=1)])
    samples = group("v0", first, 4, vision, seed=0) + group("v1", second, 3, vision, seed=1)
    # A completion that sampled a placeholder token is scored up to it, in both layouts.
    samples[2].completion.token_ids[1] = vision.video_token_id
    packed = assert_packed_equals_padded(model, samples, vision)
    assert packed.model_batch.input_ids.shape[0] == 2 and packed.visuals.rows.tolist() == [0, 1]
    assert int(packed.mask[2].sum()) == 2


@pytest.mark.parametrize("spans", [True, False], ids=["spans", "mask"])
def test_packed_image_text_and_mixed_prompts_match_padded_rows(tiny_model_dir, vision, spans):
    """Both grpo.packed_attention ways on sdpa: the rows' spans, and sdpa under their mask (the default)."""
    model = load(tiny_model_dir).train()
    first = encode_visuals(images=[image(84, 112, seed=0)])
    both = encode_visuals(images=[image(56, 56, seed=1)], videos=[video(56, 84, 4, seed=2)])
    text = encode_visuals()
    samples = group("i0", first, 3, vision, 0) + group("t", text, 2, vision, 1) + group("iv", both, 3, vision, 2)
    packed = assert_packed_equals_padded(model, samples, vision, spans=spans)
    assert packed.visuals.rows.tolist() == [0, -1, 1]


def test_packed_rows_under_eager_attention_match_padded_rows(tiny_model_dir, vision):
    model = loading.load_model(
        ModelConfig(model_name_or_path=str(tiny_model_dir), dtype="float32", attn_implementation="eager"),
        dtype=torch.float32,
    ).train()
    samples = group("v", encode_visuals(videos=[video(56, 84, 4, seed=0)]), 3, vision, seed=0)
    assert_packed_equals_padded(model, samples, vision, spans=False)


def test_packed_text_model_rows_match_padded_rows(tiny_model_dirs):
    torch.manual_seed(0)
    model = loading.load_model(
        ModelConfig(model_name_or_path=str(tiny_model_dirs["qwen2"]), dtype="float32"), dtype=torch.float32
    ).train()
    samples = group("a", None, 3, None, seed=0) + group("b", None, 2, None, seed=1)
    packed = assert_packed_equals_padded(model, samples, None)
    assert packed.model_batch.position_ids.shape == packed.model_batch.input_ids.shape  # [R, L] text positions


def test_packed_prompt_runs_once_and_attention_keeps_completions_apart(vision):
    samples = group("v", encode_visuals(videos=[video(56, 84, 4, seed=0)]), 3, vision, seed=0)
    packed = build_completion_batch(samples, 0, vision, pack=True)
    prompt = len(samples[0].prompt_ids)
    lengths = [len(s.completion.token_ids) for s in samples]
    ids = packed.model_batch.input_ids[0]
    assert ids.tolist() == samples[0].prompt_ids + [t for s in samples for t in s.completion.token_ids]
    allowed = packed.attention[0, 0]  # [L, L]
    first_start, second_start = prompt, prompt + lengths[0]
    assert bool(allowed[second_start, :prompt].all()) and not bool(allowed[second_start, first_start:second_start].any())
    # Each completion's first token is predicted by the prompt's last position.
    assert packed.positions[:, 0].tolist() == [prompt - 1] * 3


def test_flash_attention_refuses_packed_rows(tiny_model_dir, vision):
    model = load(tiny_model_dir)
    batch = build_completion_batch(group("v", None, 2, vision, seed=0), 0, vision, pack=True)
    model.config.get_text_config()._attn_implementation = "flash_attention_2"
    with pytest.raises(ConfigError, match="pack_completions needs sdpa or eager"):
        PolicyScorer(model)(batch, 1.0)


def test_micro_batches_respect_the_count_and_token_budgets_in_order(vision):
    samples = group("a", None, 4, vision, seed=0) + group("b", None, 4, vision, seed=1)
    by_count = build_micro_batches(samples, 0, vision, mini_batch=3)
    assert [len(b.advantages) for b in by_count] == [3, 3, 2]
    order = torch.cat([b.advantages for b in by_count])
    assert order.tolist() == [s.advantage for s in samples]
    prompt = len(samples[0].prompt_ids)
    longest = prompt + max(len(s.completion.token_ids) for s in samples)
    by_tokens = build_micro_batches(samples, 0, vision, mini_batch=8, mini_batch_tokens=2 * longest)
    assert all(b.num_tokens <= 2 * longest for b in by_tokens) and sum(len(b.advantages) for b in by_tokens) == 8
    packed = build_micro_batches(samples, 0, vision, mini_batch=8, pack=True)
    assert [b.model_batch.input_ids.shape[0] for b in packed] == [2]  # one row per prompt, both in one pass
    split = build_micro_batches(samples, 0, vision, mini_batch=3, pack=True)
    assert [len(b.advantages) for b in split] == [3, 1, 3, 1]  # a group's rows never exceed mini_batch completions
    tight = build_micro_batches(samples, 0, vision, mini_batch=8, mini_batch_tokens=1, pack=True)
    assert [len(b.advantages) for b in tight] == [1] * 8  # a row over the budget alone goes alone
    with pytest.raises(ValueError, match="mini_batch"):
        build_micro_batches(samples, 0, vision, mini_batch=0)


def update_settings(**changes) -> UpdateSettings:
    values = dict(
        temperature=0.7, mu_iterations=1, mini_batch=4, epsilon_low=0.2, epsilon_high=0.2, dual_clip=None,
        agg_mode="token-mean", norm_length=8, kl_beta=0.0, kl_importance_correction=False,
        importance_sampling_level="token", grad_clip=1.0,
    )
    return UpdateSettings(**{**values, **changes})


@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-mean"])
def test_update_over_packed_token_sized_batches_equals_the_padded_update(tiny_model_dir, vision, agg_mode):
    first = encode_visuals(videos=[video(56, 84, 4, seed=0)])
    second = encode_visuals(images=[image(84, 112, seed=1)])
    samples = group("v", first, 4, vision, seed=0) + group("i", second, 4, vision, seed=1)
    results = []
    for pack, mini, tokens in ((False, 4, 0), (True, 8, 80)):
        model = load(tiny_model_dir).train()
        scorer = PolicyScorer(model)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        # Plain SGD: the weight change is the accumulated (clipped) gradient times lr, Adam would magnify rounding in
        # tiny gradients; the large lr lifts every change well above the float32 rounding of the weights.
        optimizer = torch.optim.SGD(scorer.parameters(), lr=1e4)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        batches = build_micro_batches(samples, 0, vision, mini, tokens, pack)
        metrics = update_policy(
            scorer, batches, optimizer, scheduler, update_settings(agg_mode=agg_mode), init_runtime(), 1,
            torch.autocast("cpu", enabled=False),
        )
        results.append((len(batches), metrics, {n: p.detach() - before[n] for n, p in model.named_parameters()}))
    (padded_count, padded, padded_steps), (packed_count, packed, packed_steps) = results
    assert padded_count == 2 and packed_count == 1
    assert set(packed) == set(padded)
    for name, value in padded.items():
        assert packed[name] == pytest.approx(value, rel=1e-4, abs=1e-6), name
    for name, step in padded_steps.items():
        scale = float(step.abs().max()) + 1e-12
        assert float((packed_steps[name] - step).abs().max()) <= 1e-4 * scale, name


def test_an_empty_completion_in_a_packed_row_predicts_nothing_and_the_others_match_padded(tiny_model_dirs):
    """An engine may return no token: its span in the packed row is empty (arange(start, start - 1) raised before),
    and the other completions of the row score as in padded rows."""
    from dataclasses import replace

    torch.manual_seed(0)
    model = loading.load_model(
        ModelConfig(model_name_or_path=str(tiny_model_dirs["qwen2"]), dtype="float32"), dtype=torch.float32
    ).train()
    samples = group("a", None, 3, None, seed=0)
    empty = replace(samples[1].completion, token_ids=[], logprobs=[])
    samples[1] = replace(samples[1], completion=empty)
    packed = build_completion_batch(samples, 0, None, pack=True)
    assert packed.mask[1].sum() == 0 and packed.mask[0].sum() == len(samples[0].completion.token_ids)
    assert_packed_equals_padded(model, samples, None, spans=False)


def test_a_rank_short_of_micro_batches_runs_silent_ones_and_learns_the_same(tiny_model_dir, vision, monkeypatch):
    """Another data-parallel rank has more micro-batches (dynamic sampling, failed requests): this rank runs as many
    forwards, the extra ones without a token in the loss, so the update, its metrics and the weights are those of its
    own micro-batches (before: the ranks waited on each other for ever). One with none at all is an error on all."""
    from physreason.errors import PhysReasonError
    from physreason.train import grpo

    samples = group("v", encode_visuals(videos=[video(56, 84, 4, seed=0)]), 4, vision, seed=0)
    results = []
    for others in (None, 3):
        if others is not None:
            monkeypatch.setattr(grpo, "all_reduce_max", lambda value, runtime, group=None, others=others: max(value, others))
        model = load(tiny_model_dir).train()
        scorer = PolicyScorer(model)
        calls = mock.patch.object(scorer, "forward", wraps=scorer.forward)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        optimizer = torch.optim.SGD(scorer.parameters(), lr=1e4)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        batches = build_micro_batches(samples, 0, vision, 4, 0, False)
        with calls as forward:
            metrics = update_policy(scorer, batches, optimizer, scheduler, update_settings(), init_runtime(), 1,
                                    torch.autocast("cpu", enabled=False))  # fmt: skip
        results.append((forward.call_count, metrics, {n: p.detach() - before[n] for n, p in model.named_parameters()}))
    (alone, plain, plain_steps), (padded, even, even_steps) = results
    assert (alone, padded) == (1, 3)
    for name, value in plain.items():
        assert even[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name
    for name, step in plain_steps.items():
        assert torch.allclose(even_steps[name], step, rtol=1e-5, atol=1e-7), name
    answers = iter([2.0, 0.0])  # another rank has two micro-batches; this one none (the max of -0 and -2 is 0)
    monkeypatch.setattr(grpo, "all_reduce_max", lambda value, runtime, group=None: next(answers))
    with pytest.raises(PhysReasonError, match="no micro-batch to run this step"):
        grpo._even_micro_batches([], init_runtime(), None)


def test_a_rank_without_samples_runs_a_silent_batch_that_changes_nothing(tiny_model_dir, vision):
    """Dynamic sampling dropped every group of this rank while others kept some: it still runs a forward and backward
    (FSDP2's gathers), of a batch with no token in the loss, so its weights and loss do not move."""
    settings = update_settings()
    from physreason.train.grpo import UpdateSettings

    assert isinstance(settings, UpdateSettings)
    (silent,) = settings.micro_batches([], 0, vision, torch.device("cpu"))
    assert not silent.mask.any() and not silent.advantages.any()
    model = load(tiny_model_dir).train()
    scorer = PolicyScorer(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD(scorer.parameters(), lr=1e4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    metrics = update_policy(scorer, [silent], optimizer, scheduler, settings, init_runtime(), 1,
                            torch.autocast("cpu", enabled=False))  # fmt: skip
    assert metrics["loss"] == 0.0
    assert all(torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())
