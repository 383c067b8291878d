"""The registry of synthetic intuitive-physics tasks, read by the generator, the CLI, the demo and the benches.

Import-light (names and facts): the CLI reads it at start-up; a task's sample builder is imported on first use.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SynthTask:
    """One task: its name, the module that builds its samples, and how many answer options a question has."""

    name: str
    module: str  # defines make_sample(seed, slot, option_order) -> Sample and N_SLOTS
    n_options: int

    @property
    def chance(self) -> float:
        """Accuracy of a uniform guess among the options."""
        return 1.0 / self.n_options

    def _builder(self) -> Any:
        return importlib.import_module(self.module)

    @property
    def make_sample(self) -> Callable[..., Any]:
        """make_sample(seed, slot, option_order) -> Sample of this task."""
        return self._builder().make_sample

    @property
    def n_slots(self) -> int:
        """(class, letter) slots of one balanced block of samples."""
        return int(self._builder().N_SLOTS)


TASKS: dict[str, SynthTask] = {
    task.name: task
    for task in (
        SynthTask("arrow_of_time", "physreason.data.synth.arrow_of_time", n_options=2),
        SynthTask("spatial_puzzle", "physreason.data.synth.spatial_puzzle", n_options=4),
        SynthTask("object_permanence", "physreason.data.synth.object_permanence", n_options=2),
    )
}
TASK_NAMES: tuple[str, ...] = tuple(TASKS)
