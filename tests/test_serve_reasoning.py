"""The <think>/<answer> splitter behind the server's reasoning parser: exact splits, streamed and whole."""

from __future__ import annotations

import random

import pytest

from physreason.serve.reasoning import (
    ReasoningSplitter,
    output_opens_inside_think,
    prompt_opens_think,
    split_reasoning,
)

REASON1 = "<think>\nThe square falls under gravity.\nIt speeds up.\n</think>\n\n<answer>\nA\n</answer>"

CASES = [
    # (output, think opened by the prompt, reasoning, content)
    (REASON1, False, "The square falls under gravity.\nIt speeds up.", "A"),
    (REASON1 + "\n", False, "The square falls under gravity.\nIt speeds up.", "A"),
    ("The cup is full.\n</think>\n\n<answer>\nNo, wait.\n</answer>", True, "The cup is full.", "No, wait."),
    ("<answer>B</answer>", False, None, "B"),
    ("<answer>\nB\n</answer>", True, None, "B"),  # Reason2 answering without reasoning
    ("no tags at all", False, None, "no tags at all"),
    ("  leading blanks, no tags\n", False, None, "  leading blanks, no tags\n"),
    ("<think>\ncut off while reason", False, "cut off while reason", None),
    ("<think>r</think>\n\n<answer>\ncut off answ", False, "r", "cut off answ"),
    ("<think>r</think>\n\nThe answer is B.", False, "r", "The answer is B."),
    ("<think>r\n<answer>C</answer>", False, "r", "C"),  # </think> missing
    ("<think>r</think><answer>A</answer>\n\nextra", False, "r", "A\n\nextra"),
    ("<think></think>\n\n<answer>D</answer>", False, None, "D"),
    ("Sure. <think>r</think><answer>A</answer>", False, None, "Sure. <think>r</think><answer>A</answer>"),
    ("<think>r</thi", False, "r</thi", None),
]


@pytest.mark.parametrize(("text", "think_open", "reasoning", "content"), CASES)
def test_whole_output_splits_into_reasoning_and_answer(text, think_open, reasoning, content):
    assert split_reasoning(text, think_open=think_open) == (reasoning, content)


def streamed(text: str, think_open: bool, cuts: list[int]) -> tuple[str, str]:
    splitter = ReasoningSplitter(think_open=think_open)
    reasoning, content = "", ""
    for start, end in zip([0, *cuts], [*cuts, len(text)]):
        piece = splitter.feed(text[start:end])
        reasoning, content = reasoning + piece.reasoning, content + piece.content
    last = splitter.finish()
    return reasoning + last.reasoning, content + last.content


@pytest.mark.parametrize(("text", "think_open", "reasoning", "content"), CASES)
def test_streamed_pieces_add_up_to_the_whole_split_for_any_chunking(text, think_open, reasoning, content):
    rng = random.Random(0)
    chunkings = [list(range(1, len(text)))]  # one character at a time: every tag arrives split
    chunkings += [sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 6)))) for _ in range(30)]
    for cuts in chunkings:
        assert streamed(text, think_open, cuts) == (reasoning or "", content or "")


def test_a_tag_being_written_is_held_back_until_it_is_decided():
    splitter = ReasoningSplitter()
    assert splitter.feed("<thi").reasoning == "" and splitter.feed("nk>\nstep one").reasoning == "step one"
    held = splitter.feed("\n</th")
    assert (held.reasoning, held.content) == ("", "")  # blanks and a half tag could still close the reasoning
    assert splitter.feed("ink>\n\n<answer>\nA").content == "A"
    assert splitter.feed("\n</answer>").content == ""
    assert splitter.finish().content == ""


def test_reasoning_streams_before_the_answer_arrives():
    splitter = ReasoningSplitter(think_open=True)
    assert splitter.feed("The ball ").reasoning == "The ball"
    assert splitter.feed("bounces").reasoning == " bounces"


def test_the_prompt_tail_tells_whether_think_is_open():
    assert prompt_opens_think("<|im_start|>assistant\n<think>\n")
    # Cosmos-Reason1: the system prompt shows the tags, the generation prompt opens none
    assert not prompt_opens_think("<answer>\nyour answer\n</answer>.<|im_end|>\n<|im_start|>assistant\n")
    assert not prompt_opens_think("<think>x</think><|im_end|>\n<|im_start|>assistant\n")


def test_a_close_before_any_open_means_the_prompt_opened_think():
    assert output_opens_inside_think("r\n</think>\n\n<answer>A</answer>")
    assert not output_opens_inside_think(REASON1)
    assert not output_opens_inside_think("no tags")
    assert split_reasoning("r\n</think>\n\n<answer>A</answer>") == ("r", "A")
