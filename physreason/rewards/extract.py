"""The one answer extractor that rewards and evaluation share, so a score means the same in both."""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

from physreason.chat.mcq import OPTION_LETTERS, lettered_options
from physreason.chat.parse import locate_answer

# Zero-width characters are not whitespace to str.strip but are invisible in every report.
_INVISIBLE = dict.fromkeys(map(ord, "\u200b\u200c\u200d\u2060\ufeff"))
# Markdown emphasis and code marks models wrap answers in ("**B**", "`B`").
_MARKUP = dict.fromkeys(map(ord, "*`"))

# Every pattern here runs on _clean'ed text, where whitespace is single spaces: one `\s` (or `\s?`) stands for a
# run, so each pattern has a bounded width and a match attempt costs O(1), never a rescan of a long run.
# "The correct answer is:", "Answer -", "final answer would be" at the start of an answer.
_ANSWER_PREFIX = re.compile(
    r"^(?:the\s)?(?:final\s|correct\s)?answer(?:\s(?:is|would\sbe|should\sbe|must\sbe))?\s?[:=-]?\s?",
    re.IGNORECASE,
)
# Stripped with str.rstrip, linear: the regex `[\s.!?;,。！？]+$` retried its run from every start, quadratic.
# The text is _clean'ed first, so a space is the only whitespace left in it.
_TRAILING_PUNCT = " .!?;,。！？"

