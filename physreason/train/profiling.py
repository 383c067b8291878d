"""Profile a few training steps with torch.profiler and say where the time goes, by category and by phase.

`Profiled(folder, name, device)` collects CPU ops and, on a GPU, CUDA kernels; `breakdown(events)` sorts each piece
of work into one category, the first rule that matches:
  communication   NCCL kernels and collectives, and FSDP2's own work around them (ops under its "FSDP::" ranges:
                  copy-in/out of all-gathers, reduce-scatter inputs);
  optimizer       inside "physreason.optimizer" (clipping, AdamW, zeroing);
  loss/logits     inside "physreason.loss" (lm_head, log-softmax / cross-entropy, the objective), forward and backward;
  vision tower    inside "physreason.vision_tower" (its attention included), forward and backward;
  attention       attention kernels by name (flash, cuDNN, memory-efficient, sdpa, fmha);
  GEMMs           matrix multiplications by name (cuBLAS/CUTLASS/nvjet kernels, aten::mm/addmm/bmm on CPU);
  other           the rest (norms, rotary, activations, copies, casts, ...).
The three phase categories (optimizer, loss/logits, vision tower) are split once more by kernel name into attention,
GEMMs and other, with their own heaviest kernels, so a slow vision tower shows what inside it is slow. On a GPU, the
"other" kernels (generic elementwise, copy and reduction kernels, whose names say little) are also listed by the CPU
op that launched them (aten::copy_, aten::cat, aten::mul, a Triton kernel of a compiled graph, ...), in the whole step
and inside each phase category.
Work is "inside" a phase (physreason/train/phases.py) when it was launched within that range, or, for backward work,
when its autograd node was created within that range in the forward (matched by autograd sequence number); the
phase table lists the same work by phase and direction. Work items: on a GPU, each kernel (and memcpy/memset) with
its device time, attributed to the CPU op that launched it; on CPU, each op's self CPU time. Times are per step
(the total over the profiled steps divided by their number).
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from physreason.train.phases import PREFIX

CATEGORIES = ("communication", "optimizer", "loss/logits", "vision tower", "attention", "GEMMs", "other")
_PHASE_CATEGORY = {"optimizer": "optimizer", "loss": "loss/logits", "vision_tower": "vision tower"}
_ATTENTION = ("flash", "fmha", "attention", "sdpa", "attn")
_GEMM = ("gemm", "cutlass", "xmma", "nvjet", "cublas", "gemv", "aten::mm", "aten::addmm", "aten::bmm",
         "aten::baddbmm", "aten::_scaled_mm")  # fmt: skip
_COMMUNICATION = ("nccl", "c10d::", "fsdp::", "all_gather", "reduce_scatter", "allreduce", "all_reduce")
_BACKWARD_NODE = "autograd::engine::evaluate_function: "


def kind(name: str) -> str:
    """attention, GEMMs or other, by the kernel's (or op's) name alone."""
    lowered = name.lower()
    if any(key in lowered for key in _ATTENTION):
        return "attention"
    if any(key in lowered for key in _GEMM):
        return "GEMMs"
    return "other"


def category(name: str, phase: str | None, callers: tuple[str, ...] = ()) -> str:
    """The category of one piece of work: its kernel or op `name`, the phase it belongs to (None: none) and the
    names of the ops and ranges it ran under (innermost first)."""
    lowered = name.lower()
    if any(key in text.lower() for text in (name, *callers) for key in _COMMUNICATION):
        return "communication"
    if phase in _PHASE_CATEGORY:
        return _PHASE_CATEGORY[phase]
    return kind(lowered)


@dataclass
class Breakdown:
    """Microseconds per category and per (phase, direction), over all profiled steps."""

    device: str  # "cuda": kernel time; "cpu": self CPU time of ops
    by_category: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    by_phase: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    top: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # by kernel / op name
    # Inside each phase category (optimizer, loss/logits, vision tower): by kind(), and by kernel / op name.
    inside: dict[str, dict[str, float]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(float)))
    inside_top: dict[str, dict[str, float]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(float)))
    unattributed_us: float = 0.0  # device time of kernels no CPU op claimed (shown, never guessed)
    # On a GPU: the "other" kernels' time by the CPU op that launched them, in the whole step and inside each phase
    # category (CPU profiles list ops already).
    other_ops: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    inside_other_ops: dict[str, dict[str, float]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(float)))

    @property
    def total_us(self) -> float:
        return sum(self.by_category.values())


def _ancestors(event: Any):
    while event is not None:
        yield event
        event = event.cpu_parent


def _range_phase(event: Any) -> str | None:
    """The innermost physreason range that encloses `event` in its own thread's call tree."""
    for node in _ancestors(event):
        if node.name.startswith(PREFIX):
            return node.name[len(PREFIX) :]
    return None


