"""bench/grounding.py on CPU: its statistics (standard errors, the paired sign-flip test, the spread over seeds), the
tables it writes, and the whole pipeline at toy size (the GPU runs go to bench/RESULTS.md)."""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest
from setups import BENCH, load_bench


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))  # grounding imports the letter bench's stages by name, as when run as a script
    try:
        return load_bench("grounding")
    finally:
        sys.path.remove(str(BENCH))


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

    pooled = bench.pooled_paired([run(1, 0.1), run(2, 0.3)])
    assert pooled["box_2d"]["mean_diff"] == pytest.approx(0.2) and pooled["box_2d"]["seeds"] == 2
    assert pooled["box_2d"]["n"] == 10
    assert pooled["point_2d"] is None and pooled["time_span"] is None


def test_markdown_reports_mean_and_spread_over_seeds_and_the_paired_table(bench):
    def table(level: float) -> dict:
        stats = {"mean_iou": level, "mean_iou_se": 0.01, "acc50": level / 2, "acc50_se": 0.02, "n": 50}
        return {"box_2d": stats, "point_2d": None, "time_span": stats}

    runs = [
        {
            "seed": seed,
            "tables": {row: table(level) for row in bench.STAGES},
            "paired_grpo_minus_control": {"box_2d": {"mean_diff": 0.05, "p": 0.01}, "point_2d": None, "time_span": None},
        }
        for seed, level in ((1, 0.4), (2, 0.6))
    ]
    pooled = {"box_2d": {"mean_diff": 0.05, "se": 0.02, "p": 0.012, "n": 50}, "point_2d": None, "time_span": None}
    text = bench.markdown(runs, pooled, ["- device: test"])
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("| stage |"))
    assert header.count("|") - 1 == 1 + 4  # box and span kinds (no point questions), mean IoU and acc@0.5 each
    sft = next(line for line in lines if line.startswith("| after SFT |"))
    assert "50.0 ± 14.1 [40.0-60.0]" in sft  # mean ± sample std [min-max] over the two seeds
    paired = next(line for line in lines if line.startswith("| grounding, box |"))
    assert "+5.0" in paired and "0.0120" in paired and "seed 1: +5.0, p 0.010" in paired
    # one seed: the cells carry the standard error over clips instead
    single = bench.markdown(runs[:1], pooled, [])
    assert "| after SFT | 40.0 ± 1.0 | 20.0 ± 2.0 |" in single


def test_combine_pools_the_paired_test_over_runs_of_separate_leases(bench, tmp_path):
    def run(seed: int, gain: float) -> dict:
        base = {f"grounding/{i}": 0.05 * i for i in range(8)}
        stats = bench.clip_summary(list(base.values()))
        arms = {"after SFT+GRPO": {k: v + gain for k, v in base.items()}, "after SFT+SFT (control)": base}
        return {
            "seed": seed,
            "tables": {row: {"box_2d": stats, "point_2d": None, "time_span": None} for row in bench.STAGES},
            "clip_ious": {row: {"box_2d": ious, "point_2d": {}, "time_span": {}} for row, ious in arms.items()},
            "paired_grpo_minus_control": {"box_2d": bench.paired_test(arms["after SFT+GRPO"], base), "point_2d": None,
                                          "time_span": None},
        }  # fmt: skip

    for seed, gain in ((1, 0.04), (2, 0.08)):
        (tmp_path / f"s{seed}.json").write_text(json.dumps({"device": f"gpu{seed}", "per_seed": [run(seed, gain)]}))
    payload = bench.main(["--combine", str(tmp_path / "s1.json"), str(tmp_path / "s2.json")])
    assert payload["paired_grpo_minus_control"]["box_2d"]["mean_diff"] == pytest.approx(0.06)
    assert payload["device"] == "gpu1 / gpu2"
    text = (tmp_path / "grounding-combined.md").read_text()
    assert "- seeds: 1, 2" in text and "| grounding, box | +6.0 |" in text
    with pytest.raises(SystemExit):
        bench.main(["--combine", str(tmp_path / "s1.json"), str(tmp_path / "s1.json")])


def test_seeds_option_rejects_repeats_and_non_integers(bench):
    assert bench.parse_args(["--seeds", "1,2,3"]).seeds == [1, 2, 3]
    assert bench.parse_args([]).seeds == [0]
    for bad in ("1,1", "a", "-1"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--seeds", bad])


@pytest.mark.slow
def test_whole_pipeline_writes_a_table_of_every_stage_and_question_kind(bench, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.setenv("OUT", str(tmp_path / "report"))
    (tmp_path / "report").mkdir()
    payload = bench.main(
        [
            "--train-per-task", "4", "--rl-per-task", "4", "--test-per-task", "4", "--sft-steps", "2",
            "--sft-batch", "2", "--grpo-steps", "1", "--grpo-prompts", "2", "--grpo-n", "2", "--scale", "1",
            "--max-tokens", "8", "--max-pixels", "12544", "--ckpt-every", "1", "--workers", "1",
            "--loader-workers", "0", "--out", str(tmp_path / "run"),
        ]
    )  # fmt: skip
    run = payload["per_seed"][0]
    # every test clip scored at every stage: 4 grounding clips (2 box, 2 point questions) and 4 time spans
    for row in bench.STAGES:
        assert {kind: len(ious) for kind, ious in run["clip_ious"][row].items()} == {
            "box_2d": 2, "point_2d": 2, "time_span": 4,
        }  # fmt: skip
        for stats in run["tables"][row].values():
            for key in ("mean_iou", "mean_iou_se", "acc50", "acc50_se"):
                assert math.isfinite(stats[key]) and 0.0 <= stats[key] <= 1.0
    for test in payload["paired_grpo_minus_control"].values():
        assert test["n"] in (2, 4) and 0.0 < test["p"] <= 1.0 and -1.0 <= test["mean_diff"] <= 1.0
    assert payload["device"] == "cpu"
    text = (tmp_path / "report" / "grounding.md").read_text()
    assert text == (tmp_path / "run" / "qwen2_5_vl" / "grounding-scale1-sft2.md").read_text()  # the variant's name
    assert "- device: cpu" in text and "- command: `python " in text
    table = [line for line in text.splitlines() if line.startswith("| ")]
    rows = [line.split(" | ")[0].removeprefix("| ") for line in table]
    assert rows[:5] == ["stage", *bench.STAGES]
    assert all(line.count("|") == 8 for line in table[:5])  # stage + 3 question kinds x (mean IoU, acc@0.5)
    assert rows[5:] == ["question", "grounding, box", "grounding, point", "temporal localization"]
    for line in table[1:5]:
        cells = [cell.split(" ± ") for cell in line.strip("| ").split(" | ")[1:]]
        assert all(0.0 <= float(mean) <= 100.0 and 0.0 <= float(se) <= 100.0 for mean, se in cells)
    assert json.loads((tmp_path / "report" / "grounding.json").read_text())["summary"]["after SFT"]
