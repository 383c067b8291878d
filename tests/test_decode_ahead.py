"""Clips decoded in threads ahead of the engine (evaluation, GRPO rollouts) and patchified once per prompt give the
very records, completions and policy inputs of decoding one after another (issue 45: the grounding experiment's
speed)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch
from media import write_clip

from physreason.chat.prompts import GROUNDING_PROMPT
from physreason.chat.style import Prompting
from physreason.config import EngineConfig, ModelConfig, SamplingConfig, VisionConfig
from physreason.data.mcq import MCQPrompt, PromptStream
from physreason.engines.hf import HFEngine
from physreason.errors import ConfigError
from physreason.eval.benchmark import Benchmark, EvalSample
from physreason.eval.runner import evaluate_shard
from physreason.models.inputs import encode_visuals, load_processor_params
from physreason.parallel import map_in_threads, ordered_map
from physreason.train import rollout
from physreason.train.rollout import RolloutSettings, collect_rollouts

VISION = VisionConfig(fps=4, max_frames=4, min_pixels=3136, max_pixels=12544)
QUESTION = GROUNDING_PROMPT.format(object_name="the white square")
ANSWER = '[{"box_2d": [100, 200, 300, 400], "label": "the white square"}]'


def test_ordered_map_keeps_the_order_and_stays_within_its_lookahead():
    started = []
    lock = threading.Lock()

    def slow(i: int) -> int:
        with lock:
            started.append(i)
        time.sleep(0.01 * (i % 3))  # later items often finish first
        return i * i

    results = []
    for value in ordered_map(slow, range(20), workers=4, lookahead=6):
        with lock:
            assert len(started) <= len(results) + 1 + 6  # never more than the lookahead ahead of the consumer
        results.append(value)
    assert results == [i * i for i in range(20)]
    assert list(ordered_map(slow, range(5), workers=1)) == [0, 1, 4, 9, 16]
    assert map_in_threads(slow, [3, 1, 2], workers=8) == [9, 1, 4]


def test_ordered_map_raises_at_the_failing_item_and_stops_starting_more():
    started = []

    def fails_at_3(i: int) -> int:
        started.append(i)
        if i == 3:
            raise ConfigError("bad setting")
        return i

    seen = []
    with pytest.raises(ConfigError, match="bad setting"):
        for value in ordered_map(fails_at_3, range(100), workers=3, lookahead=4):
            seen.append(value)
    assert seen == [0, 1, 2]  # as the plain map: the items before the failing one, in order
    assert len(started) < 100


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> HFEngine:
    return HFEngine(ModelConfig(model_name_or_path=str(tiny_model_dir), dtype="float32"), EngineConfig(batch_size=8))


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("clips")
    for i in range(5):
        write_clip(root / f"c{i}.mp4", n_frames=8, size=(96, 128), seed=i)
    return root


def test_evaluation_in_small_batches_decoding_ahead_writes_the_records_of_one_batch_decoded_in_order(
    tmp_path, engine, clips
):
    samples = [EvalSample(f"c{i}.mp4#0", f"c{i}.mp4", QUESTION, None, ANSWER) for i in range(5)]
    samples.insert(2, EvalSample("gone.mp4#0", "gone.mp4", QUESTION, None, ANSWER))  # a missing clip: an error record
    benchmark = Benchmark("grounding", clips, samples)
    greedy = SamplingConfig(temperature=0.0, max_tokens=12, seed=1)
    records = {}
    for name, batch_size, workers in (("serial", 6, 1), ("ahead", 2, 3)):
        counts = evaluate_shard(
            engine, benchmark, tmp_path / name, prompting=Prompting("reason1", False), sampling=greedy,
            vision=VISION, batch_size=batch_size, decode_workers=workers,
        )  # fmt: skip
        assert (counts.answered, counts.failed) == (5, 1)
        lines = next((tmp_path / name).rglob("*.jsonl")).read_text().splitlines()
        records[name] = {r["id"]: r for r in map(json.loads, lines)}  # (an error is written before its batch)
    assert list(records["ahead"]) == [s.id for s in samples]  # batches of 2: in the benchmark's order
    assert "error" in records["ahead"]["gone.mp4#0"]
    assert records["ahead"] == records["serial"]  # greedy answers, token counts and scores alike
    assert len({r["full_response"] for r in records["serial"].values() if "error" not in r}) > 1  # answers differ


def test_a_request_patchified_by_the_caller_generates_as_one_the_engine_patchifies(engine, clips):
    prompt = MCQPrompt("p", QUESTION, {}, ANSWER, videos=(str(clips / "c0.mp4"),))
    params = load_processor_params(engine.model_config.model_name_or_path, None)
    plain = rollout.mcq_request(prompt, VISION, factor=params.factor)
    given = rollout.mcq_request(prompt, VISION, factor=params.factor)
    given.encoded = (params, encode_visuals(given.images, given.videos, params))
    sampling = SamplingConfig(temperature=1.0, top_p=1.0, repetition_penalty=1.0, n=3, max_tokens=8, seed=5)
    (a,), (b,) = engine.generate([plain], sampling), engine.generate([given], sampling)
    assert [c.token_ids for c in a.completions] == [c.token_ids for c in b.completions]
    assert a.prompt_token_ids == b.prompt_token_ids
    # other processor parameters than the engine's: the engine patchifies itself
    other = rollout.mcq_request(prompt, VISION, factor=params.factor)
    other.encoded = (params.__class__(patch_size=7), given.encoded[1])
    (c,) = engine.generate([other], sampling)
    assert [x.token_ids for x in c.completions] == [x.token_ids for x in a.completions]


def rollout_settings(engine: HFEngine, workers: int) -> RolloutSettings:
    return RolloutSettings(
        groups_needed=3, prompts_per_round=3, vision=VISION, reward_weights={"localization": 1.0},
        sampling=SamplingConfig(temperature=1.0, top_p=1.0, repetition_penalty=1.0, n=4, max_tokens=10),
        processor_params=load_processor_params(engine.model_config.model_name_or_path, None), seed=7,
        decode_workers=workers,
    )  # fmt: skip


def test_rollouts_decoding_in_threads_sample_the_same_groups_and_patchify_each_prompt_once(
    engine, clips, monkeypatch
):
    prompts = [MCQPrompt(f"p{i}", QUESTION, {}, ANSWER, videos=(str(clips / f"c{i}.mp4"),)) for i in range(3)]
    calls = []
    real = rollout.encode_visuals

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(rollout, "encode_visuals", counted)
    monkeypatch.setattr("physreason.engines.hf.encode_visuals", counted)
    batches = {}
    for workers in (1, 3):
        calls.clear()
        stream = PromptStream(prompts, seed=0, shuffle=False)
        batches[workers] = collect_rollouts(engine, stream, rollout_settings(engine, workers), step=0)
        assert len(calls) == 3  # once per prompt: the engine and the policy's forward share it
    serial, threaded = batches[1], batches[3]
    assert len(serial.samples) == 12
    for a, b in zip(serial.samples, threaded.samples, strict=True):
        assert (a.group, a.prompt.id, a.prompt_ids) == (b.group, b.prompt.id, b.prompt_ids)
        assert a.completion.token_ids == b.completion.token_ids
        assert a.completion.logprobs == pytest.approx(b.completion.logprobs, abs=1e-6)
        assert (a.rewards, a.advantage) == (b.rewards, b.advantage)
        assert torch.equal(a.visuals.pixel_values_videos, b.visuals.pixel_values_videos)
    # the policy's pixels are the ones encode_visuals gives the prompt's decoded clip
    first = serial.samples[0]
    request = rollout.mcq_request(first.prompt, VISION, factor=engine.processor_params.factor)
    expected = real(request.images, request.videos, engine.processor_params)
    assert torch.equal(first.visuals.pixel_values_videos, expected.pixel_values_videos)
    assert torch.equal(first.visuals.video_grid_thw, expected.video_grid_thw)



def test_rollouts_on_the_static_cache_sample_the_dynamic_caches_completions(engine, tiny_model_dir, clips):
    """--rollout-static-cache: the same seeded groups, tokens and raw log-probs as the default path."""
    static = HFEngine(
        ModelConfig(model_name_or_path=str(tiny_model_dir), dtype="float32"), EngineConfig(batch_size=8),
        static_cache=True,
    )  # fmt: skip
    prompts = [MCQPrompt(f"p{i}", QUESTION, {}, ANSWER, videos=(str(clips / f"c{i}.mp4"),)) for i in range(2)]
    settings = rollout_settings(engine, 1)
    settings.groups_needed = settings.prompts_per_round = 2
    batches = [
        collect_rollouts(e, PromptStream(prompts, seed=0, shuffle=False), settings, step=3) for e in (engine, static)
    ]
    dynamic, compiled = batches
    assert len(dynamic.samples) == 8
    for a, b in zip(dynamic.samples, compiled.samples, strict=True):
        assert a.completion.token_ids == b.completion.token_ids
        assert a.completion.logprobs == pytest.approx(b.completion.logprobs, abs=1e-4)
        assert a.advantage == pytest.approx(b.advantage)
    assert len({tuple(s.completion.token_ids) for s in dynamic.samples}) > 1  # sampled, not one answer repeated


def test_the_rollout_static_cache_is_grpos_alone(tmp_path):
    import torch

    from physreason.experiments import grounding
    from physreason.experiments.common import stage_config

    cases = (("--rollout-static-cache", True), ("--no-rollout-static-cache", False), (None, torch.cuda.is_available()))
    for flag, expected in cases:
        args = grounding.parse_args([*([flag] if flag else []), "--out", str(tmp_path)])
        cfg = stage_config(args, tmp_path, tmp_path / "model", 0)
        rl_cfg = grounding.variant_grpo_config(args, cfg, tmp_path, tmp_path / "sft", tmp_path / "grpo")
        assert rl_cfg.engine.hf_static_cache is expected
        assert cfg.engine.hf_static_cache is False  # the evaluations' engine keeps the dynamic cache
        assert cfg.engine.batch_size == 512  # an evaluation of 150 clips a task, both tasks in one generate call


def test_data_sets_of_one_sampling_share_generate_calls_with_the_records_of_one_at_a_time(
    tmp_path, engine, clips, monkeypatch
):
    from physreason.eval.runner import ShardJob, evaluate_shards

    def benchmark(name: str, first: int, count: int) -> Benchmark:
        samples = [EvalSample(f"c{i}.mp4#{name}", f"c{i}.mp4", QUESTION, None, ANSWER) for i in range(first, first + count)]
        return Benchmark(name, clips, samples)

    boxes, spans = benchmark("boxes", 0, 3), benchmark("spans", 2, 3)
    greedy = SamplingConfig(temperature=0.0, max_tokens=8, seed=1)
    common = dict(prompting=Prompting("reason1", False), vision=VISION, batch_size=8)

    def lines(run: Path) -> list[dict]:
        return [json.loads(x) for x in next(run.rglob("*.jsonl")).read_text().splitlines()]

    separately = [evaluate_shard(engine, b, tmp_path / "one" / b.name, sampling=greedy, **common) for b in (boxes, spans)]
    calls = []
    real = engine.generate
    monkeypatch.setattr(engine, "generate", lambda requests, *a, **k: calls.append(len(requests)) or real(requests, *a, **k))
    jobs = [ShardJob(b, tmp_path / "both" / b.name, greedy) for b in (boxes, spans)]
    together = evaluate_shards(engine, jobs, decode_workers=2, **common)
    assert calls == [6]  # both data sets in one call
    assert together == separately
    for name in ("boxes", "spans"):
        assert lines(tmp_path / "both" / name) == lines(tmp_path / "one" / name)
    # repeats of another seed sample with another setting: a call of their own
    calls.clear()
    sampled = [SamplingConfig(temperature=1.0, max_tokens=4, seed=seed) for seed in (1, 2)]
    jobs = [ShardJob(boxes, tmp_path / f"seed{i}", sampling) for i, sampling in enumerate(sampled)]
    evaluate_shards(engine, jobs, **common)
    assert calls == [3, 3]
    assert [r["seed"] for r in lines(tmp_path / "seed1")] == [2, 2, 2]
