"""Grounding and temporal localization on a GPU: SFT of a from-scratch model, then GRPO with the IoU reward against
its SFT control (issue 31, item 4).

The JSON-answer analogue of bench/intuitive_physics.py, sharing its stages (model, tower pre-training, SFT settings,
GRPO settings, the control, seeds and their spread). Two `data synth` tasks answer in Cosmos-Reason2's JSON:
`grounding` (a named body's `box_2d` or `point_2d` at a named time, 0-1000 per axis) and `temporal_localization`
(`start` / `end` of a named event, `mm:ss.ff`), docs/grounding.md. Three disjoint clip sets per task: SFT clips
(train split, seed 0), RL prompts (train split, seed 1: clips SFT never saw) and held-out test clips (test split).

Per initialisation seed (`--seeds 1,2,3`):
1. the random model of `--family` (Qwen2.5-VL as Cosmos-Reason1, Qwen3-VL as Cosmos-Reason2), `--scale`;
2. optionally (`--tower-steps N`) its vision tower pre-trained as in the letter bench, on `--tower-clips-per-task`
   clips of each letter task (the from-scratch stand-in for a pre-trained encoder; off by default: the letter
   tower is trained for what happens over time, not where, so whether it helps localization is what a run tells);
3. SFT on the JSON answers of the SFT clips (answer only, the prompt evaluation and GRPO send);
4. from that SFT export, two arms: GRPO on the RL prompts with the IoU reward (`localization`: box IoU, point in
   box or temporal IoU, plus `--json-format-weight` x `json_format`; `--grpo-n` completions per prompt at
   temperature `--grpo-temperature`), and the control: SFT continued on the same RL clips' answers with GRPO's
   prompts per step, steps and learning rate;
5. evaluation of every stage on the test clips (greedy): per clip the IoU, so mean IoU and accuracy at IoU 0.5
   with their standard errors over clips, for box questions, point questions (IoU is 1 inside the body's box) and
   time spans apart; and GRPO against the control clip by clip (paired: mean difference, its standard error and a
   two-sided sign-flip permutation p-value), per seed and pooled over seeds (each clip's difference averaged).

GRPO from an SFT stopped early against its control: `--sft-steps 300` (its folders carry the step count).
Stages are resumable as in the letter bench: a rerun with the same --out reuses clips, finished exports and
evaluations, and continues an interrupted SFT or GRPO from its last checkpoint (`--ckpt-every`).
Prints and writes the table as markdown and JSON to <out>/grounding<variant>.{md,json} and, when OUT is set, to
$OUT/grounding.{md,json}, with the GPU's name, the date and the command.
Run: python bench/grounding.py --seeds 1,2,3
CPU check: python bench/grounding.py --train-per-task 4 --rl-per-task 4 --test-per-task 2 --sft-steps 2 \
    --sft-batch 2 --grpo-steps 1 --grpo-prompts 2 --grpo-n 2 --scale 1 --max-tokens 8 --ckpt-every 1 --workers 1
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

from intuitive_physics import (  # the letter bench's stages (bench/ is on the path when this script runs)
    add_recipe_arguments,
    build_model,
    combined_runs,
    device_name,
    finished_export,
    generate_clip_sets,
    grpo_stage_config,
    logged,
    results_name,
    run_header,
    seed_stats,
    seed_tag,
    sft_control,
    spread,
    spread_text,
    stage_config,
    tower_stage,
    variant_suffix,
    window_means,
    write_results,
)

KINDS = ("box_2d", "point_2d", "time_span")  # what a question asks for: the table's task columns
KIND_LABELS = {"box_2d": "grounding, box", "point_2d": "grounding, point", "time_span": "temporal localization"}
IOU_HIT = 0.5  # physreason.rewards.localization.IOU_HIT: accuracy at IoU 0.5, R@0.5
PERMUTATIONS = 20000


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The experiment's knobs; the defaults are the recipe."""
    from physreason.data.synth.tasks import JSON_TASK_NAMES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_recipe_arguments(parser, "grounding", Path("/tmp/physreason-grounding"))
    parser.add_argument("--tasks", nargs="+", choices=JSON_TASK_NAMES, default=list(JSON_TASK_NAMES))
    parser.add_argument("--test-per-task", type=int, default=300, help="held-out clips per task")
    parser.add_argument(
        "--max-pixels",
        type=int,
        default=37632,
        help="largest frame area fed to the model (168x224 from the 256x192 clips: 6x8 tokens per frame pair, so "
        "a box can be told to about a sixth of the frame from the tokens' places alone)",
    )
    parser.add_argument("--max-tokens", type=int, default=128, help="longest answer, in evaluation and rollouts")
    parser.add_argument(
        "--tower-steps", type=int, default=0, help="pre-train the tower on letter clips first (0: no pre-training)"
    )
    parser.add_argument("--tower-clips-per-task", type=int, default=1000, help="letter clips per task for the tower")
    parser.add_argument(
        "--sft-freeze-tower",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="keep the vision tower fixed in SFT, GRPO and the control",
    )
    parser.add_argument("--grpo-prompts", type=int, default=16, help="prompts per GRPO step (and control batch)")
    parser.add_argument("--grpo-temperature", type=float, default=1.0)
    parser.add_argument("--json-format-weight", type=float, default=0.1, help="weight of the json_format reward")
    parser.add_argument("--stop-after", choices=("data", "sft", "all"), default="all")
    args = parser.parse_args(argv)
    args.grpo_name = "grpo"  # folder names shared with the letter bench's helpers
    args.option_order = "fixed"  # the letter clips of the tower pre-training (a JSON answer has no options)
    return args


