"""The intuitive-physics experiment (physreason/experiments/intuitive_physics.py) and its tower pre-training on CPU:
the recipe's defaults, variant names, the per-task loss, and a few tower steps on real generated clips (the GPU runs
are in bench/RESULTS.md)."""

from __future__ import annotations

import json

import pytest
import torch
from setups import BENCH


@pytest.fixture(scope="module")
def bench():
    from physreason.experiments import intuitive_physics

    return intuitive_physics


@pytest.fixture(scope="module")
def tower():
    from physreason.experiments import tower

    return tower


def test_defaults_are_the_recipe_and_variants_get_their_own_folders(bench):
    recipe = bench.parse_args([])
    assert (recipe.tower_steps, recipe.sft_freeze_tower, recipe.sft_steps, recipe.sft_lr, recipe.grpo_lr) == (
        4000,
        True,
        3000,
        3e-4,
        3e-5,
    )
    # the tower keeps its best held-out checkpoint and stops after 1,000 steps without a better one
    assert (recipe.tower_eval_every, recipe.tower_patience, recipe.seeds) == (100, 1000, [0])
    assert bench.variant_suffix(recipe) == "-tower4000-frozen"
    # no tower pre-training: nothing to keep fixed, and no head to name
    plain = bench.parse_args(["--tower-steps", "0"])
    assert not plain.sft_freeze_tower and bench.variant_suffix(plain) == ""
    trained = bench.parse_args(["--no-sft-freeze-tower"])
    assert bench.variant_suffix(trained) == "-tower4000"
    qwen3 = bench.parse_args(["--family", "qwen3_vl", "--temporal-patch", "4", "--tower-steps", "0"])
    assert bench.model_folder_name(qwen3) == "model-scale2-qwen3_vl-tp4"
    assert bench.variant_suffix(qwen3) == "-scale2-qwen3_vl-tp4"


def test_the_recipe_is_the_head_on_every_token_and_3000_sft_steps_and_the_earlier_one_is_a_named_variant(bench):
    from physreason.experiments.common import tower_tag

    recipe = bench.parse_args([])
    assert (recipe.tower_head, recipe.sft_steps) == ("tokens", 3000)
    assert bench.variant_suffix(bench.parse_args(["--tower-head", "tokens", "--sft-steps", "3000"])) == (
        "-tower4000-frozen"
    )
    earlier = bench.parse_args(["--tower-head", "time", "--sft-steps", "1500", "--seeds", "2"])
    assert bench.variant_suffix(earlier, 2) == "-tower4000-time-frozen-sft1500-seed2"
    assert bench.variant_suffix(bench.parse_args(["--tower-head", "time"])) == "-tower4000-time-frozen"
    assert bench.variant_suffix(bench.parse_args(["--sft-steps", "1500"])) == "-tower4000-frozen-sft1500"
    assert bench.results_name("table", earlier) == "table-tower4000-time-frozen-sft1500-seeds2"
    # the tower's folder says which head trained it whatever the recipe: the mean head's towers keep their names
    assert tower_tag(recipe) == "-tower4000-tokens"
    assert tower_tag(earlier) == "-tower4000"


def test_the_bench_fine_tunes_on_every_tasks_records_with_the_schemas_seed_whatever_the_demo_does(bench, tmp_path):
    # the demo's SFT default (the spatial puzzle alone) and its own seed must not move the bench's published runs
    args = bench.parse_args([])
    cfg = bench.stage_config(args, tmp_path, tmp_path / "model", 0)
    assert cfg.data.dataset.name == str(tmp_path / "data" / "train" / "sft.jsonl") and cfg.train.seed == 42
    assert bench.stage_config(args, tmp_path, tmp_path / "model", 2).train.seed == 44
    # each seed's evaluations name that seed (every seed's progress said "seed 1"); seed 0 keeps its folders' seed_1
    assert bench.stage_config(args, tmp_path, tmp_path / "model", 2).eval.seed == 2 and cfg.eval.seed == 1


def test_seeds_and_an_early_stopped_sft_get_their_own_folders(bench):
    args = bench.parse_args(["--seeds", "1,2,3", "--sft-steps", "300"])
    assert args.seeds == [1, 2, 3]
    # seed 0 keeps the folders of the runs before --seeds; other seeds have their own model, tower, SFT and GRPO
    assert bench.model_folder_name(args, 0) == "model-scale2"
    assert bench.model_folder_name(args, 2) == "model-scale2-seed2"
    assert bench.variant_suffix(args, 2) == "-tower4000-frozen-sft300-seed2"
    assert bench.variant_suffix(args, 0) == "-tower4000-frozen-sft300"
    for bad in ("1,1", "x", "-2", ""):
        with pytest.raises(SystemExit):
            bench.parse_args(["--seeds", bad])


