"""Box IoU, point in box, temporal IoU and the JSON format reward on well-formed, fenced, hostile and broken answers."""

from __future__ import annotations

import json

import pytest

from physreason.chat.structured import Box, Span, format_time, parse_json, parse_time
from physreason.errors import ConfigError, InputError
from physreason.rewards import compute_rewards
from physreason.rewards.localization import (
    IoUShaping,
    box_iou,
    box_iou_reward,
    json_format_reward,
    point_in_box_reward,
    score_localization,
    span_iou,
    temporal_iou_reward,
)

BOX_REF = json.dumps([{"box_2d": [100, 200, 300, 400], "label": "the red ball"}])
SPAN_REF = json.dumps([{"start": "00:01.00", "end": "00:02.00", "caption": "the red ball falls"}])
POINT_REF = json.dumps([{"point_2d": [200, 300], "label": "the red ball"}])


def reason1(answer: str) -> str:
    """The Cosmos-Reason1 layout: the answer inside <answer> tags."""
    return f"<think>\nI look at the frame.\n</think>\n\n<answer>\n{answer}\n</answer>"


def reason2(answer: str) -> str:
    """The Cosmos-Reason2 layout: the answer right after </think>, no tags."""
    return f"<think>\nI look at the frame.\n</think>\n\n{answer}"


LAYOUTS = [pytest.param(reason1, id="reason1"), pytest.param(reason2, id="reason2"), pytest.param(str, id="bare")]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_exact_box_scores_one_in_every_layout_and_fence(layout):
    fenced = "```json\n" + BOX_REF + "\n```"
    for answer in (BOX_REF, fenced, 'Here it is: {"box_2d": [100, 200, 300, 400]} as asked.'):
        assert box_iou_reward(layout(answer), answer=BOX_REF) == 1.0
        assert json_format_reward(layout(answer), answer=BOX_REF) == 1.0


def test_box_iou_is_the_overlap_ratio_and_swapped_corners_are_sorted():
    half = json.dumps({"box_2d": [200, 200, 300, 400]})  # half the reference, inside it
    assert box_iou_reward(reason2(half), answer=BOX_REF) == pytest.approx(0.5)
    swapped = json.dumps({"box_2d": [300, 400, 100, 200]})
    assert box_iou_reward(reason2(swapped), answer=BOX_REF) == 1.0
    disjoint = json.dumps({"box_2d": [500, 500, 600, 600]})
    assert box_iou_reward(reason2(disjoint), answer=BOX_REF) == 0.0


def test_boxes_outside_the_frame_are_clipped_to_0_1000():
    assert box_iou(Box(0, 0, 1000, 1000), Box(0, 0, 1000, 1000)) == 1.0
    wild = json.dumps({"box_2d": [-500, -500, 2000, 2000]})
    ref = json.dumps({"box_2d": [0, 0, 1000, 1000]})
    assert box_iou_reward(reason2(wild), answer=ref) == 1.0


def test_zero_area_boxes_score_zero_and_never_divide_by_zero():
    line = json.dumps({"box_2d": [100, 200, 100, 400]})
    assert box_iou_reward(reason2(line), answer=BOX_REF) == 0.0
    assert box_iou(Box(5, 5, 5, 5), Box(5, 5, 5, 5)) == 0.0
    assert json_format_reward(reason2(line), answer=BOX_REF) == 1.0  # well-formed, just wrong


def test_several_boxes_score_the_first_only():
    first_right = json.dumps([{"box_2d": [100, 200, 300, 400]}, {"box_2d": [0, 0, 10, 10]}])
    first_wrong = json.dumps([{"box_2d": [0, 0, 10, 10]}, {"box_2d": [100, 200, 300, 400]}])
    assert box_iou_reward(reason2(first_right), answer=BOX_REF) == 1.0
    assert box_iou_reward(reason2(first_wrong), answer=BOX_REF) == 0.0


@pytest.mark.parametrize(
    "answer",
    [
        "",
        "no box here",
        '{"box_2d": [1, 2, 3]}',
        '{"box_2d": [1, 2, 3, "4"]}',
        '{"box_2d": [true, 2, 3, 4]}',
        '{"box_2d": [NaN, 2, 3, 4]}',
        '{"box_2d": [1, 2, 3, 4}',  # truncated
        '{"point_2d": [1, 2]}',
        "[]",
        '"a string"',
    ],
)
def test_malformed_box_answers_score_zero(answer):
    assert box_iou_reward(reason2(answer), answer=BOX_REF) == 0.0
    assert json_format_reward(reason2(answer), answer=BOX_REF) == 0.0


