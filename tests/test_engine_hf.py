"""The transformers engine on the tiny Qwen2.5-VL and Qwen3-VL: batching, logprobs, sampling, errors, weight updates."""

from __future__ import annotations

import pytest
import torch
from media import write_clip, write_image

from physreason.config import EngineConfig, ModelConfig, SamplingConfig, VisionConfig
from physreason.engines.hf import HFEngine, video_rope_problem
from physreason.infer import build_request
from physreason.models.inputs import concat_visuals, patch_factor

SMALL = VisionConfig(min_pixels=28 * 28 * 4, max_pixels=56 * 84, total_pixels=56 * 84 * 8, image_max_pixels=56 * 84)
GREEDY = SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_tokens=8)


@pytest.fixture(scope="module")
def engine(vl_model_dir) -> HFEngine:
    return HFEngine(ModelConfig(model_name_or_path=str(vl_model_dir), dtype="float32"), EngineConfig(batch_size=4))


@pytest.fixture(scope="module")
def media(tmp_path_factory, vl_model_dir):
    root = tmp_path_factory.mktemp("media")
    return {
        "clip": write_clip(root / "a.mp4"),
        "clip2": write_clip(root / "b.mp4", n_frames=24, seed=1),
        "image": write_image(root / "x.png"),
        "factor": patch_factor(str(vl_model_dir)),
    }


def requests(media):
    small = dict(vision=SMALL, factor=media["factor"])
    return [
        build_request("Is the square falling?", videos=[media["clip"]], request_id="video", **small),
        build_request("Describe the picture in detail please.", images=[media["image"]], request_id="image", **small),
        build_request("Which clip is longer?", videos=[media["clip2"]], images=[media["image"]], request_id="both", **small),
        build_request("Say hello.", request_id="text", **small),
    ]


def test_batched_greedy_equals_one_at_a_time(engine, media):
    reqs = requests(media)
    batched = engine.generate(reqs, GREEDY)
    single = [engine.generate([r], GREEDY)[0] for r in reqs]
    assert len({len(r.prompt_token_ids) for r in batched}) > 1  # prompts differ in length, so left padding is exercised
    for b, s in zip(batched, single, strict=True):
        assert b.error is None
        assert b.completions[0].token_ids == s.completions[0].token_ids
        assert b.completions[0].logprobs == pytest.approx(s.completions[0].logprobs, abs=1e-4)


def reference_forward(engine, request, result):
    """(logits [new, vocab] before each completion token, its raw log-probs [new], the [3, L] positions) from one
    forward pass of prompt + completion, with transformers' own 3D rope index."""
    completion = result.completions[0]
    visuals = concat_visuals([engine._encode(request)[1]])
    ids = torch.tensor([result.prompt_token_ids + completion.token_ids], device=engine.device)
    positions, _ = engine.model.model.get_rope_index(
        ids, video_grid_thw=visuals.video_grid_thw, second_per_grid_ts=visuals.second_per_grid_ts,
        attention_mask=torch.ones_like(ids), mm_token_type_ids=engine.mm_token_type_ids(ids),
    )
    with torch.no_grad():
        kwargs = {k: v.to(engine.device) for k, v in visuals.model_kwargs().items()}
        logits = engine.model(input_ids=ids, position_ids=positions, **kwargs).logits[0].float().cpu()  # [L, vocab]
    start = len(result.prompt_token_ids)
    logits = logits[start - 1 : -1]
    raw = torch.log_softmax(logits, -1).gather(-1, ids[0, start:, None].cpu())[:, 0]
    return logits, raw, positions[:, 0]


def test_logprobs_match_a_forward_pass_of_the_full_sequence(engine, media):
    request = requests(media)[0]
    (result,) = engine.generate([request], GREEDY)
    completion = result.completions[0]
    logits, expected, positions = reference_forward(engine, request, result)
    assert not torch.equal(positions, torch.arange(positions.shape[1]).expand(3, -1))  # real 3D positions
    assert completion.logprobs == pytest.approx(expected.tolist(), abs=1e-4)
    # greedy picks the argmax at every step
    assert completion.token_ids == logits.argmax(-1).tolist()


