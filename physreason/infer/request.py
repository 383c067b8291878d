"""Build engine requests from a question and media files, and turn results into records."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from physreason.chat.parse import parse_completion
from physreason.chat.style import Prompting, StyleName
from physreason.config import VisionConfig
from physreason.engines.base import GenerationRequest, GenerationResult
from physreason.vision import load_image, load_video
from physreason.vision.resize import PATCH_FACTOR


def build_request(
    question: str,
    *,
    videos: Sequence[str | Path] = (),
    images: Sequence[str | Path] = (),
    vision: VisionConfig | None = None,
    prompting: Prompting | None = None,
    system_prompt: str | None = None,
    request_id: str | None = None,
    factor: int = PATCH_FACTOR,
) -> GenerationRequest:
    """Decode and sample the media and build the chat messages for one question in the prompt style's layout.

    prompting: style, reasoning mode and system prompt (models.inputs.prompting_for); None is Cosmos-Reason1
    with reasoning. system_prompt (a batch record's own) replaces the style's. factor: the model's patch factor
    (models.inputs.patch_factor: 28 Qwen2.5-VL, 32 Qwen3-VL).
    """
    vision = vision or VisionConfig()
    prompting = prompting or Prompting()
    if system_prompt is not None:
        prompting = replace(prompting, system_prompt=system_prompt)
    frames = [load_video(v, vision, factor) for v in videos]
    pictures = [load_image(i, vision, factor) for i in images]
    messages = prompting.messages(question, videos=frames, images=pictures)
    return GenerationRequest(messages=messages, images=pictures, videos=frames, request_id=request_id)


def result_record(result: GenerationResult, style: StyleName = "reason1", reasoning: bool = True) -> dict[str, Any]:
    """A JSON-ready record: each completion's text, parsed reasoning and answer, and its format problems against
    the layout the question was asked for (the style's, in the reasoning mode `reasoning`)."""
    record: dict[str, Any] = {"id": result.request_id}
    if result.error is not None:
        record["error"] = result.error
        return record
    record["prompt_tokens"] = len(result.prompt_token_ids)
    outputs = []
    for completion in result.completions:
        parsed = parse_completion(completion.text, style, reasoning)
        outputs.append(
            {
                "text": completion.text,
                "reasoning": parsed.think,
                "answer": parsed.answer,
                "format_problems": parsed.problems,
                "finish_reason": completion.finish_reason,
                "completion_tokens": len(completion.token_ids),
            }
        )
    record["outputs"] = outputs
    return record