def test_an_sft_folder_holding_a_run_of_another_tower_or_length_stops_the_run_before_its_export_is_taken(
    bench, tmp_path
):
    from physreason.config import dump_config, with_model
    from physreason.experiments.common import sft_stage

    # the earlier recipe's run (the mean head's tower, 1,500 steps) in the folder the recipe's run is named now
    earlier = bench.parse_args(["--tower-head", "time", "--sft-steps", "1500"])
    cfg = with_model(
        bench.stage_config(earlier, tmp_path, tmp_path / "model-scale2", 0), tmp_path / "model-scale2-tower4000"
    )
    cfg.train.output_dir = str(tmp_path / "sft-tower4000-frozen")
    export = tmp_path / "sft-tower4000-frozen" / "safetensors" / "step_1500"
    export.mkdir(parents=True)
    dump_config(cfg, tmp_path / "sft-tower4000-frozen" / "config.toml")
    (export / "model.safetensors").write_bytes(b"")
    assert sft_stage(cfg, 1500) == export  # the same run: its finished export is taken as it is

    recipe = bench.stage_config(bench.parse_args([]), tmp_path, tmp_path / "model-scale2", 0)
    recipe = with_model(recipe, tmp_path / "model-scale2-tower4000-tokens")
    recipe.train.output_dir = cfg.train.output_dir
    with pytest.raises(
        SystemExit,
        match=r"sft-tower4000-frozen holds a run of 1500 steps from .*model-scale2-tower4000,"
        r" not of 3000 from .*model-scale2-tower4000-tokens: .* Move it and results/sft-tower4000-fr",
    ):
        sft_stage(recipe, 3000)
    longer = cfg.model_copy(deep=True)
    longer.train.max_steps = 3000  # the same tower, another length: resuming would continue the 1,500-step run
    with pytest.raises(SystemExit, match="holds a run of 1500 steps"):
        sft_stage(longer, 3000)


def test_spread_gives_mean_std_min_max_over_seeds_per_stage_and_task(bench):
    tables = [
        {"after SFT": {"arrow_of_time": 0.8, "spatial_puzzle": 0.7}, "untrained model": {"arrow_of_time": 0.0}},
        {"after SFT": {"arrow_of_time": 0.9, "spatial_puzzle": 0.99}},
        {"after SFT": {"arrow_of_time": 0.7, "spatial_puzzle": None}},
    ]
    summary = bench.spread(tables)
    aot = summary["after SFT"]["arrow_of_time"]
    assert aot["mean"] == pytest.approx(0.8) and aot["std"] == pytest.approx(0.1)
    assert (aot["min"], aot["max"], aot["n"]) == (0.7, 0.9, 3)
    assert summary["after SFT"]["spatial_puzzle"]["n"] == 2  # a seed without the value is left out
    assert summary["untrained model"]["arrow_of_time"] == {"mean": 0.0, "std": 0.0, "min": 0.0, "max": 0.0, "n": 1}
    text = bench.markdown_table(summary, ["arrow_of_time", "spatial_puzzle"], ["- device: NVIDIA H100 80GB HBM3"])
    assert text.startswith("- device: NVIDIA H100 80GB HBM3\n")
    assert "| chance | 50.0 | 25.0 |" in text
    assert "| after SFT | 80.0 ± 10.0 [70.0-90.0] | 84.5 ± 20.5 [70.0-99.0] |" in text
    assert "| untrained model | 0.0 | - |" in text


