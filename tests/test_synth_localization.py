"""`grounding` and `temporal_localization`: answers true of the pixels and the simulation, in Cosmos-Reason2's JSON."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from physreason.chat.prompts import GROUNDING_PROMPT, TEMPORAL_LOCALIZATION_PROMPT
from physreason.chat.structured import format_time
from physreason.data.synth.generate import build_sample, generate_task
from physreason.data.synth.tasks import JSON_TASK_NAMES, TASKS
from physreason.rewards.localization import answer_item, json_format_reward, score_localization

GROUNDING_INDICES = range(8)


def _colour_mask(frame: np.ndarray, colour: list[int]) -> np.ndarray:
    return np.all(np.abs(frame.astype(int) - colour) <= 3, axis=-1)  # [H, W]


@pytest.mark.parametrize("task", JSON_TASK_NAMES)
def test_same_seed_same_sample_and_slots_balance_the_variants(task):
    _, first = build_sample(task, "train", 2, 3)
    _, again = build_sample(task, "train", 2, 3)
    assert first.frames.tobytes() == again.frames.tobytes() and first.answer == again.answer
    n = TASKS[task].n_slots
    labels = Counter(build_sample(task, "train", 0, i)[1].label for i in range(n))
    assert len(labels) == n and set(labels.values()) == {1}


@pytest.mark.parametrize("task", JSON_TASK_NAMES)
def test_answers_are_reason2_json_that_scores_one_against_itself(task):
    for index in range(4):
        _, sample = build_sample(task, "val", 0, index)
        assert sample.options == {} and sample.user_text() == sample.question
        assistant = sample.assistant_text()
        assert assistant.endswith(f"</think>\n\n{sample.answer}") and "<answer>" not in assistant
        score = score_localization(assistant, sample.answer, sample.reference.get("box_2d"))
        assert score.iou == 1.0 and score.hit
        assert json_format_reward(assistant, answer=sample.answer) == 1.0


@pytest.mark.parametrize("index", GROUNDING_INDICES)
def test_grounding_box_encloses_the_bodys_pixels_tightly(index):
    _, sample = build_sample("grounding", "train", 1, index)
    frame = sample.frames[sample.facts["frame"]]
    height, width = frame.shape[:2]
    x1, y1, x2, y2 = sample.facts["box_2d"]
    mask = _colour_mask(frame, sample.facts["colour"])
    rows, cols = np.nonzero(mask)
    assert len(rows) > 10
    # Every pixel of the body's colour lies in the box (one pixel of slack for rounding to the 0-1000 grid) ...
    assert cols.min() >= x1 * width / 1000 - 1.5 and cols.max() <= x2 * width / 1000 + 1.5
    assert rows.min() >= y1 * height / 1000 - 1.5 and rows.max() <= y2 * height / 1000 + 1.5
    # ... and the box is tight: the body's colour reaches within a few pixels of each edge (outline is darker).
    assert cols.min() <= x1 * width / 1000 + 4 and cols.max() >= x2 * width / 1000 - 4
    assert rows.min() <= y1 * height / 1000 + 4 and rows.max() >= y2 * height / 1000 - 4
    item = answer_item(sample.answer)
    if sample.label == "box_2d":
        assert item["box_2d"] == sample.facts["box_2d"] and sample.question.startswith(GROUNDING_PROMPT.split("{")[0])
    else:
        assert item["point_2d"] == sample.facts["point_2d"] and sample.reference == {"box_2d": sample.facts["box_2d"]}
    assert f"in the frame at {format_time(sample.facts['frame'] / 8)}." in sample.question


@pytest.mark.parametrize("index", range(8))
def test_temporal_spans_are_the_simulations_events(index):
    seed, sample = build_sample("temporal_localization", "train", 1, index)
    item = answer_item(sample.answer)
    start, end = sample.facts["start_s"], sample.facts["end_s"]
    assert end - start >= 0.25 and end <= 23 / 8
    assert item["caption"] in sample.question and sample.question.endswith(
        TEMPORAL_LOCALIZATION_PROMPT.split(". ", 1)[1]
    )
    if sample.label == "fall":
        assert start == 0.0
    if sample.label == "hidden":  # no pixel of the body shows from the span's first frame to its last
        first, last = round(start * 8), round(end * 8)
        assert last >= first + 2
        seen = [int(_colour_mask(frame, sample.facts["colour"]).sum()) for frame in sample.frames]
        assert seen[0] > 20 and all(count == 0 for count in seen[first : last + 1])


def test_generate_task_writes_json_answers_with_ground_truth_and_resumes(tmp_path):
    first = generate_task("grounding", 2, tmp_path, "val", base_seed=3, show_progress=False)
    again = generate_task("grounding", 2, tmp_path, "val", base_seed=3, show_progress=False)
    assert (first.generated, again.generated, again.reused) == (2, 0, 2)
    folder = tmp_path / "grounding"
    qa = json.loads((folder / "grounding_benchmark_qa_pairs.json").read_text())
    sft = [json.loads(line) for line in (folder / "grounding_sft.jsonl").read_text().splitlines()]
    meta = json.loads((folder / "meta.json").read_text())
    for entry, line in zip(qa, sft):
        pairs = entry["qa_pairs"]
        assert "index2ans" not in pairs and answer_item(pairs["answer"]) is not None
        user, assistant = line["conversations"]
        assert user["content"] == pairs["question"] and assistant["content"].endswith("\n\n" + pairs["answer"])
    assert {e["qa_pairs"].get("box_2d") is not None for e in qa} == {True, False}  # one point, one box question
    assert meta["answer_balance"] == {} and sum(meta["class_balance"].values()) == 2
    assert "grounding 0" in meta["scene_seeds"]["rule"]


def test_eval_and_grpo_read_the_json_tasks_and_score_them_by_iou(tmp_path):
    from physreason.config.schema import DatasetConfig
    from physreason.data.mcq import load_mcq_prompts
    from physreason.eval import load_benchmark
    from physreason.eval.scoring import score_completion
    from physreason.rewards.rules import format_reward

    generate_task("grounding", 2, tmp_path, "test", show_progress=False)
    benchmark = load_benchmark("grounding", tmp_path)
    prompts = load_mcq_prompts(DatasetConfig(name=str(tmp_path / "grounding" / "grounding_benchmark_qa_pairs.json")))
    for sample, prompt in zip(benchmark.samples, prompts, strict=True):
        assert sample.structured and sample.error is None and prompt.options == {}
        perfect = f"<think>\nlooking\n</think>\n\n{sample.answer}"
        assert score_completion(perfect, sample).iou == 1.0 and score_completion(perfect, sample).is_correct
        assert score_completion("<think>\n.\n</think>\n\nno idea", sample).iou == 0.0
        messages = prompt.messages("letter", "reason2")
        assert messages[0]["content"] == "You are a helpful assistant."
        assert messages[1]["content"][-1]["text"] == sample.question  # Cosmos-Reason2's prompt, as written
        pixels = prompt.messages("letter", "reason1", (280, 392))[1]["content"][-1]["text"]
        assert pixels.startswith(sample.question + " ") and "392x280 pixels" in pixels  # Reason1 grounds in pixels
        fields = prompt.reward_fields()
        assert fields["answer"] == sample.answer and ("box_2d" in fields) == ("point_2d" in sample.answer)
        assert format_reward(perfect) == 0.0  # the Reason1 format reward does not apply: json_format does