def test_n_samples_and_seed_reproducibility(engine, media):
    sampling = SamplingConfig(temperature=1.0, top_p=1.0, n=3, max_tokens=6, seed=7, repetition_penalty=1.0)
    first = engine.generate(requests(media)[:2], sampling)
    second = engine.generate(requests(media)[:2], sampling)
    assert [len(r.completions) for r in first] == [3, 3]
    assert [[c.token_ids for c in r.completions] for r in first] == [[c.token_ids for c in r.completions] for r in second]
    assert len({tuple(c.token_ids) for c in first[0].completions}) > 1


def test_finish_reason_and_token_limit(engine, media):
    (result,) = engine.generate(requests(media)[3:], GREEDY)
    completion = result.completions[0]
    assert completion.finish_reason in ("stop", "length")
    assert len(completion.token_ids) <= GREEDY.max_tokens
    if completion.finish_reason == "length":
        assert len(completion.token_ids) == GREEDY.max_tokens


def test_prompt_longer_than_context_is_a_per_request_error(engine, vl_model_dir, media):
    lengths = {r.request_id: len(engine._encode(r)[0]) for r in requests(media)}
    assert lengths["text"] + 4 < lengths["video"]
    context = lengths["text"] + 4
    short = HFEngine(ModelConfig(model_name_or_path=str(vl_model_dir), dtype="float32", model_max_length=context), EngineConfig())
    results = short.generate(requests(media), GREEDY)
    video = results[0]
    assert video.completions == [] and "lower --fps or --total-pixels" in video.error
    assert "visual" in video.error
    assert results[3].error is None and results[3].completions  # the text request still ran
    assert len(results[3].completions[0].token_ids) <= context - lengths["text"]  # generation stops at the context


def test_transformers_with_wrong_video_positions_refuses_video_requests_only(vl_model_dir, media):
    assert video_rope_problem("5.18.0") is None and video_rope_problem("5.23.1") is None
    old = HFEngine(ModelConfig(model_name_or_path=str(vl_model_dir), dtype="float32"), EngineConfig())
    old.video_problem = video_rope_problem("5.17.0")
    results = {r.request_id: r for r in old.generate(requests(media), GREEDY)}
    for rid in ("video", "both"):
        assert results[rid].completions == []
        assert "transformers 5.17.0" in results[rid].error and "transformers>=5.18.0" in results[rid].error
    for rid in ("image", "text"):
        assert results[rid].error is None and results[rid].completions


def test_update_weights_changes_generation_to_the_new_weights(vl_model_dir, media):
    engine = HFEngine(ModelConfig(model_name_or_path=str(vl_model_dir), dtype="float32"), EngineConfig())
    reference = HFEngine(ModelConfig(model_name_or_path=str(vl_model_dir), dtype="float32"), EngineConfig())
    before = engine.generate(requests(media)[:1], GREEDY)[0].completions[0].token_ids
    torch.manual_seed(3)
    perturbed = {n: p.detach() + 0.5 * torch.randn_like(p) for n, p in reference.model.named_parameters()}
    with torch.no_grad():
        for name, param in reference.model.named_parameters():
            param.copy_(perturbed[name])
    engine.update_weights(perturbed.items())
    after = engine.generate(requests(media)[:1], GREEDY)[0].completions[0].token_ids
    expected = reference.generate(requests(media)[:1], GREEDY)[0].completions[0].token_ids
    assert after == expected
    assert after != before


def test_update_weights_rejects_unknown_names(engine):
    with pytest.raises(Exception, match="does not have"):
        engine.update_weights([("model.no_such.weight", torch.zeros(1))])


def test_text_only_model_refuses_media(tiny_model_dirs, media):
    text = HFEngine(ModelConfig(model_name_or_path=str(tiny_model_dirs["qwen2"]), dtype="float32"), EngineConfig())
    results = text.generate(requests(media), GREEDY)
    assert "text-only" in results[0].error
    assert results[3].error is None


