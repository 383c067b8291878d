"""Splitting a completion into `<think>` reasoning and `<answer>` content, incrementally (no vLLM needed).

Cosmos-Reason1 and Cosmos-Reason2 answer as `<think>\\nR\\n</think>\\n\\n<answer>\\nA\\n</answer>`; a
Qwen3-VL chat template may already have opened `<think>` in the prompt, so the output starts inside the
reasoning. `ReasoningSplitter` reads the text left to right in one pass and never takes back what it
emitted, so the streamed pieces of a completion always add up to the non-streamed split of the same text
(`split_reasoning` runs the same machine over the whole text).

What goes where:
- the text between `<think>` and `</think>` (or `<answer>`, when `</think>` is missing) is reasoning;
- the text between `<answer>` and `</answer>` is content; so is text after `</think>` that does not open
  `<answer>` (an answer written without its tags), and text after `</answer>`;
- output that does not start with a tag (after whitespace) is returned whole, as written, in content;
- surrounding whitespace of the reasoning and of the answer is layout, not text, and is dropped.

Malformed output never loses text other than the tags and that whitespace: an unclosed `<think>` keeps
its text as reasoning, an unclosed `<answer>` keeps its text as content.
"""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple

from physreason.chat.parse import ANSWER_CLOSE, ANSWER_OPEN, THINK_CLOSE, THINK_OPEN


class _Phase(Enum):
    START = "start"  # before any text: a tag or plain text decides what follows
    THINK = "think"  # reasoning, up to </think> or <answer>
    BETWEEN = "between"  # after </think>: <answer>, or an answer without tags
    ANSWER = "answer"  # content, up to </answer>
    AFTER = "after"  # after </answer>: only non-blank text is kept (as content)
    RAW = "raw"  # content exactly as written, to the end


class Split(NamedTuple):
    """Text to append to the reasoning and to the content (either may be empty)."""

    reasoning: str = ""
    content: str = ""


