"""Structured answers: 2D boxes and points and time spans (`mm:ss.ff`) in JSON, and each family's coordinate grid.

Layouts (Cosmos-Reason2 `prompts/2d_grounding.yaml` and `prompts/temporal_localization.yaml`):
- a box: `{"box_2d": [x1, y1, x2, y2], "label": ...}` (Qwen3-VL's own key `bbox_2d` is read too);
- a point: `{"point_2d": [x, y], "label": ...}`;
- a time span: `{"start": "mm:ss.ff", "end": "mm:ss.ff", "caption": ...}`.
Each may stand alone or inside a list, and the whole may be wrapped in a ```json fence or surrounded
by text.

Decisions, the same for a model's answer and a reference:
- several items in a list: the first one counts. Every question names one body or one event, so
  listing more only hedges, and scoring the best of them would reward listing many.
- box corners in either order are sorted (x1 <= x2, y1 <= y2); coordinates are clipped to the grid they are
  written on (0-1000, or the frame's pixels) and returned on the common 0-1000 grid.
- a time span whose end is before its start is no answer; times are `m:ss` or `mm:ss` with an optional
  fraction of 1-3 digits (`00:01.5`, `00:01.50`, `00:01.500`).
Every parser here runs in time linear in its input: JSON is decoded at most three times (from the
first `{`, the first `[`, and after a ```json fence) and no regex has nested quantifiers.

Coordinate grids (`CoordSpace`): Cosmos-Reason2 (Qwen3-VL) writes x and y on a 0-1000 grid of each axis of the
frame; Cosmos-Reason1 (Qwen2.5-VL) writes absolute pixels of the frame as the model sees it (after the processor's
smart resize, sides multiples of 28; a timestamp bar under the frame is not part of it). References are stored on
the 0-1000 grid, the one family-neutral form; a completion is read on its model's grid and converted to 0-1000
with the frame's size, so every comparison happens on one grid.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Literal

COORD_MAX = 1000.0  # the common grid: 0-1000 per axis of the frame
BOX_KEYS = ("box_2d", "bbox_2d")
POINT_KEY = "point_2d"

AnswerKind = Literal["box_2d", "point_2d", "time_span"]
GridName = Literal["norm1000", "pixels"]
NEUTRAL_GRID: GridName = "norm1000"  # the grid references and generated data are stored on, for every family
COORDS_KEY = "coords"  # an SFT record's statement of the grid its answers' boxes and points are written on

# "mm:ss.ff": minutes (1-3 digits), seconds 00-59, an optional decimal fraction of 1-3 digits.
_TIME = re.compile(r"(\d{1,3}):([0-5]\d)(?:\.(\d{1,3}))?")
_FENCE = "```json"


@dataclass(frozen=True)
class Box:
    """An axis-aligned box in 0-1000 coordinates, corners sorted and clipped."""

    x1: float
    y1: float
    x2: float
    y2: float

    @property
    def area(self) -> float:
        """Area in squared 0-1000 units; 0 for a degenerate box."""
        return (self.x2 - self.x1) * (self.y2 - self.y1)


@dataclass(frozen=True)
class CoordSpace:
    """The grid a model writes 2D coordinates on: "norm1000" (0-1000 per axis, Qwen3-VL / Cosmos-Reason2), or
    "pixels" of a `width` x `height` frame (the frame as the model sees it, Qwen2.5-VL / Cosmos-Reason1).

    Raises ValueError for a pixel grid without a positive frame size.
    """

    grid: GridName = "norm1000"
    width: int = 0
    height: int = 0

    def __post_init__(self) -> None:
        if self.grid == "pixels" and (self.width <= 0 or self.height <= 0):
            raise ValueError(f"a pixel grid needs the frame's size, got {self.width}x{self.height}")
        if self.grid not in ("norm1000", "pixels"):
            raise ValueError(f"unknown coordinate grid {self.grid!r}: norm1000 or pixels")

    @property
    def limits(self) -> tuple[float, float]:
        """The largest x and y on this grid."""
        return (float(self.width), float(self.height)) if self.grid == "pixels" else (COORD_MAX, COORD_MAX)

    def to_common(self, x: float, y: float) -> tuple[float, float]:
        """A point on this grid, clipped to the frame, on the common 0-1000 grid."""
        x_max, y_max = self.limits
        x, y = min(max(x, 0.0), x_max), min(max(y, 0.0), y_max)
        return COORD_MAX * x / x_max, COORD_MAX * y / y_max

    def from_common(self, x: float, y: float) -> tuple[int, int]:
        """A point of the common 0-1000 grid (clipped to it) on this grid, rounded to integers as models write them."""
        x_max, y_max = self.limits
        x, y = min(max(x, 0.0), COORD_MAX), min(max(y, 0.0), COORD_MAX)
        return round(x * x_max / COORD_MAX), round(y * y_max / COORD_MAX)

    def describe(self) -> str:
        """The grid in words, for prompts and messages."""
        if self.grid == "pixels":
            return f"absolute pixels of the {self.width}x{self.height} frame"
        return "a 0-1000 grid of each axis of the frame"


NORM_1000 = CoordSpace()


@dataclass(frozen=True)
class Span:
    """A time span in seconds, start <= end."""

    start: float
    end: float


def parse_json(region: str) -> Any | None:
    """The first JSON value in `region` (fenced or with text around it), or None when there is none.

    Tries at most three start positions, so hostile input costs linear time.
    """
    starts = {region.find("{"), region.find("[")}
    fence = region.find(_FENCE)
    if fence >= 0:
        starts.add(fence + len(_FENCE))
    decoder = json.JSONDecoder(parse_constant=_reject_constant)
    for start in sorted(s for s in starts if s >= 0):
        try:
            value, _ = decoder.raw_decode(region, _skip_space(region, start))
        except (ValueError, RecursionError):
            continue
        return value
    return None


def _skip_space(text: str, start: int) -> int:
    while start < len(text) and text[start].isspace():
        start += 1
    return start


def _reject_constant(name: str) -> Any:
    # json accepts NaN and Infinity by default; a coordinate or time of NaN is no answer.
    raise ValueError(f"{name} is not a number")


def _first_item(value: Any) -> dict[str, Any] | None:
    """The answer object: the value itself, or the first element of a list (see the module docstring)."""
    if isinstance(value, list):
        value = value[0] if value else None
    return value if isinstance(value, dict) else None


def _numbers(value: Any, count: int) -> list[float] | None:
    if not isinstance(value, list) or len(value) != count:
        return None
    numbers = [finite_number(v) for v in value]
    return None if any(v is None for v in numbers) else numbers  # type: ignore[return-value]


def finite_number(value: Any) -> float | None:
    """A JSON number as a finite float; None for a non-number, a bool, NaN, infinity, or an int too large for a
    float (a model may write hundreds of digits: untrusted output is unparsed, never an OverflowError)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def box_from(item: dict[str, Any] | None, space: CoordSpace = NORM_1000) -> Box | None:
    """The box of an answer object (`box_2d` or `bbox_2d`) written on `space`'s grid, clipped to the frame, sorted,
    on the common 0-1000 grid; None when absent or malformed."""
    if item is None:
        return None
    raw = next((item[key] for key in BOX_KEYS if key in item), None)
    numbers = _numbers(raw, 4)
    if numbers is None:
        return None
    x1, y1 = space.to_common(numbers[0], numbers[1])
    x2, y2 = space.to_common(numbers[2], numbers[3])
    return Box(min(x1, x2), min(y1, y2), max(x1, x2), max(y1, y2))


