"""Rewards and scores of Cosmos-Reason2's structured answers: box IoU, point in box, temporal IoU, JSON layout.

The answers are parsed by `physreason.chat.structured` (layouts, and the decisions on several boxes,
swapped corners, clipping and end before start) from the shared extractor's answer region
(`answer_region`): the `<answer>` block of the Cosmos-Reason1 layout, else the text after `</think>`
(Cosmos-Reason2), else the whole completion; none when the reasoning never ended (cut off mid-reasoning). A box
of zero area covers nothing (IoU 0).

Coordinates: references are on the 0-1000 grid of the frame; a completion is read on its model's grid, the sample
field `coords` (a CoordSpace: Cosmos-Reason1's pixels of the frame it saw, or the 0-1000 grid; GRPO rollouts and
evaluation set it from the prompt style and the request's frame), and converted to 0-1000 before any comparison.
Without `coords` a completion is read on the 0-1000 grid.

The IoU rewards (box_iou, temporal_iou, localization) take two options (grpo.reward_options, IoUShaping): the
continuous IoU by default, a 0/1 hit at an IoU threshold, or a mix of both. Evaluation scores the plain IoU always.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from physreason.chat.structured import (
    NORM_1000,
    AnswerKind,
    Box,
    CoordSpace,
    Span,
    answer_kind,
    box_from,
    json_item,
    point_from,
    span_from,
)
from physreason.errors import ConfigError, InputError
from physreason.rewards.extract import answer_region
from physreason.rewards.registry import register_reward

IOU_HIT = 0.5  # accuracy at IoU 0.5 and temporal R@0.5 count an answer right from this overlap
NO_HIT_BONUS = 0.0  # the IoU rewards' default hit_weight: the continuous IoU alone


@dataclass(frozen=True)
class IoUShaping:
    """How an IoU in [0, 1] becomes a reward: (1 - hit_weight) x IoU + hit_weight x [IoU >= hit_threshold].

    hit_weight 0 (the default) is the continuous IoU, 1 the thresholded hit alone (the reward evaluation's acc@0.5
    counts, at the default threshold), values between a mix. The IoU rewards' options; ConfigError for values
    outside 0 < hit_threshold <= 1 and 0 <= hit_weight <= 1.
    """

    hit_threshold: float = IOU_HIT
    hit_weight: float = NO_HIT_BONUS

    def __post_init__(self) -> None:
        if not 0.0 < self.hit_threshold <= 1.0:
            # A threshold of 0 would pay every answer, parsed or not, the whole hit bonus.
            raise ConfigError(f"IoU reward option hit_threshold = {self.hit_threshold}: give a value in (0, 1]")
        if not 0.0 <= self.hit_weight <= 1.0:
            raise ConfigError(f"IoU reward option hit_weight = {self.hit_weight}: give a value in [0, 1]")

    def __call__(self, iou: float) -> float:
        """The reward of one IoU."""
        return (1.0 - self.hit_weight) * iou + self.hit_weight * float(iou >= self.hit_threshold)


def answer_item(text: str) -> dict[str, Any] | None:
    """The answer object of a completion: the JSON in its answer region (see the module docstring)."""
    region = answer_region(text)[0]
    return None if region is None else json_item(region)


def box_iou(a: Box | None, b: Box | None) -> float:
    """Intersection over union of two boxes; 0 when either is missing or the union is empty."""
    if a is None or b is None:
        return 0.0
    inter = max(0.0, min(a.x2, b.x2) - max(a.x1, b.x1)) * max(0.0, min(a.y2, b.y2) - max(a.y1, b.y1))
    union = a.area + b.area - inter
    return inter / union if union > 0 else 0.0


def span_iou(a: Span | None, b: Span | None) -> float:
    """Temporal IoU of two spans; 0 when either is missing or both are instants."""
    if a is None or b is None:
        return 0.0
    inter = max(0.0, min(a.end, b.end) - max(a.start, b.start))
    union = (a.end - a.start) + (b.end - b.start) - inter
    return inter / union if union > 0 else 0.0


def point_in(point: tuple[float, float] | None, box: Box | None) -> bool:
    """True when the point lies in the box, edges included."""
    return point is not None and box is not None and box.x1 <= point[0] <= box.x2 and box.y1 <= point[1] <= box.y2


def _reference(answer: str, parse: Any, what: str) -> Any:
    value = parse(answer_item(answer))
    if value is None:
        raise InputError(f"the sample's reference answer {answer[:80]!r} holds no valid {what}; fix the data record")
    return value


def _reference_kind(answer: str) -> AnswerKind:
    """The layout of the sample's reference answer; InputError (the data's fault, not the completion's) for none."""
    try:
        return answer_kind(answer)
    except ValueError as exc:
        raise InputError(f"{exc}; fix the data record") from None