def generate(out: Path, args: argparse.Namespace) -> dict[str, float]:
    """The clip sets of every task and their SFT / GRPO / control record files (existing clips are reused)."""
    from physreason.data.synth.records import json_sft_records, letter_sft_records, rl_records
    from physreason.data.synth.tasks import LETTER_TASK_NAMES

    sets = [
        ("train", "train", 0, args.train_per_task, args.tasks),
        ("rl", "train", 1, args.rl_per_task, args.tasks),
        ("test", "test", 0, args.test_per_task, args.tasks),
    ]
    if args.tower_steps:
        sets.append(("tower", "train", 0, args.tower_clips_per_task, list(LETTER_TASK_NAMES)))
    timings = generate_clip_sets(out, sets, args)
    json_sft_records(out / "data" / "train", out / "data" / "train" / "sft.jsonl", args.tasks)
    json_sft_records(out / "data" / "rl", out / "data" / "rl" / "control-sft.jsonl", args.tasks)
    rl_records(out / "data" / "rl", out / "data" / "rl" / "grpo.jsonl", args.tasks)
    if args.tower_steps:
        letter_sft_records(out / "data" / "tower", out / "data" / "tower" / "sft.jsonl")
    return timings


def clip_ious(results_dir: Path) -> dict[str, dict[str, float]]:
    """Per question kind (box_2d, point_2d, time_span), each scored test clip's IoU, by `<dataset>/<sample id>`.

    Samples that failed (no completion: a clip that could not be read, an engine error) have no IoU and are left out;
    an answer that does not parse scored IoU 0.
    """
    from physreason.chat.structured import answer_kind
    from physreason.eval.results import read_run

    scores: dict[str, dict[str, float]] = {kind: {} for kind in KINDS}
    for run in sorted({path.parent for path in results_dir.rglob("*.jsonl")}):
        for sample_id, record in read_run(run).items():
            if "iou" in record:
                scores[answer_kind(record["correct_answer"])][f"{run.parent.name}/{sample_id}"] = float(record["iou"])
    return scores