def test_qwen3_vl_bbox_2d_key_is_read_as_a_box():
    assert box_iou_reward(reason2('[{"bbox_2d": [100, 200, 300, 400]}]'), answer=BOX_REF) == 1.0


def test_point_in_box_uses_the_sample_box_and_counts_edges():
    box = [100, 200, 300, 400]
    for point, inside in (([200, 300], True), ([100, 400], True), ([99, 300], False), ([200, 401], False)):
        completion = reason2(json.dumps({"point_2d": point}))
        assert point_in_box_reward(completion, answer=POINT_REF, box_2d=box) == float(inside)
    assert point_in_box_reward(reason1('{"point_2d": [150, 250]}'), answer=BOX_REF) == 1.0  # box from the answer
    with pytest.raises(InputError, match="box_2d"):
        point_in_box_reward(reason2('{"point_2d": [1, 2]}'), answer=POINT_REF)  # no box anywhere
    assert json_format_reward(reason2('{"point_2d": [1, 2]}'), answer=POINT_REF) == 1.0
    assert json_format_reward(reason2('{"point_2d": [1]}'), answer=POINT_REF) == 0.0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_temporal_iou_of_spans_in_every_layout(layout):
    assert temporal_iou_reward(layout("```json\n" + SPAN_REF + "\n```"), answer=SPAN_REF) == 1.0
    half = json.dumps({"start": "00:01.50", "end": "00:02.00"})
    assert temporal_iou_reward(layout(half), answer=SPAN_REF) == pytest.approx(0.5)
    outside = json.dumps({"start": "00:02.50", "end": "00:03.00"})
    assert temporal_iou_reward(layout(outside), answer=SPAN_REF) == 0.0


def test_end_before_start_is_no_answer():
    backwards = json.dumps({"start": "00:02.00", "end": "00:01.00"})
    assert temporal_iou_reward(reason2(backwards), answer=SPAN_REF) == 0.0
    assert json_format_reward(reason2(backwards), answer=SPAN_REF) == 0.0
    instant = json.dumps({"start": "00:01.50", "end": "00:01.50"})
    assert temporal_iou_reward(reason2(instant), answer=SPAN_REF) == 0.0
    assert span_iou(Span(1, 1), Span(1, 1)) == 0.0


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("00:01.50", 1.5), ("00:01.5", 1.5), ("00:00.100", 0.1), ("01:02", 62.0), ("1:02.25", 62.25), (" 00:03.00 ", 3.0)],
)
def test_mm_ss_ff_times_parse(text, seconds):
    assert parse_time(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["00:60.00", "1.5", "00:01.5000", "00-01.50", "a:bc", "", "00:01.", 1.5, None, "0:1"])
def test_bad_time_forms_are_rejected(text):
    assert parse_time(text) is None


def test_format_time_round_trips_hundredths():
    for seconds in (0.0, 0.5, 1.25, 2.99, 61.07):
        assert parse_time(format_time(seconds)) == pytest.approx(seconds)
    assert format_time(1.5) == "00:01.50"


def test_hostile_input_parses_in_linear_time_without_recursion_errors():
    # Deep nesting and long runs of brackets and digits: each parser tries a fixed number of positions.
    for text in ("[" * 200_000, "{" * 200_000, '{"box_2d": [' + "1," * 200_000, "0:" * 200_000 + "00.1"):
        assert parse_json(text) is None or isinstance(parse_json(text), (list, dict))
        assert box_iou_reward(reason2(text), answer=BOX_REF) == 0.0
    assert parse_time("1" * 100_000 + ":00") is None


def test_a_reference_without_its_layout_is_a_clear_input_error():
    with pytest.raises(InputError, match="reference answer"):
        box_iou_reward(reason2(BOX_REF), answer="B")
    with pytest.raises(InputError, match="start/end"):
        temporal_iou_reward(reason2(SPAN_REF), answer=BOX_REF)


