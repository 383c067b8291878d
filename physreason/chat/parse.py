"""Parsing a completion into its `<think>` reasoning and `<answer>`, listing every way it breaks the format."""

from __future__ import annotations

from dataclasses import dataclass, field

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
_TAGS = (THINK_OPEN, THINK_CLOSE, ANSWER_OPEN, ANSWER_CLOSE)


# cosmos-rl's format regex ends in `$`, which also matches before one final newline; generation
# that stops right after "</answer>\n" is therefore well-formed there, and here.
_ALLOWED_AFTER_ANSWER = ("", "\n")
NO_ANSWER_AFTER_REASONING = "no answer after the reasoning"
_REASON2_ANSWER_TAGS = "<answer> tags (Cosmos-Reason2 writes the answer right after </think>)"


@dataclass(frozen=True)
class ParsedCompletion:
    """A completion split into reasoning and answer; `problems` is empty iff it is exactly well-formed.

    The well-formed layout (Cosmos-Reason1): `<think>...</think>\\n\\n<answer>...</answer>`, each tag
    once, nothing before `<think>`, at most one newline after `</answer>`, and a non-empty answer.
    `think` and `answer` are stripped of surrounding whitespace; None when their tags are absent.
    """

    think: str | None
    answer: str | None
    problems: list[str] = field(default_factory=list)


def parse_completion(text: str, style: str = "reason1", reasoning: bool = True) -> ParsedCompletion:
    """Split `text` into think and answer, extracting leniently and listing format problems strictly.

    Extraction: think is the text from the first `<think>` (or the start, when only `</think>` is
    there) to the first `</think>` (or to `<answer>`, or the end, when unclosed). The answer is
    the content of the last innermost `<answer>...</answer>` pair; failing that, the text after
    an unclosed `<answer>`, or the text between `</think>` and a stray `</answer>`. Reasoning that never
    ended (see `reasoning_cut_off`) holds no answer: only the text before it is read.
    style "reason2" (Cosmos-Reason2: the answer follows `</think>` with no tags) reads the answer from
    `<answer>` tags where there are any, else the text after the last `</think>`, else the whole text when
    there is no think tag (non-reasoning output); see `parse_reason2`.
    `reasoning` False (the question was asked without reasoning, in either style): the layout asked for is a
    bare answer, so the answer is read as `locate_answer` does and only an empty or missing answer (and, for
    reason2, `<answer>` tags) is a problem; see `parse_plain`.
    """
    if not reasoning:
        return parse_plain(text, style)
    if style == "reason2":
        return parse_reason2(text)
    counts = {tag: text.count(tag) for tag in _TAGS}
    problems = [f"missing {tag}" for tag in _TAGS if counts[tag] == 0]
    problems += [f"more than one {tag}" for tag in _TAGS if counts[tag] > 1]

    think = _extract_think(text, counts)
    cut = reasoning_cut_off(text)
    answer = _extract_answer(text, counts) if cut is None else _extract_answer(text[:cut])

    if all(count == 1 for count in counts.values()):
        problems += _layout_problems(text)
    if answer is not None and not answer:
        problems.append("empty answer")
    return ParsedCompletion(think=think, answer=answer, problems=problems)


def _extract_think(text: str, counts: dict[str, int]) -> str | None:
    """The reasoning text, or None when neither think tag is present."""
    if counts[THINK_OPEN] == 0 and counts[THINK_CLOSE] == 0:
        return None
    start = text.index(THINK_OPEN) + len(THINK_OPEN) if counts[THINK_OPEN] else 0
    end = text.find(THINK_CLOSE, start)
    if end < 0:
        end = text.find(ANSWER_OPEN, start)
    if end < 0:
        end = len(text)
    return text[start:end].strip()


def reasoning_cut_off(text: str) -> int | None:
    """Offset of the `<think>` whose reasoning never ended, or None when every reasoning block ended.

    Reasoning ends at `</think>`, or at `<answer>` when `</think>` is missing (the model opened its answer);
    the last `<think>` followed by neither is a completion cut off mid-reasoning (max_tokens), or a model that
    never stopped thinking. Nothing after that `<think>` is an answer, whatever it names.
    """
    opened = text.rfind(THINK_OPEN)
    if opened < 0:
        return None
    after = opened + len(THINK_OPEN)
    if text.find(THINK_CLOSE, after) >= 0 or text.find(ANSWER_OPEN, after) >= 0:
        return None
    return opened


def locate_answer(text: str) -> tuple[str | None, bool]:
    """The raw answer text of a completion in any style or mode, and whether it came from `<answer>` tags.

    The one rule every reader shares (rewards, evaluation, infer records): the answer lies outside the
    reasoning. Read in order: the `<answer>` tags (`_extract_answer`), else the text after the last
    `</think>`, else the whole text when there is no think tag at all (an answer without reasoning). Reasoning
    that never ended (`reasoning_cut_off`) is left out, so a completion cut off mid-reasoning has no answer
    (None), however plainly its reasoning names one. The text is returned as written (not stripped).
    """
    cut = reasoning_cut_off(text)
    scope = text if cut is None else text[:cut]
    tagged = _extract_answer(scope)
    if tagged is not None:
        return tagged, True
    think_end = scope.rfind(THINK_CLOSE)
    if think_end >= 0:
        return scope[think_end + len(THINK_CLOSE) :], False
    if cut is not None:
        return None, False
    return text, False


