"""Model output is untrusted input: no completion text raises out of a parser, a reward or the eval scorer.

Property-style: a list of hostile completions (huge and non-finite numbers, deep JSON, unbalanced tags, a megabyte
of text, control characters, lone surrogates) goes through every built-in reward, the eval scorer and the parsers.
A reward that raises anyway scores 0 for that completion, counted, and never stops a GRPO step or an eval run.
"""

from __future__ import annotations

import json
import logging
import math

import pytest

from physreason.chat.parse import parse_completion
from physreason.chat.structured import answer_kind, box_from, json_item, point_from, span_from
from physreason.config import SamplingConfig, VisionConfig
from physreason.data.mcq import MCQPrompt, PromptStream
from physreason.engines import Completion, Engine, GenerationResult
from physreason.errors import InputError, PhysReasonError
from physreason.eval.benchmark import EvalSample, expand_qa_pairs
from physreason.eval.runner import result_line
from physreason.eval.scoring import score_completion
from physreason.rewards import answer_region, compute_rewards, extract, get_reward, registered_rewards
from physreason.rewards import registry as reward_registry
from physreason.serve.reasoning import split_reasoning
from physreason.train.rollout import RolloutSettings, collect_rollouts

HUGE = "9" * 400  # an int too large for a float: float() raises OverflowError
OPTIONS = {"A": "it rises", "B": "it falls"}
BOX = json.dumps({"box_2d": [100, 200, 300, 400], "label": "the ball"})
POINT = json.dumps({"point_2d": [150, 250], "label": "the ball"})
SPAN = json.dumps({"start": "00:01.00", "end": "00:03.00", "caption": "it falls"})


def _hostile() -> list[str]:
    numbers = [HUGE, "-" + HUGE, "1e999", "-1e999", "NaN", "Infinity", "-Infinity", "1" * 5000, f"{HUGE}.5"]
    texts = []
    for n in numbers:
        box = f'{{"box_2d": [1, 2, 3, {n}]}}'
        texts += [box, f'[{{"point_2d": [{n}, 2]}}]', f"<think>\nx\n</think>\n\n{box}", f"<answer>{box}</answer>"]
        texts.append(f"```json\n[{{\"bbox_2d\": [{n}, {n}, {n}, {n}], \"label\": \"b\"}}]\n```")
    texts += [
        f'{{"start": "{HUGE}:00", "end": "00:01"}}',
        '{"start": "00:01.5", "end": "00:99"}',
        '{"start": null, "end": [1]}',
        "[" * 100_000,  # deeper than the decoder's recursion limit
        '{"box_2d": ' * 5_000,
        "[" * 100_000 + "]" * 100_000,
        "<think>" * 5000,
        "</think>" * 5000 + "B",
        "<answer>" * 3000 + "</answer>" * 2,
        "</answer><answer></think><think>" * 2000,
        "<think></answer>B",
        "a " * 500_000,  # a megabyte of text
        "<think>\n" + "B or A, " * 130_000,  # a megabyte of hedged reasoning, cut off
        "<think>x</think>\n\n" + "(" * 200_000,
        "B" * 1_000_000,
        "\x00\x01\x02\x1b[31mB\x1b[0m\x7f\u200b",
        "<think>\x00</think>\n\n\ufeffB\x00",
        "\ud800B\udfff",  # lone surrogates: not encodable as UTF-8
        '{"box_2d": [1, 2, 3, "\ud800"]}',
        "",
        " \n\t ",
        "\u0000" * 1000,
    ]
    return texts


HOSTILE = _hostile()
SAMPLES = [
    {"answer": "B", "options": OPTIONS},
    {"answer": "yes"},
    {"answer": BOX},
    {"answer": POINT, "box_2d": [100, 200, 300, 400]},
    {"answer": SPAN},
]
EVAL_SAMPLES = [
    EvalSample(id="mcq", video="c.mp4", question="q", options=OPTIONS, answer="B"),
    EvalSample(id="box", video="c.mp4", question="q", answer=BOX),
    EvalSample(id="point", video="c.mp4", question="q", answer=POINT, reference={"box_2d": [100, 200, 300, 400]}),
    EvalSample(id="span", video="c.mp4", question="q", answer=SPAN),
]
BUILT_IN = [name for name in registered_rewards() if get_reward(name).__module__.startswith("physreason.")]


