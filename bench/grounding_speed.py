"""Speed of the grounding experiment's model through its own code path: GRPO steps and a greedy evaluation.

What it times (issue 45's goals): bench/RESULTS.md ("How the scripts measure"). JSON to $OUT/grounding_speed.json.
Run: python bench/grounding_speed.py                        (the experiment's shape: 16 prompts x 8, 150 test clips a task)
     python bench/grounding_speed.py --static-cache          (GRPO rollouts on the hf engine's static KV cache)
     python bench/grounding_speed.py --grpo-prompts 4 --test-per-task 30 --profile /tmp/prof   (CPU: cProfile)
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from pathlib import Path

import harness


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/physreason-grounding-speed"))
    parser.add_argument("--grpo-prompts", type=int, default=16)
    parser.add_argument("--grpo-n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3, help="timed GRPO steps (after --warmup)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--test-per-task", type=int, default=150, help="evaluated clips per task (two tasks)")
    parser.add_argument("--workers", type=int, default=4, help="clip generation processes")
    parser.add_argument(
        "--static-cache", action="store_true", help="GRPO rollouts on the static KV cache (--rollout-static-cache)"
    )
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf")
    parser.add_argument("--skip-eval", action="store_true")
    parser.add_argument("--skip-grpo", action="store_true")
    parser.add_argument("--profile", type=Path, default=None, metavar="DIR", help="run both parts under cProfile")
    args = parser.parse_args()

    import torch

    from physreason.config import with_model
    from physreason.eval.launch import accuracy_by_dataset
    from physreason.experiments import grounding
    from physreason.experiments.common import build_model, stage_config
    from physreason.train.grpo import run_grpo

    steps = args.warmup + args.steps
    exp = grounding.parse_args(
        [
            "--train-per-task", "2", "--rl-per-task", str(max(args.grpo_prompts * steps, 4)),
            "--test-per-task", str(args.test_per_task), "--grpo-prompts", str(args.grpo_prompts),
            "--grpo-n", str(args.grpo_n), "--grpo-steps", str(steps), "--max-tokens", str(args.max_tokens),
            "--workers", str(args.workers), "--ckpt-every", "100000", "--out", str(args.out),
            *(["--rollout-static-cache"] if args.static_cache else []),
        ]
    )  # fmt: skip
    out = args.out.resolve() / exp.family
    grounding.generate(out, exp)
    model_dir = build_model(exp, out, 0)
    cfg = stage_config(exp, out, model_dir, 0)
    cfg.eval.datasets = list(exp.tasks)
    cfg.generation.max_tokens = args.max_tokens
    cfg.engine.backend = args.engine
    stamp = int(time.time())
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    report = harness.Report("grounding_speed.json", key="parts", **harness.device_line(device, engine=args.engine))
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)

    def profiled(name: str, fn):
        if args.profile is None:
            return fn()
        profile = cProfile.Profile()
        value = profile.runcall(fn)
        profile.dump_stats(args.profile / f"{name}.prof")
        print(f"--- {name}: top functions by cumulative time")
        pstats.Stats(profile).sort_stats("cumulative").print_stats(35)
        print(f"--- {name}: top functions by own time")
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)
        return value

    if not args.skip_grpo:
        rl_cfg = grounding.variant_grpo_config(exp, cfg, out, model_dir, out / f"speed-grpo-{stamp}")
        rl_cfg.train.ckpt.enable_checkpoint = False
        cpu = time.process_time()
        result = profiled("grpo", lambda: run_grpo(rl_cfg))
        grpo = {"part": "grpo", "grpo_cpu_s": time.process_time() - cpu}  # this process's CPU seconds, whole run
        timed = result.metrics[args.warmup :]
        for key in ("time/generate_s", "time/score_s", "time/train_s", "time/step_s"):
            grpo[key] = statistics.median(m[key] for m in timed)
        grpo["response_length_mean"] = statistics.mean(m["rollout/response_length_mean"] for m in timed)
        report.row(grpo, (
            f"GRPO step ({args.grpo_prompts} prompts x {args.grpo_n}, median of {len(timed)}): "
            f"{grpo['time/step_s']:.3f} s (generate {grpo['time/generate_s']:.3f}, score "
            f"{grpo['time/score_s']:.3f}, train {grpo['time/train_s']:.3f}); mean response "
            f"{grpo['response_length_mean']:.0f} tokens"
        ))
    if not args.skip_eval:
        started, cpu = time.perf_counter(), time.process_time()
        profiled("eval", lambda: accuracy_by_dataset(with_model(cfg, model_dir), out / f"speed-eval-{stamp}", show_progress=False))
        seconds, clips = time.perf_counter() - started, args.test_per_task * len(exp.tasks)
        report.row({"part": "eval", "eval_s": seconds, "eval_cpu_s": time.process_time() - cpu, "eval_clips": clips},
                   f"greedy evaluation of {clips} clips: {seconds:.2f} s (engine start included)")  # fmt: skip


if __name__ == "__main__":
    main()