def test_registry_runs_the_rewards_by_name_with_sample_fields():
    values = compute_rewards(reason2(BOX_REF), {"box_iou": 1.0, "json_format": 0.5}, answer=BOX_REF)
    assert values == {"box_iou": 1.0, "json_format": 1.0, "total": 1.5}


def test_score_localization_counts_hits_at_iou_one_half():
    assert score_localization(reason2(BOX_REF), BOX_REF).hit
    assert not score_localization(reason2('{"box_2d": [0, 0, 150, 250]}'), BOX_REF).hit
    span = score_localization(reason2('{"start": "00:01.00", "end": "00:01.60"}'), SPAN_REF)
    assert (span.kind, span.hit) == ("time_span", True) and span.iou == pytest.approx(0.6)
    point = score_localization(reason2('{"point_2d": [150, 250]}'), POINT_REF, box_2d=[100, 200, 300, 400])
    assert (point.kind, point.iou, point.hit) == ("point_2d", 1.0, True)


def test_localization_reward_follows_each_references_layout():
    from physreason.rewards.localization import localization_reward

    assert localization_reward(reason2(BOX_REF), answer=BOX_REF) == 1.0
    assert (
        localization_reward(reason2('{"point_2d": [150, 250]}'), answer=POINT_REF, box_2d=[100, 200, 300, 400]) == 1.0
    )
    assert localization_reward(reason2('{"start": "00:01.50", "end": "00:02.00"}'), answer=SPAN_REF) == 0.5


@pytest.mark.parametrize(
    ("iou", "shaping", "reward"),
    [
        (0.3, IoUShaping(), 0.3),  # the default: the continuous IoU
        (0.49, IoUShaping(hit_weight=1.0), 0.0),
        (0.5, IoUShaping(hit_weight=1.0), 1.0),  # the threshold itself is a hit, as acc@0.5 counts it
        (0.0, IoUShaping(hit_weight=1.0), 0.0),
        (1.0, IoUShaping(hit_threshold=1.0, hit_weight=1.0), 1.0),
        (0.99, IoUShaping(hit_threshold=1.0, hit_weight=1.0), 0.0),
        (0.6, IoUShaping(hit_weight=0.5), 0.5 * 0.6 + 0.5),  # a mix
        (0.4, IoUShaping(hit_weight=0.5), 0.5 * 0.4),
        (0.4, IoUShaping(hit_threshold=0.3, hit_weight=0.25), 0.75 * 0.4 + 0.25),
    ],
)
def test_iou_shaping_is_the_iou_the_hit_or_their_mix(iou, shaping, reward):
    assert shaping(iou) == pytest.approx(reward)


@pytest.mark.parametrize(
    "options",
    [{"hit_threshold": 0.0}, {"hit_threshold": 1.5}, {"hit_threshold": float("nan")}, {"hit_weight": -0.1},
     {"hit_weight": 1.01}, {"hit_weight": float("nan")}],
)  # fmt: skip
def test_iou_shaping_refuses_values_outside_its_ranges(options):
    with pytest.raises(ConfigError, match=next(iter(options))):
        IoUShaping(**options)


def test_iou_reward_options_reach_box_span_and_localization_rewards_through_compute_rewards():
    half_box = reason2(json.dumps({"box_2d": [200, 200, 300, 400]}))  # IoU 0.5 with BOX_REF
    third_span = reason2(json.dumps({"start": "00:01.50", "end": "00:03.00"}))  # tIoU 0.5 / 2.0 = 0.25 with SPAN_REF
    hit = {"hit_weight": 1.0}
    assert compute_rewards(half_box, {"box_iou": 1.0}, {"box_iou": hit}, answer=BOX_REF)["box_iou"] == 1.0
    strict = {"hit_weight": 1.0, "hit_threshold": 0.75}
    assert compute_rewards(half_box, {"box_iou": 1.0}, {"box_iou": strict}, answer=BOX_REF)["box_iou"] == 0.0
    assert compute_rewards(half_box, {"localization": 1.0}, {"localization": hit}, answer=BOX_REF)["total"] == 1.0
    mix = {"temporal_iou": {"hit_weight": 0.5, "hit_threshold": 0.2}}
    assert compute_rewards(third_span, {"temporal_iou": 2.0}, mix, answer=SPAN_REF)["total"] == pytest.approx(
        2.0 * (0.5 * 0.25 + 0.5)
    )
    # options reach only the reward they are given to; the default stays the plain IoU
    values = compute_rewards(half_box, {"box_iou": 1.0, "localization": 1.0}, {"localization": hit}, answer=BOX_REF)
    assert values["box_iou"] == pytest.approx(0.5) and values["localization"] == 1.0


