"""Time of one colocated GRPO step, split into generate / score / train / sync, and completions per second.

Model, prompts and --profile: bench/RESULTS.md ("How the scripts measure"). JSON to $OUT/grpo_step.json.
Run: python bench/grpo_step.py [--engine vllm|hf] [--prompts 8] [--n 8] [--response-len 256] [--steps 3]
     python bench/grpo_step.py --quantization fp8   (FP8 rollouts with truncated importance sampling; vLLM)
     python bench/grpo_step.py --packed-attention mask   (packed rows under their [L, L] mask: the path before)
     python bench/grpo_step.py --tiny   (a tiny model on CPU, to check the script)
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import harness
import torch
from shapes import build_model_folder

from physreason.train.profiling import Profiled

TIMES = ("time/generate_s", "time/score_s", "time/train_s", "time/sync_s", "time/step_s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=["auto", "vllm", "hf"], default="auto")
    harness.add_grpo_sizes(parser)
    parser.add_argument("--prompt-words", type=int, default=200)
    harness.add_steps(parser, 3, 1)
    parser.add_argument("--work", type=Path, default=Path("/tmp/physreason-grpo-bench"))
    parser.add_argument("--tiny", action="store_true", help="tiny model on CPU (checks the script)")
    parser.add_argument("--quantization", choices=["none", "fp8"], default="none", help="[rollout] quantization")
    parser.add_argument("--packed-attention", choices=["spans", "mask"], default="mask",
                        help="grpo.packed_attention: sdpa under the rows' [L, L] mask (physreason's default) or the "
                             "rows as variable-length sequences in one flash-attention call a layer")
    parser.add_argument("--compile", action="store_true", help="train.compile: the policy's decoder blocks compiled")
    parser.add_argument("--checkpoint-every", default="1", choices=["auto", *map(str, range(1, 65))],
                        help="train.checkpoint_every with recomputation on (a GPU): n, or auto (the fewest recomputed "
                             "decoder blocks whose plan leaves a tenth of the GPU free)")
    parser.add_argument("--cuda-graph-sizes", choices=["vllm", "batch"], default="vllm",
                        help="engine.cuda_graph_sizes: vLLM's ~50 sizes, or a round's completions and the powers of "
                             "two below (a shorter start, notably for an FP8 engine)")
    parser.add_argument("--profile", type=Path, default=None, metavar="DIR", help="profile steps after the timed ones")
    parser.add_argument("--profile-steps", type=int, default=2, help="steps under the profiler")
    harness.add_json(parser)
    args = parser.parse_args()
    profiled_steps = args.profile_steps if args.profile is not None else 0

    from physreason.config import load_config
    from physreason.train.grpo import run_grpo

    backend = harness.engine_backend(args.engine)
    info = harness.device_line(engine=backend, quantization=args.quantization)
    args.work.mkdir(parents=True, exist_ok=True)
    model = build_model_folder(args.work / ("model-tiny" if args.tiny else "model-3b"), "qwen2.5-vl-3b", args.tiny)
    total_steps = args.warmup + args.steps + profiled_steps
    data = harness.write_mcq_prompts(args.work / "prompts.jsonl", args.prompts * total_steps, max(1, args.prompt_words // 10))
    out = args.work / f"run-{int(time.time())}"
    bf16 = not args.tiny and torch.cuda.is_available()
    settings = harness.grpo_settings(model, data, out, args, backend, bf16, total_steps, 8192)
    settings += [f"train.gradient_checkpointing={'true' if bf16 else 'false'}",
                 f"rollout.quantization='{args.quantization}'", f"grpo.packed_attention='{args.packed_attention}'",
                 f"train.compile={'true' if args.compile else 'false'}",
                 "train.checkpoint_every=" + ("'auto'" if args.checkpoint_every == "auto" else args.checkpoint_every),
                 f"engine.cuda_graph_sizes='{args.cuda_graph_sizes}'"]  # fmt: skip
    config = load_config(None, settings)
    device_kind = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    profiler = Profiled(args.profile, "grpo-step", device_kind) if args.profile is not None else None
    started_profile = args.warmup + args.steps  # steps finished when the profiler starts

    def on_step(step: int) -> None:
        if profiler is None:
            return
        if step == started_profile:
            profiler.__enter__()
        elif step > started_profile:
            profiler.step()
            if step == total_steps:
                profiler.__exit__(None, None, None)

    with harness.recorded_checkpoint_every() as chosen:
        result = run_grpo(config, on_step=on_step)
    timed = result.metrics[args.warmup : args.warmup + args.steps]
    row = {key: statistics.median(m[key] for m in timed) for key in (*TIMES, "perf/samples_per_s")}
    row["rollout/response_length_mean"] = statistics.mean(m["rollout/response_length_mean"] for m in timed)
    # mean |policy - engine| log-prob of the sampled tokens: what FP8 rollouts add to the engine/policy gap
    row["rollout/logprob_mismatch"] = statistics.mean(m["rollout/logprob_mismatch"] for m in timed)
    row["train/checkpoint_every"] = chosen[0] if chosen else None
    print(f"GRPO step on {info['device']}, engine {backend} (rollout quantization {args.quantization}, packed "
          f"attention from the {args.packed_attention}{', compiled blocks' if args.compile else ''}, checkpoint_every "
          f"{row['train/checkpoint_every']} (asked {args.checkpoint_every})), {args.prompts} "
          f"prompts x {args.n} completions, {args.response_len} new tokens max (median of {len(timed)} steps)")
    print(f"{'part':<12}{'seconds':>10}{'share':>8}")
    for key in TIMES[:-1]:
        print(f"{key.split('/')[1][:-2]:<12}{row[key]:>10.2f}{row[key] / row['time/step_s']:>8.0%}")
    print(f"{'step':<12}{row['time/step_s']:>10.2f}")
    print(f"completions/s {row['perf/samples_per_s']:.2f}, mean response {row['rollout/response_length_mean']:.0f} "
          f"tokens, mean |log-prob gap| {row['rollout/logprob_mismatch']:.4f}")
    harness.write_json("grpo_step.json", {**info, "args": {k: str(v) for k, v in vars(args).items()}, **row}, args.json)


if __name__ == "__main__":
    main()
