"""Where a completion's answer is, and which layout its format is checked against, agree in every reader.

A completion cut off mid-reasoning (an unclosed `<think>`) has no answer in the rewards, evaluation, infer records and
the served reasoning split alike; a question asked without reasoning is checked against a bare answer, not Reason1's
tags.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from media import write_clip

from physreason.chat.parse import parse_completion
from physreason.chat.style import Prompting
from physreason.config import SamplingConfig, VisionConfig
from physreason.data.mcq import MCQPrompt
from physreason.engines.base import Completion, Engine, GenerationResult
from physreason.eval.benchmark import Benchmark, EvalSample
from physreason.eval.results import shard_file
from physreason.eval.runner import evaluate_shard
from physreason.eval.scoring import score_completion
from physreason.infer import result_record
from physreason.rewards import accuracy_reward, extract_answer, format_reward, get_reward
from physreason.serve.reasoning import split_reasoning
from physreason.train.rollout import completion_rewards

OPTIONS = {"A": "it rises", "B": "it falls"}
LAYOUTS = [("reason1", True), ("reason2", True), ("reason1", False), ("reason2", False)]
BOX = json.dumps({"box_2d": [100, 200, 300, 400], "label": "the ball"})

CUT_OFF = [
    "<think>\nThe ball falls, so the answer is B",  # stopped by max_tokens mid-reasoning
    "<think>\nThe answer is (B) because it falls",
    "<think>\nI will answer B.</answer>",  # a stray close tag does not end the reasoning
    "Let me see. <think>\nit falls: B",  # text before the reasoning is no answer either
    f"<think>\nThe ball is at {BOX}",
]


@pytest.mark.parametrize("text", CUT_OFF)
def test_a_completion_cut_off_mid_reasoning_has_no_answer_in_any_reader(text: str) -> None:
    assert extract_answer(text, OPTIONS) is None
    assert extract_answer(text) is None
    assert accuracy_reward(text, answer="B", options=OPTIONS) == 0.0
    for style, reasoning in LAYOUTS:
        parsed = parse_completion(text, style, reasoning)
        assert parsed.answer is None, (style, reasoning)
        assert format_reward(text, prompt_style=style, reasoning=reasoning) == 0.0, (style, reasoning)
    if text.startswith("<think>"):  # the served split keeps output that opens with plain text whole, as content
        assert split_reasoning(text)[1] is None  # reasoning only, no content
    mcq = EvalSample(id="x", video="c.mp4", question="q", options=OPTIONS, answer="B")
    assert score_completion(text, mcq).prediction is None and not score_completion(text, mcq).is_correct
    for name in ("box_iou", "localization", "json_format"):
        assert get_reward(name)(text, answer=BOX) == 0.0, name
    box = EvalSample(id="y", video="c.mp4", question="q", answer=BOX)
    assert score_completion(text, box).iou == 0.0
    record = result_record(GenerationResult("0", [1], [Completion(text, [1], [], "length")]), "reason2", False)
    assert record["outputs"][0]["answer"] is None
    assert "no answer after the reasoning" in record["outputs"][0]["format_problems"]


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("<think>\nThe ball falls.\n</think>\n\nB", "B"),  # the same reasoning, ended: its answer counts
        ("<think>\nThe ball falls.\n</think>\n\n<answer>\nB\n</answer>", "B"),
        ("<think>\nThe ball falls.\n<answer>B</answer>", "B"),  # <answer> opened the answer: reasoning ended there
        ("<think>\nx\n</think>\n\nB\n<think>\nand then A", "B"),  # an answer before a reasoning cut off later
        ("B", "B"),  # no reasoning asked or written: the whole text
    ],
)
def test_an_answer_outside_the_reasoning_is_read_everywhere(text: str, answer: str) -> None:
    assert extract_answer(text, OPTIONS) == answer
    assert accuracy_reward(text, answer="B", options=OPTIONS) == 1.0
    mcq = EvalSample(id="x", video="c.mp4", question="q", options=OPTIONS, answer="B")
    assert score_completion(text, mcq).is_correct


def test_a_question_asked_without_reasoning_is_checked_against_a_bare_answer() -> None:
    for style in ("reason1", "reason2"):
        assert parse_completion("B", style, reasoning=False).problems == []
        assert format_reward("B", prompt_style=style, reasoning=False) == 1.0
        assert parse_completion(" ", style, reasoning=False).problems == ["empty answer"]
        # a model that reasons anyway, and closes its reasoning, still answered
        assert parse_completion("<think>\nx\n</think>\n\nB", style, reasoning=False).problems == []
    # Reason2's layout has no <answer> tags, asked with reasoning or not; Reason1's plain answer may carry them
    assert parse_completion("<answer>B</answer>", "reason2", reasoning=False).problems[0].startswith("<answer> tags")
    assert parse_completion("<answer>B</answer>", "reason1", reasoning=False).problems == []
    # with reasoning, each style's own layout is checked, as before
    assert "missing <answer>" in parse_completion("<think>\nx\n</think>\n\nB", "reason1").problems
    assert parse_completion("<think>\nx\n</think>\n\nB", "reason2").problems == []
    assert "missing <think>" in parse_completion("B", "reason2").problems


def test_infer_records_check_the_layout_of_the_mode_asked() -> None:
    result = GenerationResult("0", [1], [Completion("B", [1], [], "stop")])
    assert result_record(result, "reason2", False)["outputs"][0]["format_problems"] == []
    assert result_record(result, "reason1", False)["outputs"][0]["format_problems"] == []
    assert "missing <think>" in result_record(result, "reason2", True)["outputs"][0]["format_problems"]


def test_grpo_format_reward_checks_the_layout_its_prompt_asked_for() -> None:
    weights = {"format": 1.0}
    letter = MCQPrompt("q-0", "Does it fall?", OPTIONS, "B")
    assert completion_rewards("B", letter, weights, "reason2", None, "letter")["format"] == 1.0
    assert completion_rewards("B", letter, weights, "reason2", None, "grpo")["format"] == 0.0
    assert completion_rewards("<think>\nB", letter, weights, "reason1", None, "letter")["format"] == 0.0
    # a structured question is asked as Cosmos-Reason2 asks it, without reasoning, whatever the recipe's style;
    # a "reasoning" field in its record does not change that (nor collide with the layout's keyword)
    box = MCQPrompt("b-0", "Where is the ball?", {}, BOX, reference={"reasoning": "some text"})
    # (a Reason1 model answers boxes in pixels of the frame it saw: the rollout passes that frame's size)
    assert completion_rewards(BOX, box, weights, "reason1", None, "grpo", frame_size=(280, 392))["format"] == 1.0


class ScriptedEngine:
    """Answers each request with the next scripted text."""

    vision_factor = 28

    def __init__(self, texts: list[str]) -> None:
        self.texts = list(texts)

    def generate(self, requests, sampling, *, logprobs=True):
        return [
            GenerationResult(r.request_id, [1, 2], [Completion(self.texts.pop(0), [1], [], "stop")]) for r in requests
        ]


def test_eval_results_check_the_layout_asked_and_credit_no_cut_off_answer(tmp_path) -> None:
    write_clip(tmp_path / "c.mp4", n_frames=4, size=(56, 56))
    samples = [
        EvalSample(id=f"c.mp4#{k}", video="c.mp4", question="Does it fall?", options=OPTIONS, answer="B")
        for k in range(2)
    ]
    samples.append(EvalSample(id="c.mp4#2", video="c.mp4", question="Where is the ball?", answer=BOX))
    bench = Benchmark("mini", tmp_path, samples)
    vision = VisionConfig(min_pixels=3136, max_pixels=3136, total_pixels=3136 * 4)

    def run(prompting: Prompting, texts: list[str], name: str) -> list[dict]:
        evaluate_shard(
            ScriptedEngine(texts), bench, tmp_path / name, prompting=prompting, sampling=SamplingConfig(), vision=vision
        )
        return [json.loads(line) for line in shard_file(tmp_path / name, 0, 1).read_text().splitlines()]

    plain = run(Prompting("reason2", False), ["B", "A", BOX], "plain")
    assert [r["format_problems"] for r in plain] == [[], [], []]
    assert [r["is_correct"] for r in plain] == [True, False, True]
    thinking = run(Prompting("reason2", True), ["<think>\nso B", "<think>\nit falls\n</think>\n\nB", BOX], "reasoning")
    assert [(r["prediction"], r["is_correct"]) for r in thinking[:2]] == [(None, False), ("B", True)]
    assert "no answer after the reasoning" in thinking[0]["format_problems"]
    assert thinking[1]["format_problems"] == []
    assert thinking[2]["format_problems"] == []  # structured: asked without reasoning whatever the run's mode
    reason1 = run(Prompting("reason1", False), ["B", "(A)", BOX], "reason1-letter")
    assert [r["format_problems"] for r in reason1] == [[], [], []]


@pytest.mark.slow
def test_infer_in_reason2_plain_mode_prints_no_reason1_format_problems(tiny_model_dirs, tmp_path) -> None:
    clip = write_clip(tmp_path / "c.mp4", n_frames=4, size=(56, 56))
    result = subprocess.run(
        [sys.executable, "-m", "physreason", "infer", "--model", str(tiny_model_dirs["qwen3_vl"]), "--dtype",
         "float32", "--video", str(clip), "--question", "Is it falling?", "--max-tokens", "4", "--temperature", "0",
         "--max-pixels", "3136", "--total-pixels", str(3136 * 4), "--set", "vision.min_pixels=3136"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "answer" in result.stdout
    assert "missing <think>" not in result.stdout and "missing </think>" not in result.stdout
    assert "missing <answer>" not in result.stdout


@pytest.mark.parametrize(
    ("text", "shown", "hidden"),
    [
        ("<think>\nit falls, so the answer is B", "(none: the reasoning never ended)", "missing <answer>"),
        ("<think>\nit falls\n</think>\n\nB", "B", "missing"),
    ],
)
def test_infer_prints_the_answer_the_rewards_read_and_the_problems_of_the_mode_asked(
    tiny_model_dirs, monkeypatch, text, shown, hidden
) -> None:
    from typer.testing import CliRunner

    import physreason.engines
    from physreason.cli import app

    class Scripted(Engine):  # infer closes the engine it built: the stand-in is an Engine
        def generate(self, requests, sampling, *, logprobs=True):
            return [GenerationResult(r.request_id, [1], [Completion(text, [1], [], "length")]) for r in requests]

        def update_weights(self, named_tensors):
            raise AssertionError("infer never pushes weights")

    monkeypatch.setattr(physreason.engines, "create_engine", lambda model, engine: Scripted())
    model = str(tiny_model_dirs["qwen3_vl"])
    result = CliRunner().invoke(app, ["infer", "--model", model, "--question", "Does it fall?", "--reasoning"])
    assert result.exit_code == 0, result.output
    answer_panel = result.output[result.output.index("completion: answer") :]
    assert shown in answer_panel and "so the answer is B" not in answer_panel
    assert hidden not in result.output
