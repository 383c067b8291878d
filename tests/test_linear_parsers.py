"""Every parser and reward does work linear in its input: 1 MB of hostile text, the regex work counted, not timed.

Python's regex engine has no step counter, so the bound is built from two counted facts: every pattern in the
parsing and reward modules has a bounded width (read from the compiled pattern's parse tree), so one match
attempt costs O(1); and a counting proxy in place of each pattern adds up the characters every call is handed.
Their product bounds the regex work. The rest is str methods (find, count, rstrip, split), linear by contract.
"""

from __future__ import annotations

import importlib
import random
import re
from collections.abc import Callable

import pytest

from physreason.chat import parse
from physreason.data import convert
from physreason.rewards import compute_rewards, extract, normalize_answer, registered_rewards, rules
from physreason.serve import reasoning
from physreason.serve.reasoning import ReasoningSplitter, split_reasoning

try:
    from re import _parser as sre_parse  # Python >= 3.11
except ImportError:  # pragma: no cover
    import sre_parse  # type: ignore[no-redef]

# By import_module: the package's `extract` attribute is the function of that name, not the module.
extract_module = importlib.import_module("physreason.rewards.extract")
MODULES = (parse, extract_module, rules, reasoning, convert)
MAX_WIDTH = 64  # characters one match attempt of any pattern can span
SIZE = 1_000_000


