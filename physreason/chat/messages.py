"""Chat messages in the OpenAI / Hugging Face layout, with the prompts Cosmos-Reason1 expects.

Visual payloads are never embedded: each video or image becomes a `{"type": "video"}` or
`{"type": "image"}` placeholder, and the caller passes the frames to the processor or engine
separately, in the same order (videos first, then images).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from physreason.chat.mcq import AnswerType, format_mcq
from physreason.chat.prompts import (
    GRPO_SYSTEM_PROMPT,
    MCQ_SYSTEM_PROMPT,
    PLAIN_SYSTEM_PROMPT,
    REASONING_SYSTEM_PROMPT,
)
from physreason.errors import InputError

Message = dict[str, Any]


def build_messages(
    question: str,
    *,
    videos: Sequence[object] = (),
    images: Sequence[object] = (),
    reasoning: bool = True,
    system_prompt: str | None = None,
) -> list[Message]:
    """Return [system, user] messages for one question about the given videos and images.

    With reasoning, the format instruction lives in the system prompt, as in the Cosmos-Reason1
    model card; without it, the system prompt is Qwen2.5-VL's plain default. `system_prompt`
    replaces either as given (an empty string gives an empty system message). Media placeholders
    come before the text, as in the Cosmos-Reason1 benchmark and GRPO data sets.
    """
    if not question.strip():
        raise InputError("The question is empty; give the text the model should answer.")
    if system_prompt is None:
        system_prompt = REASONING_SYSTEM_PROMPT if reasoning else PLAIN_SYSTEM_PROMPT
    content: list[dict[str, str]] = [{"type": "video"} for _ in videos]
    content += [{"type": "image"} for _ in images]
    content.append({"type": "text", "text": question})
    return [
        {"role": "system", "content": system_prompt},
        {"role": "user", "content": content},
    ]


def build_mcq_messages(
    question: str,
    options: dict[str, str] | list[str],
    *,
    videos: Sequence[object] = (),
    images: Sequence[object] = (),
    answer_type: AnswerType = "reasoning",
) -> list[Message]:
    """Return [system, user] messages for a multiple-choice question, exactly as Cosmos-Reason1 builds them.

    answer_type "reasoning" and "letter" reproduce the benchmark (system prompt "Answer the
    questions.", format instruction appended to the user text); "grpo" reproduces the GRPO training
    data (empty system prompt, its own wording of the format instruction).
    """
    system_prompt = GRPO_SYSTEM_PROMPT if answer_type == "grpo" else MCQ_SYSTEM_PROMPT
    return build_messages(
        format_mcq(question, options, answer_type),
        videos=videos,
        images=images,
        system_prompt=system_prompt,
    )
