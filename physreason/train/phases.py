"""Named profiler ranges around the phases of a training step, so that a torch.profiler trace splits by phase.

Each phase is a `torch.profiler.record_function` range named "physreason.<phase>". Outside a profiler a range
costs about a microsecond, so the SFT and GRPO steps keep them on. The vision tower is called from inside the
transformers model, so its range comes from forward hooks on the tower (`mark_vision_tower`); it nests inside
"physreason.language_model". Backward work runs on autograd's threads, outside these ranges: a profile reader
(physreason/train/profiling.py) attributes it through autograd's sequence numbers to the phase whose forward created
it.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.profiler import record_function

PREFIX = "physreason."
VISION_TOWER = "vision_tower"  # the vision encoder and its merger
LANGUAGE_MODEL = "language_model"  # the decoder (embedding to final norm), the vision tower inside it
LOSS = "loss"  # lm_head, log-softmax / cross-entropy, the objective
BACKWARD = "backward"  # the backward call (its work is attributed to the forward phases where possible)
OPTIMIZER = "optimizer"  # gradient clipping, the optimizer and scheduler steps, zeroing
GENERATE = "generate"  # GRPO rollouts (the engine, rewards, advantages)
SYNC = "sync"  # GRPO weight push to the engine
PHASES = (VISION_TOWER, LANGUAGE_MODEL, LOSS, BACKWARD, OPTIMIZER, GENERATE, SYNC)


def phase(name: str) -> record_function:
    """The profiler range of one phase (a context manager)."""
    if name not in PHASES:
        raise ValueError(f"unknown phase {name!r}; phases: {', '.join(PHASES)}")
    return record_function(PREFIX + name)


def mark_vision_tower(model: nn.Module) -> bool:
    """Open a "physreason.vision_tower" range around every forward of `model`'s vision tower (once per model).

    Returns whether the model has a tower (`model.model.visual`, the transformers layout of Qwen-VL models).
    """
    tower = getattr(getattr(model, "model", None), "visual", None)
    if tower is None:
        return False
    if getattr(tower, "_physreason_phase_hooks", False):
        return True
    open_ranges: list[Any] = []

    def enter(*_: Any) -> None:
        scope = phase(VISION_TOWER)
        scope.__enter__()
        open_ranges.append(scope)

    def leave(*_: Any) -> None:
        if open_ranges:
            open_ranges.pop().__exit__(None, None, None)

    tower.register_forward_pre_hook(enter)
    # always_call: the range closes even when the forward raises
    tower.register_forward_hook(leave, always_call=True)
    tower._physreason_phase_hooks = True
    return True

