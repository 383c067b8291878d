"""The registry of synthetic intuitive-physics tasks, read by the generator, the CLI, the demo and the benches.

Import-light (names and facts): the CLI reads it at start-up; a task's sample builder is imported on first use.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class SynthTask:
    """One task: its name, the module that builds its samples, how it is answered and how many options it offers."""

    name: str
    module: str  # defines make_sample(seed, slot, option_order) -> Sample and N_SLOTS
    n_options: int = 0  # letter tasks only
    answer: Literal["letter", "json"] = "letter"  # an option letter, or Cosmos-Reason2's JSON (box, point, span)

    @property
    def chance(self) -> float:
        """Accuracy of a uniform guess among the options (letter tasks)."""
        if self.answer != "letter":
            raise ValueError(f"{self.name} is answered in JSON: it has no options to guess among")
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
        SynthTask("grounding", "physreason.data.synth.grounding", answer="json"),
        SynthTask("temporal_localization", "physreason.data.synth.temporal_localization", answer="json"),
    )
}
TASK_NAMES: tuple[str, ...] = tuple(TASKS)
# The multiple-choice tasks of the intuitive-physics table (Cosmos-Reason1's), and the JSON-answer ones.
LETTER_TASK_NAMES: tuple[str, ...] = tuple(name for name, task in TASKS.items() if task.answer == "letter")
JSON_TASK_NAMES: tuple[str, ...] = tuple(name for name, task in TASKS.items() if task.answer == "json")