def test_pretrain_tower_refuses_an_unknown_head_input_before_any_work(tmp_path):
    from physreason.train.tower import pretrain_tower

    with pytest.raises(ValueError, match="head_input 'pooled' is not one of time, tokens"):
        pretrain_tower(tmp_path / "missing", tmp_path, tmp_path / "out", {}, head_input="pooled")
    assert not (tmp_path / "out").exists()


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
@pytest.mark.parametrize(
    ("family", "patience", "head"), [("qwen2_5_vl", 0, "time"), ("qwen3_vl", 1, "time"), ("qwen2_5_vl", 0, "tokens")]
)
def test_pretrain_tower_changes_only_the_vision_tower_and_saves_a_loadable_model(
    tower, tmp_path, monkeypatch, family, patience, head
):
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    from physreason.data.synth.generate import generate_task
    from physreason.data.synth.records import letter_sft_records
    from physreason.data.synth.tasks import LETTER_TASK_NAMES as TASK_NAMES
    from physreason.models.tiny import save_tiny_model

    monkeypatch.syspath_prepend(str(BENCH))  # the spawned decode processes import the module by name
    data, model_dir, out = tmp_path / "data", tmp_path / "model", tmp_path / "out"
    for task in TASK_NAMES:
        generate_task(task, 3, data, "train", 0, workers=1, show_progress=False, option_order="fixed")
    letter_sft_records(data, data / "sft.jsonl")
    save_tiny_model(family, model_dir)
    vision = {"min_pixels": 12544, "max_pixels": 12544, "max_frames": 12}
    result = tower.pretrain_tower(
        model_dir, data, out, vision, steps=3, batch=4, workers=1, eval_every=1, patience=patience, head_input=head
    )

    assert result["clips"] == 9 and result["steps"] == 3 and result["head_input"] == head
    # the held-out tenth is scored at every step and the first best-scoring step's tower is the one kept
    curve = result["heldout_curve"]
    assert [point["step"] for point in curve] == list(range(1, result["stopped_at"] + 1))
    means = [sum(v for k, v in point.items() if k != "step") / (len(point) - 1) for point in curve]
    assert result["best_step"] == 1 + means.index(max(means))
    if patience:  # stops at the first step that does not beat every earlier one
        first_miss = next((i + 1 for i in range(1, len(means)) if means[i] <= max(means[:i])), 3)
        assert result["stopped_at"] == first_miss
    else:
        assert result["stopped_at"] == 3 and len(result["loss_curve"]) == 3
    assert result["heldout_accuracy"] == {k: v for k, v in curve[result["best_step"] - 1].items() if k != "step"}
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


def test_combine_joins_one_seed_runs_into_one_table_over_their_seeds(bench, tmp_path):
    for seed, (device, score) in enumerate((("NVIDIA H100 80GB HBM3", 0.8), ("NVIDIA H200", 0.9)), start=1):
        run = {"seed": seed, "table": {"after SFT": {"arrow_of_time": score}}}
        (tmp_path / f"s{seed}.json").write_text(json.dumps({"device": device, "per_seed": [run]}))
    payload = bench.main(["--combine", str(tmp_path / "s1.json"), str(tmp_path / "s2.json")])
    assert payload["summary"]["after SFT"]["arrow_of_time"]["mean"] == pytest.approx(0.85)
    text = (tmp_path / "intuitive_physics-combined.md").read_text()
    assert "- device: NVIDIA H100 80GB HBM3 / NVIDIA H200" in text and "- seeds: 1, 2" in text
    assert "| after SFT | 85.0 ± 7.1 [80.0-90.0] | - | - |" in text
    with pytest.raises(SystemExit):  # the same seed twice would count one run double
        bench.main(["--combine", str(tmp_path / "s1.json"), str(tmp_path / "s1.json")])


def test_clip_paths_of_the_records_never_leave_their_data_folder(tmp_path):
    from physreason.errors import InputError
    from physreason.experiments.probe import load_split
    from physreason.models.tiny import save_tiny_model
    from physreason.train.tower import load_clips

    (tmp_path / "secret.mp4").write_bytes(b"not the data set's")
    data = tmp_path / "data"
    (data / "arrow_of_time").mkdir(parents=True)
    escaping = "arrow_of_time/../../secret.mp4"  # passes the task check: its first part is a task's folder
    record = {"video": escaping, "conversations": [{"role": "assistant", "content": "A"}]}
    (data / "sft.jsonl").write_text(json.dumps(record) + "\n")
    model_dir = save_tiny_model("qwen2_5_vl", tmp_path / "model")
    with pytest.raises(InputError, match=rf"sft.jsonl: media path '{escaping}' leads outside the data folder {data}"):
        load_clips(data, model_dir, {"min_pixels": 12544, "max_pixels": 12544}, workers=1)
    benchmark = data / "arrow_of_time" / "arrow_of_time_benchmark_qa_pairs.json"
    benchmark.write_text(json.dumps([{"video": "../../secret.mp4", "qa_pairs": {"answer": "A"}}]))
    with pytest.raises(InputError, match=r"qa_pairs.json: media path '../../secret.mp4' leads outside the data folder"):
        load_split(data / "arrow_of_time", 12544, workers=1)
