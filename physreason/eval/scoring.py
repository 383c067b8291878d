"""Scoring: one completion against its sample, and mean/std of accuracies over repeats (pure functions)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from physreason.chat.structured import CoordSpace
from physreason.eval.benchmark import EvalSample
from physreason.rewards import accuracy_reward, answer_region, extract_answer
from physreason.rewards.localization import json_format_reward, score_localization


@dataclass(frozen=True)
class Score:
    """What was read from a completion and whether it is right; `iou` for a structured answer.

    Multiple choice: the option letter (None when none could be read). Structured: the answer region's text
    (None when it holds no JSON in the reference's layout), its IoU with the reference (box, or time span; 1/0 for a
    point in the body's box), right when IoU >= 0.5 (accuracy at IoU 0.5, temporal R@0.5).
    """

    prediction: str | None
    is_correct: bool
    iou: float | None = None


def score_completion(text: str, sample: EvalSample, coords: CoordSpace | None = None) -> Score:
    """Score a completion with the extractor rewards use; raises InputError if the sample's answer names no option.

    `coords`: the grid a 2D grounding answer is written on (Cosmos-Reason1's pixels of the frame it saw, or 0-1000);
    None reads it on the 0-1000 grid of the reference."""
    if sample.structured:
        score = score_localization(text, sample.answer, sample.reference.get("box_2d"), coords)
        # an answer that is not JSON in the reference's layout is unparsed, as a letter task's answer without a letter
        readable = json_format_reward(text, answer=sample.answer) == 1.0
        prediction = answer_region(text)[0].strip() if readable else None
        return Score(prediction=prediction or None, is_correct=score.hit, iou=score.iou)
    correct = accuracy_reward(text, answer=sample.answer, options=sample.options) == 1.0
    return Score(prediction=extract_answer(text, sample.options), is_correct=correct)


def accuracy(correct: int, scored: int) -> float | None:
    """Fraction of scored samples answered correctly; None when nothing was scored."""
    return correct / scored if scored else None


def standard_error(values: list[float]) -> float | None:
    """Standard error of the mean (sample std / sqrt(n)); None for fewer than two values."""
    _, std = mean_std(values)
    return None if std is None else std / math.sqrt(len(values))


def mean_std(values: list[float]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (n - 1 denominator); std is None for fewer than two values."""
    if not values:
        return None, None
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, None
    variance = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return mean, math.sqrt(variance)
