"""Parsing completions into think and answer, with human-readable format problems."""

from __future__ import annotations

import pytest

from physreason.chat.parse import ParsedCompletion, parse_completion


def test_well_formed_completion_has_no_problems_and_stripped_parts() -> None:
    parsed = parse_completion("<think>\nThe ball falls.\n</think>\n\n<answer>\nB\n</answer>")
    assert parsed == ParsedCompletion(think="The ball falls.", answer="B", problems=[])


@pytest.mark.parametrize(
    ("text", "think", "answer", "problem"),
    [
        ("<think>x</think>\n\n<answer>B</answer> done", "x", "B", "text after </answer>"),
        (
            "<think>x</think>\n<answer>B</answer>",
            "x",
            "B",
            "expected a blank line (\\n\\n) between </think> and <answer>, found '\\n'",
        ),
        ("<answer>B</answer>", None, "B", "missing <think>"),
        ("x</think>\n\n<answer>B</answer>", "x", "B", "missing <think>"),
        ("<think>x\n\n<answer>B</answer>", "x", "B", "missing </think>"),
        ("<think>x</think>\n\n<answer>B", "x", "B", "missing </answer>"),
        ("<think>x</think>\n\nB</answer>", "x", "B", "missing <answer>"),
        ("<think>x</think>", "x", None, "missing <answer>"),
        ("Hi <think>x</think>\n\n<answer>B</answer>", "x", "B", "text before <think>"),
        ("<think>x</think>\n\n<answer> </answer>", "x", "", "empty answer"),
        ("<think>x</think>\n\n<answer>A</answer><answer>B</answer>", "x", "B", "more than one <answer>"),
        (
            "<answer>B</answer>\n\n<think>x</think>",
            "x",
            "B",
            "tags out of order: expected <think>, </think>, <answer>, </answer>",
        ),
    ],
)
def test_parse_completion_extracts_leniently_and_names_the_problem(
    text: str, think: str | None, answer: str | None, problem: str
) -> None:
    parsed = parse_completion(text)
    assert (parsed.think, parsed.answer) == (think, answer)
    assert problem in parsed.problems


def test_plain_text_has_neither_part_and_every_tag_missing() -> None:
    parsed = parse_completion("The answer is B.")
    assert (parsed.think, parsed.answer) == (None, None)
    assert parsed.problems == ["missing <think>", "missing </think>", "missing <answer>", "missing </answer>"]
