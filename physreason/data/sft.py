"""Supervised fine-tuning samples: conversation records -> token ids, assistant-only labels, visual inputs.

Accepted record layouts (the conversation key is data.conversation_column_name):
- `{"conversations": [{"role": ..., "content": "text"}], "video": "clip.mp4"}` (or "image" / "images"; a path or
  a list); media go where the user text has `<video>` / `<image>`, else in front of the first user message;
- the LLaVA / ShareGPT style of Cosmos-Reason1 and Cosmos-Reason2's SFT examples, `{"from": "human"|"gpt",
  "value": ...}` turns (cosmos-reason2 examples/cosmos_rl/scripts/llava_sft.py);
- transformers' list-of-parts content: `[{"type": "video", "video": "clip.mp4"}, {"type": "text", "text": ...}]`,
  as a list or as a JSON string of it (a Hugging Face dataset's column; cosmos-reason2 hf_sft.py). Keys a
  dataset's Arrow schema fills with None (a text part's "video") are dropped.
When no record has the configured column (the default, "conversations") and every record has `messages`,
`messages` is read and the log says so once.
Media paths are relative to data.dataset.media_root (default: the data file's folder).
A record's `video_start` / `video_end` (seconds) select the part of its videos that is sampled.
A record with `"coords": "norm1000"` (as `data synth` writes for grounding) states that the boxes and points of its
JSON answers are on the 0-1000 grid of the frame; for a model that grounds in pixels (prompt style reason1) they are
rewritten in pixels of the frame as the model sees it, and its questions ask for pixels (`regrid_conversation`).
Records without it are trained as written.
Labels are the token ids of each assistant reply through its `<|im_end|>`; every other token,
vision pads included, is -100.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch.utils.data import Dataset

from physreason.chat.structured import COORDS_KEY, NEUTRAL_GRID, CoordSpace, regrid_answer
from physreason.chat.style import StyleName, coord_space, grounding_question
from physreason.config import DataConfig, VisionConfig
from physreason.data.loaders import json_kind, media_path_in_root, parse_json_text
from physreason.data.structural_tokens import structural_token_in_texts, structural_tokens
from physreason.data.video_range import record_video_range
from physreason.errors import InputError
from physreason.models.family import VisionTokens

log = logging.getLogger(__name__)

IGNORE_INDEX = -100
MESSAGES_COLUMN = "messages"
END_OF_TURN = "<|im_end|>"
ROLE_ALIASES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
_PLACEHOLDER = re.compile(r"<(video|image)>")


def record_grid(record: dict[str, Any], where: str) -> str | None:
    """The grid a record declares for its 2D coordinates (COORDS_KEY), or None; InputError for any other value."""
    value = record.get(COORDS_KEY)
    if value is not None and value != NEUTRAL_GRID:
        raise InputError(
            f"{where}: {COORDS_KEY} = {value!r}; the only grid a record may declare is {NEUTRAL_GRID!r} (boxes and "
            f"points on 0-1000 of the frame, converted for the model); leave the key out to train answers as written"
        )
    return value


def regrid_conversation(messages: list[dict[str, Any]], space: CoordSpace, where: str) -> list[dict[str, Any]]:
    """The conversation with its 0-1000 boxes and points rewritten on `space`'s grid: each assistant answer that
    holds one in pixels, and the user turn before it asking for pixels (chat.style.grounding_question).

    InputError when no assistant answer holds a box or point (the record's `coords` key names nothing to convert).
    """
    if space.grid == NEUTRAL_GRID:
        return messages
    out = [dict(message) for message in messages]
    converted = 0
    for number, message in enumerate(out):
        if message["role"] != "assistant":
            continue
        answer = regrid_answer(message["content"], space)
        if answer is None:
            continue
        message["content"] = answer
        converted += 1
        asker = next((m for m in reversed(out[:number]) if m["role"] == "user"), None)
        if asker is None:
            continue
        if isinstance(asker["content"], str):
            asker["content"] = grounding_question(asker["content"], space)
            continue
        parts = [dict(part) for part in asker["content"]]
        text = next((part for part in reversed(parts) if part.get("type") == "text"), None)
        if text is not None:
            text["text"] = grounding_question(str(text.get("text", "")), space)
        asker["content"] = parts
    if not converted:
        raise InputError(
            f"{where}: {COORDS_KEY} = {NEUTRAL_GRID!r} but no assistant answer holds a JSON box_2d or point_2d to "
            f"convert; drop the key or fix the answer"
        )
    return out


@dataclass(frozen=True)
class MediaRef:
    """One image or video a conversation shows, in prompt order."""

    kind: Literal["image", "video"]
    path: Path


@dataclass
class SFTSample:
    """One tokenized conversation ready for collation."""

    input_ids: torch.Tensor  # [L]
    labels: torch.Tensor  # [L], IGNORE_INDEX outside assistant replies
    position_ids: torch.Tensor  # [3, L] mrope positions (text models: three equal rows)
    visuals: Any = None  # physreason.models.inputs.VisualInputs or None
    truncated: bool = False  # cut at model_max_length: the tokens after the cut (part of an answer) do not train


@dataclass(frozen=True)
class SkippedSample:
    """A record left out of training, with the reason counted and logged by the trainer."""

    index: int
    reason: str


def _as_list(value: Any) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def _split_placeholders(text: str, pending: dict[str, list[str]], where: str, record: dict[str, Any]) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    position = 0
    for match in _PLACEHOLDER.finditer(text):
        kind = match.group(1)
        if not pending[kind]:
            # An error, not a silent strip: the model would learn a literal "<video>", and which clip belongs to which
            # placeholder is no longer certain when the record lists fewer media than its text places.
            named = len(_record_media(record, kind, where))
            raise InputError(
                f"{where}: the user text has more <{kind}> placeholders than the record's {named} {kind}(s); remove "
                f"the extra <{kind}> or list its {kind} in the record"
            )
        if match.start() > position:
            parts.append({"type": "text", "text": text[position : match.start()].strip("\n")})
        parts.append({"type": kind, kind: pending[kind].pop(0)})
        position = match.end()
    rest = text[position:].lstrip("\n") if parts else text[position:]
    if rest:
        parts.append({"type": "text", "text": rest})
    return [p for p in parts if p["type"] != "text" or p["text"]]


def _media_paths(record: dict[str, Any], key: str, where: str) -> list[str]:
    """The paths under one media key: a path or a list of paths; anything else is an InputError naming the key."""
    value = record.get(key)
    if value is not None and not isinstance(value, str | list):
        raise InputError(f"{where}: {key!r} must be a path or a list of paths, got a JSON {json_kind(value)}")
    paths = _as_list(value)
    for path in paths:
        if not isinstance(path, str):
            raise InputError(f"{where}: {key!r} must list paths as text, got a JSON {json_kind(path)} in the list")
    return paths


def _record_media(record: dict[str, Any], kind: str, where: str) -> list[str]:
    """The record's paths of one media kind: "video", or "image" / "images" (LLaVA files use either)."""
    if kind == "video":
        return _media_paths(record, "video", where)
    image, images = _media_paths(record, "image", where), _media_paths(record, "images", where)
    if image and images:
        raise InputError(f"{where}: the record has both 'image' and 'images'; list every image under one of them")
    return image or images


def _turns(record: dict[str, Any], column: str, where: str) -> list[Any]:
    turns = record.get(column)
    if isinstance(turns, str):  # a dataset column holding the conversation as JSON text
        turns = parse_json_text(turns, f"{where}: {column!r} holds text that", "store a list of turns")
    if not isinstance(turns, list) or not turns:
        raise InputError(f"{where}: no list of turns under {column!r}; set data.conversation_column_name")
    return turns


def _present(part: dict[str, Any]) -> dict[str, Any]:
    # A datasets column stores every part with the union of all parts' keys, absent ones as None.
    return {key: value for key, value in part.items() if value is not None}


def normalize_conversation(record: dict[str, Any], column: str, where: str) -> list[dict[str, Any]]:
    """Return chat messages with role/content, user content as parts carrying their media paths."""
    turns = _turns(record, column, where)
    pending = {"video": _record_media(record, "video", where), "image": _record_media(record, "image", where)}
    messages: list[dict[str, Any]] = []
    for number, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise InputError(f"{where}: turn {number} is not an object with role/content (or from/value)")
        turn = _present(turn)
        role = ROLE_ALIASES.get(str(turn.get("role", turn.get("from", ""))))
        content = turn.get("content", turn.get("value"))
        if role is None or content is None:
            raise InputError(f"{where}: each turn needs role/content (or from/value); got keys {sorted(turn)}")
        if not isinstance(content, str | list):
            key = "content" if "content" in turn else "value"
            raise InputError(
                f"{where}: turn {number}'s {key!r} is a JSON {json_kind(content)}; write the text, or a list of "
                "{'type': ...} parts"
            )
        if isinstance(content, list) and not all(isinstance(part, dict) for part in content):
            raise InputError(f"{where}: turn {number}'s content list must hold {{'type': ...}} objects")
        if role == "user":
            if isinstance(content, str):
                content = _split_placeholders(content, pending, where, record)
            else:
                content = [_present(part) for part in content]
                for part in content:
                    kind = part.get("type")
                    if kind in ("image", "video") and not isinstance(part.get(kind), str):
                        if not pending[kind]:
                            raise InputError(f"{where}: a {kind} part has no path and the record names no {kind}")
                        part[kind] = pending[kind].pop(0)
        elif not isinstance(content, str):
            content = "".join(str(part.get("text") or "") for part in content)
        messages.append({"role": role, "content": content})
    leftover = pending["video"] + pending["image"]
    if leftover:
        first_user = next((m for m in messages if m["role"] == "user"), None)
        if first_user is None:
            raise InputError(f"{where}: the record has media but no user turn to show them in")
        media = [{"type": "video", "video": p} for p in pending["video"]]
        media += [{"type": "image", "image": p} for p in pending["image"]]
        first_user["content"] = media + first_user["content"]
    if not any(m["role"] == "assistant" for m in messages):
        raise InputError(f"{where}: the conversation has no assistant turn to learn from")
    return messages


def pick_conversation_column(records: list[dict[str, Any]], column: str, source: str) -> str:
    """The record key holding the conversations: `column`, or `messages` when `column` is the default and no record
    has it but every record has `messages` (transformers' name; logged). An empty data set keeps `column`."""
    default = DataConfig.model_fields["conversation_column_name"].default
    if not records or column != default or any(column in record for record in records):
        return column
    if all(MESSAGES_COLUMN in record for record in records):
        log.info(
            "%s: no record has %r; reading the %r column (set data.conversation_column_name to choose another)",
            source,
            column,
            MESSAGES_COLUMN,
        )
        return MESSAGES_COLUMN
    return column


def media_of(messages: list[dict[str, Any]], root: Path, where: str) -> list[MediaRef]:
    """The media of a conversation in prompt order, resolved inside the data root."""
    refs = []
    for message in messages:
        if isinstance(message["content"], list):
            for part in message["content"]:
                if part.get("type") in ("image", "video"):
                    kind = part["type"]
                    refs.append(MediaRef(kind, media_path_in_root(root, part[kind], where)))
    return refs


def _render(tokenizer: Any, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def conversation_segments(tokenizer: Any, messages: list[dict[str, Any]], where: str) -> list[tuple[str, bool]]:
    """Split the rendered conversation into (text, is_label) pieces; label pieces are assistant replies.

    Each reply is the text between the generation prompt and the end of its `<|im_end|>`, so training
    sees the same token boundary as generation does.
    """
    segments: list[tuple[str, bool]] = []
    done = ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = _render(tokenizer, messages[:i], True)
        full = _render(tokenizer, messages[: i + 1], False)
        if not prompt.startswith(done) or not full.startswith(prompt):
            raise InputError(
                f"{where}: the chat template does not render turn {i} as a continuation of the previous turns "
                "(templates that rewrite history cannot be trained turn by turn)"
            )
        reply = full[len(prompt) :]
        end = reply.find(END_OF_TURN)
        end = len(reply) if end < 0 else end + len(END_OF_TURN)
        segments += [(prompt[len(done) :], False), (reply[:end], True), (reply[end:], False)]
        done = full
    segments.append((_render(tokenizer, messages, False)[len(done) :], False))
    return [(text, label) for text, label in segments if text]


def tokenize_segments(
    tokenizer: Any,
    segments: list[tuple[str, bool]],
    image_counts: list[int],
    video_counts: list[int],
    video_group_seconds: list[list[float]] | None = None,
) -> tuple[list[int], list[int]]:
    """Tokenize pieces one by one, expanding vision placeholders; labels copy ids of label pieces.

    video_group_seconds (Qwen3-VL) writes each video as timestamped spans (expand_vision_placeholders).
    """
    from physreason.models.inputs import IMAGE_PAD, VIDEO_PAD, expand_vision_placeholders

    images, videos = list(image_counts), list(video_counts)
    groups = list(video_group_seconds) if video_group_seconds is not None else None
    ids: list[int] = []
    labels: list[int] = []
    for text, is_label in segments:
        n_img, n_vid = text.count(IMAGE_PAD), text.count(VIDEO_PAD)
        if n_img or n_vid:
            text = expand_vision_placeholders(
                text, images[:n_img], videos[:n_vid], groups[:n_vid] if groups is not None else None
            )
            del images[:n_img], videos[:n_vid]
            if groups is not None:
                del groups[:n_vid]
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        labels += piece if is_label else [IGNORE_INDEX] * len(piece)
    return ids, labels


def truncation_problem(
    ids: list[int], labels: list[int], max_length: int, vision: VisionTokens | None
) -> tuple[int, str | None]:
    """Return (kept length, reason to skip or None): cut at max_length unless that would split vision tokens."""
    keep = min(len(ids), max_length)
    if len(ids) > max_length and vision is not None:
        pads = (vision.image_token_id, vision.video_token_id)
        last_visual = max((i for i, t in enumerate(ids) if t in pads), default=-1)
        if last_visual >= max_length:
            return 0, f"visual tokens reach past model_max_length ({len(ids)} tokens > {max_length})"
    if all(label == IGNORE_INDEX for label in labels[1:keep]):
        return 0, f"no assistant tokens within model_max_length ({len(ids)} tokens > {max_length})"
    return keep, None


def record_layout(record: dict[str, Any], column: str) -> str:
    """The layout of one record's conversation, in words (start-up summaries name the format they detected)."""
    turns = record.get(column)
    prefix = ""
    if isinstance(turns, str):
        prefix = "JSON text of "
        try:
            turns = json.loads(turns)
        except (ValueError, RecursionError):  # not JSON, a 5,000-digit number, nesting the parser refuses
            return "unreadable"
    if not isinstance(turns, list) or not turns or not isinstance(turns[0], dict):
        return "unreadable"
    if "from" in turns[0] or "value" in turns[0]:
        return prefix + "LLaVA/ShareGPT from/value turns"
    if any(isinstance(turn, dict) and isinstance(turn.get("content"), list) for turn in turns):
        return prefix + "role/content turns with typed parts"
    return prefix + "role/content turns"


def data_layout(records: list[dict[str, Any]], column: str) -> str:
    """The layouts of a data set's records with their counts: "LLaVA/ShareGPT from/value turns under
    'conversations'", or "role/content turns: 3, LLaVA/ShareGPT from/value turns: 1 under 'messages'" when mixed."""
    counts: dict[str, int] = {}
    for record in records:
        layout = record_layout(record, column)
        counts[layout] = counts.get(layout, 0) + 1
    if not counts:
        return "no records"
    if len(counts) == 1:
        return f"{next(iter(counts))} under {column!r}"
    return ", ".join(f"{layout}: {count}" for layout, count in counts.items()) + f" under {column!r}"


def structural_token_problem(messages: list[dict[str, Any]], tokens: tuple[str, ...], where: str) -> str | None:
    """Why a conversation's text cannot be trained on as written: a turn holds one of `tokens` (see
    data.structural_tokens)."""
    texts = (
        (f"turn {number} ({message['role']})", text)
        for number, message in enumerate(messages)
        for text in _turn_texts(message["content"])
    )
    return structural_token_in_texts(
        texts, tokens, where, "images and videos go in the record's image/video keys or as <image>/<video> placeholders"
    )


def _turn_texts(content: str | list[dict[str, Any]]) -> list[str]:
    """A turn's texts: its content, or the text of each of its text parts."""
    if isinstance(content, str):
        return [content]
    return [str(part.get("text") or "") for part in content if part.get("type") == "text"]


class SFTDataset(Dataset):
    """Conversation records turned into `SFTSample`s (or `SkippedSample`s that say why) on access."""

    def __init__(
        self,
        records: list[dict[str, Any]],
        root: Path,
        tokenizer: Any,
        *,
        max_length: int,
        vision_tokens: VisionTokens | None = None,
        vision_config: VisionConfig | None = None,
        processor_params: Any = None,
        conversation_column: str = "conversations",
        source: str = "data set",
        locations: list[str] | None = None,
        default_system_prompt: str | None = None,
        prompt_style: StyleName | None = None,
    ) -> None:
        self.records = records
        self.root = Path(root).resolve()
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.vision_tokens = vision_tokens
        self.vision_config = vision_config or VisionConfig()
        self.processor_params = processor_params
        self.column = pick_conversation_column(records, conversation_column, source)
        self.source = source
        # Where each record is in its file ("data.jsonl:12"), so messages name the line, not a shuffled index.
        self.locations = locations
        # The prompt style's system turn for records that bring none (None: the chat template's own default),
        # so a model is trained on the prompt it is served with.
        self.default_system_prompt = default_system_prompt
        # The style whose coordinate grid records declaring "coords" are converted to (None: trained as written).
        self.prompt_style = prompt_style

    def layout(self) -> str:
        """The detected record layout(s) and the conversation key (data_layout)."""
        return data_layout(self.records, self.column)

    def __len__(self) -> int:
        return len(self.records)

    def where(self, index: int) -> str:
        """The record's place in its file when known ("data.jsonl:12"), else "<source> record <index>"."""
        return self.locations[index] if self.locations is not None else f"{self.source} record {index}"

    def record_problems(self) -> list[str]:
        """Why each unusable record cannot be used: layout, video range and media paths, checked without decoding.

        Cheap enough to run over every record before training, so a bad path fails at once instead of when
        the loader reaches its record, minutes in.
        """
        problems = []
        tokens = structural_tokens(self.tokenizer)
        for index, record in enumerate(self.records):
            where = self.where(index)
            try:
                messages = normalize_conversation(record, self.column, where)
                problem = structural_token_problem(messages, tokens, where)
                if problem is not None:
                    raise InputError(problem)
                media = media_of(messages, self.root, where)
                if media and self.vision_tokens is None:
                    raise InputError(f"{where}: the record has images or videos but the model has no vision tower")
                if media:
                    record_video_range(record, where)
                record_grid(record, where)
            except InputError as exc:
                problems.append(str(exc))
        return problems

    def _load_visuals(self, media: list[MediaRef], record: dict[str, Any], where: str) -> tuple[Any, Any]:
        """The record's encoded visual inputs, and its GenerationRequest-like frame (first video, else image)."""
        from physreason.engines.base import GenerationRequest
        from physreason.models.inputs import encode_visuals
        from physreason.vision import load_image, load_video
        from physreason.vision.resize import PATCH_FACTOR

        if self.vision_tokens is None:
            raise InputError(f"{where}: the record has images or videos but the model has no vision tower")
        factor = self.processor_params.factor if self.processor_params is not None else PATCH_FACTOR
        clip = self.vision_config.model_copy(update=record_video_range(record, where))
        images = [load_image(str(m.path), self.vision_config, factor) for m in media if m.kind == "image"]
        videos = [load_video(str(m.path), clip, factor) for m in media if m.kind == "video"]
        frame_size = GenerationRequest(messages=[], images=images, videos=videos).frame_size()
        return encode_visuals(images, videos, self.processor_params), frame_size

    def __getitem__(self, index: int) -> SFTSample | SkippedSample:
        where = self.where(index)
        messages = normalize_conversation(self.records[index], self.column, where)
        if self.default_system_prompt and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.default_system_prompt})
        media = media_of(messages, self.root, where)
        visuals, frame_size = self._load_visuals(media, self.records[index], where) if media else (None, None)
        if record_grid(self.records[index], where) is not None and self.prompt_style is not None:
            messages = regrid_conversation(messages, coord_space(self.prompt_style, frame_size), where)
        segments = conversation_segments(self.tokenizer, messages, where)
        ids, labels = tokenize_segments(
            self.tokenizer,
            segments,
            visuals.image_token_counts if visuals else [],
            visuals.video_token_counts if visuals else [],
            visuals.video_group_seconds if visuals else None,
        )
        keep, reason = truncation_problem(ids, labels, self.max_length, self.vision_tokens)
        if reason is not None:
            return SkippedSample(index, reason)
        input_ids = torch.tensor(ids[:keep], dtype=torch.long)  # [L]
        if self.vision_tokens is not None:
            positions = self.vision_tokens.positions(input_ids, visuals)
        else:
            positions = torch.arange(keep).expand(3, -1)
        labels_kept = torch.tensor(labels[:keep], dtype=torch.long)
        # truncated: a label token fell past the cut (an unlabelled tail, the newline after <|im_end|>, is no loss)
        cut = any(label != IGNORE_INDEX for label in labels[keep:])
        return SFTSample(input_ids, labels_kept, positions, visuals, truncated=cut)