def breakdown(events: list[Any], device: str) -> Breakdown:
    """Sort the profile's work by category and by phase (see the module docstring)."""
    cpu_events = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    # Forward ops that made an autograd node: (thread, sequence number) -> the phase they ran in.
    created: dict[tuple[int, int], str] = {}
    for event in cpu_events:
        if event.sequence_nr >= 0 and not event.name.startswith(_BACKWARD_NODE):
            phase = _range_phase(event)
            if phase is not None:
                created.setdefault((event.thread, event.sequence_nr), phase)
    # Ranges on any thread, for work no call tree or sequence number places (e.g. other threads' ops).
    ranges = sorted(
        ((e.time_range.start, e.time_range.end, e.name[len(PREFIX) :]) for e in cpu_events if e.name.startswith(PREFIX)),
        key=lambda r: r[1] - r[0],
    )

    def place(event: Any) -> tuple[str | None, str]:
        """(phase, "forward" or "backward") of the work an op did."""
        backward = False
        for node in _ancestors(event):
            if node.name.startswith(_BACKWARD_NODE):
                backward = True
                phase = created.get((node.fwd_thread, node.sequence_nr))
                if phase is not None:
                    return phase, "backward"
            elif node.name.startswith(PREFIX) and not backward:
                return node.name[len(PREFIX) :], "forward"
        start = event.time_range.start
        enclosing = next((name for begin, end, name in ranges if begin <= start <= end), None)
        return enclosing, "backward" if backward or enclosing == "backward" else "forward"

    result = Breakdown(device)

    def add(name: str, microseconds: float, event: Any) -> None:
        phase, direction = place(event)
        callers = tuple(node.name for node in _ancestors(event))
        sort = category(name, phase, callers)
        result.by_category[sort] += microseconds
        generic = device == "cuda" and kind(name) == "other"
        if generic:
            result.other_ops[event.name] += microseconds
        if sort in _PHASE_CATEGORY.values():
            result.inside[sort][kind(name)] += microseconds
            result.inside_top[sort][name] += microseconds
            if generic:
                result.inside_other_ops[sort][event.name] += microseconds
        result.by_phase[f"{phase or 'outside the phases'} ({direction})"] += microseconds
        result.top[name] += microseconds

    if device == "cuda":
        claimed = 0.0
        for event in cpu_events:
            for kernel in event.kernels:
                add(kernel.name, kernel.duration, event)
                claimed += kernel.duration
        kernel_total = sum(
            e.time_range.elapsed_us()
            for e in events
            if e.device_type != torch.autograd.DeviceType.CPU and not e.is_user_annotation
            and not e.name.startswith((PREFIX, "ProfilerStep"))
        )
        result.unattributed_us = max(0.0, kernel_total - claimed)
    else:
        for event in cpu_events:
            if event.name.startswith(PREFIX) or event.name.startswith("ProfilerStep"):
                continue
            add(event.name, event.self_cpu_time_total, event)
    return result


