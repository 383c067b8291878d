"""The README's main job runs end to end (at a toy size) and reports every stage."""

from __future__ import annotations

import inspect
import io
import json
from collections import Counter

import pytest

from physreason.data.synth.tasks import LETTER_TASK_NAMES as TASKS
from physreason.demo import (
    DEMO_MARKER,
    DemoSizes,
    claim_demo_folder,
    demo_checks,
    demo_config,
    grpo_changes,
    grpo_config,
    grpo_kept,
    grpo_verdict,
    guess_band,
    reward_trend,
    reward_windows,
    rl_file,
    run_demo,
    sft_file,
)


@pytest.mark.slow
def test_demo_runs_every_stage_and_reuses_finished_work(tmp_path):
    # 12 clips of the spatial puzzle and 2 control clips of each other task: SFT's batch of 8 and GRPO's 4 prompts
    sizes = DemoSizes(train_per_task=8, test_per_task=2, sft_steps=2, grpo_steps=1, max_tokens=2, tower_steps=2,
                      sft_task_clips=12, control_clips=2, val_per_task=4)  # fmt: skip
    table = run_demo(tmp_path / "demo", sizes)
    assert list(table) == ["base model", "after SFT", "after SFT+GRPO"]
    for scores in table.values():
        assert set(scores) == set(TASKS)
        assert all(value is None or 0.0 <= value <= 1.0 for value in scores.values())
    train = tmp_path / "demo" / "data" / "train"
    records = [json.loads(line) for line in (train / "sft.jsonl").read_text().splitlines()]
    assert len(records) == 12 + 8 * (len(TASKS) - 1)  # every task's: the tower trains on them all
    # options in one fixed order (a from-scratch model cannot learn shuffled letters), and the tower pre-trained
    for task in TASKS:
        entries = json.loads((train / task / f"{task}_benchmark_qa_pairs.json").read_text())
        assert len({json.dumps(entry["qa_pairs"]["index2ans"]) for entry in entries}) == 1
    # SFT and GRPO: every spatial-puzzle clip and the first 2 of each other task (the controls)
    for name in (sft_file(tmp_path / "demo", sizes).name, rl_file(tmp_path / "demo", sizes).name):
        rows = [json.loads(line) for line in (train / name).read_text().splitlines()]
        assert Counter(r["video"].split("/")[0] for r in rows) == {
            "spatial_puzzle": 12, "arrow_of_time": 2, "object_permanence": 2}, name
    assert sft_file(tmp_path / "demo", sizes).name == "sft-spatial_puzzle-controls2.jsonl"
    assert rl_file(tmp_path / "demo", sizes).name == "rl-spatial_puzzle-controls2.jsonl"
    tower = json.loads((tmp_path / "demo" / "model-tower2" / "tower_pretraining.json").read_text())
    assert tower["steps"] == 2 and set(tower["heldout_accuracy"]) <= set(TASKS)
    # the validation clips that choose GRPO's weights or SFT's: the val split, the SFT task only
    val = tmp_path / "demo" / "data" / "val"
    assert [d.name for d in val.iterdir() if d.is_dir()] == ["spatial_puzzle"]
    assert json.loads((val / "spatial_puzzle" / "meta.json").read_text())["split"] == "val"
    assert (tmp_path / "demo" / "results" / "val-sft").is_dir() and (tmp_path / "demo" / "results" / "val-grpo").is_dir()
    # a rerun reuses the model, the clips and the trained models instead of making them again
    clip = train / "arrow_of_time" / records[0]["video"].split("/", 1)[1]
    exports = [tmp_path / "demo" / "model-tower2",
               tmp_path / "demo" / "sft-spatial_puzzle-controls2" / "safetensors" / "step_2",
               tmp_path / "demo" / "grpo" / "safetensors" / "step_1"]  # fmt: skip
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