class ReasoningSplitter:
    """Feeds a completion's text piece by piece; each `feed` returns the reasoning and content it settles.

    Text that could still turn into a tag (a trailing `</thi`) or into layout whitespace (blanks before a
    closing tag) is held back until the next piece decides it, or until `finish`. One splitter per
    completion: it keeps state.
    """

    def __init__(self, think_open: bool = False) -> None:
        """`think_open`: the prompt already opened `<think>` (a Qwen3-VL template), so output starts as reasoning."""
        self._phase = _Phase.THINK if think_open else _Phase.START
        self._pending = ""  # text received but not yet emitted
        # Blank pieces received while everything pending was blank: they settle nothing, so they wait here
        # unjoined; joining and rescanning the held run at every piece made a long blank run quadratic.
        self._blanks: list[str] = []
        self._pending_blank = True  # self._pending holds only whitespace (or nothing)
        self._at_phase_start = True  # leading whitespace of the phase is layout

    def feed(self, delta: str) -> Split:
        """Take the next piece of the completion; return the reasoning and content it settles."""
        if self._phase is _Phase.RAW:  # the common case of untagged output: no work at all
            return Split("", delta)
        if delta.isspace() and self._pending_blank:
            if not (self._at_phase_start and self._phase in (_Phase.THINK, _Phase.ANSWER)):
                self._blanks.append(delta)
            # else: the phase's leading blanks are layout, dropped as _inside would drop them
            return Split()
        self._pending += "".join(self._blanks) + delta
        self._blanks.clear()
        reasoning: list[str] = []
        content: list[str] = []
        while self._step(reasoning, content):
            pass
        self._pending_blank = not self._pending or self._pending.isspace()
        return Split("".join(reasoning), "".join(content))

    def finish(self) -> Split:
        """The completion ended: settle the held-back text (an unfinished tag is kept as text)."""
        pending, self._pending = self._pending + "".join(self._blanks), ""
        self._blanks.clear()
        if self._phase in (_Phase.THINK,):
            return Split(reasoning=pending.strip() if self._at_phase_start else pending.rstrip())
        if self._phase in (_Phase.ANSWER, _Phase.BETWEEN):
            return Split(content=pending.strip() if self._at_phase_start else pending.rstrip())
        if self._phase in (_Phase.START, _Phase.RAW):
            return Split(content=pending if pending.strip() else "")
        return Split()  # AFTER: only blanks can be held there

    def _step(self, reasoning: list[str], content: list[str]) -> bool:
        """Advance through the pending text once; True when the phase changed and there may be more to do."""
        phase = self._phase
        if phase is _Phase.RAW:
            content.append(self._pending)
            self._pending = ""
            return False
        if phase is _Phase.START:
            return self._opening((THINK_OPEN, _Phase.THINK), (ANSWER_OPEN, _Phase.ANSWER), otherwise=_Phase.RAW)
        if phase is _Phase.BETWEEN:
            return self._opening((ANSWER_OPEN, _Phase.ANSWER), otherwise=_Phase.RAW, drop_blanks=True)
        if phase is _Phase.THINK:
            return self._inside(reasoning, {THINK_CLOSE: _Phase.BETWEEN, ANSWER_OPEN: _Phase.ANSWER})
        if phase is _Phase.ANSWER:
            return self._inside(content, {ANSWER_CLOSE: _Phase.AFTER})
        # AFTER: trailing blanks are layout; other text is kept, blanks before it included.
        if self._pending.strip():
            self._enter(_Phase.RAW)
            return True
        return False

    def _opening(self, *tags: tuple[str, _Phase], otherwise: _Phase, drop_blanks: bool = False) -> bool:
        """At a point where a tag may open: enter its phase, wait while undecided, else go to `otherwise`."""
        text = self._pending.lstrip()
        if not text:
            return False
        for tag, phase in tags:
            if text.startswith(tag):
                self._pending = text[len(tag) :]
                self._enter(phase)
                return True
        if any(tag.startswith(text) for tag, _ in tags):
            return False  # a tag still being written
        if drop_blanks:
            self._pending = text
        self._enter(otherwise)
        return True

    def _inside(self, out: list[str], closers: dict[str, _Phase]) -> bool:
        """Inside a tagged span: emit up to the first closing tag and switch phase, or emit what is settled."""
        text = self._pending
        if self._at_phase_start:
            text = text.lstrip()
            if not text:
                self._pending = ""
                return False
            self._at_phase_start = False
        if "<" not in text:  # most tokens: no tag can start here, only trailing blanks are undecided
            end = len(text)
            while end > 0 and text[end - 1].isspace():
                end -= 1
            out.append(text[:end])
            self._pending = text[end:]
            return False
        found = [(text.find(tag), tag) for tag in closers]
        found = [(index, tag) for index, tag in found if index >= 0]
        if found:
            index, tag = min(found)
            out.append(text[:index].rstrip())
            self._pending = text[index + len(tag) :]
            self._enter(closers[tag])
            return True
        keep = _held_back(text, closers)
        out.append(text[: len(text) - keep])
        self._pending = text[len(text) - keep :]
        return False

    def _enter(self, phase: _Phase) -> None:
        self._phase = phase
        self._at_phase_start = True


def _held_back(text: str, tags: dict[str, _Phase]) -> int:
    """How many characters at the end of `text` are undecided: a tag's unfinished start, and blanks before it."""
    keep = 0
    for tag in tags:
        for size in range(min(len(tag) - 1, len(text)), keep, -1):
            if text.endswith(tag[:size]):
                keep = size
                break
    end = len(text) - keep
    while end > 0 and text[end - 1].isspace():
        end -= 1
    return len(text) - end


def output_opens_inside_think(text: str) -> bool:
    """True when `text` closes `</think>` before (or without) opening `<think>`: the prompt opened it."""
    close = text.find(THINK_CLOSE)
    if close < 0:
        return False
    opened = text.find(THINK_OPEN)
    return opened < 0 or close < opened


def prompt_opens_think(prompt_tail: str) -> bool:
    """True when the prompt (its decoded end is enough) leaves `<think>` open for the model to continue."""
    return prompt_tail.rstrip().endswith(THINK_OPEN)


def split_reasoning(text: str, think_open: bool | None = None) -> tuple[str | None, str | None]:
    """Split a whole completion into (reasoning, content); None for a part that is empty.

    `think_open` None infers it from the text: a `</think>` before any `<think>` means the prompt opened it.
    """
    if think_open is None:
        think_open = output_opens_inside_think(text)
    splitter = ReasoningSplitter(think_open=think_open)
    first, last = splitter.feed(text), splitter.finish()
    reasoning = first.reasoning + last.reasoning
    content = first.content + last.content
    return reasoning or None, content or None
