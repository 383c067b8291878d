"""GRPO prompts: both record layouts load, options are reshuffled per draw with the answer remapped, draws resume."""

from __future__ import annotations

import json
import random

import pytest
from media import write_clip

from physreason.config import DatasetConfig
from physreason.data.mcq import MCQPrompt, PromptStream, load_mcq_prompts, shuffled
from physreason.errors import InputError

OPTIONS = {"A": "forward", "B": "backward", "C": "left", "D": "right"}


def flat_prompts(count: int = 5) -> list[MCQPrompt]:
    return [MCQPrompt(f"q{i}", f"Question {i}?", dict(OPTIONS), "B") for i in range(count)]


def test_shuffled_options_keep_the_correct_text_under_the_new_letter():
    prompt = flat_prompts(1)[0]
    orders = set()
    for seed in range(20):
        moved = shuffled(prompt, random.Random(seed))
        assert moved.options[moved.answer] == "backward"
        assert sorted(moved.options.values()) == sorted(OPTIONS.values())
        assert list(moved.options) == list("ABCD")
        orders.add(tuple(moved.options.values()))
    assert len(orders) > 5


def test_stream_reshuffles_each_draw_and_resumes_at_its_cursor():
    prompts = flat_prompts(3)
    first = PromptStream(prompts, seed=4)
    drawn = first.draw(9)
    assert all(p.options[p.answer] == "backward" for p in drawn)
    assert {p.answer for p in drawn} != {"B"}  # the correct letter moves
    assert sorted(p.id for p in drawn[:3]) == ["q0", "q1", "q2"]  # one epoch visits each prompt once
    assert first.epoch == 3
    again = PromptStream(prompts, seed=4)
    again.cursor = 5
    assert again.draw(4) == drawn[5:]


def test_stream_without_shuffling_keeps_order_and_options():
    stream = PromptStream(flat_prompts(2), seed=0, shuffle=False, shuffle_options=False)
    assert [(p.id, p.answer) for p in stream.draw(3)] == [("q0", "B"), ("q1", "B"), ("q0", "B")]


def test_benchmark_layout_and_flat_records_load_with_media_inside_the_root(tmp_path):
    write_clip(tmp_path / "clips" / "a.mp4", n_frames=4)
    bench = [{"video": "clips/a.mp4", "qa_pairs": [
        {"question": "Is it falling?", "index2ans": {"A": "yes", "B": "no"}, "answer": "A"},
        {"question": "Is it red?", "index2ans": {"A": "yes", "B": "no"}, "correct_answer": "B"},
    ]}]
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    loaded = load_mcq_prompts(DatasetConfig(name=str(tmp_path / "bench.json")))
    assert [(p.id, p.answer) for p in loaded] == [("clips/a.mp4#0", "A"), ("clips/a.mp4#1", "B")]
    assert loaded[0].videos == ((tmp_path / "clips" / "a.mp4").resolve(),)
    assert loaded[0].messages()[1]["content"][0] == {"type": "video"}

    flat = [{"id": "x", "question": "Which way?", "options": ["up", "down"], "answer": "B"}]
    (tmp_path / "flat.jsonl").write_text("\n".join(json.dumps(r) for r in flat))
    (only,) = load_mcq_prompts(DatasetConfig(name=str(tmp_path / "flat.jsonl")))
    assert only.options == {"A": "up", "B": "down"} and only.videos == ()
    assert only.reward_fields() == {"answer": "B", "options": {"A": "up", "B": "down"}}


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"question": "Q?", "options": ["a", "b"], "answer": "C"}, "not one of the option letters"),
        ({"question": "", "options": ["a"], "answer": "A"}, "no 'question'"),
        ({"question": "Q?", "answer": "A"}, "no options"),
        ({"question": "Q?", "options": ["a"], "answer": "A", "video": "../outside.mp4"}, "outside the data folder"),
        # options of the wrong type: refused, never split into letters ("no" had become A: "n", B: "o")
        ({"question": "Q?", "options": "no", "answer": "A"}, "options must be an object .* got str 'no'"),
        ({"question": "Q?", "options": 5, "answer": "A"}, "options must be an object .* got int 5"),
        ({"question": "Q?", "options": {"a": "x", "b": "y"}, "answer": "a"}, "single capital letters"),
        ({"question": "Q?", "options": {"A": {"text": "x"}, "B": "y"}, "answer": "A"}, "must be a text"),
        # a Parquet struct of options with no text at all: no options, and no structured answer either
        ({"question": "Q?", "options": {"A": None, "B": None}, "answer": "A"}, "no options"),
    ],
)
def test_bad_records_name_the_record_and_the_problem(tmp_path, record, message):
    (tmp_path / "bad.jsonl").write_text(json.dumps(record))
    with pytest.raises(InputError, match=message) as error:
        load_mcq_prompts(DatasetConfig(name=str(tmp_path / "bad.jsonl")))
    assert "record 0" in str(error.value)


