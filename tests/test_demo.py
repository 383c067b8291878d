"""The README's main job runs end to end (at a toy size) and reports every stage."""

from __future__ import annotations

import io
import json

import pytest

from physreason.data.synth.tasks import LETTER_TASK_NAMES as TASKS
from physreason.demo import DemoSizes, demo_config, grpo_config, reward_trend, reward_windows, run_demo


@pytest.mark.slow
def test_demo_runs_every_stage_and_reuses_finished_work(tmp_path):
    # 8 clips per task: SFT's default, the spatial puzzle alone, fills one batch of 8
    sizes = DemoSizes(train_per_task=8, test_per_task=2, sft_steps=2, grpo_steps=1, max_tokens=2, tower_steps=2)
    table = run_demo(tmp_path / "demo", sizes)
    assert list(table) == ["base model", "after SFT", "after SFT+GRPO"]
    for scores in table.values():
        assert set(scores) == set(TASKS)
        assert all(value is None or 0.0 <= value <= 1.0 for value in scores.values())
    train = tmp_path / "demo" / "data" / "train"
    records = [json.loads(line) for line in (train / "sft.jsonl").read_text().splitlines()]
    assert len(records) == 8 * len(TASKS)  # every task's: the tower trains on them all
    # options in one fixed order (a from-scratch model cannot learn shuffled letters), and the tower pre-trained
    for task in TASKS:
        entries = json.loads((train / task / f"{task}_benchmark_qa_pairs.json").read_text())
        assert len({json.dumps(entry["qa_pairs"]["index2ans"]) for entry in entries}) == 1
    spatial = [json.loads(line) for line in (train / "sft-spatial_puzzle.jsonl").read_text().splitlines()]
    assert len(spatial) == 8 and {r["video"].split("/")[0] for r in spatial} == {"spatial_puzzle"}
    tower = json.loads((tmp_path / "demo" / "model-tower2" / "tower_pretraining.json").read_text())
    assert tower["steps"] == 2 and set(tower["heldout_accuracy"]) <= set(TASKS)
    prompts = (train / "rl.jsonl").read_text().splitlines()
    assert len(prompts) == 8 * len(TASKS) and json.loads(prompts[0])["video"].startswith(f"{TASKS[0]}/")
    # a rerun reuses the model, the clips and the trained models instead of making them again
    clip = train / "arrow_of_time" / records[0]["video"].split("/", 1)[1]
    exports = [tmp_path / "demo" / "model-tower2", tmp_path / "demo" / "sft-spatial_puzzle" / "safetensors" / "step_2",
               tmp_path / "demo" / "grpo" / "safetensors" / "step_1"]
    stamps = [path.stat().st_mtime_ns for path in (clip, *(e / "config.json" for e in exports))]
    assert run_demo(tmp_path / "demo", sizes) == table
    assert [path.stat().st_mtime_ns for path in (clip, *(e / "config.json" for e in exports))] == stamps


def test_grpo_reward_is_summarised_as_window_means_not_two_single_steps():
    rewards = [0.625, 0.5, 0.375, 0.5, 0.5, 0.625, 0.375, 0.5, 0.5, 0.625, 0.5, 0.312]
    assert reward_windows(rewards) == [(1, 4, 0.5), (5, 8, 0.5), (9, 12, pytest.approx(0.48425))]
    assert reward_windows([0.2, 0.4], windows=3) == [(1, 1, 0.2), (2, 2, 0.4)]
    assert reward_windows([]) == []


def test_grpo_reward_trend_says_rose_fell_or_noise_against_the_windows_standard_error():
    noisy = [0.625, 0.5, 0.375, 0.5, 0.5, 0.625, 0.375, 0.5, 0.5, 0.625, 0.5, 0.312]
    assert reward_trend(noisy).endswith("-0.016, standard error 0.082; no change beyond the step-to-step noise")
    rising = [0.3, 0.32, 0.31, 0.3, 0.4, 0.4, 0.4, 0.4, 0.5, 0.52, 0.51, 0.5]
    assert reward_trend(rising).startswith("from 0.307 (steps 1-4) to 0.508 (steps 9-12): +0.200")
    assert reward_trend(rising).endswith("; it rose")
    assert reward_trend(rising[::-1]).endswith("; it fell")  # a real fall is said plainly
    assert reward_trend([0.5]) == ""


