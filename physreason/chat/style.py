"""Prompt styles: how each Cosmos-Reason generation is asked a question, and its sampling defaults per mode.

- reason1 (Cosmos-Reason1, Qwen2.5-VL): the reasoning format lives in the system prompt, the answer is wrapped
  in `<answer>` tags; media come first in the user turn, videos before images.
- reason2 (Cosmos-Reason2, Qwen3-VL; nvidia-cosmos/cosmos-reason2 at commit a3b4a1d): system prompt
  "You are a helpful assistant."; images, then videos, then the text in the user turn
  (cosmos_reason2_utils/text.py `create_conversation`); reasoning is opt-in by appending the reasoning
  instruction to the user text after a blank line (script/inference.py); the answer follows `</think>` directly.

2D grounding coordinates follow the generation's base model: reason1 (Qwen2.5-VL) writes absolute pixels of the
frame as the model sees it, reason2 (Qwen3-VL) a 0-1000 grid per axis (`coord_space`; chat.structured.CoordSpace).

A recipe's `[prompt] style = "auto"` is resolved from the checkpoint's family (physreason.models.family), never
from its name: Qwen3-VL (dense or MoE) is reason2, everything else reason1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from physreason.chat.mcq import AnswerType, format_mcq, lettered_options
from physreason.chat.prompts import (
    GRPO_SYSTEM_PROMPT,
    MCQ_LETTER_INSTRUCTION,
    MCQ_SYSTEM_PROMPT,
    PIXEL_GRID_INSTRUCTION,
    PLAIN_SYSTEM_PROMPT,
    REASON2_REASONING_INSTRUCTION,
    REASON2_SYSTEM_PROMPT,
    REASONING_SYSTEM_PROMPT,
)
from physreason.chat.structured import NORM_1000, CoordSpace, GridName
from physreason.config.schema import Config, SamplingConfig
from physreason.errors import InputError

StyleName = Literal["reason1", "reason2"]
Message = dict[str, Any]

# Cosmos-Reason1's published inference defaults (its README and model card), the same in both modes.
_REASON1_SAMPLING: Mapping[str, Any] = {
    "temperature": 0.6,
    "top_p": 0.95,
    "top_k": -1,
    "repetition_penalty": 1.05,
    "presence_penalty": 0.0,
    "max_tokens": 4096,
}
# cosmos-reason2 script/inference.py `SamplingOverrides.get_defaults` at commit a3b4a1d (after f180ea7 "Fix
# sampling parameter defaults", which swapped the two modes; it cites the Qwen3-VL README's evaluation settings).
_REASON2_REASONING_SAMPLING: Mapping[str, Any] = {
    "temperature": 0.6,
    "top_p": 0.95,
    "top_k": 20,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "seed": 1234,
    "max_tokens": 4096,
}
_REASON2_PLAIN_SAMPLING: Mapping[str, Any] = {
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 20,
    "repetition_penalty": 1.0,
    "presence_penalty": 1.5,
    "seed": 3407,
    "max_tokens": 4096,
}


@dataclass(frozen=True)
class PromptStyle:
    """One generation's conventions: its default reasoning mode, its sampling defaults per mode, and the grid its
    model writes 2D coordinates on."""

    name: StyleName
    reasoning_default: bool
    reasoning_sampling: Mapping[str, Any]
    plain_sampling: Mapping[str, Any]
    coord_grid: GridName = "norm1000"

    def sampling_defaults(self, reasoning: bool) -> Mapping[str, Any]:
        """The generation settings this style uses in the given mode."""
        return self.reasoning_sampling if reasoning else self.plain_sampling


STYLES: dict[str, PromptStyle] = {
    # Qwen2.5-VL grounds in absolute pixels of its resized input; Qwen3-VL on a 0-1000 grid.
    "reason1": PromptStyle("reason1", True, _REASON1_SAMPLING, _REASON1_SAMPLING, "pixels"),
    # The reference inference script's --reasoning defaults to off.
    "reason2": PromptStyle("reason2", False, _REASON2_REASONING_SAMPLING, _REASON2_PLAIN_SAMPLING),
}


def style_for_family(family_name: str) -> StyleName:
    """The prompt style of a model family: Qwen3-VL checkpoints are Cosmos-Reason2's, the rest Cosmos-Reason1's."""
    return "reason2" if family_name in ("qwen3_vl", "qwen3_vl_moe") else "reason1"


def coord_space(style: StyleName, frame_size: tuple[int, int] | None) -> CoordSpace:
    """The grid a model of `style` writes 2D coordinates on, for a question about a frame of `frame_size`
    ((height, width) as the model sees it: GenerationRequest.frame_size()).

    Raises InputError when the style writes pixels and no frame size is given (a question without image or video).
    """
    if STYLES[style].coord_grid == "norm1000":
        return NORM_1000
    if frame_size is None:
        raise InputError(
            f"prompt style {style} answers 2D coordinates in pixels of the frame it sees, but no frame is known (a "
            "question without image or video): give the record its media"
        )
    height, width = frame_size
    return CoordSpace("pixels", width=width, height=height)


def grounding_question(question: str, space: CoordSpace) -> str:
    """A 2D grounding question as asked on `space`'s grid: Cosmos-Reason2's prompt as written for the 0-1000 grid
    (Qwen3-VL's own, which its prompts leave unsaid); for a pixel grid, the question and a sentence asking for
    absolute pixels of the frame as the model sees it, with its size."""
    if space.grid == "norm1000":
        return question
    return f"{question.rstrip()} {PIXEL_GRID_INSTRUCTION.format(width=space.width, height=space.height)}"


@dataclass(frozen=True)
class Prompting:
    """A resolved prompt style and mode: builds every chat prompt physreason sends to a model."""

    style: StyleName = "reason1"
    reasoning: bool = True
    system_prompt: str | None = None  # None: the style's own

    def messages(self, question: str, *, videos: Sequence[object] = (), images: Sequence[object] = ()) -> list[Message]:
        """[system, user] messages for one free-form question about the given media."""
        return build_messages(
            question,
            videos=videos,
            images=images,
            reasoning=self.reasoning,
            system_prompt=self.system_prompt,
            style=self.style,
        )

    def describe(self) -> dict[str, Any]:
        """The prompt settings a reproduction needs, JSON-ready."""
        return {"prompt_style": self.style, "reasoning": self.reasoning, "system_prompt": self.system_prompt}


def resolve_prompting(config: Config, family_name: str) -> Prompting:
    """The prompt style and mode of a recipe for a checkpoint of the given family ('auto' reads the family)."""
    name: StyleName = style_for_family(family_name) if config.prompt.style == "auto" else config.prompt.style
    reasoning = config.prompt.reasoning
    if reasoning is None:
        reasoning = STYLES[name].reasoning_default
    return Prompting(name, reasoning, config.prompt.system_prompt)


def resolve_sampling(config: Config, prompting: Prompting) -> SamplingConfig:
    """`[generation]` with every setting the recipe left out taken from the style's defaults for the mode.

    A setting counts as left out when no recipe, --set or option named it and it still holds the schema's
    default, so a Config built in code that changed a value keeps it.
    """
    defaults = STYLES[prompting.style].sampling_defaults(prompting.reasoning)
    fields = SamplingConfig.model_fields
    update = {
        key: value
        for key, value in defaults.items()
        if f"generation.{key}" not in config.explicit_keys
        and getattr(config.generation, key) == fields[key].default
    }
    return config.generation.model_copy(update=update)


def build_messages(
    question: str,
    *,
    videos: Sequence[object] = (),
    images: Sequence[object] = (),
    reasoning: bool = True,
    system_prompt: str | None = None,
    style: StyleName = "reason1",
) -> list[Message]:
    """Return the chat messages for one question about the given videos and images, in the given style.

    reason1: the format instruction lives in the system prompt (Cosmos-Reason1 model card); without reasoning
    the system prompt is Qwen2.5-VL's plain default; media (videos, then images) come before the text.
    reason2: system "You are a helpful assistant."; images, then videos, then the question, with the reasoning
    instruction appended after a blank line when reasoning is on. `system_prompt` replaces the style's; an
    empty string gives an empty system message (reason1) or none at all (reason2, as its reference does).
    """
    if not question.strip():
        raise InputError("The question is empty; give the text the model should answer.")
    if style == "reason2":
        text = question.strip()
        if reasoning:
            text += f"\n\n{REASON2_REASONING_INSTRUCTION}"
        content: list[dict[str, str]] = [{"type": "image"} for _ in images]
        content += [{"type": "video"} for _ in videos]
        content.append({"type": "text", "text": text})
        system = REASON2_SYSTEM_PROMPT if system_prompt is None else system_prompt
        head = [{"role": "system", "content": system}] if system else []
        return [*head, {"role": "user", "content": content}]
    if system_prompt is None:
        system_prompt = REASONING_SYSTEM_PROMPT if reasoning else PLAIN_SYSTEM_PROMPT
    content = [{"type": "video"} for _ in videos]
    content += [{"type": "image"} for _ in images]
    content.append({"type": "text", "text": question})
    return [
        {"role": "system", "content": system_prompt},
        {"role": "user", "content": content},
    ]


def reason2_mcq_text(question: str, options: dict[str, str] | list[str], reasoning: bool) -> str:
    """A multiple-choice question in Cosmos-Reason2's style: question, "(A) text" lines, the letter instruction.

    The option lines follow the reference's multiple-choice prompts (prompts/mvp_bench.yaml); the letter
    instruction is the benchmark's; reasoning appends nothing here (build_messages adds the instruction).
    """
    lines = [question.strip()]
    lines += [f"({letter}) {text}" for letter, text in lettered_options(options).items()]
    lines.append(MCQ_LETTER_INSTRUCTION)
    return "\n".join(lines)


def build_mcq_messages(
    question: str,
    options: dict[str, str] | list[str],
    *,
    videos: Sequence[object] = (),
    images: Sequence[object] = (),
    answer_type: AnswerType = "reasoning",
    style: StyleName = "reason1",
) -> list[Message]:
    """Return the messages of a multiple-choice question, as each generation's benchmark and RL data build them.

    reason1: answer_type "reasoning" and "letter" reproduce the Cosmos-Reason1 benchmark (system prompt
    "Answer the questions.", format instruction appended to the user text); "grpo" reproduces its GRPO
    training data (empty system prompt, its own wording). reason2: "letter" asks for the letter alone,
    "reasoning" and "grpo" append Cosmos-Reason2's reasoning instruction; the system prompt is its default.
    """
    if style == "reason2":
        reasoning = answer_type != "letter"
        return build_messages(
            reason2_mcq_text(question, options, reasoning),
            videos=videos,
            images=images,
            reasoning=reasoning,
            style="reason2",
        )
    system_prompt = GRPO_SYSTEM_PROMPT if answer_type == "grpo" else MCQ_SYSTEM_PROMPT
    return build_messages(
        format_mcq(question, options, answer_type),
        videos=videos,
        images=images,
        system_prompt=system_prompt,
    )