def _accepts(name: str, sample: dict) -> bool:
    """Whether a reward scores this kind of sample (a box reward has no use for a letter answer)."""
    try:
        get_reward(name)("B", **sample)
    except InputError:
        return False
    return True


PAIRS = [(name, sample) for name in BUILT_IN for sample in SAMPLES if _accepts(name, sample)]


def test_every_built_in_reward_is_tried_on_some_sample() -> None:
    assert {name for name, _ in PAIRS} == set(BUILT_IN)
    assert {"format", "accuracy", "box_iou", "point_in_box", "temporal_iou", "localization", "json_format"} <= set(
        BUILT_IN
    )


@pytest.mark.parametrize("index", range(len(HOSTILE)))
def test_no_hostile_completion_raises_out_of_a_parser_a_reward_or_the_scorer(index: int) -> None:
    text = HOSTILE[index]
    for style in ("reason1", "reason2"):
        for reasoning in (True, False):
            parse_completion(text, style, reasoning)
    split_reasoning(text)
    extract(text, OPTIONS)
    extract(text)
    region, _ = answer_region(text)
    item = json_item(region) if region is not None else None
    box_from(item), point_from(item), span_from(item)
    for name, sample in PAIRS:
        value = get_reward(name)(text, **sample)
        assert math.isfinite(value) and 0.0 <= value <= 1.0, (name, sample)
    for style in ("reason1", "reason2"):
        for reasoning in (True, False):
            assert get_reward("format")(text, prompt_style=style, reasoning=reasoning) in (0.0, 1.0)
    for sample in EVAL_SAMPLES:
        score = score_completion(text, sample)
        assert score.iou is None or 0.0 <= score.iou <= 1.0


def test_a_huge_or_non_finite_coordinate_is_no_answer() -> None:
    for n in (HUGE, "1e999", "NaN"):
        assert box_from(json_item(f'{{"box_2d": [1, 2, 3, {n}]}}')) is None
        assert point_from(json_item(f'{{"point_2d": [{n}, 2]}}')) is None
    assert box_from(json_item('{"box_2d": [1, 2, 3, 4000]}')) is not None  # large but finite: clipped, as before
    assert get_reward("box_iou")(f'{{"box_2d": [100, 200, 300, {HUGE}]}}', answer=BOX) == 0.0
    assert get_reward("json_format")(f'{{"box_2d": [100, 200, 300, {HUGE}]}}', answer=BOX) == 0.0


def test_a_reference_with_a_huge_coordinate_is_a_counted_bad_sample_not_a_crash() -> None:
    with pytest.raises(ValueError, match="holds no box_2d"):
        answer_kind(f'{{"box_2d": [1, 2, 3, {HUGE}]}}')
    # A benchmark's reference is checked as it loads: one line naming the file, record and what is wrong (exit 2 in
    # `physreason eval`, before any model loads), never an OverflowError out of the loader
    with pytest.raises(InputError, match=r"f.json record 0 \(c.mp4#0\): the answer's box_2d .* not a finite number"):
        expand_qa_pairs(
            [{"video": "c.mp4", "qa_pairs": {"question": "Where?", "answer": f'{{"box_2d": [1, 2, 3, {HUGE}]}}'}}],
            "f.json",
        )


@pytest.fixture()
def raising_reward(monkeypatch):
    """A reward "test_fragile" that raises OverflowError on completions holding "boom", and "test_bad_data" that
    raises InputError (the sample's fault) on every completion."""
    monkeypatch.setattr(reward_registry, "_REWARDS", dict(reward_registry._REWARDS))
    monkeypatch.setattr(reward_registry, "_WARNED", set())

    def fragile(completion: str, **sample) -> float:
        if "boom" in completion:
            raise OverflowError("int too large to convert to float")
        return 1.0

    def bad_data(completion: str, **sample) -> float:
        raise InputError("the sample's reference is broken")

    reward_registry.register_reward("test_fragile")(fragile)
    reward_registry.register_reward("test_bad_data")(bad_data)


