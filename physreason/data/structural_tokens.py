"""Chat-structure special tokens written in a data file's text, which training refuses before it starts.

A tokenizer reads such a string in a prompt's text as the special token itself, not as text: a record could end a
turn early, open a turn of its own (`<|im_start|>assistant`) or show a vision placeholder with no image or video
behind it. SFT (data.sft, for each conversation turn) and GRPO (data.mcq, for each question and option) refuse those
records by name before any model is built.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

# Token strings that structure a conversation (turn markers, end of text) or stand for visual inputs (the vision
# placeholders): written in a record's text they are read as those tokens, not as text, so a turn ends early or a
# placeholder has no image or video behind it. Other special tokens (Qwen's <|box_start|> and <|object_ref_start|>)
# are the data's to use.
STRUCTURAL_TOKENS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|vision_start|>", "<|vision_end|>",
                     "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")  # fmt: skip


def structural_tokens(tokenizer: Any) -> tuple[str, ...]:
    """The STRUCTURAL_TOKENS that `tokenizer` has as special tokens (a tokenizer without them: none)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    special = {token.content for token in decoder.values() if getattr(token, "special", False)}
    return tuple(token for token in STRUCTURAL_TOKENS if token in special)


def structural_token_in_texts(
    texts: Iterable[tuple[str, str]], tokens: tuple[str, ...], where: str, media: str
) -> str | None:
    """Why a record's texts cannot go into a prompt as written: the first of its (what, text) pairs that holds one of
    `tokens`, named with `where` and `what` ("turn 0 (user)", "the question"); `media` says where the record's images
    and videos go instead. None when no text holds one."""
    for what, text in texts:
        found = next((token for token in tokens if token in text), None)
        if found is not None:
            return (
                f"{where}: {what} has {found!r} in its text, a control token of the model's tokenizer: it would be "
                f"read as that token (a turn marker or a vision placeholder), not as text. Remove it from the record "
                f"({media})"
            )
    return None
