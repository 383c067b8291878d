"""Rewrite SFT records from Cosmos-Reason1's answer layout to Cosmos-Reason2's (`physreason data convert`).

Reason1 replies `<think>...</think>` then `<answer>...</answer>`; Reason2 answers right after `</think>`, with no
answer tags. A Reason2 model fine-tuned on Reason1 replies learns to write the tags, which its own parser and the
prompts it is served with do not expect. Only assistant replies change; every other key of a record is kept.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from physreason.data.loaders import jsonl_lines
from physreason.errors import InputError
from physreason.files import write_atomic

_ASSISTANT = ("assistant", "gpt")
CONVERSATION_KEYS = ("conversations", "messages")


def reason1_reply(text: str) -> bool:
    """Whether an assistant reply is in Cosmos-Reason1's layout (it holds an <answer> block)."""
    return "<answer>" in text and "</answer>" in text


def to_reason2(text: str) -> str:
    """The reply in Reason2's layout: the reasoning, a blank line, the answer; a reply without <answer> unchanged."""
    split = _split_answer(text)
    if split is None:
        return text
    head, answer = split
    return f"{head}\n\n{answer}" if head else answer


def _split_answer(text: str) -> tuple[str, str] | None:
    """(reasoning, answer) of a reply ending in an <answer> block, both stripped; None for any other reply.

    The block runs from the first <answer> to the last </answer>, which only whitespace may follow. str.find and
    rfind keep this linear in the reply: a regex with two lazy groups backtracks quadratically on tag soup.
    """
    close = text.rfind("</answer>")
    if close < 0 or text[close + len("</answer>") :].strip():
        return None
    start = text.find("<answer>", 0, close)
    if start < 0:
        return None
    return text[:start].rstrip(), text[start + len("<answer>") : close].strip()


def _assistant_texts(turns: Any) -> list[str]:
    texts = []
    for turn in turns if isinstance(turns, list) else []:
        if not isinstance(turn, dict) or str(turn.get("role", turn.get("from", ""))) not in _ASSISTANT:
            continue
        content = turn.get("content", turn.get("value"))
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts += [part["text"] for part in content if isinstance(part, dict) and isinstance(part.get("text"), str)]
    return texts


def count_reason1_records(records: list[dict[str, Any]], column: str) -> int:
    """How many records have an assistant reply in Cosmos-Reason1's layout (under the conversation key `column`)."""
    count = 0
    for record in records:
        turns = record.get(column)
        if isinstance(turns, str):
            try:
                turns = json.loads(turns)
            except (ValueError, RecursionError):  # not JSON, a 5,000-digit number, nesting the parser refuses
                continue
        count += any(reason1_reply(text) for text in _assistant_texts(turns))
    return count


def _convert_turns(turns: Any) -> int:
    """Rewrite a conversation's Reason1 replies in place; how many replies changed."""
    changed = 0
    for turn in turns if isinstance(turns, list) else []:
        if not isinstance(turn, dict) or str(turn.get("role", turn.get("from", ""))) not in _ASSISTANT:
            continue
        key = "content" if "content" in turn else "value"
        content = turn.get(key)
        if isinstance(content, str) and reason1_reply(content):
            turn[key] = to_reason2(content)
            changed += turn[key] != content  # a reply with tags but no final <answer> block is kept as it is
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str) and reason1_reply(part["text"]):
                    text = part["text"]
                    part["text"] = to_reason2(text)
                    changed += part["text"] != text
    return changed


def convert_records(source: Path, target: Path, overwrite: bool = False) -> tuple[int, int]:
    """Write `source`'s JSONL records to `target` with every Reason1 reply in Reason2's layout: (converted, total).

    An existing `target` is replaced only with `overwrite` (it may be another data set); never `source`.
    """
    if source.resolve() == target.resolve():
        raise InputError(f"{target} is the input file: write the converted records to another file")
    if target.is_dir():
        raise InputError(f"{target} is a folder: give the JSONL file to write")
    if target.exists() and not overwrite:
        raise InputError(f"{target} already exists: give a new file, or pass --overwrite to replace it")
    converted = total = 0
    lines = []
    for number, record in jsonl_lines(source):
        if not isinstance(record, dict):
            raise InputError(f"{source}:{number} holds a JSON {type(record).__name__}, not a record object")
        total += 1
        changes = 0
        for key in CONVERSATION_KEYS:
            turns = record.get(key)
            if isinstance(turns, str):  # a conversation stored as JSON text stays JSON text
                try:
                    parsed = json.loads(turns)
                except (ValueError, RecursionError):  # not JSON, a 5,000-digit number, nesting the parser refuses
                    continue  # kept as written: the SFT loader names the record
                rewritten = _convert_turns(parsed)
                if rewritten:  # an unchanged conversation keeps its text as written
                    record[key] = json.dumps(parsed, ensure_ascii=False)
                changes += rewritten
            else:
                changes += _convert_turns(turns)
        converted += changes > 0
        lines.append(json.dumps(record, ensure_ascii=False))
    target.parent.mkdir(parents=True, exist_ok=True)
    # a new file renamed into place: a link or a hard link at target (even to source) is replaced, not written through
    write_atomic(target, "".join(line + "\n" for line in lines))
    return converted, total