@pytest.fixture(scope="module")
def static_engine(vl_model_dir) -> HFEngine:
    return HFEngine(
        ModelConfig(model_name_or_path=str(vl_model_dir), dtype="float32"), EngineConfig(batch_size=4), static_cache=True
    )


def test_static_cache_path_gives_the_default_paths_tokens_and_logprobs(engine, static_engine, media):
    reqs = requests(media)
    fast = static_engine.generate(reqs, GREEDY)
    default = engine.generate(reqs, GREEDY)
    for f, d in zip(fast, default, strict=True):
        assert f.error is None and f.prompt_token_ids == d.prompt_token_ids
        assert f.completions[0].token_ids == d.completions[0].token_ids
        assert f.completions[0].finish_reason == d.completions[0].finish_reason
        assert f.completions[0].logprobs == pytest.approx(d.completions[0].logprobs, abs=1e-4)


def test_static_cache_path_records_logprobs_before_the_repetition_penalty(engine, static_engine, media):
    # The penalty changes which tokens are picked, not the reported (raw) log-probabilities.
    penalized = SamplingConfig(temperature=0.0, repetition_penalty=1.5, max_tokens=8)
    (fast,) = static_engine.generate(requests(media)[1:2], penalized)
    (default,) = engine.generate(requests(media)[1:2], penalized)
    (plain,) = engine.generate(requests(media)[1:2], GREEDY)
    assert fast.completions[0].token_ids == default.completions[0].token_ids
    assert fast.completions[0].token_ids != plain.completions[0].token_ids  # the penalty did act
    assert fast.completions[0].logprobs == pytest.approx(default.completions[0].logprobs, abs=1e-4)


def test_static_cache_path_samples_n_per_request_reproducibly(static_engine, media):
    sampling = SamplingConfig(temperature=1.0, top_p=1.0, n=3, max_tokens=6, seed=7, repetition_penalty=1.0)
    first = static_engine.generate(requests(media)[:2], sampling)
    second = static_engine.generate(requests(media)[:2], sampling)
    assert [len(r.completions) for r in first] == [3, 3]
    assert [[c.token_ids for c in r.completions] for r in first] == [[c.token_ids for c in r.completions] for r in second]
    for completion in first[0].completions:
        assert len(completion.logprobs) == len(completion.token_ids)
        assert all(lp <= 0.0 for lp in completion.logprobs)


@pytest.mark.parametrize("path", ["default", "static"])
def test_without_logprobs_the_tokens_are_the_same_and_no_logprobs_are_returned(engine, static_engine, media, path):
    chosen = static_engine if path == "static" else engine
    penalized = SamplingConfig(temperature=0.0, repetition_penalty=1.3, max_tokens=8)
    with_logprobs = chosen.generate(requests(media), penalized)
    without = chosen.generate(requests(media), penalized, logprobs=False)
    for a, b in zip(with_logprobs, without, strict=True):
        assert b.error is None and a.prompt_token_ids == b.prompt_token_ids
        assert a.completions[0].token_ids == b.completions[0].token_ids
        assert a.completions[0].finish_reason == b.completions[0].finish_reason
        assert b.completions[0].logprobs == [] and len(a.completions[0].logprobs) == len(a.completions[0].token_ids)


def test_ignore_eos_runs_every_completion_to_max_tokens(engine, media, monkeypatch):
    request = requests(media)[3:]
    (plain,) = engine.generate(request, GREEDY)
    # Make the first greedy token an end-of-sequence token: the plain run now stops after it.
    monkeypatch.setattr(engine, "eos_token_ids", engine.eos_token_ids | {plain.completions[0].token_ids[0]})
    (stopped,) = engine.generate(request, GREEDY)
    assert stopped.completions[0].finish_reason == "stop" and len(stopped.completions[0].token_ids) == 1
    (forced,) = engine.generate(request, GREEDY.model_copy(update={"ignore_eos": True}))
    completion = forced.completions[0]
    assert completion.finish_reason == "length"
    assert len(completion.token_ids) == len(completion.logprobs) == GREEDY.max_tokens
    assert not set(completion.token_ids) & engine.eos_token_ids