def clip_summary(ious: list[float]) -> dict[str, float] | None:
    """Mean IoU and accuracy at IoU 0.5 over clips, each with its standard error (sample std / sqrt n), and n."""
    import numpy as np

    if not ious:
        return None
    values = np.asarray(ious, dtype=float)
    hits = (values >= IOU_HIT).astype(float)
    return {
        "mean_iou": float(values.mean()),
        "mean_iou_se": standard_error(values),
        "acc50": float(hits.mean()),
        "acc50_se": standard_error(hits),
        "n": len(values),
    }


def standard_error(values: Any) -> float:
    """Standard error of the mean of a 1-D array: sample std / sqrt(n); 0 for fewer than two values."""
    return float(values.std(ddof=1) / math.sqrt(len(values))) if len(values) > 1 else 0.0


def paired_test(a: dict[str, float], b: dict[str, float], seed: int = 0) -> dict[str, float] | None:
    """a - b over the clips both scored: mean difference, its standard error, t, and a two-sided sign-flip p-value.

    Under the null hypothesis that the arms do not differ, each clip's difference is as likely negative as positive;
    the p-value is the share of random sign flips (PERMUTATIONS of them, plus the observed one) whose mean is at
    least as far from 0 as the observed mean. It needs no normality, unlike the t-test, on IoUs bounded in [0, 1].
    """
    import numpy as np

    common = sorted(a.keys() & b.keys())
    if len(common) < 2:
        return None
    diff = np.array([a[k] - b[k] for k in common])  # [clips]
    mean, se = float(diff.mean()), standard_error(diff)
    signs = np.random.default_rng(seed).choice([-1.0, 1.0], size=(PERMUTATIONS, len(diff)))  # [draws, clips]
    extreme = int((np.abs(signs @ diff) / len(diff) >= abs(mean) - 1e-12).sum())
    return {
        "mean_diff": mean,
        "se": se,
        "t": mean / se if se > 0 else 0.0,
        "p": (extreme + 1) / (PERMUTATIONS + 1),
        "n": len(diff),
    }


STAGES = {  # table row -> its run and evaluation folder name, given the variant suffix (the letter bench's names)
    "untrained model": "base{seed}",
    "after SFT": "sft{suffix}",
    "after SFT+GRPO": "grpo{suffix}",
    "after SFT+SFT (control)": "grpo{suffix}-sft-control",
}


