"""The strict format reward and the accuracy reward."""

from __future__ import annotations

import pytest

from physreason.errors import InputError
from physreason.rewards import accuracy_reward, format_reward

GOOD = "<think>\nThe ball rolls left.\n</think>\n\n<answer>\nC\n</answer>"


@pytest.mark.parametrize(
    "completion",
    [
        GOOD,
        GOOD + "\n",  # one final newline, as cosmos-rl's `$` allows
        "<think>short</think>\n\n<answer>C</answer>",  # inner newlines are not required
        "<think>\n\n</think>\n\n<answer>\nC\n</answer>",  # empty reasoning is still the format
    ],
)
def test_format_reward_accepts_the_cosmos_reason1_layout(completion: str) -> None:
    assert format_reward(completion) == 1.0


@pytest.mark.parametrize(
    "completion",
    [
        GOOD + " I hope that helps.",  # text after </answer>
        GOOD + "\n\n",  # more than one newline after </answer>
        GOOD.replace("</think>\n\n<answer>", "</think>\n<answer>"),  # missing blank line
        GOOD.replace("</think>\n\n<answer>", "</think><answer>"),
        GOOD.replace("</think>\n\n<answer>", "</think>\n\nSo:\n<answer>"),
        "<answer>\nC\n</answer>",  # missing think
        "The ball rolls left.\n</think>\n\n<answer>\nC\n</answer>",  # missing <think>
        "<think>\nThe ball rolls left.\n</think>",  # missing answer
        "<think>\nx\n</think>\n\n<answer>\nC",  # unclosed answer
        " " + GOOD,  # text before <think>
        "Sure! " + GOOD,
        "<think>x</think>\n\n<answer>\n\n</answer>",  # empty answer
        "<think>x</think>\n\n<answer>A</answer><answer>C</answer>",  # repeated answer
        "<think>x<think>y</think>\n\n<answer>C</answer>",  # nested think
        "<answer>C</answer>\n\n<think>x</think>",  # out of order
        "",
    ],
)
def test_format_reward_rejects_every_deviation(completion: str) -> None:
    assert format_reward(completion) == 0.0


def test_format_reward_ignores_sample_fields() -> None:
    assert format_reward(GOOD, answer="A", options=["x", "y", "z"]) == 1.0


@pytest.mark.parametrize(
    ("completion", "answer", "options", "expected"),
    [
        (GOOD, "C", None, 1.0),
        (GOOD, "c", None, 1.0),
        (GOOD, "(C)", None, 1.0),
        (GOOD, "B", None, 0.0),
        (GOOD, "C", {"A": "up", "B": "down", "C": "left"}, 1.0),
        (GOOD, "left", {"A": "up", "B": "down", "C": "left"}, 1.0),  # reference given as option text
        (GOOD.replace("\nC\n", "\nleft\n"), "C", ["up", "down", "left"], 1.0),
        (GOOD.replace("\nC\n", "\nBecause\n"), "B", None, 0.0),
        (GOOD.replace("\nC\n", "\nYes.\n"), "yes", None, 1.0),  # free-form
        (GOOD.replace("\nC\n", "\nno\n"), "yes", None, 0.0),
        ("C", "C", None, 1.0),  # accuracy does not require the format
    ],
)
def test_accuracy_reward_compares_extracted_answers(
    completion: str, answer: str, options: dict[str, str] | list[str] | None, expected: float
) -> None:
    assert accuracy_reward(completion, answer=answer, options=options) == expected


def test_accuracy_reward_names_a_reference_that_is_no_option() -> None:
    with pytest.raises(InputError, match="'sideways'"):
        accuracy_reward(GOOD, answer="sideways", options=["up", "down", "left"])


def test_accuracy_reward_rejects_an_empty_reference() -> None:
    with pytest.raises(InputError, match="empty"):
        accuracy_reward(GOOD, answer="  ")
