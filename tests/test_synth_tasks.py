"""Each synthetic task's answer is true of the simulation, samples are deterministic, splits and letters balanced."""

from __future__ import annotations

import itertools
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from physreason.data.synth import arrow_of_time, object_permanence, spatial_puzzle
from physreason.data.synth.generate import build_sample
from physreason.data.synth.render import render_frames
from physreason.data.synth.sample import SPLITS, balanced_slot, scene_seed, split_of_seed
from physreason.data.synth.tasks import JSON_TASK_NAMES, LETTER_TASK_NAMES, TASKS
from physreason.demo import DemoSizes


@pytest.mark.parametrize("task", LETTER_TASK_NAMES)
def test_same_seed_gives_identical_frames_and_text(task):
    _, first = build_sample(task, "train", 3, 5)
    _, again = build_sample(task, "train", 3, 5)
    _, other = build_sample(task, "train", 3, 6)
    assert first.frames.tobytes() == again.frames.tobytes()
    assert (first.user_text(), first.assistant_text()) == (again.user_text(), again.assistant_text())
    assert first.frames.tobytes() != other.frames.tobytes()


@pytest.mark.parametrize("task", LETTER_TASK_NAMES)
def test_clips_have_12_frames_at_4_fps(task):
    _, sample = build_sample(task, "val", 0, 0)
    assert sample.frames.shape == (24, 192, 256, 3) and sample.frames.dtype == np.uint8
    assert len(range(0, len(sample.frames), sample.fps // 4)) == 12


def test_scene_seeds_of_different_splits_never_meet():
    seeds = {
        split: {scene_seed(base, split, task, i) for base in range(4) for task in TASKS for i in range(500)}
        for split in SPLITS
    }
    for a, b in itertools.combinations(SPLITS, 2):
        assert not seeds[a] & seeds[b]
    for split, group in seeds.items():
        assert {split_of_seed(s) for s in group} == {split}
        for family in (LETTER_TASK_NAMES, JSON_TASK_NAMES):  # no collisions inside a seed family and split
            members = {scene_seed(base, split, task, i) for base in range(4) for task in family for i in range(500)}
            assert len(members) == 4 * len(family) * 500


@pytest.mark.parametrize("task", LETTER_TASK_NAMES)
def test_every_block_of_slots_balances_classes_and_letters(task):
    n_slots = TASKS[task].n_slots
    slots = [balanced_slot(7, "train", task, i, n_slots) for i in range(3 * n_slots)]
    for block in range(3):
        assert sorted(slots[block * n_slots : (block + 1) * n_slots]) == list(range(n_slots))
    assert slots[:n_slots] != slots[n_slots : 2 * n_slots] or n_slots <= 2  # the order is shuffled per block


@pytest.mark.parametrize("task", LETTER_TASK_NAMES)
def test_generated_answers_are_balanced_over_letters(task):
    n_slots = TASKS[task].n_slots
    samples = [build_sample(task, "train", 0, i)[1] for i in range(n_slots)]
    letters = Counter(s.answer for s in samples)
    assert len(set(letters.values())) == 1 and len(letters) == len(samples[0].options)


def test_reversed_clip_is_the_forward_clip_backwards_and_gains_energy():
    seed = scene_seed(0, "test", "arrow_of_time", 11)
    forward = arrow_of_time.make_sample(seed, slot=0)
    backward = arrow_of_time.make_sample(seed, slot=2)
    assert (forward.label, backward.label) == ("forward", "reversed")
    assert np.array_equal(backward.frames, forward.frames[::-1])
    energy_fwd = np.array(forward.facts["energy_in_clip_order"])
    energy_back = np.array(backward.facts["energy_in_clip_order"])
    assert energy_fwd[-1] <= 0.5 * energy_fwd[0] and energy_back[-1] >= 2 * energy_back[0]
    assert np.polyfit(np.arange(len(energy_back)), energy_back, 1)[0] > 0


@pytest.mark.parametrize("index", range(8))
def test_arrow_of_time_answer_names_the_true_direction(index):
    _, sample = build_sample("arrow_of_time", "train", 1, index)
    assert sample.options[sample.answer] == arrow_of_time.OPTION_TEXTS[sample.label]
    energy = np.array(sample.facts["energy_in_clip_order"])
    assert (energy[-1] > energy[0]) == (sample.label == "reversed")
    assert ("playing in reverse" in sample.reasoning) == (sample.label == "reversed")


def _arrangement_of(option_text: str) -> tuple[int, ...]:
    shown = re.findall(r"shown (top-left|top-right|bottom-left|bottom-right)", option_text)
    return tuple(spatial_puzzle.POSITIONS.index(p) for p in shown)


def test_patch_shuffle_and_restore_are_inverse():
    frames = np.random.default_rng(0).integers(0, 256, (3, 8, 12, 3), dtype=np.uint8)
    for shown_from in itertools.permutations(range(4)):
        arrangement = tuple(int(i) for i in np.argsort(shown_from))
        restored = spatial_puzzle.restore_patches(spatial_puzzle.shuffle_patches(frames, shown_from), arrangement)
        assert np.array_equal(restored, frames)


@pytest.mark.parametrize("index", range(8))
def test_spatial_puzzle_answer_restores_the_rendered_scene_and_no_other_option_does(index):
    seed, sample = build_sample("spatial_puzzle", "train", 2, index)
    _, scene, trajectory = spatial_puzzle.choose_scene(np.random.default_rng(seed))
    original = render_frames(scene, trajectory)
    arrangements = {letter: _arrangement_of(text) for letter, text in sample.options.items()}
    assert len(set(arrangements.values())) == len(arrangements) == 4
    for letter, arrangement in arrangements.items():
        restored = spatial_puzzle.restore_patches(sample.frames, arrangement)
        assert np.array_equal(restored, original) == (letter == sample.answer)
    assert not np.array_equal(sample.frames, original)  # the clip is really shuffled


@pytest.mark.parametrize("index", range(8))
def test_spatial_puzzle_floor_and_walls_sit_where_the_answer_puts_them(index):
    _, sample = build_sample("spatial_puzzle", "train", 2, index)
    shown_from = sample.facts["shown_from"]
    first = sample.frames[0].astype(int)  # [H, W, 3]
    h, w = first.shape[0] // 2, first.shape[1] // 2
    for p, q in enumerate(shown_from):
        patch = first[(p // 2) * h : (p // 2 + 1) * h, (p % 2) * w : (p % 2 + 1) * w]
        # The floor is one flat colour; above it every row crosses a wall and the backdrop.
        assert (np.ptp(patch[-6:].reshape(-1, 3), axis=0).max() <= 2) == (q >= 2)


def _target_pixels(frame: np.ndarray, colour: list[int]) -> int:
    return int(np.all(np.abs(frame.astype(int) - colour) <= 3, axis=-1).sum())


@pytest.mark.parametrize("slot", range(object_permanence.N_SLOTS))
def test_object_permanence_answer_matches_what_the_pixels_show(slot):
    seed = scene_seed(0, "train", "object_permanence", 100 + slot)
    sample = object_permanence.make_sample(seed, slot)
    colour, (hide_first, hide_last) = sample.facts["target_colour"], sample.facts["occluded_frames"]
    violation = sample.label != "persists"
    assert sample.options[sample.answer] == object_permanence.OPTION_TEXTS["violation" if violation else "physical"]
    assert _target_pixels(sample.frames[0], colour) > 20  # seen at the start
    for t in range(hide_first, hide_last + 1):
        assert _target_pixels(sample.frames[t], colour) == 0  # fully hidden behind the screen
    at_end = [_target_pixels(frame, colour) for frame in sample.frames[-3:]]
    if violation:
        assert at_end == [0, 0, 0]
        vanish = sample.facts["vanish_frame"]
        assert all(_target_pixels(frame, colour) == 0 for frame in sample.frames[vanish:])
        if sample.label == "vanishes_in_open":
            assert _target_pixels(sample.frames[vanish - 1], colour) > 20  # in plain view just before
    else:
        assert min(at_end) > 20  # came out again and stays in view


def test_object_permanence_classes_are_half_physical():
    labels = [object_permanence.SLOT_LABELS[s // 2] for s in range(object_permanence.N_SLOTS)]
    assert Counter(label == "persists" for label in labels) == {True: 4, False: 4}


@pytest.mark.parametrize("task", LETTER_TASK_NAMES)
def test_assistant_text_has_think_and_single_letter_answer(task):
    _, sample = build_sample(task, "train", 0, 3)
    match = re.fullmatch(r"<think>\n(.+)\n</think>\n\n<answer>\n([A-D])\n</answer>", sample.assistant_text(), re.DOTALL)
    assert match and match.group(2) == sample.answer
    assert f"option {sample.answer}" in match.group(1)
    assert sample.user_text().startswith(sample.question)


@pytest.mark.parametrize("task", LETTER_TASK_NAMES)
def test_registry_chance_is_one_over_the_options_every_sample_offers(task):
    for index in range(TASKS[task].n_slots):
        _, sample = build_sample(task, "train", 0, index)
        assert len(sample.options) == TASKS[task].n_options
    assert TASKS[task].chance == 1 / TASKS[task].n_options


def test_cli_demo_and_generator_read_the_one_task_registry():
    from physreason.cli import data_cmd
    from physreason.data.synth.tasks import TASK_NAMES
    from physreason.demo import demo_config

    assert data_cmd.TASK_NAMES is TASK_NAMES == tuple(TASKS)
    assert tuple(demo_config(Path("/tmp/x"), Path("/tmp/m"), DemoSizes()).eval.datasets) == LETTER_TASK_NAMES
    assert set(LETTER_TASK_NAMES) == {"arrow_of_time", "spatial_puzzle", "object_permanence"}