def table_lines(sft_tasks, control_clips=8) -> list[str]:
    from rich.console import Console

    from physreason.demo import task_table

    scores = {"arrow_of_time": 0.5, "spatial_puzzle": 0.625, "object_permanence": 0.4375}
    table = {"base model": dict.fromkeys(TASKS, 0.0), "after SFT": scores, "after SFT+GRPO": dict(scores)}
    buffer = io.StringIO()
    Console(file=buffer, width=160).print(task_table(table, 48, sft_tasks, control_clips))
    return buffer.getvalue().splitlines()


def test_demo_table_shows_the_sft_task_apart_from_the_control_tasks_with_a_guess_s_band():
    lines = table_lines(("spatial_puzzle",))
    at = {name: next(i for i, line in enumerate(lines) if name in line)
          for name in ("trained by SFT", "spatial_puzzle", "not trained: 8 control clips", "arrow_of_time",
                       "object_permanence", "a guess lands in: the central 95%")}  # fmt: skip
    assert at["trained by SFT"] < at["spatial_puzzle"] < at["not trained: 8 control clips"] < at["arrow_of_time"]
    assert at["arrow_of_time"] < at["object_permanence"] < at["a guess lands in: the central 95%"]
    # a rule between the trained task and the others
    rule = lines[at["spatial_puzzle"] + 1 : at["not trained: 8 control clips"]]
    assert len(rule) == 1 and set(rule[0].strip()) <= set("├┼─┤")
    header = [cell.strip() for cell in lines[at["trained by SFT"] - 2].split("┃")[1:-1]]
    assert header == ["task", "chance", "a guess lands in", "base model", "after SFT", "after SFT+GRPO"]
    # each task's row: chance, the exact binomial band of a guess on 48 clips, then every stage
    cells = {task: [cell.strip() for cell in lines[at[task]].split("│")[1:-1]] for task in TASKS}
    assert cells["spatial_puzzle"] == ["spatial_puzzle", "25.0", "12.5-37.5", "0.0", "62.5", "62.5"]
    assert cells["arrow_of_time"] == ["arrow_of_time", "50.0", "35.4-64.6", "0.0", "50.0", "50.0"]
    assert cells["object_permanence"][1:3] == ["50.0", "35.4-64.6"]
    assert "(binomial, 48 clips)" in " ".join(lines[at["a guess lands in: the central 95%"] :])
    # no control clips: the others are "not in SFT's data"; SFT on every task: one section, no rule
    assert any("not in SFT's data" in line for line in table_lines(("spatial_puzzle",), control_clips=0))
    every = table_lines(TASKS)
    assert not any("not trained" in line or "not in SFT's data" in line for line in every)
    assert all(any(task in line for line in every) for task in TASKS)


def test_guess_band_is_the_central_95_percent_of_a_binomial_guess():
    # P(X <= 16) = 1.5% and P(X <= 17) = 3.0% for X ~ Binomial(48, 0.5): 17 of 48 is the band's floor
    assert guess_band(0.5, 48) == (17 / 48, 31 / 48)
    assert guess_band(0.25, 48) == (6 / 48, 18 / 48)
    assert guess_band(0.5, 30) == (10 / 30, 20 / 30)
    assert guess_band(0.5, 2) == (0.0, 1.0)  # too few clips: anything is a guess


def checks_of(sft, grpo):
    table = {"base model": dict.fromkeys(TASKS, 0.0), "after SFT": sft, "after SFT+GRPO": grpo}
    return demo_checks(table, 48, ("spatial_puzzle",))


def test_demo_checks_pass_a_table_that_meets_the_aim():
    at_chance = {"arrow_of_time": 24 / 48, "object_permanence": 17 / 48}  # 17 of 48: inside a guess's band
    checks = checks_of({**at_chance, "spatial_puzzle": 24 / 48}, {**at_chance, "spatial_puzzle": 26 / 48})
    assert all(ok for ok, _ in checks)
    # 24 of 48 is 25 points above a chance of 25 exactly: the aim is met, not missed by a float's hair
    assert [line for _, line in checks] == [
        "spatial_puzzle after SFT: 50.0, +25.0 points from chance (25.0); the demo aims at +25",
        "GRPO raised spatial_puzzle (+2 clips): 50.0 -> 54.2",
        "no task below chance after SFT or after GRPO (none under the band a guess lands in)",
    ]
    assert checks_of({**at_chance, "spatial_puzzle": 0.75}, {**at_chance, "spatial_puzzle": 0.75})[1] == (
        True, "GRPO did not lower spatial_puzzle: 75.0 -> 75.0"
    )