_LETTER = r"(?:[(\[]([A-Za-z])[)\]]|([A-Za-z])(?![A-Za-z0-9]))"
# The whole answer is one letter: "B", "(B)", "[b]", "B.", "B)".
_BARE_LETTER = re.compile(r"^[(\[]?([A-Za-z])[)\]]?[.:,]?$")
# A letter with a delimiter, then text: "(b) the cup", "B) the cup", "B. the cup", "B: cup", "B, because".
_LEADING_LETTER = re.compile(r"^(?:[(\[]([A-Za-z])[)\]]|([A-Za-z])[.):,])[.:,]?\s\S")
_VERB = r"(?:\s(?:is|would\sbe|should\sbe|must\sbe|will\sbe))?\s?[:=-]?\s?"
# "Answer: B", "the answer is (b)", "answer would be option C".
_ANSWER_LETTER = re.compile(rf"\banswer\b{_VERB}(?:option\s|choice\s)?{_LETTER}", re.IGNORECASE)
# "option B", "choice (c)": weaker evidence, used only when no "answer ..." phrase names a letter.
_OPTION_LETTER = re.compile(rf"\b(?:option|choice)\b{_VERB}{_LETTER}", re.IGNORECASE)
# A capital letter standing alone as a word ("so B is right"); never a letter inside a word ("Because").
_STANDALONE_CAPITAL = re.compile(r"(?<![A-Za-z0-9])([A-Z])(?![A-Za-z0-9'’])")
# "A" and "I" are also English words: followed by a lower-case word they are an article or a pronoun.
_WORD_LETTERS = frozenset("AI")
_FOLLOWED_BY_WORD = re.compile(r"\s[a-z]")
# A second letter joined to the one just read ("A or B", "A, C", "(A) and (C)", "A/B", "B & D"): a hedge.
_COORDINATED_LETTER = re.compile(
    r"[)\]]?\s?(?:,|/|&|\bor\b|\band\b|\bnor\b)\s?(?:(?:or|and)\s)?(?:option\s|choice\s)?"
    r"(?:[(\[]([A-Za-z])[)\]]|([A-Za-z])(?![A-Za-z0-9'’]))",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class ExtractedAnswer:
    """An extracted answer and where it came from.

    `answer` is an option letter ("B") for multiple choice, the normalised text otherwise, None when
    nothing usable was found. `tagged` is True when it came from `<answer>` tags, False when the
    fallback text (after `</think>`, else the whole completion) was read instead.
    """

    answer: str | None
    tagged: bool


def normalize_answer(text: str) -> str:
    """Return free-form answer text in comparable form: NFKC, casefolded, whitespace collapsed.

    Also drops zero-width characters, markdown marks, a leading "The answer is:" and trailing
    sentence punctuation, so "  The answer is  YES. " and "yes" compare equal.
    """
    cleaned = _clean(text)
    cleaned = _ANSWER_PREFIX.sub("", cleaned)
    cleaned = cleaned.rstrip(_TRAILING_PUNCT)
    return cleaned.strip(" \"'“”‘’").casefold()


def extract(
    text: str,
    options: dict[str, str] | list[str] | None = None,
    *,
    multiple_choice: bool | None = None,
) -> ExtractedAnswer:
    """Extract the answer from a completion: an option letter for multiple choice, else normalised text.

    The answer region is the content of the last `<answer>...</answer>` pair (see
    `parse_completion`); without answer tags it is the text after the last `</think>`, or the whole
    completion when it has no think tag; a completion whose reasoning never ended (cut off by max_tokens)
    has no answer (None), whatever its reasoning names. Multiple choice (when `options` are given, or
    `multiple_choice` is True, then any letter A-Z counts) reads, in order: a bare letter, a letter opening
    the answer with a delimiter, an option's full text, "answer is X", "option X", and finally a single
    capital letter standing alone; a letter that is not an option is ignored. A hedge that names two different options
    ("A or B", "A, C", "the answer is A and B") is no answer (None).
    """
    region, tagged = answer_region(text)
    if multiple_choice is None:
        multiple_choice = options is not None
    if region is None:
        return ExtractedAnswer(answer=None, tagged=False)
    if not multiple_choice:
        return ExtractedAnswer(answer=normalize_answer(region) or None, tagged=tagged)
    lettered = lettered_options(options) if options is not None else None
    return ExtractedAnswer(answer=_option_letter(region, lettered), tagged=tagged)


def answer_region(text: str) -> tuple[str | None, bool]:
    """The raw answer text of a completion and whether it came from `<answer>` tags (see `extract`).

    None when the completion has no answer: its reasoning never ended (`chat.parse.locate_answer`, the rule the
    parsers share). Structured answers (JSON boxes, time spans) are parsed from this region as written, before
    any normalisation that would change their text.
    """
    region, tagged = locate_answer(text)
    return (region.strip() if tagged and region is not None else region), tagged


def extract_answer(
    text: str,
    options: dict[str, str] | list[str] | None = None,
    *,
    multiple_choice: bool | None = None,
) -> str | None:
    """Return the answer `extract` finds: an option letter, normalised free-form text, or None."""
    return extract(text, options, multiple_choice=multiple_choice).answer


def _clean(text: str) -> str:
    """NFKC-normalise (full-width letters become ASCII), drop invisible marks, collapse whitespace."""
    text = unicodedata.normalize("NFKC", text).translate(_INVISIBLE).translate(_MARKUP)
    return " ".join(text.split())


def _option_letter(region: str, options: dict[str, str] | None) -> str | None:
    """The option letter `region` names, or None; `options` None means any letter A-Z, no option texts."""
    valid = set(options) if options is not None else set(OPTION_LETTERS)
    cleaned = _clean(region)
    if not cleaned:
        return None

    for pattern in (_BARE_LETTER, _LEADING_LETTER):
        match = pattern.match(cleaned)
        if match:
            letter = _group_letter(match).upper()
            if letter in valid:
                return None if _hedged(cleaned, _letter_end(match), letter, valid) else letter

    if options is not None:
        wanted = normalize_answer(cleaned)
        for letter, option_text in options.items():
            if wanted and normalize_answer(option_text) == wanted:
                return letter

    for pattern in (_ANSWER_LETTER, _OPTION_LETTER):
        named = [(letter, end) for letter, end in _phrase_letters(pattern, cleaned) if letter in valid]
        if named:
            letter, end = named[-1]
            # "option C or option D" names D last, but the phrase before it joined C to it.
            joined_to_last = len(named) > 1 and _joined_letter_end(cleaned, named[-2][1], named[-2][0], valid) == end
            return None if joined_to_last or _hedged(cleaned, end, letter, valid) else letter

    capitals = [match for match in _STANDALONE_CAPITAL.finditer(cleaned) if match.group(1) in valid]
    if any(_hedged(cleaned, match.end(1), match.group(1), valid) for match in capitals):
        return None  # "A and B", "either A or B": the article rule below would otherwise keep only B
    standalone = {match.group(1) for match in capitals if not _is_english_word(cleaned, match)}
    return standalone.pop() if len(standalone) == 1 else None


def _phrase_letters(pattern: re.Pattern[str], text: str) -> list[tuple[str, int]]:
    """(letter, end offset) named by keyword phrases, in order; an unbracketed letter that reads as a word is skipped."""
    letters = []
    for match in pattern.finditer(text):
        bracketed, plain = match.group(1), match.group(2)
        if bracketed:
            letters.append((bracketed.upper(), match.end(1)))
        elif plain.isupper() and not _is_english_word(text, match, group=2):
            letters.append((plain, match.end(2)))
        elif plain.islower() and not _FOLLOWED_BY_WORD.match(text, match.end(2)):
            # "the answer is b." names an option; "the answer is a ball" does not.
            letters.append((plain.upper(), match.end(2)))
    return letters


def _hedged(text: str, end: int, letter: str, valid: set[str]) -> bool:
    """True when the letter ending at `end` is joined by "or"/"and"/","/"/" to another valid option letter.

    An answer naming two options ("A or B", "A, C") commits to neither, so it scores as no answer
    instead of crediting whichever letter a rule happens to read first or last.
    """
    return _joined_letter_end(text, end, letter, valid) is not None


def _joined_letter_end(text: str, end: int, letter: str, valid: set[str]) -> int | None:
    """End offset of a different valid option letter joined to the letter ending at `end`, else None."""
    match = _COORDINATED_LETTER.match(text, end)
    if match is None:
        return None
    bracketed, plain = match.group(1), match.group(2)
    if plain and (plain.islower() or plain in _WORD_LETTERS) and _FOLLOWED_BY_WORD.match(text, match.end(2)):
        return None  # "B or a ball": the article, not option A
    other = (bracketed or plain).upper()
    return match.end(1 if bracketed else 2) if other in valid and other != letter else None


def _letter_end(match: re.Match[str]) -> int:
    """End offset of the letter itself in a one-or-two-group letter pattern's match."""
    return next(match.end(i) for i in range(1, len(match.groups()) + 1) if match.group(i))


def _is_english_word(text: str, match: re.Match[str], group: int = 1) -> bool:
    """True for "A"/"I" followed by a lower-case word: an article or pronoun, not an option."""
    return match.group(group) in _WORD_LETTERS and bool(_FOLLOWED_BY_WORD.match(text, match.end(group)))


def _group_letter(match: re.Match[str]) -> str:
    """The letter from whichever alternative of a one-or-two-group letter pattern matched."""
    return next(group for group in match.groups() if group)
