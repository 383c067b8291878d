"""What the learning experiments share: the recipe's knobs, the random-init model, its tower pre-training, the SFT,
GRPO and control stages' settings, resumable stages, seeds and their spread, and the results files.

`physreason.experiments.intuitive_physics` (the letter tasks) and `physreason.experiments.grounding` (the JSON-answer
tasks) are built on these, and on the demo's recipe (physreason.demo) as their base.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from physreason.cpu import cpu_share
from physreason.train.tower import HEAD_INPUTS


def seed_list(text: str) -> list[int]:
    """`--seeds 1,2,3` as [1, 2, 3]: distinct non-negative integers."""
    try:
        seeds = [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seeds {text!r}: give comma-separated integers such as 1,2,3") from None
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise argparse.ArgumentTypeError(f"--seeds {text!r}: give distinct non-negative integers such as 1,2,3")
    return seeds


@dataclass(frozen=True)
class Recipe:
    """An experiment's recipe for the shared knobs that name its folders: their defaults, and what variant_suffix
    leaves out of folder names (a run of the recipe's settings carries none of their tags)."""

    tower_head: str = "time"
    """What the tower pre-training's linear head sees (physreason.train.tower.HEAD_INPUTS)."""
    sft_steps: int = 1500
    """SFT optimizer steps."""
    train_per_task: int = 2000
    """SFT clips per task."""
    rl_per_task: int = 1000
    """GRPO prompt clips per task."""


def add_recipe_arguments(parser: argparse.ArgumentParser, results: str, out: Path, recipe: Recipe) -> None:
    """The knobs of the stages the intuitive-physics and grounding experiments share: clip counts, the from-scratch
    model, the tower pre-training's schedule, SFT and GRPO settings, seeds, processes, the output folder (default
    `out`) and --combine of earlier runs' $OUT/<results>.json. The defaults are the recipe's, `recipe` those the
    experiments set apart; it is kept as args.recipe, which folder names are relative to (variant_suffix)."""
    parser.set_defaults(recipe=recipe)
    parser.add_argument(
        "--train-per-task",
        type=int,
        default=recipe.train_per_task,
        help="SFT clips per task: the labelled answers SFT sees (fewer than --rl-per-task: fewer SFT labels than RL "
        "prompts)",
    )
    parser.add_argument(
        "--rl-per-task",
        type=int,
        default=recipe.rl_per_task,
        help="GRPO prompt clips per task (unseen by SFT; the control's labelled answers)",
    )
    parser.add_argument("--scale", type=int, default=2, help="model size multiplier of the tiny architecture")
    parser.add_argument(
        "--family",
        choices=("qwen2_5_vl", "qwen3_vl"),
        default="qwen2_5_vl",
        help="architecture of the from-scratch model: Cosmos-Reason1's Qwen2.5-VL or Cosmos-Reason2's Qwen3-VL",
    )
    parser.add_argument(
        "--temporal-patch",
        type=int,
        default=2,
        help="frames per temporal patch of the vision tower (2 in the released models; 12 puts a whole 12-frame "
        "clip into each patch)",
    )
    parser.add_argument("--tower-lr", type=float, default=1e-3)
    parser.add_argument(
        "--tower-head",
        choices=HEAD_INPUTS,
        default=recipe.tower_head,
        help="what the tower pre-training's linear head sees: 'time' the merged tokens averaged per temporal patch, "
        "'tokens' every merged token in place, the frame's layout kept (physreason/train/tower.py); the tower's "
        "folder carries -tokens, and the SFT, GRPO and control folders of a head other than the recipe's carry its "
        "name",
    )
    parser.add_argument(
        "--tower-eval-every", type=int, default=100, help="score the tower's held-out tenth every N steps"
    )
    parser.add_argument(
        "--tower-patience",
        type=int,
        default=1000,
        help="stop the tower pre-training after N steps without a better held-out score (0: run every step); the "
        "best-scoring tower is kept either way",
    )
    parser.add_argument(
        "--seeds",
        type=seed_list,
        default=[0],
        help="initialisation seeds, comma-separated (e.g. 1,2,3): the model's random weights, the tower's head, "
        "held-out split and batches, SFT's data order and GRPO's sampling; the clips are the same for every seed. "
        "Each seed runs every stage; the table reports mean, std, min and max over seeds",
    )
    parser.add_argument(
        "--sft-steps",
        type=int,
        default=recipe.sft_steps,
        help="SFT steps (fewer: GRPO from an SFT stopped early, against its control; folders of a length other than "
        "the recipe's carry -sft<N>)",
    )
    parser.add_argument("--sft-batch", type=int, default=16)
    parser.add_argument("--sft-lr", type=float, default=3e-4)
    parser.add_argument("--sft-warmup", type=int, default=100)
    parser.add_argument("--grpo-steps", type=int, default=100)
    parser.add_argument("--grpo-n", type=int, default=8, help="completions per prompt")
    parser.add_argument("--grpo-lr", type=float, default=3e-5, help="GRPO's and the control's learning rate")
    parser.add_argument(
        "--grpo-dynamic-sampling",
        action="store_true",
        help="drop prompt groups whose completions all score the same and draw more prompts (grpo.dynamic_sampling)",
    )
    parser.add_argument("--ckpt-every", type=int, default=250, help="checkpoint interval of both training stages")
    parser.add_argument(
        "--rollout-static-cache",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="GRPO's rollouts on the hf engine's static KV cache (engine.hf_static_cache: on a GPU transformers "
        "compiles the decode step into CUDA graphs once per run, ~30 s, instead of launching each of a step's ~340 "
        "kernels per token; the same completions: tests/test_decode_ahead.py). Default: on where CUDA is (a GRPO "
        "step 0.91 s against 1.25 s on an H100, bench/RESULTS.md), off on CPU. Evaluations keep the dynamic cache",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=max(1, cpu_share().threads - 2),
        help="generation and data-loader processes (default: this process's share of the host's CPUs less 2: "
        "seeds side by side one a GPU share the host, see physreason/cpu.py; two on one GPU set "
        "PHYSREASON_HOST_PROCESSES=2)",
    )
    parser.add_argument(
        "--loader-workers", type=int, default=None, help="SFT data-loader processes (default: --workers)"
    )
    parser.add_argument("--out", type=Path, default=out)
    parser.add_argument(
        "--combine",
        nargs="+",
        type=Path,
        metavar="JSON",
        help=f"only join the tables of runs written earlier ($OUT/{results}.json, one or more seeds each, e.g. from "
        "separate GPU leases) into one table over all their seeds, written beside the first file",
    )


def architecture_tag(args: argparse.Namespace) -> str:
    """The random-init model's scale, family and temporal patch, e.g. scale2, scale2-qwen3_vl, scale2-tp12."""
    family = "" if args.family == "qwen2_5_vl" else f"-{args.family}"
    patch = "" if args.temporal_patch == 2 else f"-tp{args.temporal_patch}"
    return f"scale{args.scale}{family}{patch}"


def seed_tag(seed: int) -> str:
    """Folder-name tag of an initialisation seed: "" for seed 0 (the folders of runs before --seeds), else -seedN."""
    return f"-seed{seed}" if seed else ""


def model_folder_name(args: argparse.Namespace, seed: int = 0) -> str:
    """The random-init model's folder under --out: one per architecture, scale, temporal patch and seed."""
    return f"model-{architecture_tag(args)}{seed_tag(seed)}"


def tower_tag(args: argparse.Namespace) -> str:
    """The tower folder's part of its name: its steps, and -tokens when its head saw every token. Not relative to a
    recipe, as the SFT folders are: a tower folder's name says which tower it holds in every experiment, so that no
    run reuses another head's tower, and the mean head's towers keep the names they had before --tower-head."""
    return f"-tower{args.tower_steps}" + ("" if args.tower_head == "time" else f"-{args.tower_head}")


def variant_suffix(args: argparse.Namespace, seed: int = 0) -> str:
    """What tells this run's trained stages apart from other variants' under the same --out ("" for the recipe):
    the architecture when not the recipe's, the tower pre-training (its steps, its head when not the experiment's
    recipe's), a frozen tower, SFT / RL clip counts other than the recipe's (`--train-per-task 250`: fewer SFT
    labels; the clip files hold the first N clips, so a count alone would not tell the runs apart), an SFT length
    other than the recipe's (`--sft-steps 300`: GRPO from an SFT stopped early) and the seed. The SFT folder, its
    evaluation and the GRPO / control folders carry it, so a variant never reuses another's finished stage. The
    settings set apart by experiment are compared with that experiment's recipe (args.recipe, add_recipe_arguments).
    """
    recipe: Recipe = args.recipe
    tag = architecture_tag(args)
    model = "" if tag == "scale2" else f"-{tag}"
    head = "" if args.tower_head == recipe.tower_head else f"-{args.tower_head}"
    tower = f"-tower{args.tower_steps}{head}" if args.tower_steps else ""
    frozen = "-frozen" if args.sft_freeze_tower else ""
    train = "" if args.train_per_task == recipe.train_per_task else f"-train{args.train_per_task}"
    rl = "" if args.rl_per_task == recipe.rl_per_task else f"-rl{args.rl_per_task}"
    sft = "" if args.sft_steps == recipe.sft_steps else f"-sft{args.sft_steps}"
    return f"{model}{tower}{frozen}{train}{rl}{sft}{seed_tag(seed)}"


def generate_clip_sets(
    out: Path, sets: list[tuple[str, str, int, int, Sequence[str]]], args: argparse.Namespace
) -> dict[str, float]:
    """Each clip set (folder under out/data, split, base seed, clips per task, tasks) with `args.option_order`, its
    existing clips reused; returns the seconds each set took, as data_<folder>_s."""
    from physreason.data.synth.generate import generate_task

    timings = {}
    for name, split, seed, n, tasks in sets:
        t = time.perf_counter()
        for task in tasks:
            summary = generate_task(
                task, n, out / "data" / name, split, base_seed=seed, workers=args.workers, show_progress=False,
                option_order=args.option_order,
            )  # fmt: skip
            print(
                f"{name} ({split} split, seed {seed}) {task}: {summary.generated} generated, {summary.reused} reused",
                flush=True,
            )
        timings[f"data_{name}_s"] = time.perf_counter() - t
    return timings


def logged(output_dir: Path, key: str) -> list[float]:
    """Every value of `key` in a training run's metrics log, in step order (a resumed run's log continues).

    A torn last line (a run killed mid-write) is skipped; a corrupt line elsewhere is InputError naming it.
    """
    from physreason.train.metrics import read_records

    path = output_dir / "logs" / "metrics.jsonl"
    rows = read_records(path) if path.is_file() else []
    by_step = {row["step"]: row[key] for row in rows if key in row}
    return [by_step[step] for step in sorted(by_step)]


def finished_export(output_dir: Path, steps: int) -> Path | None:
    """The run's export at its last step, when a previous invocation got that far."""
    folder = output_dir / "safetensors" / f"step_{steps}"
    return folder if (folder / "model.safetensors").is_file() else None


def sft_stage(cfg: Any, steps: int) -> Path:
    """cfg's SFT export at `steps`: a previous invocation's when it finished, else trained (an interrupted run
    resumed from its last checkpoint). A run folder that holds a run of another start or length stops the run first
    (refuse_other_run)."""
    from physreason.train.sft import run_sft

    refuse_other_run(cfg)
    return finished_export(Path(cfg.train.output_dir), steps) or run_sft(cfg).export_dir


def refuse_other_run(cfg: Any) -> None:
    """Stop the run when cfg's run folder holds a run that started from a model folder of another name (another
    tower, seed or architecture) or ran another number of steps: resuming it would continue the other run, and its
    finished export would pass for this variant's.

    A folder's name is relative to the recipe of the day it was written: the intuitive-physics recipe's tower head
    and SFT length changed on 2026-11-27, so its earlier mean-head folders bear the names of other settings now.
    """
    import tomllib

    recorded = Path(cfg.train.output_dir) / "config.toml"
    if not recorded.is_file():
        return
    earlier = tomllib.loads(recorded.read_text(encoding="utf-8"))
    model = earlier.get("model", {}).get("model_name_or_path", "")
    steps = earlier.get("train", {}).get("max_steps")
    if Path(model).name != Path(cfg.model.model_name_or_path).name or steps != cfg.train.max_steps:
        raise SystemExit(
            f"{recorded.parent} holds a run of {steps} steps from {model}, not of {cfg.train.max_steps} from "
            f"{cfg.model.model_name_or_path}: a run of other settings under this variant's name, such as one written "
            f"before the recipe changed. Move it and results/{recorded.parent.name} aside, or use another --out"
        )


def stage_config(args: argparse.Namespace, out: Path, model_dir: Path, seed: int) -> Any:
    """The recipe's configuration of every stage for one seed (SFT settings; evaluation on the test clips)."""
    from physreason.data.synth.tasks import LETTER_TASK_NAMES as TASKS
    from physreason.demo import DemoSizes, demo_config

    sizes = DemoSizes(
        args.train_per_task, args.test_per_task, args.sft_steps, args.grpo_steps, max_tokens=4, sft_tasks=TASKS
    )
    cfg = demo_config(out, model_dir, sizes).model_copy(deep=True)
    # Requests per generate call. A from-scratch model's decode step costs about the same at 64 rows or 512 (on a GPU
    # it is a few milliseconds of kernel launches), and an evaluation's data sets share calls (evaluate_shards): 150
    # test clips a task are one call of ~128 steps, not six. GRPO's rounds are one call either way.
    cfg.engine.batch_size = 512
    cfg.vision.min_pixels = min(cfg.vision.min_pixels, args.max_pixels)
    cfg.vision.max_pixels = args.max_pixels
    cfg.data.num_workers = args.workers if args.loader_workers is None else args.loader_workers
    cfg.train.seed += seed  # seed 0 keeps the schema's default: the runs before --seeds
    if seed:  # evaluations name the run's seed (greedy answers do not depend on it); seed 0 keeps its folders' seed_1
        cfg.eval.seed = seed
    cfg.train.train_batch_per_replica = args.sft_batch
    cfg.train.mini_batch = args.sft_batch
    cfg.train.optm_lr = args.sft_lr
    cfg.train.optm_warmup_steps = args.sft_warmup
    cfg.train.optm_min_lr_factor = 0.1
    cfg.train.log_freq = 1
    cfg.train.resume = True
    cfg.train.ckpt.save_freq = args.ckpt_every
    cfg.train.freeze_vision_tower = args.sft_freeze_tower
    return cfg


def build_model(args: argparse.Namespace, out: Path, seed: int) -> Path:
    """The random-init model of this seed under `out` (kept when it exists)."""
    from physreason.models.tiny import save_tiny_model

    model_dir = out / model_folder_name(args, seed)
    if not (model_dir / "model.safetensors").is_file():
        save_tiny_model(args.family, model_dir, seed=seed, scale=args.scale, temporal_patch_size=args.temporal_patch)
    return model_dir


def tower_stage(args: argparse.Namespace, model_dir: Path, data_root: Path, cfg: Any, seed: int) -> tuple[Path, dict]:
    """Pre-train `model_dir`'s tower on the letter SFT records under `data_root` (a finished one is reused)."""
    from physreason.train.tower import pretrain_tower

    tower_dir = model_dir.parent / f"{model_dir.name}{tower_tag(args)}"
    done = tower_dir / "tower_pretraining.json"
    if done.is_file():
        return tower_dir, json.loads(done.read_text())
    result = pretrain_tower(
        model_dir, data_root, tower_dir, cfg.vision.model_dump(), args.tower_steps, args.tower_lr,
        workers=cfg.data.num_workers, seed=seed, eval_every=args.tower_eval_every, patience=args.tower_patience,
        head_input=args.tower_head,
    )  # fmt: skip
    return tower_dir, result


def sft_control(cfg: Any, sft_dir: Path, records: Path, output_dir: Path, args: argparse.Namespace) -> Path:
    """The control: SFT continued from `sft_dir` on `records` with GRPO's prompts per step, steps and (constant) lr."""
    from physreason.config import with_model
    from physreason.train.sft import run_sft

    ctl_cfg = with_model(cfg, sft_dir).model_copy(deep=True)
    ctl_cfg.data.dataset.name = str(records)
    ctl_cfg.train.output_dir = str(output_dir)
    ctl_cfg.train.max_steps = args.grpo_steps
    ctl_cfg.train.train_batch_per_replica = args.grpo_prompts
    ctl_cfg.train.mini_batch = args.grpo_prompts
    ctl_cfg.train.optm_lr = args.grpo_lr
    ctl_cfg.train.optm_warmup_steps = 0
    ctl_cfg.train.optm_decay_type = "constant"
    ctl_cfg.train.ckpt.save_freq = min(args.ckpt_every, args.grpo_steps)
    return finished_export(output_dir, args.grpo_steps) or run_sft(ctl_cfg).export_dir


def grpo_stage_config(
    args: argparse.Namespace, cfg: Any, out: Path, sft_dir: Path, prompts: Path, output_dir: Path
) -> Any:
    """GRPO from `sft_dir` on `prompts`: the experiment's prompts per step, group size, lr and checkpointing."""
    from physreason.data.synth.tasks import LETTER_TASK_NAMES as TASKS
    from physreason.demo import DemoSizes, grpo_config

    sizes = DemoSizes(
        args.train_per_task, args.test_per_task, args.sft_steps, args.grpo_steps, max_tokens=4, sft_tasks=TASKS
    )
    rl_cfg = grpo_config(cfg, out, sft_dir, sizes)
    rl_cfg.data.dataset.name = str(prompts)
    rl_cfg.train.output_dir = str(output_dir)
    rl_cfg.train.seed = cfg.train.seed
    rl_cfg.train.freeze_vision_tower = args.sft_freeze_tower  # as SFT trained it, and as the control continues
    rl_cfg.train.optm_lr = args.grpo_lr
    rl_cfg.train.train_batch_per_replica = args.grpo_prompts * args.grpo_n
    rl_cfg.train.resume = True
    rl_cfg.train.log_freq = 1
    rl_cfg.train.ckpt.save_freq = min(args.ckpt_every, args.grpo_steps)
    rl_cfg.rollout.n_generation = args.grpo_n
    rl_cfg.rollout.batch_size = args.grpo_prompts
    rl_cfg.grpo.mini_batch = 64
    rl_cfg.grpo.dynamic_sampling = args.grpo_dynamic_sampling
    # a copy: grpo_config shares the stages' engine settings, which the evaluations use
    static = args.rollout_static_cache
    if static is None:  # on a GPU the compiled decode step pays (bench/RESULTS.md); on CPU it only compiles
        import torch

        static = torch.cuda.is_available()
    rl_cfg.engine = rl_cfg.engine.model_copy(update={"hf_static_cache": static})
    return rl_cfg


def window_means(values: list[float], window: int) -> dict[int, float]:
    """Means of the `window` values before about ten evenly spaced steps (a curve in a line of output)."""
    return {
        step: round(sum(values[max(0, step - window) : step]) / len(values[max(0, step - window) : step]), 4)
        for step in range(window, len(values) + 1, max(window, len(values) // 10))
    }


def spread(tables: list[dict[str, dict[str, float | None]]]) -> dict[str, dict[str, dict[str, float] | None]]:
    """Per stage and task, the mean, sample std (0 with one seed), min and max over seeds' values, and their count.

    A stage or task missing from some seeds' tables is summarised over the seeds that have it; None when none has.
    """
    stages = list(dict.fromkeys(stage for table in tables for stage in table))
    summary: dict[str, dict[str, dict[str, float] | None]] = {}
    for stage in stages:
        tasks = list(dict.fromkeys(task for table in tables for task in table.get(stage, {})))
        summary[stage] = {}
        for task in tasks:
            values = [v for table in tables if (v := table.get(stage, {}).get(task)) is not None]
            summary[stage][task] = seed_stats(values) if values else None
    return summary


def seed_stats(values: list[float]) -> dict[str, float]:
    """mean, sample std (0 for one value), min, max and n of per-seed values."""
    import statistics

    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def run_header(device: str, seeds: list[int]) -> list[str]:
    """The lines every results table starts with: device, date, command and seeds."""
    from datetime import UTC, datetime

    return [
        f"- device: {device}",
        f"- date: {datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- command: `{command_line()}`",
        f"- seeds: {', '.join(map(str, seeds))}",
    ]


def command_line() -> str:
    """The command that is running, as a user would type it again: `physreason experiment ...` when started through
    the physreason command (its entry point or `python -m physreason`), else `python <script> ...`."""
    import shlex
    import sys

    script = Path(sys.argv[0])
    if script.name == "physreason" or (script.name == "__main__.py" and script.parent.name == "physreason"):
        return shlex.join(["physreason", *sys.argv[1:]])
    return f"python {shlex.join(sys.argv)}"


def spread_text(stats: dict[str, float] | None, scale: float = 100.0) -> str:
    """`mean ± std [min-max]` in percent, or the value alone for one seed, or - when missing."""
    if stats is None:
        return "-"
    if stats["n"] == 1:
        return f"{scale * stats['mean']:.1f}"
    return (
        f"{scale * stats['mean']:.1f} ± {scale * stats['std']:.1f} "
        f"[{scale * stats['min']:.1f}-{scale * stats['max']:.1f}]"
    )


def device_name() -> str:
    """The GPU's name (torch.cuda.get_device_name), or cpu."""
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def combined_runs(files: list[Path]) -> tuple[list[dict[str, Any]], str, list[str]]:
    """The per-seed runs of earlier runs' JSON files, their devices (joined by " / ") and the combined table's header
    lines; a seed in more than one file stops the run, as the pooled statistics would count it twice."""
    payloads = [json.loads(path.read_text()) for path in files]
    runs = [run for payload in payloads for run in payload["per_seed"]]
    seeds = [run["seed"] for run in runs]
    if len(set(seeds)) != len(seeds):
        raise SystemExit(f"--combine: seed {max(seeds, key=seeds.count)} is in more than one file; give each seed once")
    devices = " / ".join(sorted({payload["device"] for payload in payloads}))
    header = [f"- combined from: {', '.join(str(path) for path in files)}", *run_header(devices, seeds)]
    return runs, devices, header


def results_name(prefix: str, args: argparse.Namespace) -> str:
    """The file name (no suffix) of a run's table: `prefix`, the variant, and the seeds unless only seed 0 ran."""
    seeds = "-seeds" + "_".join(map(str, args.seeds)) if args.seeds != [0] else ""
    return f"{prefix}{variant_suffix(args)}{seeds}"


def write_results(stem: Path, payload: dict[str, Any], markdown: str, out_name: str | None = None) -> None:
    """`payload` as stem.json and `markdown` as stem.md, and as $OUT/<out_name>.{json,md} when OUT is set (the GPU
    lease's folder that comes back) and out_name is given."""
    stem.with_suffix(".json").write_text(json.dumps(payload, indent=2))
    stem.with_suffix(".md").write_text(markdown)
    if out_name and os.environ.get("OUT"):
        write_results(Path(os.environ["OUT"], out_name), payload, markdown)
