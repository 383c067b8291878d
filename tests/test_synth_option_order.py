"""option_order "fixed": the same options in the same order in every sample, classes balanced, answers still true."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from physreason.data.synth import spatial_puzzle
from physreason.data.synth.generate import build_sample, generate_task
from physreason.data.synth.render import render_frames
from physreason.data.synth.tasks import LETTER_TASK_NAMES, TASKS
from physreason.errors import InputError


def _block(task: str, option_order: str):
    """One balanced block of samples (every slot once)."""
    return [build_sample(task, "train", 0, i, option_order)[1] for i in range(TASKS[task].n_slots)]


@pytest.mark.parametrize("task", LETTER_TASK_NAMES)
def test_fixed_order_lists_identical_options_and_balances_the_answer_letters(task):
    samples = _block(task, "fixed")
    assert len({json.dumps(s.options) for s in samples}) == 1
    letters = Counter(s.answer for s in samples)
    assert len(set(letters.values())) == 1 and set(letters) == set(samples[0].options)


@pytest.mark.parametrize("task", ["arrow_of_time", "object_permanence"])
def test_fixed_order_keeps_the_clip_class_and_answer_text_of_the_shuffled_order(task):
    for fixed, shuffled in zip(_block(task, "fixed"), _block(task, "shuffled")):
        assert fixed.frames.tobytes() == shuffled.frames.tobytes() and fixed.label == shuffled.label
        assert fixed.options[fixed.answer] == shuffled.options[shuffled.answer]
        assert f"option {fixed.answer}." in fixed.reasoning


def test_fixed_spatial_puzzle_answer_restores_the_rendered_scene_and_no_other_option_does():
    for index, sample in enumerate(_block("spatial_puzzle", "fixed")):
        seed, _ = build_sample("spatial_puzzle", "train", 0, index)
        _, scene, trajectory = spatial_puzzle.choose_scene(np.random.default_rng(seed))
        original = render_frames(scene, trajectory)
        for letter, arrangement in zip(sample.options, spatial_puzzle.FIXED_SHUFFLES):
            restored = spatial_puzzle.restore_patches(sample.frames, arrangement)
            assert np.array_equal(restored, original) == (letter == sample.answer)


def test_meta_records_the_option_order_and_a_rerun_with_the_other_order_is_refused(tmp_path):
    generate_task("arrow_of_time", 2, tmp_path, "val", 0, workers=1, show_progress=False, option_order="fixed")
    meta = json.loads((tmp_path / "arrow_of_time" / "meta.json").read_text())
    assert meta["option_order"] == "fixed"
    with pytest.raises(InputError, match="option order"):
        generate_task("arrow_of_time", 2, tmp_path, "val", 0, workers=1, show_progress=False)


def test_unknown_option_order_is_refused_with_the_choices(tmp_path):
    with pytest.raises(InputError, match="shuffled, fixed"):
        generate_task("arrow_of_time", 1, tmp_path, "val", option_order="sorted")


def test_index_files_are_written_through_a_temporary_file_of_each_writers_own(tmp_path):
    # Seeds run side by side rewrite one clip folder's index files: another writer's temporary file must survive.
    folder = tmp_path / "arrow_of_time"
    folder.mkdir()
    other = folder / "arrow_of_time_benchmark_qa_pairs.json.partial"  # the name every writer once shared
    other.write_text("another process's half-written file")
    generate_task("arrow_of_time", 1, tmp_path, "train", show_progress=False, option_order="fixed")
    assert other.read_text() == "another process's half-written file"
    assert len(json.loads((folder / "arrow_of_time_benchmark_qa_pairs.json").read_text())) == 1
    assert not [path for path in folder.iterdir() if path.name.endswith(".partial") and path != other]