def test_demo_seed_draws_the_training_runs_and_grpo_keeps_it(tmp_path):
    cfg = demo_config(tmp_path, tmp_path / "model", DemoSizes(), seed=3)
    assert cfg.train.seed == 3 and grpo_config(cfg, tmp_path, tmp_path / "sft", DemoSizes()).train.seed == 3
    # without a seed the schema's stays (the intuitive-physics experiment's published runs used it)
    assert demo_config(tmp_path, tmp_path / "model", DemoSizes()).train.seed == 42
    # the evaluations name the demo's seed (their progress said "seed 1" for every seed)
    assert cfg.eval.seed == 3 and demo_config(tmp_path, tmp_path / "model", DemoSizes(), seed=0).eval.seed == 0


def table_lines(sft_tasks) -> list[str]:
    from rich.console import Console

    from physreason.demo import task_table

    scores = {"arrow_of_time": 0.4, "spatial_puzzle": 0.633, "object_permanence": 0.233}
    table = {"base model": dict.fromkeys(TASKS, 0.5), "after SFT": scores, "after SFT+GRPO": dict(scores)}
    buffer = io.StringIO()
    Console(file=buffer, width=120).print(task_table(table, 30, sft_tasks))
    return buffer.getvalue().splitlines()


def test_demo_table_shows_the_sft_task_apart_from_the_tasks_sft_did_not_train():
    lines = table_lines(("spatial_puzzle",))
    at = {name: next(i for i, line in enumerate(lines) if name in line)
          for name in ("trained by SFT", "spatial_puzzle", "not in SFT's data", "arrow_of_time", "object_permanence")}
    assert at["trained by SFT"] < at["spatial_puzzle"] < at["not in SFT's data"] < at["arrow_of_time"]
    assert at["not in SFT's data"] < at["object_permanence"]
    assert any(set(line.strip()) <= set("├┼─┤") for line in lines[at["spatial_puzzle"] + 1 : at["not in SFT's data"]])
    # each task's row: chance, then every stage
    row = lines[at["spatial_puzzle"]].split("│")
    assert [cell.strip() for cell in row[1:-1]] == ["spatial_puzzle", "25.0", "50.0", "63.3", "63.3"]
    # SFT on every task: one section, no "not in SFT's data"
    every = table_lines(TASKS)
    assert not any("not in SFT's data" in line for line in every)
    assert all(any(task in line for line in every) for task in TASKS)


def test_demo_recipe_trains_on_a_fixed_pretrained_tower_and_grpo_keeps_the_option_order(tmp_path):
    sizes = DemoSizes()
    cfg = demo_config(tmp_path, tmp_path / "model-tower", sizes)
    assert cfg.train.freeze_vision_tower and cfg.vision.max_frames == 4 and cfg.vision.max_pixels == 12544
    rl = grpo_config(cfg, tmp_path, tmp_path / "sft", sizes)
    assert rl.train.freeze_vision_tower  # as SFT trained it
    assert not rl.grpo.shuffle_options  # reshuffled options would ask questions SFT never taught
    assert rl.train.optm_lr < cfg.train.optm_lr
    assert rl.train.train_batch_per_replica == rl.rollout.n_generation * rl.rollout.batch_size == 32
    # without a pre-trained tower there is nothing to keep fixed: SFT and GRPO train the random one
    plain = DemoSizes(tower_steps=0)
    cfg = demo_config(tmp_path, tmp_path / "model", plain)
    assert not cfg.train.freeze_vision_tower and not grpo_config(cfg, tmp_path, tmp_path / "s", plain).train.freeze_vision_tower


def test_sft_on_some_tasks_has_its_own_records_and_run_folder(tmp_path):
    import subprocess
    import sys

    spatial = DemoSizes(sft_tasks=("spatial_puzzle",))
    cfg = demo_config(tmp_path, tmp_path / "model", spatial)
    assert cfg.data.dataset.name == str(tmp_path / "data" / "train" / "sft-spatial_puzzle.jsonl")
    assert cfg.train.output_dir == str(tmp_path / "sft-spatial_puzzle")
    # by default SFT trains on the spatial puzzle alone (the task the demo's tower makes learnable in minutes)
    assert DemoSizes().sft_tasks == ("spatial_puzzle",)
    every = DemoSizes(sft_tasks=TASKS)
    assert demo_config(tmp_path, tmp_path / "model", every).train.output_dir == str(tmp_path / "sft")
    result = subprocess.run([sys.executable, "-m", "physreason", "demo", "--out", str(tmp_path), "--sft-task", "gravity"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "--sft-task gravity: choose among arrow_of_time" in result.stderr
    assert "Traceback" not in result.stderr