def launches_under(events: list[Any], ranges: tuple[str, ...], device: str) -> dict[str, int]:
    """Work launched under each named range (its innermost one of `ranges`), over all profiled steps: on a GPU the
    kernels (memcpy/memset included) the range's CPU ops launched; on CPU the ops called from Python in it (those
    under no other op: what a launch is there)."""
    counts = dict.fromkeys(ranges, 0)
    for event in events:
        if event.device_type != torch.autograd.DeviceType.CPU:
            continue
        called = not event.is_user_annotation and (event.cpu_parent is None or event.cpu_parent.is_user_annotation)
        work = len(event.kernels) if device == "cuda" else int(called)
        if not work:
            continue
        owner = next((node.name for node in _ancestors(event) if node.name in counts), None)
        if owner is not None:
            counts[owner] += work
    return counts


def optimizer_steps(events: list[Any]) -> int:
    """How many optimizer steps ran inside the profiled window: torch.optim's own `Optimizer.step#<class>.step` ranges
    (what a per-step figure should divide by, whatever the number of profiler steps)."""
    return sum(
        1 for e in events if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("Optimizer.step#")
    )


def device_busy_us(events: list[Any]) -> tuple[float, float, float]:
    """(sum, union, longest) of the device events' durations in microseconds (kernels, memcpy, memset): the union is
    the time the device was busy at all; on one stream the sum cannot exceed it unless the trace's device times
    overlap, and no one event can outlast the step that launched it unless its record is corrupt."""
    intervals = sorted(
        (e.time_range.start, e.time_range.end)
        for e in events
        if e.device_type != torch.autograd.DeviceType.CPU and not e.is_user_annotation
        and not e.name.startswith((PREFIX, "ProfilerStep"))
    )
    total = sum(end - start for start, end in intervals)
    busy, reach = 0.0, float("-inf")
    for start, end in intervals:
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return total, busy, max((end - start for start, end in intervals), default=0.0)


def format_breakdown(result: Breakdown, steps: int, top: int = 12, inside_share: float = 0.1) -> str:
    """Tables of ms per step by category, by phase and the heaviest kernels (or ops); then, for each phase category
    (optimizer, loss/logits, vision tower) with at least `inside_share` of the total, its split by kind and its own
    heaviest kernels."""
    unit = "GPU kernel time" if result.device == "cuda" else "CPU self time"
    total = max(result.total_us, 1e-9)
    lines = [f"{unit} per step: {result.total_us / steps / 1e3:.1f} ms over {steps} profiled steps"]
    if result.unattributed_us:
        lines.append(f"  (plus {result.unattributed_us / steps / 1e3:.1f} ms of kernels no CPU op claimed)")
    for title, table in (("category", result.by_category), ("phase", result.by_phase)):
        lines.append(f"{title:<40}{'ms/step':>10}{'share':>8}")
        keys = CATEGORIES if title == "category" else sorted(table, key=table.get, reverse=True)
        for key in keys:
            lines.append(f"  {key:<38}{table.get(key, 0.0) / steps / 1e3:>10.2f}{table.get(key, 0.0) / total:>8.1%}")
    heaviest = "heaviest " + ("kernels" if result.device == "cuda" else "ops")
    lines += _heaviest(result.top, heaviest, steps, total, "share", top)
    if result.other_ops:
        lines += _heaviest(result.other_ops, "ops behind the 'other' kernels", steps, total, "share", 8)
    for sort in CATEGORIES:
        part = result.by_category.get(sort, 0.0)
        if sort not in result.inside or part < inside_share * total:
            continue
        lines.append(f"{'inside ' + sort + ', by kind':<40}{'ms/step':>10}{'of it':>8}")
        for key in ("attention", "GEMMs", "other"):
            value = result.inside[sort].get(key, 0.0)
            lines.append(f"  {key:<38}{value / steps / 1e3:>10.2f}{value / part:>8.1%}")
        lines += _heaviest(result.inside_top[sort], f"{heaviest} inside {sort}", steps, part, "of it", top)
        if result.inside_other_ops.get(sort):  # GPU profiles only: CPU ones list ops already
            lines += _heaviest(result.inside_other_ops[sort], f"ops behind 'other' inside {sort}", steps, part, "of it", 8)
    return "\n".join(lines)


