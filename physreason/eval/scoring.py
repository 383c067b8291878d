"""Scoring: one completion against its sample, and mean/std of accuracies over repeats (pure functions)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from physreason.eval.benchmark import EvalSample
from physreason.rewards import accuracy_reward, extract_answer


@dataclass(frozen=True)
class Score:
    """The option letter read from a completion (None when none could be read) and whether it is right."""

    prediction: str | None
    is_correct: bool


def score_completion(text: str, sample: EvalSample) -> Score:
    """Score a completion with the extractor rewards use; raises InputError if the sample's answer names no option."""
    correct = accuracy_reward(text, answer=sample.answer, options=sample.options) == 1.0
    return Score(prediction=extract_answer(text, sample.options), is_correct=correct)


def accuracy(correct: int, scored: int) -> float | None:
    """Fraction of scored samples answered correctly; None when nothing was scored."""
    return correct / scored if scored else None


def mean_std(values: list[float]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (n - 1 denominator); std is None for fewer than two values."""
    if not values:
        return None, None
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, None
    variance = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return mean, math.sqrt(variance)
