"""Intuitive-physics table on a GPU: a small Qwen2.5-VL-architecture model trained from scratch with SFT, then GRPO.

The analogue of the Cosmos-Reason1 paper's intuitive-physics table (arrow of time, spatial puzzle,
object permanence): held-out accuracy of chance, the untrained model, after SFT and after SFT+GRPO.
Every stage is physreason's own: `data synth` clips, letter-answer SFT records built from the benchmark
records, `run_sft`, `run_grpo` (hf engine for rollouts), and the evaluation runner. The model is the tiny
architecture scaled up (`--scale`; random init, the tiny BPE tokenizer), so it learns from pixels alone.
Train and test clips come from disjoint scene seeds (`data synth` splits).

Recipe (defaults) for a model with no pretraining:
- `--option-order fixed`: every question lists the same options in the same order, with the classes balanced,
  so the letter says nothing by itself (chance stays 50 / 25 / 50). With shuffled letters the answer is an
  XOR of the clip and the option order, which a from-scratch model does not learn in this budget.
- small frames (`--max-pixels`, 84x112 from the 256x192 clips: 12 tokens per pair of frames, 72 per clip),
  many small optimizer steps at a high learning rate with warmup, answer-only (letter) loss; the data
  loader (decode, resize, patchify on CPU) bounds the samples per second, so steps beat batch size;
- GRPO at a low learning rate on the same letter prompts, options not reshuffled.
Prints the table and writes JSON to $OUT/intuitive_physics.json when OUT is set.
Run: python bench/intuitive_physics.py
     python bench/intuitive_physics.py --train-per-task 4 --test-per-task 2 --sft-steps 2 --grpo-steps 1 --scale 1 --sft-batch 4  (CPU check)
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def parse_args() -> argparse.Namespace:
    """The recipe's knobs; the defaults are the recipe."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-per-task", type=int, default=1500)
    parser.add_argument("--test-per-task", type=int, default=200)
    parser.add_argument("--option-order", choices=("fixed", "shuffled"), default="fixed")
    parser.add_argument("--scale", type=int, default=2, help="model size multiplier of the tiny architecture")
    parser.add_argument("--max-pixels", type=int, default=12544, help="largest frame area fed to the model")
    parser.add_argument("--sft-steps", type=int, default=2000)
    parser.add_argument("--sft-batch", type=int, default=16)
    parser.add_argument("--sft-lr", type=float, default=1e-3)
    parser.add_argument("--sft-warmup", type=int, default=100)
    parser.add_argument("--grpo-steps", type=int, default=15)
    parser.add_argument("--grpo-lr", type=float, default=1e-5)
    parser.add_argument(
        "--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2), help="generation and data-loader processes"
    )
    parser.add_argument("--loader-workers", type=int, default=None, help="SFT data-loader processes (default: --workers)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/physreason-intuitive-physics"))
    return parser.parse_args()


def main() -> None:
    args = parse_args()

    import torch

    from physreason.data.synth.generate import generate_task
    from physreason.demo import (
        TASKS,
        DemoSizes,
        _evaluate,
        _with_model,
        demo_config,
        grpo_config,
        letter_sft_records,
        print_table,
        rl_records,
    )
    from physreason.models.tiny import save_tiny_model
    from physreason.train.grpo import run_grpo
    from physreason.train.sft import run_sft

    out = args.out.resolve() / args.option_order
    timings: dict[str, float] = {}
    started = time.perf_counter()
    model_dir = out / f"model-scale{args.scale}"
    if not (model_dir / "model.safetensors").is_file():
        save_tiny_model("qwen2_5_vl", model_dir, scale=args.scale)
    for split, n in (("train", args.train_per_task), ("test", args.test_per_task)):
        for task in TASKS:
            t = time.perf_counter()
            summary = generate_task(
                task, n, out / "data" / split, split, base_seed=0, workers=args.workers, show_progress=False,
                option_order=args.option_order,
            )  # fmt: skip
            timings[f"data_{split}_{task}_s"] = time.perf_counter() - t
            print(
                f"{split} {task}: {summary.generated} generated, {summary.reused} reused "
                f"({timings[f'data_{split}_{task}_s']:.1f} s)",
                flush=True,
            )
    letter_sft_records(out / "data" / "train", out / "data" / "train" / "sft.jsonl")
    rl_records(out / "data" / "train", out / "data" / "train" / "rl.jsonl")
    timings["data_s"] = time.perf_counter() - started

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
    cfg.train.log_freq = 50
    cfg.train.ckpt.save_freq = args.sft_steps

    table: dict[str, dict[str, float | None]] = {}
    t = time.perf_counter()
    table["untrained model"] = _evaluate(cfg, "base", out / "results")
    timings["eval_base_s"] = time.perf_counter() - t
    t = time.perf_counter()
    sft = run_sft(cfg)
    timings["sft_s"] = time.perf_counter() - t
    t = time.perf_counter()
    table["after SFT"] = _evaluate(_with_model(cfg, sft.export_dir), "sft", out / "results")
    timings["eval_sft_s"] = time.perf_counter() - t
    t = time.perf_counter()
    rl_cfg = grpo_config(cfg, out, sft.export_dir, sizes)
    rl_cfg.train.optm_lr = args.grpo_lr
    rl_cfg.train.train_batch_per_replica = 64
    rl_cfg.rollout.n_generation = 8
    rl_cfg.rollout.batch_size = 8
    rl_cfg.grpo.mini_batch = 64
    # The SFT prompts list options in the generated order; reshuffling them would ask a new question.
    rl_cfg.grpo.shuffle_options = args.option_order == "shuffled"
    rl = run_grpo(rl_cfg)
    timings["grpo_s"] = time.perf_counter() - t
    t = time.perf_counter()
    table["after SFT+GRPO"] = _evaluate(_with_model(cfg, rl.export_dir), "grpo", out / "results")
    timings["eval_grpo_s"] = time.perf_counter() - t
    timings["total_s"] = time.perf_counter() - started

    from safetensors.torch import load_file

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    params = sum(p.numel() for p in load_file(model_dir / "model.safetensors").values())
    curve = {
        step: round(sum(sft.losses[max(0, step - 50) : step]) / len(sft.losses[max(0, step - 50) : step]), 4)
        for step in range(50, len(sft.losses) + 1, max(50, len(sft.losses) // 10))
    }
    print(
        f"device {device}; model {params / 1e6:.1f}M parameters (scale {args.scale}); options {args.option_order}; "
        f"{args.train_per_task} train / {args.test_per_task} test clips per task; SFT {len(sft.losses)} steps of "
        f"{args.sft_batch} (loss {sft.losses[0]:.3f} -> {sft.losses[-1]:.3f}); GRPO {len(rl.rewards)} steps "
        f"(reward {rl.rewards[0]:.3f} -> {rl.rewards[-1]:.3f})"
    )
    print("SFT loss, mean of the 50 steps before:", curve)
    print({k: round(v, 1) for k, v in timings.items()})
    print_table(table, args.test_per_task)
    if os.environ.get("OUT"):
        payload = {
            "device": device,
            "args": {k: str(v) for k, v in vars(args).items()},
            "parameters": params,
            "sft_losses": sft.losses,
            "grpo_rewards": rl.rewards,
            "table": table,
            "timings": timings,
        }
        Path(os.environ["OUT"], "intuitive_physics.json").write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
