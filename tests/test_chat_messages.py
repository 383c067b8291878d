"""Message building: where the prompts go, media placeholders, and golden snapshots of rendered prompts.

The snapshots under tests/fixtures/chat/ make any prompt change a visible diff. After an intended
change, rewrite them with `PHYSREASON_UPDATE_GOLDEN=1 pytest tests/test_chat_messages.py` and
review the diff.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from physreason.chat import prompts
from physreason.chat.messages import Message, build_mcq_messages, build_messages
from physreason.errors import InputError

GOLDEN_DIR = Path(__file__).parent / "fixtures" / "chat"
QUESTION = "Is the video playing forward or backward?"
OPTIONS = {"A": "forward", "B": "backward"}


def test_reasoning_prompt_goes_in_the_system_message() -> None:
    messages = build_messages(QUESTION, videos=["clip"])
    assert messages[0] == {"role": "system", "content": prompts.REASONING_SYSTEM_PROMPT}
    assert messages[1] == {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": QUESTION}]}


def test_plain_prompt_without_reasoning() -> None:
    assert build_messages(QUESTION, reasoning=False)[0]["content"] == "You are a helpful assistant."


def test_explicit_system_prompt_replaces_the_default_even_when_empty() -> None:
    assert build_messages(QUESTION, system_prompt="")[0] == {"role": "system", "content": ""}


def test_media_placeholders_come_first_videos_then_images_in_order() -> None:
    content = build_messages(QUESTION, videos=[1, 2], images=[3])[1]["content"]
    assert [part["type"] for part in content] == ["video", "video", "image", "text"]


def test_empty_question_is_an_input_error() -> None:
    with pytest.raises(InputError, match="question is empty"):
        build_messages(" \n")


def test_mcq_messages_use_the_benchmark_system_prompt_and_user_instruction() -> None:
    messages = build_mcq_messages(QUESTION, OPTIONS, videos=["clip"])
    assert messages[0]["content"] == "Answer the questions."
    assert messages[1]["content"][1]["text"].endswith("<answer> your single letter answer </answer>.")


def test_grpo_mcq_messages_have_an_empty_system_prompt() -> None:
    assert build_mcq_messages(QUESTION, OPTIONS, answer_type="grpo")[0]["content"] == ""


def _render(messages: list[Message]) -> str:
    from physreason.models.tiny import build_tiny_tokenizer

    return build_tiny_tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


# name -> the text whose exact characters are pinned.
SNAPSHOTS = {
    "system_reasoning.txt": lambda: prompts.REASONING_SYSTEM_PROMPT,
    "mcq_user_reasoning.txt": lambda: build_mcq_messages(QUESTION, OPTIONS)[1]["content"][0]["text"],
    "rendered_free_reasoning_video.txt": lambda: _render(build_messages(QUESTION, videos=["clip"])),
    "rendered_free_plain_image.txt": lambda: _render(build_messages(QUESTION, images=["frame"], reasoning=False)),
    "rendered_mcq_reasoning_video.txt": lambda: _render(build_mcq_messages(QUESTION, OPTIONS, videos=["clip"])),
    "rendered_mcq_letter_video.txt": lambda: _render(
        build_mcq_messages(QUESTION, OPTIONS, videos=["clip"], answer_type="letter")
    ),
    "rendered_mcq_grpo_video.txt": lambda: _render(
        build_mcq_messages(QUESTION, OPTIONS, videos=["clip"], answer_type="grpo")
    ),
}


@pytest.mark.parametrize("name", sorted(SNAPSHOTS))
def test_prompt_matches_golden_snapshot(name: str) -> None:
    text = SNAPSHOTS[name]()
    path = GOLDEN_DIR / name
    if os.environ.get("PHYSREASON_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8", newline="")
    assert path.read_text(encoding="utf-8") == text, f"{name} changed; if intended, see this file's docstring"