def run_seed(args: argparse.Namespace, out: Path, seed: int) -> dict[str, Any]:
    """Every stage after the data for one seed: the per-clip IoUs of each evaluated stage, and the runs' logs."""
    from physreason.demo import _evaluate, _with_model
    from physreason.train.grpo import run_grpo
    from physreason.train.sft import run_sft

    timings: dict[str, float] = {}
    model_dir = build_model(args, out, seed)
    cfg = stage_config(args, out, model_dir, seed)
    cfg.eval.datasets = list(args.tasks)
    cfg.generation.max_tokens = args.max_tokens
    suffix = variant_suffix(args, seed)
    cfg.train.output_dir = str(out / f"sft{suffix}")
    labels = {row: name.format(suffix=suffix, seed=seed_tag(seed)) for row, name in STAGES.items()}
    results = out / "results"

    def evaluate(row: str, model: Path) -> None:
        t = time.perf_counter()
        _evaluate(_with_model(cfg, model), labels[row], results)
        timings[f"eval {row}"] = time.perf_counter() - t

    evaluate("untrained model", model_dir)
    tower = None
    if args.tower_steps:
        t = time.perf_counter()
        tower_dir, tower = tower_stage(args, model_dir, out / "data" / "tower", cfg, seed)
        cfg = _with_model(cfg, tower_dir)
        timings["tower_s"] = time.perf_counter() - t
    t = time.perf_counter()
    sft_dir = finished_export(Path(cfg.train.output_dir), args.sft_steps) or run_sft(cfg).export_dir
    timings["sft_s"] = time.perf_counter() - t
    evaluate("after SFT", sft_dir)
    if args.stop_after == "all":
        t = time.perf_counter()
        rl_cfg = grpo_stage_config(
            args, cfg, out, sft_dir, out / "data" / "rl" / "grpo.jsonl", out / labels["after SFT+GRPO"]
        )
        rl_cfg.grpo.reward_function = {"localization": 1.0, "json_format": args.json_format_weight}
        rl_cfg.grpo.shuffle_options = False  # no options: the question is asked as written
        rl_cfg.rollout.max_response_length = args.max_tokens
        rl_cfg.rollout.sampling_config.temperature = args.grpo_temperature
        grpo_dir = finished_export(Path(rl_cfg.train.output_dir), args.grpo_steps) or run_grpo(rl_cfg).export_dir
        timings["grpo_s"] = time.perf_counter() - t
        evaluate("after SFT+GRPO", grpo_dir)
        t = time.perf_counter()
        control = out / labels["after SFT+SFT (control)"]
        control_dir = sft_control(cfg, sft_dir, out / "data" / "rl" / "control-sft.jsonl", control, args)
        timings["sft_control_s"] = time.perf_counter() - t
        evaluate("after SFT+SFT (control)", control_dir)
    ious = {row: clip_ious(results / label) for row, label in labels.items() if (results / label).is_dir()}
    tables = {row: {kind: clip_summary(list(scores[kind].values())) for kind in KINDS} for row, scores in ious.items()}
    paired = None
    if "after SFT+GRPO" in ious and "after SFT+SFT (control)" in ious:
        grpo, ctl = ious["after SFT+GRPO"], ious["after SFT+SFT (control)"]
        paired = {kind: paired_test(grpo[kind], ctl[kind], seed) for kind in KINDS}
    rewards = logged(out / labels["after SFT+GRPO"], "reward/total_mean")
    print(f"seed {seed}: GRPO mean reward, means of 10 steps:", window_means(rewards, 10))
    print({k: round(v, 1) for k, v in timings.items()})
    return {
        "seed": seed,
        "labels": labels,
        "tables": tables,
        "paired_grpo_minus_control": paired,
        "clip_ious": ious,
        "sft_losses": logged(Path(cfg.train.output_dir), "train/loss"),
        "grpo_rewards": rewards,
        "tower_pretraining": tower,
        "timings": timings,
    }