BOX_ANSWER = '[{"box_2d": [100, 200, 300, 400], "label": "ball"}]'


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"question": "Q?", "answer": '[{"box_2d": [300, 200, 100, 400]}]'}, "reversed or empty"),
        ({"question": "Q?", "answer": '[{"point_2d": [5, 10]}]', "box_2d": [1, 2, 3]}, "not four numbers"),
        ({"question": "Q?", "answer": '[{"point_2d": [-5, 10]}]'}, "not a finite number >= 0"),
        ({"question": "Q?", "answer": '[{"point_2d": [5, 10]}]', "box_2d": [1, 2, "x", 4]}, "its 'box_2d'"),
        ({"question": "Q?", "answer": BOX_ANSWER, "hit_threshold": 0.01}, r"\['hit_threshold'\].*grpo.reward_options"),
        ({"question": "Q?", "answer": BOX_ANSWER, "hit_weight": 9}, "name options of the reward"),
    ],
)
def test_structured_references_are_checked_when_the_records_load(tmp_path, record, message):
    """A reference a reward could not score, or a record field that would set a reward option for its own sample,
    stops the load naming the record (before: at the first rollout that drew it, or silently rescored)."""
    lines = [json.dumps({"question": "Fine?", "answer": BOX_ANSWER}), json.dumps(record)]
    (tmp_path / "rl.jsonl").write_text("\n".join(lines))
    with pytest.raises(InputError, match=message) as error:
        load_mcq_prompts(DatasetConfig(name=str(tmp_path / "rl.jsonl")))
    assert "record 1" in str(error.value)


def test_fields_physreason_sets_never_reach_the_rewards_from_a_record(tmp_path):
    """A record's `completion`, `coords`, `prompt_style` or `reasoning` is not a reward input: physreason gives
    those itself (a `completion` key made every reward raise and score 0; a `coords` key set the grid a
    reason2 box was read on)."""
    from physreason.train.rollout import completion_rewards

    record = {
        "question": "Where is the ball?",
        "answer": BOX_ANSWER,
        "completion": "a reference text",
        "coords": {"kind": "pixels", "width": 10, "height": 10},
        "reasoning": "some annotator's notes",
        "prompt_style": "reason1",
        "note": "kept",
    }
    (tmp_path / "rl.jsonl").write_text(json.dumps(record))
    (prompt,) = load_mcq_prompts(DatasetConfig(name=str(tmp_path / "rl.jsonl")))
    fields = prompt.reward_fields()
    assert fields["answer"] == BOX_ANSWER and fields["note"] == "kept"
    assert not {"completion", "coords", "reasoning", "prompt_style"} & set(fields)
    weights = {"box_iou": 1.0, "format": 0.5}
    scores = completion_rewards(BOX_ANSWER, prompt, weights, "reason2")
    assert scores["box_iou"] == pytest.approx(1.0) and scores["format"] == 1.0
    assert scores["total"] == pytest.approx(1.5)