def test_iou_reward_options_leave_unparsed_answers_and_points_as_they_were():
    hit = {"hit_weight": 1.0, "hit_threshold": 0.1}
    for garbage in ("no json here", reason2("{"), reason2(json.dumps({"box_2d": [1, 2]}))):
        assert compute_rewards(garbage, {"localization": 1.0}, {"localization": hit}, answer=BOX_REF)["total"] == 0.0
    inside, outside = reason2(json.dumps({"point_2d": [150, 250]})), reason2(json.dumps({"point_2d": [900, 900]}))
    for options in ({}, {"hit_weight": 0.5}, hit, {"hit_weight": 1.0, "hit_threshold": 1.0}):
        kw = {"answer": POINT_REF, "box_2d": [100, 200, 300, 400]}
        assert compute_rewards(inside, {"localization": 1.0}, {"localization": options}, **kw)["total"] == 1.0
        assert compute_rewards(outside, {"localization": 1.0}, {"localization": options}, **kw)["total"] == 0.0


def test_evaluation_scores_the_plain_iou_whatever_the_reward_options():
    half_box = reason2(json.dumps({"box_2d": [200, 200, 300, 400]}))
    score = score_localization(half_box, BOX_REF)
    assert score.iou == pytest.approx(0.5) and score.hit


@pytest.mark.parametrize(
    ("reference", "answer", "fields"),
    [
        (BOX_REF, '[{"box_2d": [110, 200, 300, 410]}]', {}),  # IoU 0.9: right, though its text differs
        (BOX_REF, '[{"box_2d": [100, 200, 150, 250]}]', {}),  # IoU 0.0625: wrong
        (SPAN_REF, '[{"start": "00:01.10", "end": "00:02.00"}]', {}),
        (SPAN_REF, '[{"start": "00:01.90", "end": "00:03.00"}]', {}),
        (POINT_REF, '[{"point_2d": [150, 250]}]', {"box_2d": [100, 200, 300, 400]}),
        (POINT_REF, '[{"point_2d": [50, 50]}]', {"box_2d": [100, 200, 300, 400]}),
    ],
)
def test_accuracy_of_a_structured_answer_is_the_hit_that_evaluation_counts(reference, answer, fields):
    from physreason.eval.benchmark import EvalSample
    from physreason.eval.scoring import score_completion

    sample = EvalSample(id="v#0", video="v.mp4", answer=reference, reference=fields)
    for layout in (reason1, reason2):
        rewards = compute_rewards(layout(answer), {"accuracy": 1.0}, answer=reference, **fields)
        assert rewards["accuracy"] == float(score_completion(layout(answer), sample).is_correct)
    assert compute_rewards(reason1(answer), {"accuracy": 1.0}, answer=reference, **fields)["accuracy"] == float(
        score_localization(reason1(answer), reference, fields.get("box_2d")).iou >= 0.5
    )


@pytest.mark.parametrize(
    ("reference", "text", "readable"),
    [
        (BOX_REF, "8 8 8 8 8 8", False),  # no JSON at all: what a random model writes
        (BOX_REF, '[{"point_2d": [150, 250]}]', False),  # JSON, not the reference's layout
        (BOX_REF, '[{"box_2d": [0, 0, 10, 10]}]', True),  # readable, and wrong
        (SPAN_REF, "the ball falls at one second", False),
        (SPAN_REF, '[{"start": "00:05.00", "end": "00:06.00"}]', True),
    ],
)
def test_a_structured_answer_without_json_in_the_references_layout_is_unparsed(reference, text, readable):
    from physreason.eval.benchmark import EvalSample
    from physreason.eval.scoring import score_completion

    score = score_completion(reason1(text), EvalSample(id="v#0", video="v.mp4", answer=reference))
    assert (score.prediction is not None) == readable and not score.is_correct
    assert score.prediction is None or score.prediction == text