def _extract_answer(text: str, counts: dict[str, int] | None = None) -> str | None:
    """The answer text, or None when neither answer tag is present."""
    if counts is None:
        counts = {tag: text.count(tag) for tag in _TAGS}
    pair = _last_answer_pair(text)
    if pair is not None:
        return pair.strip()
    if counts[ANSWER_OPEN]:
        return text[text.rindex(ANSWER_OPEN) + len(ANSWER_OPEN) :].strip()
    if counts[ANSWER_CLOSE]:
        close = text.index(ANSWER_CLOSE)
        think_end = text.rfind(THINK_CLOSE, 0, close)
        start = think_end + len(THINK_CLOSE) if think_end >= 0 else 0
        return text[start:close].strip()
    return None


def _last_answer_pair(text: str) -> str | None:
    """Content of the last innermost `<answer>...</answer>` pair (no `<answer>` inside it), or None.

    Nested or repeated tags resolve to the pair the model closed last: the last `<answer>` before the last
    `</answer>`, up to the first `</answer>` after it. Three string scans: linear by construction, where the
    regex it replaces had to be argued linear.
    """
    close = text.rfind(ANSWER_CLOSE)
    start = text.rfind(ANSWER_OPEN, 0, close) if close >= 0 else -1
    if start < 0:
        return None
    start += len(ANSWER_OPEN)
    return text[start : text.find(ANSWER_CLOSE, start)]


def _layout_problems(text: str) -> list[str]:
    """Problems of order and spacing, for a text holding each of the four tags exactly once."""
    positions = [text.index(tag) for tag in _TAGS]
    if positions != sorted(positions):
        return ["tags out of order: expected <think>, </think>, <answer>, </answer>"]
    think_open, think_close, answer_open, answer_close = positions
    problems = []
    if think_open > 0:
        problems.append("text before <think>")
    between = text[think_close + len(THINK_CLOSE) : answer_open]
    if between != "\n\n":
        problems.append(f"expected a blank line (\\n\\n) between </think> and <answer>, found {between!r}")
    if text[answer_close + len(ANSWER_CLOSE) :] not in _ALLOWED_AFTER_ANSWER:
        problems.append("text after </answer>")
    return problems


def parse_reason2(text: str) -> ParsedCompletion:
    """Split a Cosmos-Reason2 completion: `<think>\\n...\\n</think>\\n\\nanswer`, or a bare answer without reasoning.

    Well-formed (no problems): one `<think>` at the start (after optional whitespace), one `</think>` after it,
    a non-empty answer after it, no `<answer>` tags. A completion with no think tag at all is a non-reasoning
    answer: its whole text is the answer, and only "missing <think>" / "missing </think>" are reported (a question
    asked without reasoning is parsed by `parse_plain` instead). `<answer>` tags, when a model writes them anyway,
    still give the answer. Reasoning that never ended gives no answer (`locate_answer`).
    """
    counts = {tag: text.count(tag) for tag in _TAGS}
    problems = [f"missing {tag}" for tag in (THINK_OPEN, THINK_CLOSE) if counts[tag] == 0]
    problems += [f"more than one {tag}" for tag in (THINK_OPEN, THINK_CLOSE) if counts[tag] > 1]
    if counts[ANSWER_OPEN] or counts[ANSWER_CLOSE]:
        problems.append(_REASON2_ANSWER_TAGS)
    think = _extract_think(text, counts)
    located, _ = locate_answer(text)
    answer = None if located is None else located.strip()
    if counts[THINK_OPEN] == 1 and counts[THINK_CLOSE] == 1:
        open_at, close_at = text.index(THINK_OPEN), text.index(THINK_CLOSE)
        if close_at < open_at:
            problems.append("</think> before <think>")
        elif text[:open_at].strip():
            problems.append("text before <think>")
    if answer is not None and not answer:
        problems.append("empty answer")
    elif answer is None and counts[THINK_OPEN]:
        problems.append(NO_ANSWER_AFTER_REASONING)
    return ParsedCompletion(think=think, answer=answer, problems=problems)


def parse_plain(text: str, style: str = "reason1") -> ParsedCompletion:
    """Split a completion to a question asked without reasoning, in either style: the answer is the text.

    Well-formed: a non-empty answer. A think block the model writes anyway is read as reasoning and is no
    problem; one it never closes leaves no answer ("no answer after the reasoning"). `<answer>` tags give the
    answer; for reason2, whose layout has none, they are also a problem, as in `parse_reason2`.
    """
    counts = {tag: text.count(tag) for tag in _TAGS}
    problems = []
    if style == "reason2" and (counts[ANSWER_OPEN] or counts[ANSWER_CLOSE]):
        problems.append(_REASON2_ANSWER_TAGS)
    located, _ = locate_answer(text)
    answer = None if located is None else located.strip()
    if answer is None:
        problems.append(NO_ANSWER_AFTER_REASONING)
    elif not answer:
        problems.append("empty answer")
    return ParsedCompletion(think=_extract_think(text, counts), answer=answer, problems=problems)
