"""Multiple-choice questions: option letters, the benchmark's user text, and answer-preserving shuffles."""

from __future__ import annotations

import random
from typing import Literal

from physreason.chat.prompts import (
    GRPO_REASONING_INSTRUCTION,
    MCQ_LETTER_INSTRUCTION,
    MCQ_REASONING_INSTRUCTION,
)
from physreason.errors import InputError

OPTION_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"

AnswerType = Literal["reasoning", "letter", "grpo"]

# The instruction lines that follow the options, per answer type. "reasoning" and "letter" are the
# benchmark's two modes; "grpo" is the GRPO training recipe's wording (see prompts.py).
_INSTRUCTIONS: dict[str, tuple[str, ...]] = {
    "letter": (MCQ_LETTER_INSTRUCTION,),
    "reasoning": (MCQ_LETTER_INSTRUCTION, MCQ_REASONING_INSTRUCTION),
    "grpo": (MCQ_LETTER_INSTRUCTION, GRPO_REASONING_INSTRUCTION),
}


def lettered_options(options: dict[str, str] | list[str]) -> dict[str, str]:
    """Return options as an ordered {letter: text} dict; a list is lettered A, B, C, ...

    Raises InputError for options that are neither a dict nor a list (a string is not split into letters), no
    options, more than 26, dict keys that are not single capital letters, or option texts that are not text or numbers.
    """
    if isinstance(options, dict):
        # a letter without text is no option: Parquet and Arrow data sets store {letter: text} as a struct, where a
        # question with fewer options than another has None under the letters it lacks
        lettered = {key: text for key, text in options.items() if text is not None}
    else:
        if not isinstance(options, (list, tuple)):
            raise InputError(
                f"options must be an object of {{letter: text}} or a list of texts; got {type(options).__name__} "
                f"{_short(options)}."
            )
        if len(options) > len(OPTION_LETTERS):
            raise InputError(f"{len(options)} options given; at most {len(OPTION_LETTERS)} can be lettered A-Z.")
        lettered = dict(zip(OPTION_LETTERS, options))
    if not lettered:
        raise InputError("A multiple-choice question needs at least one option; none were given.")
    bad = [key for key in lettered if not (isinstance(key, str) and len(key) == 1 and key in OPTION_LETTERS)]
    if bad:
        raise InputError(
            f"Option keys must be single capital letters A-Z; got {bad!r}. "
            "Rename them (A, B, C, ...) or pass the options as a list."
        )
    texts = [text for text in lettered.values() if isinstance(text, bool) or not isinstance(text, (str, int, float))]
    if texts:
        raise InputError(f"Each option must be a text (or a number); got {_short(texts[0])}.")
    return lettered


def _short(value: object, limit: int = 80) -> str:
    """repr(value), cut to `limit` characters (error messages quote what the data holds)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def format_mcq(question: str, options: dict[str, str] | list[str], answer_type: AnswerType = "reasoning") -> str:
    """Return the user text exactly as the Cosmos-Reason1 benchmark builds it.

    Layout: the question, one "(A) text" line per option, then the letter instruction and, for
    answer_type "reasoning" (or "grpo", the training wording), the format instruction, all joined
    by single newlines with no trailing newline.
    """
    if answer_type not in _INSTRUCTIONS:
        raise InputError(f"Unknown answer_type {answer_type!r}; use one of {sorted(_INSTRUCTIONS)}.")
    lettered = lettered_options(options)
    lines = [question]
    lines += [f"({letter}) {text}" for letter, text in lettered.items()]
    lines += _INSTRUCTIONS[answer_type]
    return "\n".join(lines)


def shuffle_options(options: dict[str, str], answer: str, rng: random.Random) -> tuple[dict[str, str], str]:
    """Return the option texts in a random order under the same letters, and the correct answer's new letter.

    The letters keep their original order (A, B, C, ...); only the texts move, so a model cannot
    learn a position bias. Raises InputError when `answer` is not one of the option letters.
    """
    lettered = lettered_options(options)
    if answer not in lettered:
        raise InputError(
            f"Answer {answer!r} is not one of the option letters {list(lettered)}; "
            "the record's answer must name an option by its letter."
        )
    letters = list(lettered)
    order = letters.copy()
    rng.shuffle(order)
    shuffled = {letter: lettered[source] for letter, source in zip(letters, order)}
    return shuffled, letters[order.index(answer)]