def seed_summary(runs: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per stage and question kind, mean IoU and acc@0.5 over seeds (mean, std, min, max, n: seed_stats)."""
    tables = [
        {row: {f"{kind}/{key}": s[key] for kind, s in table.items() if s for key in ("mean_iou", "acc50")}
         for row, table in run["tables"].items()}
        for run in runs
    ]  # fmt: skip
    return {row: {key: stats for key, stats in values.items() if stats} for row, values in spread(tables).items()}


def pooled_paired(runs: list[dict[str, Any]]) -> dict[str, dict[str, float] | None]:
    """GRPO - control per question kind over all seeds: each clip's difference averaged over the seeds, then tested."""
    pooled: dict[str, dict[str, float] | None] = {}
    for kind in KINDS:
        arms = [
            (run["clip_ious"]["after SFT+GRPO"][kind], run["clip_ious"]["after SFT+SFT (control)"][kind])
            for run in runs
            if "after SFT+GRPO" in run["clip_ious"]
        ]
        if not arms:
            pooled[kind] = None
            continue
        common = set.intersection(*(set(g) & set(c) for g, c in arms))
        mean = {arm: {k: sum(pair[arm][k] for pair in arms) / len(arms) for k in common} for arm in (0, 1)}
        pooled[kind] = paired_test(mean[0], mean[1])
        if pooled[kind] is not None:
            pooled[kind]["seeds"] = len(arms)
    return pooled


def markdown(runs: list[dict[str, Any]], pooled: dict[str, Any], header: list[str]) -> str:
    """The stage table (mean IoU and acc@0.5 per question kind) and the paired GRPO-vs-control table."""
    single = len(runs) == 1
    note = (
        "(%; ± one standard error over the test clips)"
        if single
        else f"(%; mean ± std over {len(runs)} seeds [min-max]; standard errors over clips per seed in the JSON)"
    )
    kinds = [kind for kind in KINDS if any(run["tables"]["after SFT"][kind] for run in runs)]
    columns = [f"{KIND_LABELS[k]}: {'mean tIoU' if k == 'time_span' else 'mean IoU'}" for k in kinds]
    columns = [c for kind, col in zip(kinds, columns) for c in (col, f"{KIND_LABELS[kind]}: acc@0.5")]
    lines = [*header, "", f"Held-out test clips {note}", ""]
    lines += ["| stage | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for row in STAGES:
        cells = []
        for kind in kinds:
            for key in ("mean_iou", "acc50"):
                values = [s[key] for run in runs if (s := run["tables"].get(row, {}).get(kind))]
                if not values:
                    cells.append("-")
                elif single:
                    stats = runs[0]["tables"][row][kind]
                    cells.append(f"{100 * stats[key]:.1f} ± {100 * stats[key + '_se']:.1f}")
                else:
                    cells.append(spread_text(seed_stats(values)))
        if any(cell != "-" for cell in cells):
            lines.append(f"| {row} | " + " | ".join(cells) + " |")
    if any(pooled.values()):
        lines += [
            "",
            "GRPO minus its SFT control, clip by clip (mean IoU points; pooled: each clip's difference averaged over "
            "seeds; p: two-sided sign-flip permutation test)",
            "",
            "| question | difference | standard error | p | clips | per seed (difference, p) |",
            "|---|---|---|---|---|---|",
        ]
        for kind in kinds:
            test = pooled.get(kind)
            if not test:
                continue
            per_seed = ", ".join(
                f"seed {run['seed']}: {100 * t['mean_diff']:+.1f}, p {t['p']:.3f}"
                for run in runs
                if run["paired_grpo_minus_control"] and (t := run["paired_grpo_minus_control"][kind])
            )
            lines.append(
                f"| {KIND_LABELS[kind]} | {100 * test['mean_diff']:+.1f} | {100 * test['se']:.1f} | {test['p']:.4f} | "
                f"{test['n']} | {per_seed} |"
            )
    return "\n".join(lines) + "\n"


def combine(files: list[Path]) -> dict[str, Any]:
    """The tables and pooled paired test over the seeds of earlier runs' JSON files, written beside the first."""
    runs, devices, header = combined_runs(files)
    pooled = pooled_paired(runs)
    text = markdown(runs, pooled, header)
    print(text)
    payload = {"device": devices, "header": header, "summary": seed_summary(runs), "paired_grpo_minus_control": pooled}
    write_results(files[0].with_name("grounding-combined"), {**payload, "per_seed": runs}, text)
    return payload


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    """Run the experiment for every seed and write the tables; returns the JSON payload (None after --stop-after data)."""
    args = parse_args(argv)
    if args.combine:
        return combine(args.combine)
    out = args.out.resolve() / args.family
    started = time.perf_counter()
    data_timings = generate(out, args)
    data_timings["data_s"] = time.perf_counter() - started
    if args.stop_after == "data":
        print({k: round(v, 1) for k, v in data_timings.items()})
        return None
    runs = [run_seed(args, out, seed) for seed in args.seeds]
    device = device_name()
    pooled = pooled_paired(runs)
    header = run_header(device, args.seeds)
    text = markdown(runs, pooled, header)
    print(text)
    payload = {
        "device": device,
        "header": header,
        "args": {k: str(v) for k, v in vars(args).items()},
        "data_timings": data_timings,
        "summary": seed_summary(runs),
        "paired_grpo_minus_control": pooled,
        "per_seed": runs,
        "total_s": time.perf_counter() - started,
    }
    write_results(out / results_name("grounding", args), payload, text, out_name="grounding")
    return payload


if __name__ == "__main__":
    main()
