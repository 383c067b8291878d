"""Intuitive-physics table on a GPU: a small Qwen2.5-VL-architecture model trained from scratch with SFT, then GRPO.

The analogue of the Cosmos-Reason1 paper's intuitive-physics table (arrow of time, spatial puzzle,
object permanence): held-out accuracy of chance, the untrained model, after SFT and after SFT+GRPO.
Every stage is physreason's own: `data synth` clips, letter-answer SFT records built from the benchmark
records, `run_sft`, `run_grpo` (hf engine for rollouts), and the evaluation runner. The model is the tiny
architecture scaled up (`--scale`; random init, the tiny BPE tokenizer), so it learns from pixels alone.
Prints the table and writes JSON to $OUT/intuitive_physics.json when OUT is set.
Run: python bench/intuitive_physics.py [--train-per-task 1000] [--test-per-task 150] [--scale 4]
     python bench/intuitive_physics.py --train-per-task 4 --test-per-task 2 --sft-epochs 1 --grpo-steps 1 --scale 1  (CPU check)
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-per-task", type=int, default=1000)
    parser.add_argument("--test-per-task", type=int, default=150)
    parser.add_argument("--scale", type=int, default=4, help="model size multiplier of the tiny architecture")
    parser.add_argument("--sft-epochs", type=int, default=2)
    parser.add_argument("--sft-batch", type=int, default=32)
    parser.add_argument("--sft-lr", type=float, default=5e-4)
    parser.add_argument("--grpo-steps", type=int, default=30)
    parser.add_argument("--grpo-lr", type=float, default=5e-5)
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    parser.add_argument("--out", type=Path, default=Path("/tmp/physreason-intuitive-physics"))
    args = parser.parse_args()

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

    out = args.out.resolve()
    timings: dict[str, float] = {}
    started = time.perf_counter()
    model_dir = out / "model"
    if not (model_dir / "model.safetensors").is_file():
        save_tiny_model("qwen2_5_vl", model_dir, scale=args.scale)
    for split, n in (("train", args.train_per_task), ("test", args.test_per_task)):
        for task in TASKS:
            generate_task(task, n, out / "data" / split, split, base_seed=0, workers=args.workers, show_progress=False)
    letter_sft_records(out / "data" / "train", out / "data" / "train" / "sft.jsonl")
    rl_records(out / "data" / "train", out / "data" / "train" / "rl.jsonl")
    timings["data_s"] = time.perf_counter() - started

    steps = args.sft_epochs * (args.train_per_task * len(TASKS)) // args.sft_batch
    sizes = DemoSizes(args.train_per_task, args.test_per_task, max(steps, 1), args.grpo_steps, max_tokens=4)
    cfg = demo_config(out, model_dir, sizes)
    cfg = cfg.model_copy(deep=True)
    cfg.engine.batch_size = 64
    cfg.data.num_workers = min(8, args.workers)
    cfg.train.train_batch_per_replica = args.sft_batch
    cfg.train.mini_batch = min(16, args.sft_batch)
    cfg.train.optm_lr = args.sft_lr
    cfg.train.optm_warmup_steps = max(1, steps // 20)
    cfg.train.ckpt.save_freq = max(steps, 1)

    table: dict[str, dict[str, float | None]] = {}
    t = time.perf_counter()
    table["untrained model"] = _evaluate(cfg, "base", out / "results")
    timings["eval_base_s"] = time.perf_counter() - t
    t = time.perf_counter()
    sft = run_sft(cfg)
    timings["sft_s"] = time.perf_counter() - t
    table["after SFT"] = _evaluate(_with_model(cfg, sft.export_dir), "sft", out / "results")
    t = time.perf_counter()
    rl_cfg = grpo_config(cfg, out, sft.export_dir, sizes)
    rl_cfg.train.optm_lr = args.grpo_lr
    rl_cfg.train.train_batch_per_replica = 64
    rl_cfg.rollout.n_generation = 8
    rl_cfg.rollout.batch_size = 8
    rl_cfg.grpo.mini_batch = 16
    rl = run_grpo(rl_cfg)
    timings["grpo_s"] = time.perf_counter() - t
    table["after SFT+GRPO"] = _evaluate(_with_model(cfg, rl.export_dir), "grpo", out / "results")
    timings["total_s"] = time.perf_counter() - started

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    params = sum(p.numel() for p in __import__("safetensors.torch", fromlist=["load_file"]).load_file(model_dir / "model.safetensors").values())
    print(f"device {device}; model {params / 1e6:.1f}M parameters (scale {args.scale}); "
          f"{args.train_per_task} train / {args.test_per_task} test clips per task; SFT {steps} steps "
          f"(loss {sft.losses[0]:.3f} -> {sft.losses[-1]:.3f}); GRPO {len(rl.rewards)} steps "
          f"(reward {rl.rewards[0]:.3f} -> {rl.rewards[-1]:.3f})")
    print({k: round(v, 1) for k, v in timings.items()})
    print_table(table, args.test_per_task)
    if os.environ.get("OUT"):
        payload = {"device": device, "date": "2026-11-22", "args": {k: str(v) for k, v in vars(args).items()},
                   "parameters": params, "sft_losses": sft.losses, "grpo_rewards": rl.rewards, "table": table,
                   "timings": timings}
        Path(os.environ["OUT"], "intuitive_physics.json").write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