def test_a_reward_that_raises_on_a_completion_scores_0_counted_and_warned_once(raising_reward, caplog) -> None:
    failed: list[str] = []
    weights = {"test_fragile": 1.0, "accuracy": 1.0}
    with caplog.at_level(logging.WARNING, logger="physreason.rewards.registry"):
        first = compute_rewards("boom B", weights, None, failed, answer="B", options=OPTIONS)
        second = compute_rewards("boom again B", weights, None, failed, answer="B", options=OPTIONS)
    assert first == {"test_fragile": 0.0, "accuracy": 1.0, "total": 1.0} and second["test_fragile"] == 0.0
    assert failed == ["test_fragile", "test_fragile"]
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "'test_fragile' raised OverflowError" in warnings[0] and "scores 0" in warnings[0]
    assert compute_rewards("B", weights, None, failed, answer="B", options=OPTIONS)["test_fragile"] == 1.0
    # the sample's data at fault is no completion's doing: it still stops, naming it
    with pytest.raises(InputError, match="reference is broken"):
        compute_rewards("B", {"test_bad_data": 1.0}, None, failed, answer="B")


class BoomEngine(Engine):
    """Half of every group's completions make the fragile reward raise; one holds a 400-digit box coordinate."""

    def generate(self, requests, sampling):
        texts = ["boom", f'{{"box_2d": [1, 2, 3, {HUGE}]}}', "<answer>A</answer>", "<answer>B</answer>"]
        return [
            GenerationResult(r.request_id, [7, 8], [Completion(t, [1, 2], [-0.5, -0.5], "stop") for t in texts])
            for r in requests
        ]

    def update_weights(self, named_tensors):
        raise AssertionError("rollouts never push weights")


def test_a_grpo_step_survives_hostile_completions_and_counts_reward_errors(raising_reward) -> None:
    # a box question: the huge coordinate reaches the IoU rewards, and scores 0 there
    rollout = RolloutSettings(
        groups_needed=2, prompts_per_round=2, sampling=SamplingConfig(temperature=1.0, n=4, max_tokens=10),
        vision=VisionConfig(), reward_weights={"test_fragile": 0.5, "box_iou": 1.0, "json_format": 0.1},
        dynamic_sampling=False, prompt_style="reason2",  # boxes on the 0-1000 grid: the prompt has no frame
    )  # fmt: skip
    box = PromptStream([MCQPrompt("box-0", "Where is the ball?", {}, BOX)], seed=0, shuffle=False)
    batch = collect_rollouts(BoomEngine(), box, rollout, step=0)
    assert batch.counts["reward_errors"] == 2  # the "boom" completion, in each of the two groups drawn
    assert [(r["box_iou"], r["json_format"]) for r in batch.scored[:4]] == [(0.0, 0.0)] * 4
    # a letter question: the others in the group keep their rewards
    rollout.reward_weights = {"accuracy": 1.0, "test_fragile": 0.5}
    mcq = [MCQPrompt("mcq-1", "Does it fall?", OPTIONS, "A")]
    batch = collect_rollouts(BoomEngine(), PromptStream(mcq, seed=0, shuffle=False, shuffle_options=False), rollout, step=0)
    assert batch.counts["reward_errors"] == 2 and [r["accuracy"] for r in batch.scored[:4]] == [0.0, 0.0, 1.0, 0.0]


def test_an_eval_record_survives_a_scorer_that_raises(monkeypatch) -> None:
    from physreason.eval import runner

    def overflow(text, sample, coords=None):
        raise OverflowError("int too large to convert to float")

    monkeypatch.setattr(runner, "score_completion", overflow)
    result = GenerationResult("box", [1], [Completion(f'{{"box_2d": [1, 2, 3, {HUGE}]}}', [1], [], "stop")])
    record = result_line(EVAL_SAMPLES[1], result, seed=1)
    assert "error" not in record  # answered, and wrong: not a failed request
    assert (record["is_correct"], record["prediction"], record["iou"]) == (False, None, 0.0)
    assert record["score_error"] == "OverflowError: int too large to convert to float"
    # a problem of the sample's own data is still the record's error, as before
    monkeypatch.setattr(runner, "score_completion", lambda text, sample, coords=None: (_ for _ in ()).throw(PhysReasonError("bad")))
    assert result_line(EVAL_SAMPLES[0], result, seed=1)["error"] == "bad"