@pytest.mark.parametrize("static", [False, True])
def test_suppress_vision_tokens_never_samples_a_placeholder_and_reports_raw_logprobs(vl_model_dir, media, static):
    from physreason.models.family import vision_special_token_ids

    chosen = HFEngine(
        ModelConfig(model_name_or_path=str(vl_model_dir), dtype="float32"), EngineConfig(batch_size=4), static_cache=static
    )
    request = requests(media)[:1]
    vision_ids = vision_special_token_ids(chosen.model.config)
    assert chosen.model.config.video_token_id in vision_ids and len(vision_ids) == 4
    # Make the video pad every step's most likely token: its output row becomes the hidden state's direction.
    head = chosen.model.get_output_embeddings().weight
    with torch.no_grad():
        head[chosen.model.config.video_token_id] = 0.0
        (plain,) = chosen.generate(request, GREEDY)
        first = plain.completions[0].token_ids[0]
        head[chosen.model.config.video_token_id] = 20.0 * head[first]
    (drawn,) = chosen.generate(request, GREEDY)
    assert drawn.completions[0].token_ids[0] == chosen.model.config.video_token_id  # without the option: a pad
    (kept,) = chosen.generate(request, GREEDY.model_copy(update={"suppress_vision_tokens": True}))
    completion = kept.completions[0]
    assert completion.token_ids[0] == first and not set(completion.token_ids) & set(vision_ids)
    # The log-probabilities are the raw ones: the pad's share of the mass is not given back to the rest.
    _, raw, _ = reference_forward(chosen, request[0], kept)
    assert completion.logprobs == pytest.approx(raw.tolist(), abs=1e-4)
    assert completion.logprobs[0] < -1.0  # the pad took most of the first step's mass


@pytest.mark.parametrize("path", ["default", "static"])
@pytest.mark.parametrize(("presence", "frequency"), [(2.0, 0.0), (0.0, 1.5), (1.0, 0.5)])
def test_presence_and_frequency_penalties_follow_vllm_semantics(engine, static_engine, media, path, presence, frequency):
    # vLLM: logit -= frequency x (times the token is in the completion so far) + presence x (it is there at all);
    # prompt tokens do not count. Greedy must pick the argmax of the penalised logits at every step.
    chosen = static_engine if path == "static" else engine
    request = requests(media)[0]
    sampling = GREEDY.model_copy(update={"presence_penalty": presence, "frequency_penalty": frequency, "max_tokens": 12})
    (penalised,) = chosen.generate([request], sampling)
    (plain,) = chosen.generate([request], GREEDY.model_copy(update={"max_tokens": 12}))
    tokens = penalised.completions[0].token_ids
    assert tokens != plain.completions[0].token_ids  # the penalty acted
    logits, _, _ = reference_forward(engine, request, penalised)  # [new, vocab] raw logits before each token
    counts = torch.zeros(logits.shape[-1])
    for step, token in enumerate(tokens):
        adjusted = logits[step] - frequency * counts - presence * (counts > 0).float()
        assert int(adjusted.argmax()) == token, f"step {step}"
        counts[token] += 1
    # the reported log-probs stay those of the raw logits
    raw = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]
    assert penalised.completions[0].logprobs == pytest.approx(raw.tolist(), abs=1e-4)


SEEDED = SamplingConfig(temperature=1.0, top_p=0.9, top_k=50, n=2, max_tokens=6, seed=11, repetition_penalty=1.05)


def seeded(request, *identity):
    """The request with a seed of its own (GenerationRequest.seed), as evaluation gives each sample."""
    from dataclasses import replace

    from physreason.engines.base import request_seed

    return replace(request, seed=request_seed(*identity))


def tokens_of(result):
    return [c.token_ids for c in result.completions]


