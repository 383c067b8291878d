"""One generated sample, scene seeds that keep splits disjoint, and answer slots that keep letters balanced."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from physreason.chat.mcq import OPTION_LETTERS, format_mcq

SPLITS = ("train", "val", "test")
# "shuffled": the correct option's letter is drawn per sample (balanced), the benchmark layout.
# "fixed": every sample lists the same option texts in the same order, so the letter names the class;
# classes stay balanced, so the order carries no hint. A model trained from scratch learns this far
# sooner: with shuffled letters the answer depends on the clip and the option order jointly (an XOR),
# and neither alone correlates with it.
OPTION_ORDERS = ("shuffled", "fixed")
TASK_IDS = {"arrow_of_time": 0, "spatial_puzzle": 1, "object_permanence": 2}
# The structured-answer tasks form a second seed family with its own task ids: the letter tasks' seed rule
# (base_seed * 3 + task id) fills every integer, so no new id fits into it without renumbering their data.
# Both families keep seed % 3 as the split; the localization tasks seed their generators with (seed,
# LOCALIZATION_STREAM), so a seed number shared with a letter task still draws another scene.
LOCALIZATION_TASK_IDS = {"grounding": 0, "temporal_localization": 1}
LOCALIZATION_STREAM = 1
MAX_INDEX = 2**32


@dataclass
class Sample:
    """A rendered clip (as the model sees it) with its multiple-choice question, answer and grounded reasoning."""

    task: str
    frames: np.ndarray  # [T, H, W, 3] uint8, in the order the clip plays
    fps: int
    question: str
    options: dict[str, str]  # letter -> option text; empty for a structured (JSON) answer
    answer: str  # the correct letter, or the reference JSON answer
    label: str  # the answer's class, e.g. "reversed", for balance reports
    reasoning: str  # the <think> text, built from the simulation's ground truth
    facts: dict[str, Any] = field(default_factory=dict)  # JSON-ready ground truth, for tests and audits
    reference: dict[str, Any] = field(default_factory=dict)  # ground truth beside the answer that rewards read

    def user_text(self) -> str:
        """The user turn: question, lettered options and the benchmark's answer instructions (or the question alone)."""
        return format_mcq(self.question, self.options) if self.options else self.question

    def assistant_text(self) -> str:
        """The assistant turn: Cosmos-Reason1's layout with the letter, or Cosmos-Reason2's with the JSON after </think>."""
        if not self.options:
            return f"<think>\n{self.reasoning}\n</think>\n\n{self.answer}"
        return f"<think>\n{self.reasoning}\n</think>\n\n<answer>\n{self.answer}\n</answer>"


def scene_seed(base_seed: int, split: str, task: str, index: int) -> int:
    """The seed of sample `index`: injective in (base_seed, task, index, split), and seed % 3 names the split.

    So train, val and test can never share a scene, whatever base seeds they were generated with.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if not 0 <= index < MAX_INDEX or base_seed < 0:
        raise ValueError(f"need 0 <= index < 2**32 and base_seed >= 0, got index={index}, base_seed={base_seed}")
    family = TASK_IDS if task in TASK_IDS else LOCALIZATION_TASK_IDS
    return ((base_seed * len(family) + family[task]) * MAX_INDEX + index) * len(SPLITS) + SPLITS.index(split)


def seed_rule(task: str) -> str:
    """The scene-seed rule of `task`'s family, as meta.json records it."""
    if task in TASK_IDS:
        return (
            "((base_seed * 3 + task_id) * 2**32 + index) * 3 + split_id; seed % 3 is the split (train 0, val 1, test 2)"
        )
    return (
        "((base_seed * 2 + task_id) * 2**32 + index) * 3 + split_id, task_id grounding 0, temporal_localization 1; "
        f"scenes drawn from numpy default_rng([seed, {LOCALIZATION_STREAM}]); seed % 3 is the split (train 0, val 1, "
        "test 2)"
    )


def task_key(task: str) -> int:
    """A number naming `task` among every task, for generator keys (letter tasks keep their ids)."""
    return TASK_IDS[task] if task in TASK_IDS else len(TASK_IDS) + LOCALIZATION_TASK_IDS[task]


def split_of_seed(seed: int) -> str:
    """The split a scene seed belongs to (the inverse of `scene_seed` for its split)."""
    return SPLITS[seed % len(SPLITS)]


def balanced_slot(base_seed: int, split: str, task: str, index: int, n_slots: int) -> int:
    """A slot in [0, n_slots) for sample `index`: each block of n_slots consecutive samples uses every slot once.

    Tasks map a slot to (class, correct letter), so classes and letter positions are balanced exactly
    over every full block, in an order that looks random.
    """
    block, position = divmod(index, n_slots)
    rng = np.random.default_rng([base_seed, task_key(task), SPLITS.index(split), block])
    return int(rng.permutation(n_slots)[position])


def fixed_options(texts: list[str], correct: int) -> tuple[dict[str, str], str]:
    """Letter the option texts in the given order; the answer is the letter of texts[correct]."""
    letters = OPTION_LETTERS[: len(texts)]
    return dict(zip(letters, texts)), letters[correct]


def options_with_answer(
    texts: list[str], correct: int, letter_index: int, rng: np.random.Generator
) -> tuple[dict[str, str], str]:
    """Letter the option texts with texts[correct] at letter `letter_index` and the others in random order."""
    others = [t for i, t in enumerate(texts) if i != correct]
    order = [others[i] for i in rng.permutation(len(others))]
    order.insert(letter_index, texts[correct])
    letters = OPTION_LETTERS[: len(order)]
    return dict(zip(letters, order)), letters[letter_index]
