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
- the vision tower pre-trained first on the SFT clips with a dense loss (`--tower-steps 3000`,
  bench/intuitive_physics_tower.py), as released VLMs start from a pre-trained encoder: without it the temporal
  tasks stay at chance, because one answer letter per clip through a random language model does not train the
  tower (bench/RESULTS.md). SFT then keeps the tower fixed (`--sft-freeze-tower`; `--no-sft-freeze-tower`
  trains it too);
- SFT: 1,500 steps of 16 at lr 3e-4 with warmup, answer-only (letter) loss; the data loader (decode, resize,
  patchify on CPU, in spawned worker processes) bounds the samples per second;
- GRPO on the RL prompts with the accuracy reward at lr 3e-5, options not reshuffled.
On one H200 this recipe reaches 85.2-85.6 / 99.8 / 91.2 after SFT from random init, in 7 minutes from nothing.
Stages are resumable: a rerun with the same --out reuses the clips, a finished SFT or GRPO export, finished
evaluations, and resumes an interrupted SFT or GRPO run from its last checkpoint (every `--ckpt-every` steps).
Several GRPO variants can start from one SFT stage: each `--grpo-name` has its own run folder, prompt file and
evaluation under the same --out (`--grpo-tasks spatial_puzzle --grpo-name grpo-spatial`).
`--sft-control` adds the control row: SFT continued from the SFT export on the same RL clips (letter answers),
with GRPO's prompts per step, steps and learning rate, so a GRPO gain can be told from more supervised data.
Architecture experiments: `--family qwen3_vl` (Cosmos-Reason2's layout), `--temporal-patch N` (frames per temporal
patch of the vision tower; the released models use 2), `--tower-steps N` (0: no tower pre-training),
`--no-sft-freeze-tower` (SFT, GRPO and the control also train the tower). A variant's SFT, GRPO and control folders and evaluations carry its name
(`sft-tower3000-frozen`, `grpo-tower3000-frozen`, ...), so variants can share one --out and its clips, untrained
evaluation and pre-trained tower: `--stop-after data` only writes the clips, `--stop-after tower` also evaluates the
untrained model and pre-trains the tower, after which SFT variants can run side by side.
Prints the table and writes JSON to $OUT/intuitive_physics.json when OUT is set (and to <out>/table<variant>.json).
Run: python bench/intuitive_physics.py
     python bench/intuitive_physics.py --train-per-task 4 --rl-per-task 4 --test-per-task 2 --sft-steps 2 \
         --grpo-steps 1 --grpo-prompts 2 --scale 1 --sft-batch 4 --ckpt-every 1 --tower-steps 3  (CPU check)
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The recipe's knobs; the defaults are the recipe."""
    from physreason.data.synth.tasks import LETTER_TASK_NAMES as TASKS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-per-task", type=int, default=2000, help="SFT clips per task")
    parser.add_argument("--rl-per-task", type=int, default=1000, help="GRPO prompt clips per task (unseen by SFT)")
    parser.add_argument("--test-per-task", type=int, default=500, help="held-out clips per task")
    parser.add_argument("--option-order", choices=("fixed", "shuffled"), default="fixed")
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
    parser.add_argument("--max-pixels", type=int, default=12544, help="largest frame area fed to the model")
    parser.add_argument(
        "--tower-steps",
        type=int,
        default=3000,
        help="pre-train the vision tower on the SFT clips for this many steps before SFT "
        "(bench/intuitive_physics_tower.py; 0: no pre-training)",
    )
    parser.add_argument("--tower-lr", type=float, default=1e-3)
    parser.add_argument(
        "--sft-freeze-tower",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep the vision tower (and its merger) fixed in SFT, GRPO and the control (default: when --tower-steps "
        "pre-trained it)",
    )
    parser.add_argument("--sft-steps", type=int, default=1500)
    parser.add_argument("--sft-batch", type=int, default=16)
    parser.add_argument("--sft-lr", type=float, default=3e-4)
    parser.add_argument("--sft-warmup", type=int, default=100)
    parser.add_argument("--grpo-steps", type=int, default=100)
    parser.add_argument("--grpo-prompts", type=int, default=16, help="prompts per GRPO step")
    parser.add_argument("--grpo-n", type=int, default=8, help="completions per prompt")
    parser.add_argument("--grpo-lr", type=float, default=3e-5)
    parser.add_argument(
        "--grpo-dynamic-sampling",
        action="store_true",
        help="drop prompt groups whose completions all score the same and draw more prompts (grpo.dynamic_sampling)",
    )
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
    parser.add_argument("--ckpt-every", type=int, default=250, help="checkpoint interval of both training stages")
    parser.add_argument(
        "--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2), help="generation and data-loader processes"
    )
    parser.add_argument(
        "--loader-workers", type=int, default=None, help="SFT data-loader processes (default: --workers)"
    )
    parser.add_argument(
        "--stop-after",
        choices=("data", "tower", "sft", "grpo"),
        default="grpo",
        help="last stage to run (data: only generate the clips and records, e.g. for variants sharing them; "
        "tower: also evaluate the untrained model and pre-train its tower, for SFT variants that share it)",
    )
    parser.add_argument("--out", type=Path, default=Path("/tmp/physreason-intuitive-physics"))
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


def architecture_tag(args: argparse.Namespace) -> str:
    """The random-init model's scale, family and temporal patch, e.g. scale2, scale2-qwen3_vl, scale2-tp12."""
    family = "" if args.family == "qwen2_5_vl" else f"-{args.family}"
    patch = "" if args.temporal_patch == 2 else f"-tp{args.temporal_patch}"
    return f"scale{args.scale}{family}{patch}"


def model_folder_name(args: argparse.Namespace) -> str:
    """The random-init model's folder under --out: one per architecture, scale and temporal patch."""
    return f"model-{architecture_tag(args)}"


def variant_suffix(args: argparse.Namespace) -> str:
    """What tells this run's trained stages apart from other variants' under the same --out ("" for the recipe):
    the architecture when not the recipe's, the tower pre-training and a frozen tower. The SFT folder, its
    evaluation and the GRPO / control folders carry it, so a variant never reuses another's finished stage."""
    tag = architecture_tag(args)
    model = "" if tag == "scale2" else f"-{tag}"
    tower = f"-tower{args.tower_steps}" if args.tower_steps else ""
    frozen = "-frozen" if args.sft_freeze_tower else ""
    return f"{model}{tower}{frozen}"


def generate(out: Path, args: argparse.Namespace, timings: dict[str, float]) -> None:
    """The three clip sets of every task and the SFT / RL record files (existing clips are reused)."""
    from physreason.data.synth.generate import generate_task
    from physreason.data.synth.tasks import LETTER_TASK_NAMES as TASKS
    from physreason.demo import letter_sft_records, rl_records

    sets = (
        ("train", "train", 0, args.train_per_task),
        ("rl", "train", 1, args.rl_per_task),
        ("test", "test", 0, args.test_per_task),
    )
    for name, split, seed, n in sets:
        t = time.perf_counter()
        for task in TASKS:
            summary = generate_task(
                task, n, out / "data" / name, split, base_seed=seed, workers=args.workers, show_progress=False,
                option_order=args.option_order,
            )  # fmt: skip
            print(
                f"{name} ({split} split, seed {seed}) {task}: {summary.generated} generated, {summary.reused} reused",
                flush=True,
            )
        timings[f"data_{name}_s"] = time.perf_counter() - t
    letter_sft_records(out / "data" / "train", out / "data" / "train" / "sft.jsonl")
    rl_records(out / "data" / "rl", out / "data" / "rl" / "rl.jsonl")
    tasks = args.grpo_tasks or list(TASKS)  # parse_args checked the names
    keep_tasks(out / "data" / "rl" / "rl.jsonl", grpo_prompts(out, args), tasks)
    letter_sft_records(out / "data" / "rl", out / "data" / "rl" / "rl-sft.jsonl")
    keep_tasks(out / "data" / "rl" / "rl-sft.jsonl", control_records(out, args), tasks)


def keep_tasks(source: Path, target: Path, tasks: list[str]) -> None:
    """Copy the JSONL records of `source` whose clip (`<task>/clips/...`) belongs to one of `tasks`."""
    rows = [line for line in source.read_text().splitlines() if line.strip()]
    target.write_text("".join(row + "\n" for row in rows if json.loads(row)["video"].split("/")[0] in tasks))


def control_records(out: Path, args: argparse.Namespace) -> Path:
    """Letter-answer SFT records of the same RL clips, for --sft-control."""
    return out / "data" / "rl" / f"{args.grpo_name}-sft.jsonl"


def grpo_prompts(out: Path, args: argparse.Namespace) -> Path:
    """The GRPO prompt file of this variant: the RL clips of the --grpo-tasks."""
    return out / "data" / "rl" / f"{args.grpo_name}.jsonl"


def logged(output_dir: Path, key: str) -> list[float]:
    """Every value of `key` in a training run's metrics log, in step order (a resumed run's log continues)."""
    path = output_dir / "logs" / "metrics.jsonl"
    rows = [json.loads(line) for line in path.open()] if path.is_file() else []
    by_step = {row["step"]: row[key] for row in rows if key in row}
    return [by_step[step] for step in sorted(by_step)]


def finished_export(output_dir: Path, steps: int) -> Path | None:
    """The run's export at its last step, when a previous invocation got that far."""
    folder = output_dir / "safetensors" / f"step_{steps}"
    return folder if (folder / "model.safetensors").is_file() else None


def main() -> None:
    args = parse_args()

    import torch

    from physreason.demo import DemoSizes, _evaluate, _with_model, demo_config, grpo_config, print_table
    from physreason.models.tiny import save_tiny_model
    from physreason.train.grpo import run_grpo
    from physreason.train.sft import run_sft

    out = args.out.resolve() / args.option_order
    timings: dict[str, float] = {}
    started = time.perf_counter()
    model_dir = out / model_folder_name(args)
    if not (model_dir / "model.safetensors").is_file():
        save_tiny_model(args.family, model_dir, scale=args.scale, temporal_patch_size=args.temporal_patch)
    generate(out, args, timings)
    timings["data_s"] = time.perf_counter() - started
    if args.stop_after == "data":
        print({k: round(v, 1) for k, v in timings.items()})
        return

    sizes = DemoSizes(args.train_per_task, args.test_per_task, args.sft_steps, args.grpo_steps, max_tokens=4)
    cfg = demo_config(out, model_dir, sizes).model_copy(deep=True)
    cfg.engine.batch_size = 64
    cfg.vision.min_pixels = min(cfg.vision.min_pixels, args.max_pixels)
    cfg.vision.max_pixels = args.max_pixels
    cfg.data.num_workers = args.workers if args.loader_workers is None else args.loader_workers
    cfg.train.train_batch_per_replica = args.sft_batch
    cfg.train.mini_batch = args.sft_batch
    cfg.train.optm_lr = args.sft_lr
    cfg.train.optm_warmup_steps = args.sft_warmup
    cfg.train.optm_min_lr_factor = 0.1
    cfg.train.log_freq = 1
    cfg.train.resume = True
    cfg.train.ckpt.save_freq = args.ckpt_every
    cfg.train.freeze_vision_tower = args.sft_freeze_tower
    suffix = variant_suffix(args)
    cfg.train.output_dir = str(out / f"sft{suffix}")
    grpo_name = f"{args.grpo_name}{suffix}"

    table: dict[str, dict[str, float | None]] = {}
    t = time.perf_counter()
    table["untrained model"] = _evaluate(cfg, "base", out / "results")  # resumable: finished clips are kept
    timings["eval_base_s"] = time.perf_counter() - t
    tower: dict | None = None
    if args.tower_steps:
        from intuitive_physics_tower import pretrain_tower

        t = time.perf_counter()
        tower_dir = out / f"{model_dir.name}-tower{args.tower_steps}"
        done = tower_dir / "tower_pretraining.json"
        tower = json.loads(done.read_text()) if done.is_file() else pretrain_tower(
            model_dir, out / "data" / "train", tower_dir, cfg.vision.model_dump(), args.tower_steps, args.tower_lr,
            workers=cfg.data.num_workers,
        )  # fmt: skip
        cfg = _with_model(cfg, tower_dir)
        timings["tower_s"] = time.perf_counter() - t
    if args.stop_after == "tower":
        print({k: round(v, 1) for k, v in timings.items()})
        return
    t = time.perf_counter()
    sft_dir = finished_export(Path(cfg.train.output_dir), args.sft_steps) or run_sft(cfg).export_dir
    timings["sft_s"] = time.perf_counter() - t
    t = time.perf_counter()
    table["after SFT"] = _evaluate(_with_model(cfg, sft_dir), f"sft{suffix}", out / "results")
    timings["eval_sft_s"] = time.perf_counter() - t
    grpo_dir = None
    if args.stop_after == "grpo":
        t = time.perf_counter()
        rl_cfg = grpo_config(cfg, out, sft_dir, sizes)
        rl_cfg.data.dataset.name = str(grpo_prompts(out, args))
        rl_cfg.train.output_dir = str(out / grpo_name)
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
        # The SFT prompts list options in the generated order; reshuffling them would ask a new question.
        rl_cfg.grpo.shuffle_options = args.option_order == "shuffled"
        grpo_dir = finished_export(Path(rl_cfg.train.output_dir), args.grpo_steps) or run_grpo(rl_cfg).export_dir
        timings["grpo_s"] = time.perf_counter() - t
        t = time.perf_counter()
        table["after SFT+GRPO"] = _evaluate(_with_model(cfg, grpo_dir), grpo_name, out / "results")
        timings["eval_grpo_s"] = time.perf_counter() - t
        if args.sft_control:
            t = time.perf_counter()
            ctl_cfg = _with_model(cfg, sft_dir).model_copy(deep=True)
            ctl_cfg.data.dataset.name = str(control_records(out, args))
            ctl_cfg.train.output_dir = str(out / f"{grpo_name}-sft-control")
            ctl_cfg.train.max_steps = args.grpo_steps
            ctl_cfg.train.train_batch_per_replica = args.grpo_prompts
            ctl_cfg.train.mini_batch = args.grpo_prompts
            ctl_cfg.train.optm_lr = args.grpo_lr
            ctl_cfg.train.optm_warmup_steps = 0
            ctl_cfg.train.optm_decay_type = "constant"
            ctl_cfg.train.ckpt.save_freq = min(args.ckpt_every, args.grpo_steps)
            control_dir = (
                finished_export(Path(ctl_cfg.train.output_dir), args.grpo_steps) or run_sft(ctl_cfg).export_dir
            )
            timings["sft_control_s"] = time.perf_counter() - t
            t = time.perf_counter()
            label = f"{grpo_name}-sft-control"
            table["after SFT+SFT (control)"] = _evaluate(_with_model(cfg, control_dir), label, out / "results")
            timings["eval_sft_control_s"] = time.perf_counter() - t
    timings["total_s"] = time.perf_counter() - started

    from safetensors.torch import load_file

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    params = sum(p.numel() for p in load_file(model_dir / "model.safetensors").values())
    losses = logged(Path(cfg.train.output_dir), "train/loss")
    rewards = logged(out / grpo_name, "reward/total_mean")
    window = 50
    curve = {
        step: round(sum(losses[step - window : step]) / window, 4)
        for step in range(window, len(losses) + 1, max(window, len(losses) // 10))
    }
    reward_curve = {
        step: round(sum(rewards[max(0, step - 10) : step]) / len(rewards[max(0, step - 10) : step]), 3)
        for step in range(10, len(rewards) + 1, max(10, len(rewards) // 10))
    }
    print(
        f"device {device}; model {params / 1e6:.1f}M parameters (scale {args.scale}); options {args.option_order}; "
        f"{args.train_per_task} SFT / {args.rl_per_task} RL / {args.test_per_task} test clips per task; "
        f"SFT {len(losses)} steps of {args.sft_batch}; GRPO {len(rewards)} steps of {args.grpo_prompts} x {args.grpo_n}"
    )
    print(f"SFT loss, mean of the {window} steps before:", curve)
    print("GRPO mean reward, mean of the 10 steps before:", reward_curve)
    print({k: round(v, 1) for k, v in timings.items()})
    if tower:
        print("vision tower pre-training:", {k: tower[k] for k in ("train_accuracy", "heldout_accuracy", "loss_curve")})
    print_table(table, args.test_per_task)
    payload = {
        "device": device,
        "args": {k: str(v) for k, v in vars(args).items()},
        "parameters": params,
        "sft_losses": losses,
        "grpo_rewards": rewards,
        "table": table,
        "tower_pretraining": tower,
        "timings": timings,
        "exports": {"sft": str(sft_dir), "grpo": str(grpo_dir) if grpo_dir else None},
    }
    (out / f"table{suffix}.json").write_text(json.dumps(payload, indent=2))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "intuitive_physics.json").write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