@pytest.mark.parametrize("path", ["default", "static"])
def test_a_request_seeded_by_identity_draws_the_same_completions_in_any_batch(engine, static_engine, media, path):
    """Completion k of a request with a seed draws from its own generator: alone, second or third in a batch, beside
    unseeded requests (batched apart) or in batches of one, its completions and log-probs are the same."""
    chosen = static_engine if path == "static" else engine
    video, image, both, text = requests(media)
    mine = seeded(both, "mini", "s3")
    alone = chosen.generate([mine], SEEDED)[0]
    second = chosen.generate([seeded(text, "mini", "s1"), mine], SEEDED)[1]
    third = chosen.generate([seeded(image, "mini", "s0"), seeded(video, "mini", "s2"), mine], SEEDED)[2]
    mixed = chosen.generate([text, mine, image], SEEDED)[1]
    chosen.engine_config.batch_size = 1
    try:
        ones = chosen.generate([seeded(video, "mini", "s2"), mine], SEEDED)[1]
    finally:
        chosen.engine_config.batch_size = 4
    assert tokens_of(alone) == tokens_of(second) == tokens_of(third) == tokens_of(mixed) == tokens_of(ones)
    assert tokens_of(alone)[0] != tokens_of(alone)[1]  # the n completions of one request draw differently
    for completion, other in zip(alone.completions, third.completions, strict=True):
        assert completion.logprobs == pytest.approx(other.logprobs, abs=1e-4)
        assert len(completion.logprobs) == len(completion.token_ids) and min(completion.logprobs) < 0.0  # raw, not one-hot
    # another identity, or another sampling seed, draws other completions
    assert tokens_of(chosen.generate([seeded(both, "mini", "s4")], SEEDED)[0]) != tokens_of(alone)
    assert tokens_of(chosen.generate([mine], SEEDED.model_copy(update={"seed": 12}))[0]) != tokens_of(alone)


def test_a_row_that_stops_early_does_not_shift_the_draws_of_its_batch(engine, media, monkeypatch):
    video, _, both, _ = requests(media)
    first, mine = seeded(video, "mini", "s2"), seeded(both, "mini", "s3")
    batched = engine.generate([first, mine], SEEDED)
    # make a token of the first request's first completion an end of sequence it does not share with `mine`
    stop = next(t for t in batched[0].completions[0].token_ids[:3] if t not in sum(tokens_of(batched[1]), []))
    monkeypatch.setattr(engine, "eos_token_ids", engine.eos_token_ids | {stop})
    early, again = engine.generate([first, mine], SEEDED)
    assert early.completions[0].finish_reason == "stop" and len(early.completions[0].token_ids) <= 3
    assert tokens_of(again) == tokens_of(batched[1]) == tokens_of(engine.generate([mine], SEEDED)[0])


@pytest.mark.parametrize("path", ["default", "static"])
def test_duplicate_requests_without_a_seed_of_their_own_still_draw_different_completions(engine, static_engine, media, path):
    """GRPO sends a prompt's group without request seeds: its rows share the call's stream, so duplicates of one prompt
    differ (one seed for every duplicate would give the whole group one answer and zero advantage)."""
    chosen = static_engine if path == "static" else engine
    text = requests(media)[3]
    one = SEEDED.model_copy(update={"n": 1})
    results = chosen.generate([text, text, text], one)
    assert len({tuple(r.completions[0].token_ids) for r in results}) > 1
    grouped = chosen.generate([text], SEEDED.model_copy(update={"n": 4}))[0]
    assert len({tuple(c.token_ids) for c in grouped.completions}) > 1
    # the same call draws the same completions again (the sampling seed still pins the shared stream)
    assert [tokens_of(r) for r in chosen.generate([text, text, text], one)] == [tokens_of(r) for r in results]


def test_request_seeds_change_nothing_for_greedy_or_unseeded_sampling(engine, media):
    reqs = requests(media)
    mine = [seeded(r, "mini", r.request_id) for r in reqs]
    assert [tokens_of(r) for r in engine.generate(mine, GREEDY)] == [tokens_of(r) for r in engine.generate(reqs, GREEDY)]
    from physreason.engines.base import sampling_seed

    assert sampling_seed(SEEDED.model_copy(update={"seed": None}), mine[0]) is None
    assert sampling_seed(GREEDY.model_copy(update={"seed": 3}), mine[0]) is None
    assert sampling_seed(SEEDED, reqs[0]) is None
    assert sampling_seed(SEEDED, mine[0]) == sampling_seed(SEEDED, seeded(reqs[0], "mini", "video"))
