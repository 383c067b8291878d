"""Multiple-choice formatting and answer-preserving option shuffles."""

from __future__ import annotations

import random

import pytest

from physreason.chat.mcq import OPTION_LETTERS, format_mcq, lettered_options, shuffle_options
from physreason.errors import InputError

OPTIONS = {"A": "forward", "B": "backward", "C": "sideways", "D": "it does not move"}


def test_format_mcq_matches_the_benchmark_layout() -> None:
    assert format_mcq("Is the video playing forward or backward?", ["forward", "backward"]) == (
        "Is the video playing forward or backward?\n"
        "(A) forward\n"
        "(B) backward\n"
        "Answer with the option's letter from the given choices directly.\n"
        "Please answer the question in the following format: "
        "<think> your reasoning </think> <answer> your single letter answer </answer>."
    )


def test_format_mcq_letter_mode_omits_the_reasoning_instruction() -> None:
    text = format_mcq("Q?", OPTIONS, answer_type="letter")
    assert text.endswith("(D) it does not move\nAnswer with the option's letter from the given choices directly.")
    assert "<think>" not in text


def test_format_mcq_grpo_mode_uses_the_training_wording() -> None:
    assert format_mcq("Q?", OPTIONS, answer_type="grpo").endswith("<answer> your answer </answer>.")


def test_format_mcq_keeps_dict_order_and_letters() -> None:
    lines = format_mcq("Q?", {"B": "second", "A": "first"}).splitlines()
    assert lines[1:3] == ["(B) second", "(A) first"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ([], "at least one option"),
        ({"1": "x"}, "single capital letters"),
        ({"a": "x"}, "single capital letters"),
        ([str(i) for i in range(27)], "at most 26"),
        ("AB", "object of {letter: text} or a list of texts; got str 'AB'"),
        (3, "got int 3"),
        ({"A": None}, "at least one option"),
        (["x", ["y"]], "must be a text"),
        ({"A": True}, "must be a text"),
    ],
)
def test_lettered_options_rejects_unusable_options(options: object, message: str) -> None:
    with pytest.raises(InputError, match=message):
        lettered_options(options)  # type: ignore[arg-type]


def test_format_mcq_rejects_unknown_answer_type() -> None:
    with pytest.raises(InputError, match="'essay'"):
        format_mcq("Q?", OPTIONS, answer_type="essay")  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", range(200))
def test_shuffle_options_keeps_the_correct_text_under_the_new_answer_letter(seed: int) -> None:
    for answer, text in OPTIONS.items():
        shuffled, new_answer = shuffle_options(OPTIONS, answer, random.Random(seed))
        assert shuffled[new_answer] == text
        assert list(shuffled) == list(OPTIONS)
        assert sorted(shuffled.values()) == sorted(OPTIONS.values())


def test_shuffle_options_moves_the_answer_across_seeds() -> None:
    new_letters = {shuffle_options(OPTIONS, "A", random.Random(seed))[1] for seed in range(50)}
    assert new_letters == set("ABCD")


def test_shuffle_options_is_reproducible_for_a_seed() -> None:
    assert shuffle_options(OPTIONS, "C", random.Random(7)) == shuffle_options(OPTIONS, "C", random.Random(7))


def test_shuffle_options_rejects_an_answer_that_is_no_option() -> None:
    with pytest.raises(InputError, match="'E'"):
        shuffle_options(OPTIONS, "E", random.Random(0))


def test_option_letters_are_the_capital_alphabet() -> None:
    assert OPTION_LETTERS == "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def test_letters_without_text_are_no_options() -> None:
    # Parquet and Arrow store {letter: text} as a struct: a question with fewer options has None under the rest
    assert lettered_options({"A": "x", "B": "y", "C": None}) == {"A": "x", "B": "y"}
