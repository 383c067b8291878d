"""Intuitive-physics table on a GPU: a small Qwen2.5-VL-architecture model trained from scratch with SFT, then GRPO.

The analogue of the Cosmos-Reason1 paper's intuitive-physics table (arrow of time, spatial puzzle,
object permanence): held-out accuracy of chance, the untrained model, after SFT and after SFT+GRPO.
Every stage is physreason's own: `data synth` clips, letter-answer SFT records built from the benchmark
records, `run_sft`, `run_grpo` (hf engine for rollouts), and the evaluation runner. The model is the tiny
architecture scaled up (`--scale`; random init, the tiny BPE tokenizer), so it learns from pixels alone.

Three disjoint clip sets per task (`data synth` scene seeds never repeat across them): SFT clips (split train,
seed 0), RL prompts (split train, seed 1: clips the SFT stage never saw, as the paper's RL stage uses its own
questions) and held-out test clips (split test).

Recipe (defaults) for a model with no pretraining:
- `--option-order fixed`: every question lists the same options in the same order, with the classes balanced,
  so the letter says nothing by itself (chance stays 50 / 25 / 50). With shuffled letters the answer is an
  XOR of the clip and the option order, which a from-scratch model does not learn in this budget.
- small frames (`--max-pixels`, 84x112 from the 256x192 clips: 12 tokens per pair of frames, 72 per clip);
- the vision tower pre-trained first on the SFT clips with a dense loss (at most `--tower-steps 4000`, scored on
  its held-out tenth every `--tower-eval-every 100` steps, the best-scoring tower kept, stopped after
  `--tower-patience 1000` steps without a better one; physreason/experiments/tower.py), as released VLMs start
  from a pre-trained encoder: without it the temporal
  tasks stay at chance, because one answer letter per clip through a random language model does not train the
  tower (bench/RESULTS.md). Its linear head sees every merged token in place (`--tower-head tokens`; `time`, the
  earlier recipe's, their mean per temporal patch). SFT then keeps the tower fixed (`--sft-freeze-tower`;
  `--no-sft-freeze-tower` trains it too);
- SFT: 3,000 steps of 16 at lr 3e-4 with warmup, answer-only (letter) loss; the data loader (decode, resize,
  patchify on CPU, in spawned worker processes) bounds the samples per second;
- GRPO on the RL prompts with the accuracy reward at lr 3e-5, options not reshuffled.
After SFT, seeds 1-3 side by side on one GPU (2026-11-27, `--stop-after sft`, held-out accuracy %, mean ± std
[min-max]): on an NVIDIA H100 80GB HBM3 arrow of time 95.2 ± 0.6 [94.6-95.8], spatial puzzle 95.9 ± 0.9
[95.0-96.8], object permanence 88.8 ± 1.4 [87.4-90.2]; on an NVIDIA H200 95.2 ± 0.7 [94.4-95.8], 95.4 ± 1.6
[94.2-97.2], 89.8 ± 1.1 [88.6-90.8]. The earlier recipe (the mean head, 1,500 SFT steps) left the spatial puzzle
at 82.1 ± 14.1 over 3 seeds on an H100; the head on every token with 1,500 steps gave 93.7 ± 1.0 [92.6-94.6],
90.5 ± 3.3 [87.0-93.4], 88.3 ± 0.9 [87.6-89.4] (4 x H200).
Before that, on one H200 a recipe of 3,000 tower steps, the last step's tower kept, reached 85.2-85.6 / 99.8 / 91.2
after SFT from random init, in 7 minutes from nothing; on an H100 the same command's tower did not converge on the
spatial puzzle (held-out 73.0): hence the selection on the held-out tenth and the longer budget.
`--seeds 1,2,3` runs every stage after the data once per initialisation seed (the random weights, the tower's
batches and held-out tenth, SFT's data order, GRPO's sampling; the clips stay the same) and reports mean ± std
[min-max] over seeds per stage and task; seed 0 is the runs before --seeds (its folders keep their names).
Stages are resumable: a rerun with the same --out reuses the clips, a finished SFT or GRPO export, finished
evaluations, and resumes an interrupted SFT or GRPO run from its last checkpoint (every `--ckpt-every` steps).
Several GRPO variants can start from one SFT stage: each `--grpo-name` has its own run folder, prompt file and
evaluation under the same --out (`--grpo-tasks spatial_puzzle --grpo-name grpo-spatial`).
`--sft-control` adds the control row: SFT continued from the SFT export on the same RL clips (letter answers),
with GRPO's prompts per step, steps and learning rate, so a GRPO gain can be told from more supervised data.
Architecture experiments: `--family qwen3_vl` (Cosmos-Reason2's layout), `--temporal-patch N` (frames per temporal
patch of the vision tower; the released models use 2), `--tower-steps N` (0: no tower pre-training),
`--no-sft-freeze-tower` (SFT, GRPO and the control also train the tower). A variant's SFT, GRPO and control folders
and evaluations carry its settings other than the recipe's (`sft-tower3000-frozen`, `grpo-tower4000-time-frozen` for
the mean head, `sft-tower4000-frozen-sft1500`, ...; the tower's own folder carries -tokens for the recipe's head, so
that no run takes another head's tower), so variants can share one --out and its clips, untrained evaluation and
pre-trained tower: `--stop-after data` only writes the clips, `--stop-after tower` also evaluates the untrained model
and pre-trains the tower, after which SFT variants can run side by side. Folders written before the recipe changed
(2026-11-27) keep the names of the recipe of then: the mean head's `sft-tower4000-frozen` would be named
`sft-tower4000-time-frozen-sft1500` now, and a run that finds its SFT folder holding a run of another start or length
stops, naming it (common.refuse_other_run).
Prints the table, with the GPU's name, the date and the command, and writes it as JSON and markdown to
$OUT/intuitive_physics.{json,md} when OUT is set, and to <out>/table<variant>[-seeds1_2_3].{json,md}.
`--sft-steps 300 --sft-control`: GRPO from an SFT stopped early, against its control (own folders, `-sft300`).
Run: physreason experiment intuitive-physics
     physreason experiment intuitive-physics --train-per-task 4 --rl-per-task 4 --test-per-task 2 --sft-steps 2 \
         --grpo-steps 1 --grpo-prompts 2 --scale 1 --sft-batch 4 --ckpt-every 1 --tower-steps 3 --seeds 0,1  (CPU check)
docs/experiments.md says what each experiment checks and what it gave (bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from physreason.cpu import apply_cpu_share
from physreason.experiments.common import (
    Recipe,
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
    seed_tag,
    sft_control,
    sft_stage,
    spread,
    spread_text,
    stage_config,
    tower_stage,
    variant_suffix,
    window_means,
    write_results,
)
from physreason.experiments.common import model_folder_name as model_folder_name  # a run's folders: with variant_suffix

# The tower's head on every token and 3,000 SFT steps: with them the letter table held over seeds 1-3 (spatial puzzle
# 95.9 ± 0.9 on an H100, 95.4 ± 1.6 on an H200, 2026-11-27) where the mean head and 1,500 steps gave 82.1 ± 14.1.
RECIPE = Recipe(tower_head="tokens", sft_steps=3000)


def parse_args(argv: list[str] | None = None, prog: str | None = None) -> argparse.Namespace:
    """The recipe's knobs; the defaults are the recipe. `prog` names the command in usage lines and errors (default:
    the script's name)."""
    from physreason.data.synth.tasks import LETTER_TASK_NAMES as TASKS

    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    add_recipe_arguments(parser, "intuitive_physics", Path("/tmp/physreason-intuitive-physics"), RECIPE)
    parser.add_argument("--test-per-task", type=int, default=500, help="held-out clips per task")
    parser.add_argument("--option-order", choices=("fixed", "shuffled"), default="fixed")
    parser.add_argument("--max-pixels", type=int, default=12544, help="largest frame area fed to the model")
    parser.add_argument(
        "--tower-steps",
        type=int,
        default=4000,
        help="pre-train the vision tower on the SFT clips for at most this many steps before SFT "
        "(physreason/experiments/tower.py; 0: no pre-training)",
    )
    parser.add_argument(
        "--sft-freeze-tower",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep the vision tower (and its merger) fixed in SFT, GRPO and the control (default: when --tower-steps "
        "pre-trained it)",
    )
    parser.add_argument("--grpo-prompts", type=int, default=16, help="prompts per GRPO step")
    parser.add_argument(
        "--grpo-tasks",
        nargs="+",
        choices=TASKS,
        default=None,
        help="tasks whose clips become GRPO prompts (default: all)",
    )
    parser.add_argument(
        "--grpo-name",
        default="grpo",
        help="GRPO run folder and results label under --out (several GRPO variants can share one SFT stage)",
    )
    parser.add_argument(
        "--sft-control",
        action="store_true",
        help="also continue SFT from the SFT export on the same RL clips, as many prompts per step and steps as GRPO "
        "at GRPO's learning rate (constant): the control that tells GRPO's gain from more supervised data",
    )
    parser.add_argument(
        "--stop-after",
        choices=("data", "tower", "sft", "grpo"),
        default="grpo",
        help="last stage to run (data: only generate the clips and records, e.g. for variants sharing them; "
        "tower: also evaluate the untrained model and pre-train its tower, for SFT variants that share it)",
    )
    args = parser.parse_args(argv)
    if args.sft_freeze_tower is None:
        args.sft_freeze_tower = args.tower_steps > 0
    if (
        args.grpo_name in {"data", "results", "sft", "rl", "rl-sft"}
        or not args.grpo_name.replace("-", "_").isidentifier()
    ):
        parser.error(
            f"--grpo-name {args.grpo_name!r}: use a plain folder name other than data, results, sft, rl, rl-sft"
        )
    return args


def generate(out: Path, args: argparse.Namespace, timings: dict[str, float]) -> None:
    """The three clip sets of every task and the SFT / RL record files (existing clips are reused)."""
    from physreason.data.synth.records import letter_sft_records, rl_records
    from physreason.data.synth.tasks import LETTER_TASK_NAMES as TASKS

    sets = [
        ("train", "train", 0, args.train_per_task, TASKS),
        ("rl", "train", 1, args.rl_per_task, TASKS),
        ("test", "test", 0, args.test_per_task, TASKS),
    ]
    timings.update(generate_clip_sets(out, sets, args))
    letter_sft_records(out / "data" / "train", out / "data" / "train" / "sft.jsonl")
    rl_records(out / "data" / "rl", out / "data" / "rl" / "rl.jsonl")
    tasks = args.grpo_tasks or list(TASKS)  # parse_args checked the names
    keep_tasks(out / "data" / "rl" / "rl.jsonl", grpo_prompts(out, args), tasks)
    letter_sft_records(out / "data" / "rl", out / "data" / "rl" / "rl-sft.jsonl")
    keep_tasks(out / "data" / "rl" / "rl-sft.jsonl", control_records(out, args), tasks)


def keep_tasks(source: Path, target: Path, tasks: list[str]) -> None:
    """Copy the JSONL records of `source` whose clip (`<task>/clips/...`) belongs to one of `tasks`."""
    from physreason.data.synth.records import write_records

    rows = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
    write_records(target, [row for row in rows if row["video"].split("/")[0] in tasks])


def control_records(out: Path, args: argparse.Namespace) -> Path:
    """Letter-answer SFT records of the same RL clips, for --sft-control."""
    return out / "data" / "rl" / f"{args.grpo_name}-sft.jsonl"


def grpo_prompts(out: Path, args: argparse.Namespace) -> Path:
    """The GRPO prompt file of this variant: the RL clips of the --grpo-tasks."""
    return out / "data" / "rl" / f"{args.grpo_name}.jsonl"


def run_seed(args: argparse.Namespace, out: Path, seed: int) -> dict[str, Any] | None:
    """Every stage after the data for one initialisation seed; its table and logs (None when stopped before SFT)."""
    import torch

    from physreason.config import with_model
    from physreason.eval.launch import accuracy_by_dataset
    from physreason.train.grpo import run_grpo

    timings: dict[str, float] = {}
    started = time.perf_counter()
    model_dir = build_model(args, out, seed)
    cfg = stage_config(args, out, model_dir, seed)
    suffix = variant_suffix(args, seed)
    cfg.train.output_dir = str(out / f"sft{suffix}")
    grpo_name = f"{args.grpo_name}{suffix}"

    table: dict[str, dict[str, float | None]] = {}
    t = time.perf_counter()
    # resumable: finished clips are kept
    table["untrained model"] = accuracy_by_dataset(cfg, out / "results" / f"base{seed_tag(seed)}")
    timings["eval_base_s"] = time.perf_counter() - t
    tower: dict | None = None
    if args.tower_steps:
        t = time.perf_counter()
        tower_dir, tower = tower_stage(args, model_dir, out / "data" / "train", cfg, seed)
        cfg = with_model(cfg, tower_dir)
        timings["tower_s"] = time.perf_counter() - t
    if args.stop_after == "tower":
        print({k: round(v, 1) for k, v in timings.items()})
        return None
    t = time.perf_counter()
    sft_dir = sft_stage(cfg, args.sft_steps)
    timings["sft_s"] = time.perf_counter() - t
    t = time.perf_counter()
    table["after SFT"] = accuracy_by_dataset(with_model(cfg, sft_dir), out / "results" / f"sft{suffix}")
    timings["eval_sft_s"] = time.perf_counter() - t
    grpo_dir = None
    if args.stop_after == "grpo":
        t = time.perf_counter()
        rl_cfg = grpo_stage_config(args, cfg, out, sft_dir, grpo_prompts(out, args), out / grpo_name)
        # The SFT prompts list options in the generated order; reshuffling them would ask a new question.
        rl_cfg.grpo.shuffle_options = args.option_order == "shuffled"
        grpo_dir = finished_export(Path(rl_cfg.train.output_dir), args.grpo_steps) or run_grpo(rl_cfg).export_dir
        timings["grpo_s"] = time.perf_counter() - t
        t = time.perf_counter()
        table["after SFT+GRPO"] = accuracy_by_dataset(with_model(cfg, grpo_dir), out / "results" / grpo_name)
        timings["eval_grpo_s"] = time.perf_counter() - t
        if args.sft_control:
            t = time.perf_counter()
            label = f"{grpo_name}-sft-control"
            control_dir = sft_control(cfg, sft_dir, control_records(out, args), out / label, args)
            timings["sft_control_s"] = time.perf_counter() - t
            t = time.perf_counter()
            table["after SFT+SFT (control)"] = accuracy_by_dataset(
                with_model(cfg, control_dir), out / "results" / label
            )
            timings["eval_sft_control_s"] = time.perf_counter() - t
    timings["total_s"] = time.perf_counter() - started

    from safetensors.torch import load_file

    params = sum(p.numel() for p in load_file(model_dir / "model.safetensors").values())
    losses = logged(Path(cfg.train.output_dir), "train/loss")
    rewards = logged(out / grpo_name, "reward/total_mean")
    print(
        f"seed {seed}: model {params / 1e6:.1f}M parameters (scale {args.scale}); options {args.option_order}; "
        f"{args.train_per_task} SFT / {args.rl_per_task} RL / {args.test_per_task} test clips per task; "
        f"SFT {len(losses)} steps of {args.sft_batch}; GRPO {len(rewards)} steps of {args.grpo_prompts} x {args.grpo_n}"
    )
    print("SFT loss, means of 50 steps:", window_means(losses, 50))
    print("GRPO mean reward, means of 10 steps:", window_means(rewards, 10))
    print({k: round(v, 1) for k, v in timings.items()})
    if tower:
        print("vision tower pre-training:", {k: tower[k] for k in ("train_accuracy", "heldout_accuracy", "best_step")})
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {
        "seed": seed,
        "parameters": params,
        "sft_losses": losses,
        "grpo_rewards": rewards,
        "table": table,
        "tower_pretraining": tower,
        "timings": timings,
        "exports": {"sft": str(sft_dir), "grpo": str(grpo_dir) if grpo_dir else None},
    }


def markdown_table(
    summary: dict[str, dict[str, dict[str, float] | None]], tasks: list[str], header: list[str], chance: bool = True
) -> str:
    """Held-out accuracy (%) per stage and task as mean ± std [min-max] over seeds, under the run's header lines."""
    from physreason.data.synth.tasks import TASKS

    lines = [*header, "", "| held-out accuracy (%) | " + " | ".join(tasks) + " |", "|---" * (len(tasks) + 1) + "|"]
    if chance:
        lines.append("| chance | " + " | ".join(f"{100 * TASKS[t].chance:.1f}" for t in tasks) + " |")
    for stage, scores in summary.items():
        lines.append(f"| {stage} | " + " | ".join(spread_text(scores.get(task)) for task in tasks) + " |")
    return "\n".join(lines) + "\n"


def combine(files: list[Path]) -> dict[str, Any]:
    """One table over the seeds of earlier runs' JSON files (each device named); written beside the first file."""
    from physreason.data.synth.tasks import LETTER_TASK_NAMES as TASKS

    runs, devices, header = combined_runs(files)
    summary = spread([run["table"] for run in runs])
    markdown = markdown_table(summary, list(TASKS), header)
    print(markdown)
    payload = {"device": devices, "header": header, "summary": summary, "per_seed": runs}
    write_results(files[0].with_name("intuitive_physics-combined"), payload, markdown)
    return payload


def main(argv: list[str] | None = None, prog: str | None = None) -> dict[str, Any] | None:
    """Run the recipe for every seed and write the table (JSON and markdown); returns the JSON payload."""
    from physreason.data.synth.tasks import LETTER_TASK_NAMES as TASKS

    args = parse_args(argv, prog)
    if args.combine:
        return combine(args.combine)
    print(apply_cpu_share().describe(), flush=True)  # threads of this seed's share of the host, before any stage
    out = args.out.resolve() / args.option_order
    started = time.perf_counter()
    timings: dict[str, float] = {}
    generate(out, args, timings)
    timings["data_s"] = time.perf_counter() - started
    if args.stop_after == "data":
        print({k: round(v, 1) for k, v in timings.items()})
        return None
    runs = [run for seed in args.seeds if (run := run_seed(args, out, seed)) is not None]
    if not runs:
        return None
    device = device_name()
    summary = spread([run["table"] for run in runs])
    header = run_header(device, args.seeds)
    markdown = markdown_table(summary, list(TASKS), header)
    print(markdown)
    payload = {
        "device": device,
        "header": header,
        "args": {k: str(v) for k, v in vars(args).items()},
        "data_timings": timings,
        "summary": summary,
        "per_seed": runs,
    }
    write_results(out / results_name("table", args), payload, markdown, out_name="intuitive_physics")
    return payload


if __name__ == "__main__":
    main()