def test_demo_checks_say_when_sft_fell_short_grpo_lowered_it_or_a_task_fell_below_a_guess():
    sft = {"arrow_of_time": 16 / 48, "spatial_puzzle": 23 / 48, "object_permanence": 0.5}
    checks = checks_of(sft, {**sft, "spatial_puzzle": 21 / 48})
    assert [line for ok, line in checks if not ok] == [
        "spatial_puzzle after SFT: 47.9, +22.9 points from chance (25.0); the demo aims at +25: short of it",
        "GRPO lowered spatial_puzzle: 47.9 -> 43.8 (2 of 48 held-out clips fewer right)",
        "below chance, under the band a guess lands in: arrow_of_time after SFT 33.3 (a guess: 35.4 or more); "
        "arrow_of_time after SFT+GRPO 33.3 (a guess: 35.4 or more)",
    ]


def hits(right: int, wrong: int, start: int = 0) -> dict[str, bool]:
    return {f"spatial_puzzle/clip{start + k}": k < right for k in range(right + wrong)}


def test_grpo_weights_are_kept_only_when_their_validation_gain_beats_the_noise_of_the_changes():
    sft = {**hits(30, 18)}
    # seed 1's first run: GRPO turned 4 validation clips right and 1 wrong (62.5 -> 68.8), then lowered the test
    # by 5 clips; +3 is within twice the noise of 5 changes (4.5), so SFT's weights stay
    turned = {**sft, **{f"spatial_puzzle/clip{k}": True for k in range(30, 34)}, "spatial_puzzle/clip0": False}
    assert grpo_changes(sft, turned) == (4, 1) and not grpo_kept(sft, turned)
    assert grpo_verdict(sft, turned) == (
        "GRPO's weights not kept: on 48 validation clips (scenes neither training nor the test has) GRPO turned "
        "right 4 and wrong 1 of SFT's answers (30 -> 33 right; twice the noise of those changes: 4.5); no gain "
        "beyond that noise, so the last column is the SFT model's"
    )
    # 9 right and 1 wrong: +8 beyond 2 sqrt(10) = 6.3
    clear = {**sft, **{f"spatial_puzzle/clip{k}": True for k in range(30, 39)}, "spatial_puzzle/clip0": False}
    assert grpo_kept(sft, clear) and grpo_verdict(sft, clear).startswith("GRPO's weights kept: on 48 validation")
    assert not grpo_kept(sft, sft)  # no change keeps SFT's
    assert grpo_changes(sft, {}) == (0, 30)  # a clip GRPO's evaluation lacks counts as wrong
    assert grpo_verdict({}, {}).startswith("GRPO's weights not kept: no validation clips")