def hostile_texts() -> dict[str, str]:
    """About 1 MB each: long runs that end in a character that fails a trailing match, and tag soups."""
    texts = {
        "punctuation run": "<answer>" + ".!?;, 。" * (SIZE // 7) + "x",
        "whitespace run": "<answer>" + " \t\n" * (SIZE // 3) + "x</answer>",
        "no tags, punctuation": "." * SIZE + "x",
        "10k open tags": "<answer>" * 10_000 + "a" * (SIZE - 80_000),
        "10k pairs": "<think>r</think><answer>B</answer>" * 10_000 + " r" * (SIZE // 3),
        "empty pairs, then text": "<answer></answer>x" * (SIZE // 18),
        "nested tags": "<answer><think>" * (SIZE // 32) + "B" + "</think></answer>" * (SIZE // 32),
        "unclosed think": "<think>" + "<" * SIZE,
        "answer phrases": "the answer is " * (SIZE // 14),
        "answer then spaces": "answer" + " " * SIZE + ":",
        "hedged letters": "A or B, " * (SIZE // 8),
        "bracket soup": "([" * (SIZE // 2),
        "option words": "option choice " * (SIZE // 14),
    }
    assert all(len(t) >= SIZE * 0.9 for t in texts.values())
    return texts


class CountingPattern:
    """Stands in for a compiled pattern; `handed` adds up the characters each call may scan."""

    def __init__(self, pattern: re.Pattern[str]) -> None:
        self.pattern = pattern
        self.handed = 0

    def _count(self, string: str, pos: int = 0, endpos: int | None = None) -> None:
        self.handed += (len(string) if endpos is None else min(endpos, len(string))) - pos

    def match(self, string, pos=0, endpos=None):
        self._count(string, pos, endpos)
        return self.pattern.match(string, pos, len(string) if endpos is None else endpos)

    def search(self, string, pos=0, endpos=None):
        self._count(string, pos, endpos)
        return self.pattern.search(string, pos, len(string) if endpos is None else endpos)

    def fullmatch(self, string, pos=0, endpos=None):
        self._count(string, pos, endpos)
        return self.pattern.fullmatch(string, pos, len(string) if endpos is None else endpos)

    def finditer(self, string, pos=0, endpos=None):
        self._count(string, pos, endpos)
        return self.pattern.finditer(string, pos, len(string) if endpos is None else endpos)

    def findall(self, string, pos=0, endpos=None):
        self._count(string, pos, endpos)
        return self.pattern.findall(string, pos, len(string) if endpos is None else endpos)

    def sub(self, repl, string, count=0):
        self._count(string)
        return self.pattern.sub(repl, string, count)


def module_patterns() -> list[tuple[object, str, re.Pattern[str]]]:
    return [
        (module, name, value)
        for module in MODULES
        for name, value in vars(module).items()
        if isinstance(value, re.Pattern)
    ]


def test_every_pattern_in_parsers_and_rewards_has_a_bounded_width():
    patterns = module_patterns()
    assert {"_ANSWER_LETTER", "_COORDINATED_LETTER", "_LETTER_ANSWER"} <= {name for _, name, _ in patterns}
    for module, name, pattern in patterns:
        widest = sre_parse.parse(pattern.pattern, pattern.flags).getwidth()[1]
        assert widest <= MAX_WIDTH, f"{module.__name__}.{name} can span {widest} characters per attempt"


def test_an_unbounded_pattern_is_what_the_width_check_catches():
    # The pattern normalize_answer used to strip trailing punctuation: quadratic on a run ending in a letter.
    widest = sre_parse.parse(r"[\s.!?;,。！？]+$", 0).getwidth()[1]
    assert widest > MAX_WIDTH


CALLS: dict[str, Callable[[str], object]] = {
    "parse_completion": parse.parse_completion,
    "extract free-form": lambda t: extract(t),
    "extract any letter": lambda t: extract(t, multiple_choice=True),
    "extract with options": lambda t: extract(t, {"A": "the cup", "B": "the ball."}),
    "normalize_answer": normalize_answer,
    "split_reasoning": split_reasoning,
    "to_reason2": convert.to_reason2,
    "every reward": lambda t: compute_rewards(
        t, dict.fromkeys(sorted(set(registered_rewards()) & {"accuracy", "format"}), 1.0),
        answer="B", options=["the cup", "the ball"],
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("call", sorted(CALLS))
def test_parsers_and_rewards_hand_the_regex_engine_linear_work_on_hostile_text(call, monkeypatch):
    proxies = []
    for module, name, pattern in module_patterns():
        proxy = CountingPattern(pattern)
        monkeypatch.setattr(module, name, proxy)
        proxies.append(proxy)
    for label, text in hostile_texts().items():
        for proxy in proxies:
            proxy.handed = 0
        CALLS[call](text)
        handed = sum(proxy.handed for proxy in proxies)
        # Each pattern scans the (cleaned) text a few times at most: O(1) attempts per character handed.
        assert handed * MAX_WIDTH <= 20 * MAX_WIDTH * len(text), f"{call} on {label}: {handed} characters handed"


def test_the_pair_scan_finds_the_pair_the_old_regex_found():
    innermost_pair = re.compile(r"<answer>((?:(?!<answer>)[\s\S])*?)</answer>")  # the regex it replaced
    rng = random.Random(0)
    atoms = ["<answer>", "</answer>", "<think>", "</think>", "a", " ", "<answer", "answer>", "</"]
    for _ in range(20_000):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(0, 10)))
        pairs = innermost_pair.findall(text)
        assert parse._last_answer_pair(text) == (pairs[-1] if pairs else None), text


def test_the_answer_split_gives_what_the_old_regex_gave():
    # the regex to_reason2 used: quadratic on "<answer></answer>x" repeated
    reason1 = re.compile(r"^(?P<head>.*?)\s*<answer>\s*(?P<answer>.*?)\s*</answer>\s*$", re.DOTALL)
    rng = random.Random(0)
    atoms = ["<answer>", "</answer>", "<think>", "</think>", "a", "B", " ", "\n", "\u3000", "<answer", "answer>", "</"]
    for _ in range(20_000):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(0, 10)))
        match = reason1.match(text)
        expected = None if match is None else (match.group("head").rstrip(), match.group("answer"))
        assert convert._split_answer(text) == expected, repr(text)


class CountingSplitter(ReasoningSplitter):
    """Counts the characters each feed hands the splitter's scans: the text pending plus the new piece."""

    scanned = 0

    def feed(self, delta: str):
        CountingSplitter.scanned += len(self._pending) + len(delta)
        return super().feed(delta)


@pytest.mark.parametrize("think_open", [False, True])
@pytest.mark.parametrize("piece", [" ", "\n", "</thin", " <", "<answer>"])
def test_streaming_a_long_run_token_by_token_rescans_nothing(piece, think_open):
    CountingSplitter.scanned = 0
    splitter = CountingSplitter(think_open=think_open)
    pieces = (["<think>"] if not think_open else []) + ["r"] + [piece] * 20_000 + ["x"]
    streamed = [splitter.feed(p) for p in pieces] + [splitter.finish()]
    total = sum(len(p) for p in pieces)
    assert CountingSplitter.scanned <= 20 * total, f"{CountingSplitter.scanned} characters scanned for {total}"
    whole = split_reasoning("".join(pieces), think_open=think_open)
    reasoning_text = "".join(s.reasoning for s in streamed) or None
    content = "".join(s.content for s in streamed) or None
    assert (reasoning_text, content) == whole
