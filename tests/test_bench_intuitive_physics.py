"""bench/intuitive_physics.py and its tower pre-training on CPU: the recipe's defaults, variant names, the per-task
loss, and a few tower steps on real generated clips (the GPU runs are in bench/RESULTS.md)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    return _load("intuitive_physics")


@pytest.fixture(scope="module")
def tower():
    return _load("intuitive_physics_tower")


def test_defaults_are_the_measured_recipe_and_variants_get_their_own_folders(bench):
    recipe = bench.parse_args([])
    assert (recipe.tower_steps, recipe.sft_freeze_tower, recipe.sft_steps, recipe.sft_lr, recipe.grpo_lr) == (
        3000,
        True,
        1500,
        3e-4,
        3e-5,
    )
    assert bench.variant_suffix(recipe) == "-tower3000-frozen"
    # no tower pre-training: nothing to keep fixed, and the folders keep the earlier recipe's names
    plain = bench.parse_args(["--tower-steps", "0"])
    assert not plain.sft_freeze_tower and bench.variant_suffix(plain) == ""
    trained = bench.parse_args(["--no-sft-freeze-tower"])
    assert bench.variant_suffix(trained) == "-tower3000"
    qwen3 = bench.parse_args(["--family", "qwen3_vl", "--temporal-patch", "4", "--tower-steps", "0"])
    assert bench.model_folder_name(qwen3) == "model-scale2-qwen3_vl-tp4"
    assert bench.variant_suffix(qwen3) == "-scale2-qwen3_vl-tp4"


def test_own_task_loss_is_each_rows_cross_entropy_over_its_own_tasks_options(tower):
    torch.manual_seed(0)
    bounds = torch.tensor([0, 2, 6, 8])  # tasks of 2, 4 and 2 options
    task = torch.tensor([0, 1, 2, 1, 0, 1])
    answer = torch.tensor([1, 3, 0, 0, 0, 2])
    logits = torch.randn(6, 8)
    loss, hits = tower.own_task_loss(logits, task, answer, bounds)
    per_row, expected_hits = [], []
    for row in range(6):
        scores = logits[row, bounds[task[row]] : bounds[task[row] + 1]]
        per_row.append(torch.nn.functional.cross_entropy(scores[None], answer[row][None]))
        expected_hits.append(float(scores.argmax() == answer[row]))
    assert torch.allclose(loss, torch.stack(per_row).mean())
    assert hits.tolist() == expected_hits
    logits[0, 2:] = 100.0  # another task's columns never count for row 0
    assert torch.allclose(tower.own_task_loss(logits, task, answer, bounds)[0], loss)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_pretrain_tower_changes_only_the_vision_tower_and_saves_a_loadable_model(tower, tmp_path, monkeypatch, family):
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    from physreason.data.synth.generate import generate_task
    from physreason.data.synth.tasks import LETTER_TASK_NAMES as TASK_NAMES
    from physreason.demo import letter_sft_records
    from physreason.models.tiny import save_tiny_model

    monkeypatch.syspath_prepend(str(BENCH))  # the spawned decode processes import the module by name
    data, model_dir, out = tmp_path / "data", tmp_path / "model", tmp_path / "out"
    for task in TASK_NAMES:
        generate_task(task, 3, data, "train", 0, workers=1, show_progress=False, option_order="fixed")
    letter_sft_records(data, data / "sft.jsonl")
    save_tiny_model(family, model_dir)
    vision = {"min_pixels": 12544, "max_pixels": 12544, "max_frames": 12}
    result = tower.pretrain_tower(model_dir, data, out, vision, steps=3, batch=4, workers=1)

    assert result["clips"] == 9 and result["steps"] == 3 and len(result["loss_curve"]) == 3
    assert set(result["train_accuracy"]) <= set(TASK_NAMES)
    assert json.loads((out / "tower_pretraining.json").read_text())["grid_thw"] == result["grid_thw"]
    before, after = load_file(model_dir / "model.safetensors"), load_file(out / "model.safetensors")
    assert before.keys() == after.keys()
    visual = [name for name in before if ".visual." in name or name.startswith("visual.")]
    assert visual and len(visual) < len(before)
    assert any(not torch.equal(before[name], after[name]) for name in visual)
    assert all(torch.equal(before[name], after[name]) for name in before if name not in visual)
    for name in ("tokenizer.json", "preprocessor_config.json"):
        assert (out / name).is_file()
    AutoModelForImageTextToText.from_pretrained(out)  # SFT starts from this folder