def test_the_held_out_clips_balance_every_task_s_classes_exactly():
    # a model that answers one letter scores chance exactly: each task's slots (class and letter) fill whole blocks
    from physreason.data.synth.sample import balanced_slot
    from physreason.data.synth.tasks import TASKS as REGISTRY

    sizes = DemoSizes()
    for task in TASKS:
        slots = REGISTRY[task].n_slots
        for split, n in (("test", sizes.test_per_task), ("val", sizes.val_per_task)):
            counts = Counter(balanced_slot(0, split, task, index, slots) for index in range(n))
            assert counts == dict.fromkeys(range(slots), n // slots), (task, split)


def test_demo_command_defaults_are_the_demo_sizes(tmp_path, monkeypatch):
    # `physreason demo` passes every size explicitly: its option defaults must be DemoSizes'
    import physreason.demo
    from physreason.cli.demo_cmd import demo

    seen = {}
    monkeypatch.setattr(physreason.demo, "run_demo", lambda out, sizes, seed: seen.update(sizes=sizes, seed=seed))
    defaults = {name: option.default.default for name, option in inspect.signature(demo).parameters.items()}
    demo(**{**defaults, "out": tmp_path})
    assert seen == {"sizes": DemoSizes(), "seed": 0}


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

    spatial = DemoSizes(sft_tasks=("spatial_puzzle",), control_clips=8)
    cfg = demo_config(tmp_path, tmp_path / "model", spatial)
    assert cfg.data.dataset.name == str(tmp_path / "data" / "train" / "sft-spatial_puzzle-controls8.jsonl")
    assert cfg.train.output_dir == str(tmp_path / "sft-spatial_puzzle-controls8")
    # GRPO's prompts are the same clips
    assert grpo_config(cfg, tmp_path, tmp_path / "sft", spatial).data.dataset.name == str(
        tmp_path / "data" / "train" / "rl-spatial_puzzle-controls8.jsonl"
    )
    alone = DemoSizes(sft_tasks=("spatial_puzzle",), control_clips=0)
    assert demo_config(tmp_path, tmp_path / "model", alone).train.output_dir == str(tmp_path / "sft-spatial_puzzle")
    # by default SFT trains on the spatial puzzle (the task the demo's tower makes learnable in minutes) and control
    # clips of the others
    assert DemoSizes().sft_tasks == ("spatial_puzzle",) and DemoSizes().control_clips > 0
    every = DemoSizes(sft_tasks=TASKS)
    assert demo_config(tmp_path, tmp_path / "model", every).train.output_dir == str(tmp_path / "sft")
    assert rl_file(tmp_path, every) == tmp_path / "data" / "train" / "rl.jsonl"
    result = subprocess.run([sys.executable, "-m", "physreason", "demo", "--out", str(tmp_path), "--sft-task", "gravity"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "--sft-task gravity: choose among arrow_of_time" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_demo_writes_only_into_a_new_or_empty_folder_or_its_own(tmp_path):
    from physreason.errors import ConfigError

    new = tmp_path / "new"
    claim_demo_folder(new)
    assert json.loads((new / DEMO_MARKER).read_text()) == {"written_by": "physreason demo"}
    claim_demo_folder(new)  # a rerun reuses its own folder
    empty = tmp_path / "empty"
    empty.mkdir()
    claim_demo_folder(empty)
    assert (empty / DEMO_MARKER).is_file()
    # a project folder of the user's: its model's shards and its data would be written over
    project = tmp_path / "project"
    (project / "model").mkdir(parents=True)
    (project / "model" / "model-00001-of-00002.safetensors").write_bytes(b"weights")
    (project / "data" / "train").mkdir(parents=True)
    (project / "data" / "train" / "sft.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError, match=rf"--out {project} is not empty .* no {DEMO_MARKER}.*new or empty folder"):
        claim_demo_folder(project)
    assert sorted(p.name for p in project.iterdir()) == ["data", "model"]  # nothing written
    # an output of the demo from before the marker: its tiny model and pre-trained tower
    legacy = tmp_path / "legacy"
    (legacy / "model").mkdir(parents=True)
    (legacy / "model" / "model.safetensors").write_bytes(b"tiny")
    (legacy / "model-tower150").mkdir()
    claim_demo_folder(legacy)
    assert (legacy / DEMO_MARKER).is_file()
    file = tmp_path / "file"
    file.write_text("x")
    with pytest.raises(ConfigError, match="is not an earlier output"):
        claim_demo_folder(file)


def test_the_demo_command_refuses_a_folder_of_the_users_before_writing(tmp_path):
    import subprocess
    import sys

    project = tmp_path / "project"
    (project / "model").mkdir(parents=True)
    (project / "model" / "config.json").write_text("{}")
    result = subprocess.run([sys.executable, "-m", "physreason", "demo", "--out", str(project)], capture_output=True,
                            text=True, timeout=300)  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    assert "not empty" in result.stderr and "Traceback" not in result.stderr
    assert (project / "model" / "config.json").read_text() == "{}"
    assert not (project / DEMO_MARKER).exists()