def point_from(item: dict[str, Any] | None, space: CoordSpace = NORM_1000) -> tuple[float, float] | None:
    """The `point_2d` of an answer object written on `space`'s grid, clipped to the frame, on the common 0-1000
    grid; None when absent or malformed."""
    numbers = _numbers(item.get(POINT_KEY), 2) if item is not None else None
    return None if numbers is None else space.to_common(numbers[0], numbers[1])


def parse_time(text: Any) -> float | None:
    """Seconds of an `mm:ss.ff` string (fraction of 1-3 digits optional); None for any other form."""
    if not isinstance(text, str):
        return None
    match = _TIME.fullmatch(text.strip())
    if match is None:
        return None
    minutes, seconds, fraction = match.groups()
    return int(minutes) * 60 + int(seconds) + (int(fraction) / 10 ** len(fraction) if fraction else 0.0)


def format_time(seconds: float) -> str:
    """`mm:ss.ff` of a non-negative time in seconds, rounded to hundredths."""
    hundredths = round(seconds * 100)
    minutes, rest = divmod(hundredths, 6000)
    return f"{minutes:02d}:{rest // 100:02d}.{rest % 100:02d}"


def span_from(item: dict[str, Any] | None) -> Span | None:
    """The `start`/`end` span of an answer object; None when a time is missing, malformed or end < start."""
    if item is None:
        return None
    start, end = parse_time(item.get("start")), parse_time(item.get("end"))
    if start is None or end is None or end < start:
        return None
    return Span(start, end)


def json_item(text: str) -> dict[str, Any] | None:
    """The answer object of a JSON answer text: the first JSON value, or the first element of a JSON list."""
    return _first_item(parse_json(text))


def answer_kind(reference: str) -> AnswerKind:
    """Which layout a reference answer uses; ValueError when it is none of box, point or time span."""
    item = json_item(reference)
    if box_from(item) is not None:
        return "box_2d"
    if point_from(item) is not None:
        return "point_2d"
    if span_from(item) is not None:
        return "time_span"
    raise ValueError(f"the reference answer {reference[:80]!r} holds no box_2d, point_2d or start/end time span")


