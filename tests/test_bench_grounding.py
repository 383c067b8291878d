"""The grounding experiment (physreason/experiments/grounding.py) on CPU: its statistics (standard errors, the paired
sign-flip test, the spread over seeds), the tables it writes, and the whole pipeline at toy size (the GPU runs go to
bench/RESULTS.md)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from setups import BENCH


@pytest.fixture(scope="module")
def bench():
    from physreason.experiments import grounding

    return grounding


def test_clip_summary_gives_mean_iou_accuracy_at_half_and_their_standard_errors(bench):
    ious = [0.0, 0.5, 0.8, 0.1]
    stats = bench.clip_summary(ious)
    assert stats["n"] == 4
    assert stats["mean_iou"] == pytest.approx(0.35)
    assert stats["mean_iou_se"] == pytest.approx(np.std(ious, ddof=1) / 2)
    assert stats["acc50"] == pytest.approx(0.5)  # 0.5 counts as a hit, as in the evaluation
    assert stats["acc50_se"] == pytest.approx(np.std([0, 1, 1, 0], ddof=1) / 2)
    assert bench.clip_summary([]) is None
    assert bench.clip_summary([0.7])["mean_iou_se"] == 0.0


def test_paired_test_pairs_clips_by_id_and_detects_a_consistent_gain(bench):
    rng = np.random.default_rng(0)
    control = {f"c{i}": float(v) for i, v in enumerate(rng.uniform(0, 0.6, 40))}
    better = {k: v + 0.1 + 0.02 * rng.standard_normal() for k, v in control.items()}
    better["only-in-grpo"] = 1.0  # a clip the other arm did not score is left out
    gain = bench.paired_test(better, control)
    assert gain["n"] == 40
    assert gain["mean_diff"] == pytest.approx(np.mean([better[k] - control[k] for k in control]))
    assert gain["p"] < 0.001 and gain["t"] > 10
    # the same arm against itself: every difference is 0, so every sign flip is as extreme
    assert bench.paired_test(control, control)["p"] == 1.0
    # noise around zero is not significant, and the test is two-sided (a loss is found as well as a gain)
    noise = {k: v + 0.05 * rng.standard_normal() for k, v in control.items()}
    assert bench.paired_test(noise, control)["p"] > 0.05
    assert bench.paired_test(control, better)["p"] < 0.001
    assert bench.paired_test({"a": 1.0}, {"a": 0.0}) is None


def test_pooled_paired_averages_each_clips_difference_over_seeds(bench):
    grpo = "after SFT+GRPO"
    control = "after SFT+SFT (control)"

    def run(seed: int, gain: float) -> dict:
        base = {f"grounding/{i}": 0.02 * i for i in range(10)}
        return {
            "seed": seed,
            "clip_ious": {
                grpo: {"box_2d": {k: v + gain for k, v in base.items()}, "point_2d": {}, "time_span": {}},
                control: {"box_2d": base, "point_2d": {}, "time_span": {}},
            },
        }

    pooled = bench.pooled_paired([run(1, 0.1), run(2, 0.3)])[grpo]
    assert pooled["box_2d"]["mean_diff"] == pytest.approx(0.2) and pooled["box_2d"]["seeds"] == 2
    assert pooled["box_2d"]["n"] == 10
    assert pooled["point_2d"] is None and pooled["time_span"] is None


def test_pooled_paired_tests_each_variant_against_the_one_control_over_the_seeds_that_ran_it(bench):
    control = "after SFT+SFT (control)"
    base = {f"grounding/{i}": 0.02 * i for i in range(10)}

    def run(seed: int, gains: dict[str, float]) -> dict:
        arms = {row: {k: v + gain for k, v in base.items()} for row, gain in gains.items()}
        rows = {**arms, control: base}
        return {"seed": seed, "clip_ious": {row: {"box_2d": ious, "point_2d": {}, "time_span": {}}
                                            for row, ious in rows.items()}}  # fmt: skip

    hit = bench.grpo_row("grpo-hit")
    assert hit == "after SFT+GRPO (grpo-hit)" and bench.grpo_row("grpo") == "after SFT+GRPO"
    pooled = bench.pooled_paired([run(1, {"after SFT+GRPO": 0.1, hit: -0.2}), run(2, {"after SFT+GRPO": 0.3})])
    assert list(pooled) == ["after SFT+GRPO", hit]
    assert pooled["after SFT+GRPO"]["box_2d"]["mean_diff"] == pytest.approx(0.2)
    assert pooled[hit]["box_2d"]["mean_diff"] == pytest.approx(-0.2) and pooled[hit]["box_2d"]["seeds"] == 1


def test_holm_adjusts_p_values_step_down_in_their_given_order(bench):
    # sorted 0.01, 0.02, 0.04: x3, x2, x1 -> 0.03, 0.04, 0.04 (kept monotone), back in the given order
    assert bench.holm([0.04, 0.01, 0.02]) == pytest.approx([0.04, 0.03, 0.04])
    assert bench.holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])  # capped at 1
    assert bench.holm([0.03]) == pytest.approx([0.03])
    assert bench.holm([]) == []


def test_markdown_reports_mean_and_spread_over_seeds_and_the_paired_table(bench):
    def table(level: float) -> dict:
        stats = {"mean_iou": level, "mean_iou_se": 0.01, "acc50": level / 2, "acc50_se": 0.02, "n": 50}
        return {"box_2d": stats, "point_2d": None, "time_span": stats}

    grpo = "after SFT+GRPO"
    runs = [
        {
            "seed": seed,
            "tables": {row: table(level) for row in bench.stage_labels(["grpo"], "", seed)},
            "paired_grpo_minus_control": {
                grpo: {"box_2d": {"mean_diff": 0.05, "p": 0.01}, "point_2d": None, "time_span": None}
            },
        }
        for seed, level in ((1, 0.4), (2, 0.6))
    ]
    pooled = {grpo: {"box_2d": {"mean_diff": 0.05, "se": 0.02, "p": 0.012, "n": 50}, "point_2d": None,
                     "time_span": None}}  # fmt: skip
    text = bench.markdown(runs, pooled, ["- device: test"])
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("| stage |"))
    assert header.count("|") - 1 == 1 + 4  # box and span kinds (no point questions), mean IoU and acc@0.5 each
    sft = next(line for line in lines if line.startswith("| after SFT |"))
    assert "50.0 ± 14.1 [40.0-60.0]" in sft  # mean ± sample std [min-max] over the two seeds
    paired = next(line for line in lines if line.startswith("| grounding, box |"))
    assert "+5.0" in paired and "| 0.0120 | 0.0120 |" in paired and "seed 1: +5.0, p 0.010" in paired
    # one seed: the cells carry the standard error over clips instead
    single = bench.markdown(runs[:1], pooled, [])
    assert "| after SFT | 40.0 ± 1.0 | 20.0 ± 2.0 |" in single
    assert "training reward" not in text  # no run logged rewards: no reward table


def test_the_reward_table_gives_each_variants_first_and_last_steps_over_seeds(bench):
    grpo, fp8 = "after SFT+GRPO", "after SFT+GRPO (grpo-fp8)"
    runs = [
        {
            "seed": seed,
            "tables": {row: {"box_2d": None, "point_2d": None, "time_span": None} for row in
                       bench.stage_labels(["grpo", "grpo-fp8"], "", seed)},  # fmt: skip
            "paired_grpo_minus_control": {},
            # 25 steps: the first ten at `start`, the last ten at `end`, five between
            "grpo_rewards": {row: [start] * 10 + [0.0] * 5 + [end] * 10 for row, (start, end) in rows.items()},
        }
        for seed, rows in ((1, {grpo: (0.2, 0.5), fp8: (0.2, 0.45)}), (2, {grpo: (0.3, 0.6), fp8: (0.3, 0.62)}))
    ]
    summary = bench.reward_summary(runs)
    assert list(summary) == [grpo, fp8]
    assert summary[grpo]["last"]["mean"] == pytest.approx(0.55) and summary[fp8]["last"]["min"] == pytest.approx(0.45)
    assert summary[fp8]["first"]["mean"] == pytest.approx(0.25) and summary[grpo]["last_per_seed"] == pytest.approx({1: 0.5, 2: 0.6})
    lines = bench.markdown(runs, {}, []).splitlines()
    assert next(line for line in lines if line.startswith("| grpo-fp8 |")) == (
        "| grpo-fp8 | 0.250 ± 0.071 [0.200-0.300] | 0.535 ± 0.120 [0.450-0.620] | seed 1: 0.450, seed 2: 0.620 |"
    )
    short = [{**runs[0], "grpo_rewards": {grpo: [0.1, 0.3]}}]  # fewer steps than the window: all of them, one seed
    assert next(line for line in bench.markdown(short, {}, []).splitlines() if line.startswith("| grpo |")) == (
        "| grpo | 0.200 | 0.200 | seed 1: 0.200 |"
    )


def test_combine_pools_the_paired_test_over_runs_of_separate_leases(bench, tmp_path):
    def run(seed: int, gain: float) -> dict:
        base = {f"grounding/{i}": 0.05 * i for i in range(8)}
        stats = bench.clip_summary(list(base.values()))
        arms = {"after SFT+GRPO": {k: v + gain for k, v in base.items()}, "after SFT+SFT (control)": base}
        return {
            "seed": seed,
            "tables": {row: {"box_2d": stats, "point_2d": None, "time_span": None}
                       for row in bench.stage_labels(["grpo"], "", seed)},
            "clip_ious": {row: {"box_2d": ious, "point_2d": {}, "time_span": {}} for row, ious in arms.items()},
            "paired_grpo_minus_control": {"after SFT+GRPO": {"box_2d": bench.paired_test(arms["after SFT+GRPO"], base),
                                                             "point_2d": None, "time_span": None}},
        }  # fmt: skip

    for seed, gain in ((1, 0.04), (2, 0.08)):
        header = ["- device: x", f"- seeds: {seed}", "- clips per task: 4 SFT (labelled)", "- grpo: reward IoU"]
        payload = {"device": f"gpu{seed}", "header": header, "per_seed": [run(seed, gain)]}
        (tmp_path / f"s{seed}.json").write_text(json.dumps(payload))
    payload = bench.main(["--combine", str(tmp_path / "s1.json"), str(tmp_path / "s2.json")])
    assert payload["paired_grpo_minus_control"]["after SFT+GRPO"]["box_2d"]["mean_diff"] == pytest.approx(0.06)
    assert payload["device"] == "gpu1 / gpu2"
    text = (tmp_path / "grounding-combined.md").read_text()
    assert "- seeds: 1, 2" in text and "| grounding, box | +6.0 |" in text
    assert text.count("- clips per task: 4 SFT (labelled)") == 1 and "- grpo: reward IoU" in text
    assert "- seeds: 1\n" not in text  # the files' own run lines give way to the combined ones
    with pytest.raises(SystemExit):
        bench.main(["--combine", str(tmp_path / "s1.json"), str(tmp_path / "s1.json")])


def test_seeds_option_rejects_repeats_and_non_integers(bench):
    assert bench.parse_args(["--seeds", "1,2,3"]).seeds == [1, 2, 3]
    assert bench.parse_args([]).seeds == [0]
    for bad in ("1,1", "a", "-1"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--seeds", bad])


@pytest.mark.slow
def test_whole_pipeline_writes_a_table_of_every_stage_variant_and_question_kind(bench, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.setenv("OUT", str(tmp_path / "report"))
    (tmp_path / "report").mkdir()
    argv = [
        "--train-per-task", "4", "--rl-per-task", "4", "--test-per-task", "4", "--sft-steps", "2",
        "--sft-batch", "2", "--grpo-steps", "1", "--grpo-prompts", "2", "--grpo-n", "2", "--scale", "1",
        "--max-tokens", "8", "--max-pixels", "12544", "--ckpt-every", "1", "--workers", "1",
        "--loader-workers", "0", "--out", str(tmp_path / "run"),
        "--variants", "grpo", "grpo-hit:iou-hit-weight=1,grpo-n=3,grpo-lr=1e-5,kl-beta=0.04",
    ]  # fmt: skip
    payload = bench.main(argv)
    run = payload["per_seed"][0]
    rows = ["untrained model", "after SFT", "after SFT+GRPO", "after SFT+GRPO (grpo-hit)", "after SFT+SFT (control)"]
    assert list(run["clip_ious"]) == rows
    # every test clip scored at every stage: 4 grounding clips (2 box, 2 point questions) and 4 time spans
    for row in rows:
        assert {kind: len(ious) for kind, ious in run["clip_ious"][row].items()} == {
            "box_2d": 2, "point_2d": 2, "time_span": 4,
        }  # fmt: skip
        for stats in run["tables"][row].values():
            for key in ("mean_iou", "mean_iou_se", "acc50", "acc50_se"):
                assert math.isfinite(stats[key]) and 0.0 <= stats[key] <= 1.0
    # both variants ran from the one SFT export, each with its own settings, and are tested against the one control
    folder = tmp_path / "run" / "qwen2_5_vl"
    from physreason.config import load_config

    # each variant's folder names its settings other than the recipe's (the command's --grpo-n 2 is one of them)
    hit = load_config(folder / "grpo-hit-hit1-n3-lr1e-05-kl0.04-scale1-train4-rl4-sft2" / "config.toml")
    plain = load_config(folder / "grpo-n2-scale1-train4-rl4-sft2" / "config.toml")
    control = load_config(folder / "grpo-scale1-train4-rl4-sft2-sft-control" / "config.toml")
    assert hit.grpo.reward_options == {"localization": {"hit_weight": 1.0, "hit_threshold": 0.5}}
    assert (hit.rollout.n_generation, plain.rollout.n_generation, plain.grpo.reward_options) == (3, 2, {})
    assert hit.model.model_name_or_path == plain.model.model_name_or_path  # the SFT export
    assert (hit.train.optm_lr, plain.train.optm_lr, control.train.optm_lr) == (1e-5, 3e-5, 3e-5)
    assert (hit.grpo.kl_beta, plain.grpo.kl_beta) == (0.04, 0.0)
    assert hit.grpo.reference_model_path == hit.model.model_name_or_path  # the KL is to the SFT export
    assert plain.grpo.reference_model_path is None
    # the KL variant scored its completions with the reference model: its log has the KL term, the plain run's not
    assert len(bench.logged(folder / "grpo-hit-hit1-n3-lr1e-05-kl0.04-scale1-train4-rl4-sft2", "policy/kl_ref")) == 1
    assert bench.logged(folder / "grpo-n2-scale1-train4-rl4-sft2", "policy/kl_ref") == []
    assert len(run["grpo_rewards"]["after SFT+GRPO (grpo-hit)"]) == 1
    assert list(payload["paired_grpo_minus_control"]) == ["after SFT+GRPO", "after SFT+GRPO (grpo-hit)"]
    for tests in payload["paired_grpo_minus_control"].values():
        for test in tests.values():
            assert test["n"] in (2, 4) and 0.0 < test["p"] <= 1.0 and -1.0 <= test["mean_diff"] <= 1.0
    assert payload["device"] == "cpu"
    text = (tmp_path / "report" / "grounding.md").read_text()
    assert text == (folder / "grounding-scale1-train4-rl4-sft2.md").read_text()  # the variant's name
    assert "- device: cpu" in text and "- command: `python " in text
    assert "- grpo-hit: reward hit@0.5 + 0.1 x json_format; 3 completions per prompt" in text
    assert "dynamic sampling off; lr 1e-05; KL 0.04 x k3 to the SFT export" in text
    assert "steps of 2 prompts, the control at lr 3e-05" in text
    settings = json.loads((tmp_path / "report" / "grounding.json").read_text())["variant_settings"]
    assert (settings["grpo-hit"]["grpo_lr"], settings["grpo-hit"]["kl_beta"], settings["grpo"]["grpo_lr"]) == (
        1e-5, 0.04, 3e-5,
    )  # fmt: skip
    table = [line for line in text.splitlines() if line.startswith("| ")]
    labels = [line.split(" | ")[0].removeprefix("| ") for line in table]
    assert labels[:6] == ["stage", *rows]
    assert all(line.count("|") == 8 for line in table[:6])  # stage + 3 question kinds x (mean IoU, acc@0.5)
    for line in table[1:6]:
        cells = [cell.split(" ± ") for cell in line.strip("| ").split(" | ")[1:]]
        assert all(0.0 <= float(mean) <= 100.0 and 0.0 <= float(se) <= 100.0 for mean, se in cells)
    # GRPO's training reward of each variant (one seed: its first and last steps' means)
    assert labels[6:9] == ["variant", "grpo", "grpo-hit"]
    for line in table[7:9]:
        first, last = (float(cell) for cell in line.strip("| ").split(" | ")[1:3])
        assert 0.0 <= first <= 1.1 and 0.0 <= last <= 1.1  # IoU (or hit) + 0.1 x json_format
    kinds = ["grounding, box", "grounding, point", "temporal localization"]
    assert labels[9:] == ["question", *kinds, *(f"grpo-hit: {kind}" for kind in kinds)]
    for line in table[10:]:
        cells = line.strip("| ").split(" | ")
        assert -100.0 <= float(cells[1]) <= 100.0 and all(0.0 < float(p) <= 1.0 for p in cells[3:5])
        assert float(cells[4]) >= float(cells[3])  # Holm never lowers a p-value
    assert json.loads((tmp_path / "report" / "grounding.json").read_text())["summary"]["after SFT"]
    # a rerun with the same --out reuses every finished stage; the same variant name with other settings gets
    # another folder (test_a_variants_folder_changes_with_its_settings), and one reused anyway stops the bench
    rerun = bench.main(argv)
    assert rerun["per_seed"][0]["clip_ious"] == run["clip_ious"]
    other = bench.parse_args([*argv[:-1], "grpo-hit:iou-hit-weight=0.5,grpo-n=3,grpo-lr=1e-5,kl-beta=0.04"])
    assert (
        bench.run_labels(other, 0)["after SFT+GRPO (grpo-hit)"]
        == "grpo-hit-hit0.5-n3-lr1e-05-kl0.04-scale1-train4-rl4-sft2"
    )


def test_variants_parse_into_each_runs_overrides_of_the_commands_grpo_settings(bench):
    assert bench.parse_args([]).variants == {"grpo": {}}  # the recipe: one GRPO run, as before --variants
    args = bench.parse_args(
        ["--grpo-n", "4", "--variants", "grpo", "grpo-hit:iou-hit-weight=1", "grpo-mix:iou-hit-weight=0.5,"
         "iou-hit-threshold=0.3", "grpo-n16:grpo-n=16", "grpo-dyn:grpo-dynamic-sampling=true,grpo-temperature=1.2",
         "grpo-lr:grpo-lr=1e-5", "grpo-kl:kl-beta=0.04,grpo-lr=2e-5"]
    )  # fmt: skip
    assert args.variants == {
        "grpo": {},
        "grpo-hit": {"iou_hit_weight": 1.0},
        "grpo-mix": {"iou_hit_weight": 0.5, "iou_hit_threshold": 0.3},
        "grpo-n16": {"grpo_n": 16},
        "grpo-dyn": {"grpo_dynamic_sampling": True, "grpo_temperature": 1.2},
        "grpo-lr": {"grpo_lr": 1e-5},
        "grpo-kl": {"kl_beta": 0.04, "grpo_lr": 2e-5},
    }
    assert (args.grpo_lr, args.kl_beta) == (3e-5, 0.0)  # the command's (the control's lr) unchanged
    n16 = bench.variant_args(args, args.variants["grpo-n16"])
    assert (n16.grpo_n, bench.variant_args(args, {}).grpo_n, args.grpo_n) == (16, 4, 4)  # the command's args unchanged
    assert bench.variant_text(bench.variant_args(args, args.variants["grpo-mix"])).startswith(
        "reward 0.5 x IoU + 0.5 x hit@0.3 + 0.1 x json_format; 4 completions"
    )
    assert "reward hit@0.5 +" in bench.variant_text(bench.variant_args(args, args.variants["grpo-hit"]))
    assert "reward IoU +" in bench.variant_text(args) and "dynamic sampling off" in bench.variant_text(args)
    assert bench.variant_text(args).endswith("; lr 3e-05; no KL")
    assert bench.variant_text(bench.variant_args(args, args.variants["grpo-kl"])).endswith(
        "; lr 2e-05; KL 0.04 x k3 to the SFT export"
    )
    assert bench.parse_args(["--kl-beta", "0.1"]).kl_beta == 0.1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--variants", "hit"], "name a variant grpo or grpo-"),
        (["--variants", "grpo-sft-control"], "name a variant"),
        (["--variants", "grpo/x"], "name a variant"),
        (["--variants", "grpo", "grpo"], "'grpo' is given twice"),
        (["--variants", "grpo-a:grpo-steps=10"], "grpo-steps is shared by every variant and the control"),
        (["--variants", "grpo-a:grpo-prompts=8"], "grpo-prompts is shared"),
        (["--variants", "grpo-a:grpo-lr=0"], "--variants 'grpo-a:grpo-lr=0': grpo-lr='0' is not a valid float > 0"),
        (["--variants", "grpo-a:grpo-lr=fast"], "grpo-lr='fast' is not a valid float > 0"),
        (["--variants", "grpo-a:grpo-lr=nan"], "grpo-lr='nan' is not a valid float > 0"),
        (
            ["--variants", "grpo-kl:kl-beta=-0.1"],
            "--variants 'grpo-kl:kl-beta=-0.1': kl-beta='-0.1' is not a valid float >= 0",
        ),
        (["--variants", "grpo-kl:kl-beta=inf"], "kl-beta='inf' is not a valid float >= 0"),
        (["--variants", "grpo-a:grpo-n=0"], "grpo-n='0' is not a valid int > 0"),
        (["--kl-beta", "-1"], "--kl-beta -1: give a weight >= 0"),
        (["--variants", "grpo-a:kl=1"], "'kl=1' is not KEY=VALUE"),
        (["--variants", "grpo-a:grpo-n"], "'grpo-n' is not KEY=VALUE"),
        (["--variants", "grpo-a:grpo-n=many"], "grpo-n='many' is not a valid int"),
        (["--variants", "grpo-a:grpo-dynamic-sampling=maybe"], "is not a valid boolean"),
        (["--variants", "grpo-a:iou-hit-weight=1.5"], "hit_weight = 1.5: give a value in"),
        (["--iou-hit-threshold", "0"], "hit_threshold = 0.0: give a value in"),
    ],
)
def test_bad_variants_stop_the_bench_before_it_runs_naming_the_part_at_fault(bench, argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert message in capsys.readouterr().err


def test_a_variants_grpo_config_carries_its_reward_shaping_group_size_and_sampling(bench, tmp_path):
    args = bench.parse_args(["--variants", "grpo", "grpo-x:iou-hit-weight=0.5,grpo-n=16,grpo-dynamic-sampling=1"])
    cfg = bench.stage_config(args, tmp_path, tmp_path / "model", 1)
    plain = bench.variant_grpo_config(bench.variant_args(args, {}), cfg, tmp_path, tmp_path / "sft", tmp_path / "g")
    assert plain.grpo.reward_function == {"localization": 1.0, "json_format": 0.1}
    assert plain.grpo.reward_options == {}  # the continuous IoU: the recipe of the runs before reward shaping
    assert (plain.rollout.n_generation, plain.grpo.dynamic_sampling) == (8, False)
    shaped_args = bench.variant_args(args, args.variants["grpo-x"])
    shaped = bench.variant_grpo_config(shaped_args, cfg, tmp_path, tmp_path / "sft", tmp_path / "g2")
    assert shaped.grpo.reward_options == {"localization": {"hit_weight": 0.5, "hit_threshold": 0.5}}
    assert (shaped.rollout.n_generation, shaped.grpo.dynamic_sampling) == (16, True)
    assert shaped.train.train_batch_per_replica == 16 * args.grpo_prompts  # prompts per step as the control's
    assert (shaped.rollout.batch_size, shaped.train.optm_lr) == (plain.rollout.batch_size, plain.train.optm_lr)
    assert (plain.grpo.kl_beta, plain.grpo.reference_model_path) == (0.0, None)  # the recipe: no reference loaded


def test_a_variants_lr_and_kl_reach_its_grpo_config_against_its_sft_export_and_leave_the_control(
    bench, tmp_path, monkeypatch
):
    args = bench.parse_args(["--grpo-lr", "4e-5", "--variants", "grpo", "grpo-x:grpo-lr=1e-5,kl-beta=0.04"])
    cfg = bench.stage_config(args, tmp_path, tmp_path / "model", 1)
    sft = tmp_path / "sft-export"
    plain = bench.variant_grpo_config(bench.variant_args(args, {}), cfg, tmp_path, sft, tmp_path / "g")
    tuned = bench.variant_grpo_config(
        bench.variant_args(args, args.variants["grpo-x"]), cfg, tmp_path, sft, tmp_path / "h"
    )
    assert (plain.train.optm_lr, plain.grpo.kl_beta, plain.grpo.reference_model_path) == (4e-5, 0.0, None)
    assert (tuned.train.optm_lr, tuned.grpo.kl_beta) == (1e-5, 0.04)
    # the KL reference is the SFT export the variant starts from (its policy), not the random model or a hub id
    assert tuned.grpo.reference_model_path == str(sft) == tuned.model.model_name_or_path
    everywhere = bench.parse_args(["--kl-beta", "0.02"])  # the command-level flag: every variant
    kl = bench.variant_grpo_config(everywhere, cfg, tmp_path, sft, tmp_path / "k")
    assert (kl.grpo.kl_beta, kl.grpo.reference_model_path) == (0.02, str(sft))

    # the control continues SFT at the command's --grpo-lr whatever the variants' lr
    import physreason.train.sft

    seen = []
    monkeypatch.setattr(
        physreason.train.sft, "run_sft", lambda c: seen.append(c) or type("R", (), {"export_dir": tmp_path / "c"})
    )
    bench.sft_control(cfg, sft, tmp_path / "control.jsonl", tmp_path / "control", args)
    assert (seen[0].train.optm_lr, seen[0].grpo.kl_beta, seen[0].model.model_name_or_path) == (4e-5, 0.0, str(sft))


def test_a_variants_folder_changes_with_its_settings_and_the_controls_with_its_lr(bench):
    argv = ["--sft-steps", "300", "--seeds", "1", "--variants", "grpo", "grpo-mix:iou-hit-weight=0.5"]
    labels = bench.run_labels(bench.parse_args(argv), 1)
    assert labels == {  # the recipe's GRPO settings: the folders of the runs before settings tags
        "untrained model": "base-seed1",
        "after SFT": "sft-sft300-seed1",
        "after SFT+GRPO": "grpo-sft300-seed1",
        "after SFT+GRPO (grpo-mix)": "grpo-mix-hit0.5-sft300-seed1",
        "after SFT+SFT (control)": "grpo-sft300-seed1-sft-control",
    }
    folders = {  # the same variant name with each other setting gets another folder
        spec: bench.run_labels(bench.parse_args([*argv[:-1], f"grpo-mix:{spec}"]), 1)["after SFT+GRPO (grpo-mix)"]
        for spec in ("iou-hit-weight=0.5", "iou-hit-weight=0.5,iou-hit-threshold=0.7", "grpo-lr=1e-5",
                     "kl-beta=0.04", "kl-beta=0.1", "grpo-n=16", "grpo-dynamic-sampling=on", "grpo-temperature=0.8",
                     "json-format-weight=0.2", "grpo-lr=1e-5,kl-beta=0.04")
    }  # fmt: skip
    assert len(set(folders.values())) == len(folders)
    assert folders["grpo-lr=1e-5,kl-beta=0.04"] == "grpo-mix-lr1e-05-kl0.04-sft300-seed1"
    # settings given for the whole command count too; the control's folder carries a --grpo-lr not the recipe's
    command = bench.run_labels(bench.parse_args(["--grpo-lr", "1e-5", "--kl-beta", "0.04", *argv]), 1)
    assert command["after SFT+GRPO"] == "grpo-lr1e-05-kl0.04-sft300-seed1"
    assert command["after SFT+SFT (control)"] == "grpo-lr1e-05-sft300-seed1-sft-control"
    variant_lr = bench.run_labels(bench.parse_args([*argv[:-1], "grpo-lr:grpo-lr=1e-5"]), 1)
    assert variant_lr["after SFT+SFT (control)"] == labels["after SFT+SFT (control)"]  # a variant's lr is its own


def test_a_variant_name_reused_with_other_settings_stops_the_bench(bench, tmp_path):
    from physreason.config.loader import dump_config

    args = bench.parse_args([])
    cfg = bench.stage_config(args, tmp_path, tmp_path / "model", 1)
    folder = tmp_path / "grpo-x"
    first = bench.variant_grpo_config(args, cfg, tmp_path, tmp_path / "sft", folder)
    bench.refuse_other_settings(first)  # no run there yet
    folder.mkdir()
    dump_config(first, folder / "config.toml")
    bench.refuse_other_settings(bench.variant_grpo_config(args, cfg, tmp_path, tmp_path / "sft", folder))  # the same
    other = bench.variant_grpo_config(bench.variant_args(args, {"iou_hit_weight": 1.0}), cfg, tmp_path,
                                      tmp_path / "sft", folder)  # fmt: skip
    with pytest.raises(SystemExit, match=r"grpo-x holds a GRPO run with other settings \(grpo.reward_options: \{\} th"):
        bench.refuse_other_settings(other)
    kl = bench.variant_grpo_config(bench.variant_args(args, {"kl_beta": 0.04}), cfg, tmp_path, tmp_path / "sft", folder)
    with pytest.raises(SystemExit, match=r"grpo.kl_beta: 0.0 there, 0.04 now; grpo.reference_model_path: None there"):
        bench.refuse_other_settings(kl)


def test_fewer_sft_labels_than_rl_prompts_get_their_own_sft_grpo_and_control_folders(bench):
    args = bench.parse_args(["--train-per-task", "250", "--rl-per-task", "500", "--sft-steps", "300", "--seeds", "2"])
    suffix = bench.variant_suffix(args, 2)
    assert suffix == "-train250-rl500-sft300-seed2"
    labels = bench.stage_labels(["grpo", "grpo-hit"], suffix, 2)
    assert labels == {
        "untrained model": "base-seed2",
        "after SFT": "sft-train250-rl500-sft300-seed2",
        "after SFT+GRPO": "grpo-train250-rl500-sft300-seed2",
        "after SFT+GRPO (grpo-hit)": "grpo-hit-train250-rl500-sft300-seed2",
        "after SFT+SFT (control)": "grpo-train250-rl500-sft300-seed2-sft-control",
    }
    assert bench.variant_suffix(bench.parse_args(["--sft-steps", "1500"])) == ""  # the recipe's counts and length


def test_the_grounding_recipe_keeps_the_mean_head_and_1500_sft_steps_and_its_folder_names(bench):
    recipe = bench.parse_args([])
    assert (recipe.tower_head, recipe.sft_steps, recipe.tower_steps) == ("time", 1500, 0)
    assert bench.variant_suffix(recipe) == ""
    assert bench.variant_suffix(bench.parse_args(["--tower-steps", "100"]), 1) == "-tower100-seed1"
    tokens = bench.parse_args(["--tower-steps", "100", "--tower-head", "tokens", "--sft-steps", "3000"])
    assert bench.variant_suffix(tokens) == "-tower100-tokens-sft3000"  # the letter recipe's settings are a variant here


def test_fp8_rollouts_run_on_vllm_beside_bf16_vllm_rollouts_in_folders_of_their_own(bench, tmp_path):
    argv = ["--sft-steps", "300", "--seeds", "1", "--rollout-engine", "vllm", "--variants", "grpo",
            "grpo-fp8:rollout-quantization=fp8"]  # fmt: skip
    args = bench.parse_args(argv)
    assert args.variants == {"grpo": {}, "grpo-fp8": {"rollout_quantization": "fp8"}}
    labels = bench.run_labels(args, 1)
    assert labels["after SFT+GRPO"] == "grpo-vllm-sft300-seed1"  # not the hf engine's run folder
    assert labels["after SFT+GRPO (grpo-fp8)"] == "grpo-fp8-vllm-fp8-sft300-seed1"
    assert labels["after SFT+SFT (control)"] == "grpo-sft300-seed1-sft-control"  # the control rolls nothing out
    assert bench.variant_text(bench.variant_args(args, args.variants["grpo-fp8"])).endswith(
        "; rollouts on vLLM, FP8 weights with truncated importance sampling"
    )
    assert bench.variant_text(args).endswith("; no KL; rollouts on vLLM, bf16")
    cfg = bench.stage_config(args, tmp_path, tmp_path / "model", 1)
    bf16 = bench.variant_grpo_config(args, cfg, tmp_path, tmp_path / "sft", tmp_path / "g")
    fp8 = bench.variant_grpo_config(bench.variant_args(args, args.variants["grpo-fp8"]), cfg, tmp_path,
                                    tmp_path / "sft", tmp_path / "h")  # fmt: skip
    for run in (bf16, fp8):
        assert (run.engine.backend, run.engine.gpu_memory_utilization, run.model.dtype) == ("vllm", 0.2, "bfloat16")
        assert run.engine.kv_cache_memory_gib is None  # vLLM sizes its cache unless told
        assert run.train.param_dtype == "float32"  # the policy trains as before; only the engine's copy is bf16
    sized = bench.variant_grpo_config(bench.parse_args([*argv, "--rollout-kv-cache-gib", "2"]), cfg, tmp_path,
                                      tmp_path / "sft", tmp_path / "s")  # fmt: skip
    assert sized.engine.kv_cache_memory_gib == 2.0
    assert (bf16.rollout.quantization, fp8.rollout.quantization) == ("none", "fp8")
    assert fp8.tis_enabled and not bf16.tis_enabled  # FP8's correction; the bf16 arm as the recipe
    # the stages' engine (evaluations) and the recipe's rollouts stay on the hf engine in float32
    assert (cfg.engine.backend, cfg.model.dtype) == ("hf", "float32")
    hf = bench.variant_grpo_config(bench.parse_args([]), cfg, tmp_path, tmp_path / "sft", tmp_path / "k")
    assert (hf.engine.backend, hf.model.dtype, hf.rollout.quantization) == ("hf", "float32", "none")
    # a folder of one engine is not resumed by the other
    from physreason.config.loader import dump_config

    (tmp_path / "g").mkdir()
    dump_config(hf.model_copy(update={"train": bf16.train}), tmp_path / "g" / "config.toml")
    with pytest.raises(SystemExit, match=r"engine.backend: hf there, vllm now"):
        bench.refuse_other_settings(bf16)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--variants", "grpo-fp8:rollout-quantization=fp8"], "FP8 rollouts (grpo-fp8) run on vLLM: add --rollout-engine"),
        (["--rollout-quantization", "fp8"], "FP8 rollouts (grpo) run on vLLM"),
        (["--rollout-engine", "vllm", "--variants", "grpo-a:rollout-quantization=int4"],
         "rollout-quantization='int4' is not one of none, fp8"),
        (["--rollout-engine", "vllm", "--scale", "1", "--rollout-quantization", "fp8"],
         "at --scale 1 k_proj / v_proj has 64 output rows, not a multiple of 128: use a --scale that fits (2, 4, 6, 8"),
        (["--rollout-gpu-memory", "1.5"], "--rollout-gpu-memory 1.5: give a share of the GPU in (0, 1)"),
        (["--rollout-kv-cache-gib", "0"], "--rollout-kv-cache-gib 0: give a size in GiB > 0"),
        (["--rollout-engine", "vllm", "--variants", "grpo", "grpo-f:rollout-quantization=fp8,grpo-temperature=1.2"],
         "grpo-f: FP8 rollouts weight the loss by truncated importance ratios, which need the rollouts sampled at "
         "temperature 1 (grpo-temperature is 1.2)"),
    ],
)  # fmt: skip
def test_fp8_rollouts_are_refused_before_any_stage_where_they_cannot_run(bench, argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_the_tiny_models_text_widths_are_what_the_fp8_check_reads(family, tmp_path):
    from transformers import AutoConfig

    from physreason.models.tiny import save_tiny_model, text_widths

    save_tiny_model(family, tmp_path / "m", scale=2)
    text = AutoConfig.from_pretrained(tmp_path / "m").get_text_config()
    widths = text_widths(2)
    assert {key: getattr(text, key) for key in widths if key != "head_dim"} == {
        key: value for key, value in widths.items() if key != "head_dim"
    }
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    assert head_dim == widths["head_dim"]
