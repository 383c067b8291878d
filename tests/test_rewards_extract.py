"""The shared answer extractor on a table of tricky completions."""

from __future__ import annotations

import pytest

from physreason.rewards import extract, extract_answer, normalize_answer

OPTIONS = {"A": "the ball", "B": "the cup", "C": "left", "D": "right"}
WELL_FORMED = "<think>\nThe cup is on the table.\n</think>\n\n<answer>\n{}\n</answer>"

# (completion, expected letter) with OPTIONS given.
MULTIPLE_CHOICE_CASES = [
    (WELL_FORMED.format("B"), "B"),
    (WELL_FORMED.format("(B)"), "B"),
    (WELL_FORMED.format("(b)"), "B"),
    (WELL_FORMED.format("b"), "B"),
    (WELL_FORMED.format("B."), "B"),
    (WELL_FORMED.format("B)"), "B"),
    (WELL_FORMED.format("[C]"), "C"),
    (WELL_FORMED.format("B) the cup"), "B"),
    (WELL_FORMED.format("b) the cup"), "B"),
    (WELL_FORMED.format("(D) right"), "D"),
    (WELL_FORMED.format("C. left"), "C"),
    (WELL_FORMED.format("Answer: C."), "C"),
    (WELL_FORMED.format("The answer is B"), "B"),
    (WELL_FORMED.format("The correct answer is (d)."), "D"),
    (WELL_FORMED.format("The answer would be option C"), "C"),
    (WELL_FORMED.format("**C**"), "C"),
    (WELL_FORMED.format("the cup"), "B"),
    (WELL_FORMED.format("The Cup."), "B"),
    (WELL_FORMED.format("Left"), "C"),
    (WELL_FORMED.format("The answer is right."), "D"),
    (WELL_FORMED.format("\u00a0B\u3000"), "B"),  # no-break space and ideographic space
    (WELL_FORMED.format("\u200bB\u200b"), "B"),  # zero-width spaces
    (WELL_FORMED.format("\uff22"), "B"),  # full-width B
    (WELL_FORMED.format("Because"), None),  # the B of a word is no option
    (WELL_FORMED.format("Doubtful"), None),  # nor the D
    (WELL_FORMED.format(""), None),  # empty answer
    (WELL_FORMED.format("E"), None),  # a letter that is no option
    (WELL_FORMED.format("A ball falls"), None),  # the article "A" is no option
    (WELL_FORMED.format("The answer is a ball"), None),  # nor is the lower-case article
    (WELL_FORMED.format("Option A is wrong; the answer is (c)"), "C"),  # the answer phrase beats "option"
    ("B", "B"),  # no tags: the whole text
    ("The answer is C.", "C"),  # no tags, a phrase
    ("<think>\nThe ball is heavier than A.\n</think>\n\nD", "D"),  # no answer tags: text after </think>
    ("<answer>A</answer> wait, <answer>C</answer>", "C"),  # repeated tags: the last pair
    ("<answer><answer>B</answer></answer>", "B"),  # nested tags: the innermost pair
    ("<think>x</think>\n\n<answer>\nD", "D"),  # unclosed answer, as when generation stops at </answer>
    ("<think>x</think>\n\nB</answer>", "B"),  # stray closing tag
    ("<think>\nMaybe B? Maybe C?\n</think>", None),  # two candidate letters, no commitment
    ("So I pick B", "B"),  # pronoun "I" followed by a word is no letter
    # Hedges: an answer naming two different options commits to neither.
    (WELL_FORMED.format("A or B"), None),
    (WELL_FORMED.format("A, C"), None),
    (WELL_FORMED.format("A and B"), None),
    (WELL_FORMED.format("(A) or (C)"), None),
    (WELL_FORMED.format("B/D"), None),
    (WELL_FORMED.format("B & D"), None),
    (WELL_FORMED.format("either A or B"), None),
    (WELL_FORMED.format("A, B, C or D"), None),
    (WELL_FORMED.format("The answer is B or C."), None),
    (WELL_FORMED.format("The answer is (b) or (d)"), None),
    (WELL_FORMED.format("Option C or option D"), None),
    (WELL_FORMED.format("The answer is C or option D"), None),
    # Not hedges: one option, the other excluded, or a word that only looks like a letter.
    (WELL_FORMED.format("The answer is A, not B"), "A"),
    (WELL_FORMED.format("B, because the cup is lighter"), "B"),
    (WELL_FORMED.format("B or a ball"), "B"),
    (WELL_FORMED.format("Answer: B. A is wrong because it rolls"), "B"),
    ("<think>It is A or B.</think>\n\n<answer>B</answer>", "B"),  # hesitation while thinking is fine
    ("It is between A and B. The answer is B.", "B"),  # no tags: the answer phrase decides
]


@pytest.mark.parametrize(("completion", "expected"), MULTIPLE_CHOICE_CASES)
def test_extract_answer_reads_option_letters(completion: str, expected: str | None) -> None:
    assert extract_answer(completion, OPTIONS) == expected


def test_extract_answer_accepts_options_as_a_list() -> None:
    assert extract_answer(WELL_FORMED.format("the cup"), list(OPTIONS.values())) == "B"


def test_extract_answer_without_options_reads_any_letter_when_told_multiple_choice() -> None:
    assert extract_answer(WELL_FORMED.format("(h)"), multiple_choice=True) == "H"
    assert extract_answer(WELL_FORMED.format("the cup"), multiple_choice=True) is None


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        (WELL_FORMED.format("Yes"), "yes"),
        (WELL_FORMED.format("  The answer is   YES. "), "yes"),
        (WELL_FORMED.format("The red\u00a0 car"), "the red car"),
        (WELL_FORMED.format("3.5 m/s"), "3.5 m/s"),
        (WELL_FORMED.format(""), None),
        ("Moving forward.", "moving forward"),
    ],
)
def test_extract_answer_normalises_free_form_answers(completion: str, expected: str | None) -> None:
    assert extract_answer(completion) == expected


def test_extract_reports_whether_the_answer_came_from_tags() -> None:
    assert extract(WELL_FORMED.format("B"), OPTIONS).tagged is True
    fallback = extract("<think>x</think>\n\nB", OPTIONS)
    assert fallback.tagged is False
    assert fallback.answer == "B"


def test_normalize_answer_equates_case_whitespace_and_trailing_punctuation() -> None:
    assert normalize_answer("  Answer:  The\tRed CAR!! ") == normalize_answer("the red car")


@pytest.mark.parametrize("hedge", ["A or B", "A, C", "A and B", "The answer is B or C"])
def test_hedged_answer_scores_zero_in_rewards_and_eval_alike(hedge: str) -> None:
    from physreason.eval.benchmark import EvalSample
    from physreason.eval.scoring import score_completion
    from physreason.rewards import accuracy_reward

    completion = WELL_FORMED.format(hedge)
    for answer in ("A", "B", "C"):
        assert accuracy_reward(completion, answer=answer, options=OPTIONS) == 0.0
        score = score_completion(completion, EvalSample(id="v#0", video="v.mp4", options=OPTIONS, answer=answer))
        assert score.prediction is None and not score.is_correct