def grounds_2d(reference: str) -> bool:
    """Whether a reference answer is a 2D box or point (answered on its model's coordinate grid); False otherwise."""
    try:
        return answer_kind(reference) in ("box_2d", "point_2d")
    except ValueError:
        return False


def _regrid_item(item: Any, space: CoordSpace) -> bool:
    """Rewrite the 0-1000 box and point of one answer object on `space`'s grid, in place; True when it held one."""
    if not isinstance(item, dict):
        return False
    found = False
    for key, count in ((BOX_KEYS[0], 4), (BOX_KEYS[1], 4), (POINT_KEY, 2)):
        numbers = _numbers(item.get(key), count)
        if numbers is not None:
            item[key] = [v for i in range(0, count, 2) for v in space.from_common(numbers[i], numbers[i + 1])]
            found = True
    return found


def regrid_answer(text: str, space: CoordSpace) -> str | None:
    """`text` with the boxes and points of its JSON answer, written on the 0-1000 grid, rewritten on `space`'s grid
    (integers, as models write them); None when the answer holds no box or point.

    The answer is the first JSON value after the last `</think>` (the whole text without one), so an `<answer>`
    block or a bare answer both work; the text around it is kept as it is.
    """
    close = text.rfind("</think>")
    offset = close + len("</think>") if close >= 0 else 0
    region = text[offset:]
    decoder = json.JSONDecoder(parse_constant=_reject_constant)
    for start in sorted({region.find("{"), region.find("[")} - {-1}):
        try:
            value, end = decoder.raw_decode(region, start)
        except (ValueError, RecursionError):
            continue
        items = value if isinstance(value, list) else [value]
        if not [item for item in items if _regrid_item(item, space)]:
            return None
        return text[: offset + start] + json.dumps(value) + text[offset + end :]
    return None


def _shown(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, list) and len(repr(value)) < 200 else repr(value)
    return text if len(text) <= 80 else f"{text[:80]}..."


def _box_problem(name: str, box: Any) -> str | None:
    """What makes `box` unusable as a reference [x1, y1, x2, y2] (top-left corner first), or None."""
    if not isinstance(box, list) or len(box) != 4:
        return f"{name} {_shown(box)} is not four numbers [x1, y1, x2, y2]"
    for value in box:
        if finite_number(value) is None:
            return f"{name} {_shown(box)} holds {_shown(value)}, not a finite number"
    if min(box) < 0:
        return f"{name} {_shown(box)} has a negative coordinate"
    x1, y1, x2, y2 = box
    if x2 <= x1 or y2 <= y1:
        return f"{name} {_shown(box)} is reversed or empty: a box is [x1, y1, x2, y2] with x1 < x2 and y1 < y2"
    return None


def _point_problem(name: str, point: Any) -> str | None:
    """What makes `point` unusable as a reference [x, y], or None."""
    if not isinstance(point, list) or len(point) != 2:
        return f"{name} {_shown(point)} is not two numbers [x, y]"
    for value in point:
        if finite_number(value) is None or value < 0:
            return f"{name} {_shown(point)} holds {_shown(value)}, not a finite number >= 0"
    return None


def reference_problem(qa: dict[str, Any]) -> str | None:
    """What is wrong with a structured question's reference, or None (usable, or no structured answer at all).

    Checks the answer's first JSON item (a box_2d / bbox_2d, a point_2d, a start/end span) and a `box_2d` given beside
    the answer (the body a point answer must fall in). Scoring an unusable reference would count every answer wrong
    without saying why, so load_benchmark and GRPO's prompt loading (data.mcq) refuse the record instead.
    """
    answer = qa.get("answer")
    try:
        value = json.loads(answer) if isinstance(answer, str) else None
    except (ValueError, RecursionError):
        return None
    item = value[0] if isinstance(value, list) and value else value
    if not isinstance(item, dict):
        return None
    problem = None
    box_key = next((key for key in BOX_KEYS if key in item), None)
    if box_key is not None:
        problem = _box_problem(f"the answer's {box_key}", item[box_key])
    elif POINT_KEY in item:
        problem = _point_problem(f"the answer's {POINT_KEY}", item[POINT_KEY])
    elif "start" in item or "end" in item:
        start, end = parse_time(item.get("start")), parse_time(item.get("end"))
        if start is None or end is None:
            bad = "start" if start is None else "end"
            problem = f"the answer's {bad} {_shown(item.get(bad))} is not a time mm:ss.ff"
        elif end <= start:
            problem = f"the answer's span ends ({item['end']}) no later than it starts ({item['start']})"
    else:
        return None
    if problem is None and "box_2d" in qa:
        problem = _box_problem("its 'box_2d'", qa["box_2d"])
    return problem