@register_reward("box_iou", options=IoUShaping)
def box_iou_reward(
    completion: str,
    *,
    answer: str,
    hit_threshold: float = IOU_HIT,
    hit_weight: float = NO_HIT_BONUS,
    coords: CoordSpace | None = None,
    **sample: Any,
) -> float:
    """IoU of the completion's first `box_2d` (read on the `coords` grid) with the reference answer's box (0 when it
    has none), IoUShaping'd."""
    iou = box_iou(box_from(answer_item(completion), coords or NORM_1000), _reference(answer, box_from, "box_2d"))
    return IoUShaping(hit_threshold, hit_weight)(iou)


@register_reward("point_in_box")
def point_in_box_reward(
    completion: str,
    *,
    answer: str,
    box_2d: list[float] | None = None,
    coords: CoordSpace | None = None,
    **sample: Any,
) -> float:
    """1.0 when the completion's first `point_2d` (read on the `coords` grid) lies inside the body's box, else 0.0.

    The box is the sample's `box_2d` field (the point variant of grounding carries it beside its
    point answer), else the reference answer's own box.
    """
    if box_2d is None:
        box = _reference(answer, box_from, "box_2d")
    else:
        box = box_from({"box_2d": box_2d})
        if box is None:
            raise InputError(f"the sample's box_2d {box_2d!r} is not four numbers; fix the data record")
    return float(point_in(point_from(answer_item(completion), coords or NORM_1000), box))


@register_reward("temporal_iou", options=IoUShaping)
def temporal_iou_reward(
    completion: str,
    *,
    answer: str,
    hit_threshold: float = IOU_HIT,
    hit_weight: float = NO_HIT_BONUS,
    **sample: Any,
) -> float:
    """Temporal IoU of the completion's first start/end span with the reference answer's span, IoUShaping'd."""
    iou = span_iou(span_from(answer_item(completion)), _reference(answer, span_from, "start/end span"))
    return IoUShaping(hit_threshold, hit_weight)(iou)


@register_reward("json_format")
def json_format_reward(completion: str, *, answer: str, **sample: Any) -> float:
    """1.0 when the completion's answer is JSON in the reference answer's layout (box, point or span), else 0.0."""
    parse = {"box_2d": box_from, "point_2d": point_from, "time_span": span_from}[_reference_kind(answer)]
    return float(parse(answer_item(completion)) is not None)


@dataclass(frozen=True)
class LocalizationScore:
    """How one completion localises: its IoU (1/0 for a point in the box) and whether it counts as a hit."""

    kind: AnswerKind
    iou: float
    hit: bool


def score_localization(
    completion: str, answer: str, box_2d: list[float] | None = None, coords: CoordSpace | None = None
) -> LocalizationScore:
    """The evaluation score of a structured answer: box IoU, point in box, or temporal IoU, and the hit at 0.5.

    `coords` is the grid the completion's 2D coordinates are written on (None: 0-1000, the reference's)."""
    kind = _reference_kind(answer)
    if kind == "box_2d":  # the rewards' default options: the plain IoU
        iou = box_iou_reward(completion, answer=answer, coords=coords)
    elif kind == "point_2d":
        iou = point_in_box_reward(completion, answer=answer, box_2d=box_2d, coords=coords)
    else:
        iou = temporal_iou_reward(completion, answer=answer)
    return LocalizationScore(kind, iou, iou >= IOU_HIT)


@register_reward("localization", options=IoUShaping)
def localization_reward(
    completion: str,
    *,
    answer: str,
    box_2d: list[float] | None = None,
    hit_threshold: float = IOU_HIT,
    hit_weight: float = NO_HIT_BONUS,
    coords: CoordSpace | None = None,
    **sample: Any,
) -> float:
    """The IoU the reference's layout calls for: box IoU, point in box, or temporal IoU (for files that mix them),
    IoUShaping'd (a point's 0/1 stays as it is at any threshold in (0, 1])."""
    return IoUShaping(hit_threshold, hit_weight)(score_localization(completion, answer, box_2d, coords).iou)