def _heaviest(times: dict[str, float], heading: str, steps: int, whole: float, share: str, top: int) -> list[str]:
    """A table of the `top` heaviest names in `times` (microseconds over `steps`), each with its share of `whole`."""
    lines = [f"{heading:<40}{'ms/step':>10}{share:>8}"]
    for name, value in sorted(times.items(), key=lambda item: item[1], reverse=True)[:top]:
        lines.append(f"  {name[:70]:<38}{value / steps / 1e3:>10.2f}{value / whole:>8.1%}")
    return lines


def summary_json(result: Breakdown, steps: int) -> dict[str, Any]:
    """The breakdown in ms per step, for a bench's JSON output."""
    per_step = 1e3 * steps
    return {
        "device_time": result.device,
        "total_ms_per_step": result.total_us / per_step,
        "unattributed_ms_per_step": result.unattributed_us / per_step,
        "by_category_ms_per_step": {k: result.by_category.get(k, 0.0) / per_step for k in CATEGORIES},
        "by_phase_ms_per_step": {k: v / per_step for k, v in sorted(result.by_phase.items())},
        "top_ms_per_step": {k: v / per_step for k, v in sorted(result.top.items(), key=lambda i: -i[1])[:30]},
        "other_by_op_ms_per_step": {k: v / per_step for k, v in sorted(result.other_ops.items(), key=lambda i: -i[1])[:30]},
        "inside_ms_per_step": {
            sort: {
                "by_kind": {k: result.inside[sort].get(k, 0.0) / per_step for k in ("attention", "GEMMs", "other")},
                "top": {k: v / per_step for k, v in sorted(result.inside_top[sort].items(), key=lambda i: -i[1])[:30]},
                "other_by_op": {k: v / per_step for k, v in sorted(result.inside_other_ops.get(sort, {}).items(),
                                                                   key=lambda i: -i[1])[:30]},  # fmt: skip
            }
            for sort in CATEGORIES
            if sort in result.inside
        },
    }


class Profiled:
    """Context that profiles what runs inside it; `step()` marks a step's end; on exit writes a chrome trace
    (`folder/<name>.trace.json`) and the breakdown (`folder/<name>.profile.json`), and prints the tables."""

    def __init__(self, folder: Path, name: str, device: torch.device, echo: bool = True) -> None:
        """`echo`: print the tables on exit (False: the caller prints what it needs from `result`)."""
        from torch.profiler import ProfilerActivity, profile

        self.folder, self.name, self.steps, self.echo = Path(folder), name, 0, echo
        self.device = "cuda" if device.type == "cuda" else "cpu"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device == "cuda" else [])
        self.profiler = profile(activities=activities, record_shapes=False, with_stack=False)
        self.result: Breakdown | None = None

    def __enter__(self) -> Profiled:
        self.profiler.__enter__()
        return self

    def step(self) -> None:
        """One profiled step has finished."""
        self.steps += 1
        self.profiler.step()

    def __exit__(self, *exc: Any) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()
        self.profiler.__exit__(*exc)
        if exc[0] is not None:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        self.profiler.export_chrome_trace(str(self.folder / f"{self.name}.trace.json"))
        steps = max(self.steps, 1)
        self.result = breakdown(list(self.profiler.events()), self.device)
        (self.folder / f"{self.name}.profile.json").write_text(json.dumps(summary_json(self.result, steps), indent=2))
        if self.echo:
            print(f"profile of {self.name} ({self.folder / f'{self.name}.trace.json'}):", flush=True)
            print(format_breakdown(self.result, steps), flush=True)
