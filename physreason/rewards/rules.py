"""The built-in rule-based rewards of Cosmos-Reason1 GRPO: strict format, and answer accuracy."""

from __future__ import annotations

import re
from typing import Any

from physreason.chat.parse import parse_completion
from physreason.chat.structured import answer_kind
from physreason.errors import InputError
from physreason.rewards.extract import extract_answer
from physreason.rewards.localization import score_localization
from physreason.rewards.registry import register_reward

_LETTER_ANSWER = re.compile(r"^[(\[]?[A-Za-z][)\]]?$")


@register_reward("format")
def format_reward(completion: str, *, prompt_style: str = "reason1", reasoning: bool = True, **sample: Any) -> float:
    """Return 1.0 when the completion has exactly the layout its prompt style (and reasoning mode) asks for, else 0.0.

    reason1: `<think>...</think>\\n\\n<answer>...</answer>`, "exactly" being what `parse_completion` reports
    no problem for: each tag once, in order, nothing before `<think>`, a blank line between the blocks, at
    most a newline after `</answer>`, and a non-empty answer (cosmos-rl's `format` reward accepts an empty
    answer and repeated answer tags; this one does not). reason2: one `<think>...</think>` block at the start,
    then a non-empty answer, no `<answer>` tags (`parse_reason2`). `reasoning` False (a question asked without
    reasoning): a non-empty answer (`parse_plain`). Reasoning that never ended scores 0 in every layout.
    """
    return 0.0 if parse_completion(completion, prompt_style, reasoning).problems else 1.0


@register_reward("accuracy", aliases=("single_choice",))
def accuracy_reward(
    completion: str, *, answer: str, options: dict[str, str] | list[str] | None = None, **sample: Any
) -> float:
    """Return 1.0 when the completion's extracted answer equals the sample's `answer`, else 0.0.

    Multiple choice when `options` are given or `answer` is a lone letter: the answer may be a
    letter or an option's text, and letters are compared. A structured `answer` (box_2d, point_2d or
    a time span) is right at IoU >= 0.5, as evaluation counts it. Otherwise both sides are compared as
    normalised free-form text. One extractor serves both sides and evaluation alike. Registered
    also as "single_choice", the name cosmos-rl recipes use.
    """
    if options is None and _is_structured(answer):
        # the exact JSON text almost never matches: GRPO's accuracy on these tasks would read 0 for a model that
        # localises well, while evaluation counts the same answer right
        return float(score_localization(completion, answer, sample.get("box_2d"), sample.get("coords")).hit)
    multiple_choice = options is not None or bool(_LETTER_ANSWER.match(answer.strip()))
    reference = extract_answer(answer, options, multiple_choice=multiple_choice)
    if reference is None:
        raise InputError(
            f"The sample's answer {answer!r} names no option of {options!r}; "
            "give the correct option's letter (or its exact text)."
            if multiple_choice
            else "The sample's answer is empty; every sample needs a reference answer."
        )
    return 1.0 if extract_answer(completion, options, multiple_choice=multiple_choice) == reference else 0.0


def _is_structured(answer: str) -> bool:
    """Whether a reference answer is a box, point or time span in Cosmos-Reason2's JSON layout."""
    try:
        answer_kind(answer)
    except ValueError:
        return False
    return True
