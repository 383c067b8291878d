"""Time of one GRPO policy update with video prompts on one GPU: per-row pixels vs shared visuals vs grouped attention.

Settings a-d and how they are timed: bench/RESULTS.md ("How the scripts measure"). A markdown table; JSON to
$OUT/policy_update_video.json.
GPU:  PYTHONPATH=$PWD:/tmp/site python3 bench/policy_update_video.py [--prompts 8] [--completions 8] [--runs 3]
CPU:  python bench/policy_update_video.py --tiny   (tiny float32 model and clip, to check every path)
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

import harness
import numpy as np
import torch
from shapes import build_model_folder

SETTINGS = {"a": "per-row visuals, per-window attention", "b": "shared visuals, per-window attention",
            "c": "shared visuals, grouped attention", "d": "c + packed rows, passes sized by tokens"}  # fmt: skip
# The arrow-of-time clips of `physreason data synth` (physreason/data/synth/scenarios.py): 24 frames at 8 fps.
CLIP_SECONDS, CLIP_FPS, CLIP_HEIGHT, CLIP_WIDTH = 3.0, 8.0, 192, 256
QUESTION = (
    "Watch the clip of objects moving on a floor. Is the video playing forwards or backwards in time? "
    "Look at how the objects gain or lose speed and height."
)
OPTIONS = {"A": "forwards", "B": "backwards"}


def bench_config(model: Path, args: argparse.Namespace):
    """The GRPO recipe of bench/rl_disaggregated.py for one process (bf16 autocast and checkpointing on the GPU)."""
    from physreason.config import Config

    dtype = "float32" if args.tiny else "bfloat16"
    return Config.model_validate({
        "model": {"model_name_or_path": str(model), "model_max_length": 8192, "dtype": dtype},
        "train": {"output_dir": str(args.work / "unused"), "param_dtype": dtype, "gradient_checkpointing": True,
                  "ckpt": {"enable_checkpoint": False}},
        "rollout": {"n_generation": args.completions, "max_response_length": args.response_len,
                    "sampling_config": {"temperature": 1.0, "top_p": 1.0, "repetition_penalty": 1.0}},
        "grpo": {"mini_batch": args.mini_batch},
    })  # fmt: skip


def synthetic_clip(vision, seed: int):
    """Random frames of one clip, sampled and resized as load_video would from the clip's size, length and fps."""
    from physreason import vision as v
    from physreason.vision.resize import PATCH_FACTOR

    source_frames = round(CLIP_SECONDS * CLIP_FPS)
    count = v.num_sampled_frames(source_frames, CLIP_FPS, vision.fps, vision.min_frames, vision.max_frames)
    budgets = v.pixel_budgets(vision)
    budget = v.video_frame_max_pixels(count, budgets.min_pixels, budgets.max_pixels, budgets.total_pixels)
    height, width = v.smart_resize(CLIP_HEIGHT, CLIP_WIDTH, PATCH_FACTOR, budgets.min_pixels, budget)
    frames = np.random.default_rng(seed).integers(0, 256, size=(count, height, width, 3), dtype=np.uint8)
    indices = v.sample_indices(source_frames, count)
    return v.VideoFrames(frames=frames, timestamps=[i / CLIP_FPS for i in indices], indices=indices,
                         sample_fps=count / CLIP_SECONDS, source_fps=CLIP_FPS, source_num_frames=source_frames,
                         duration=CLIP_SECONDS, source_size=(CLIP_HEIGHT, CLIP_WIDTH),
                         path=f"synthetic-clip-{seed}.mp4")  # fmt: skip


def build_rollout(config, tokenizer, vision, args: argparse.Namespace) -> list:
    """prompts x completions RolloutSamples, group-major; each group's samples share one VisualInputs object."""
    from physreason.data.mcq import MCQPrompt
    from physreason.engines import Completion
    from physreason.models.inputs import encode_visuals, expand_vision_placeholders, load_processor_params
    from physreason.train.rollout import RolloutSample

    params = load_processor_params(config.model.model_name_or_path)
    generator = torch.Generator().manual_seed(0)
    # Completion tokens come from the BPE vocabulary below every special token (so none is a vision placeholder).
    text_vocab = min(tokenizer.added_tokens_decoder)
    samples = []
    for group in range(args.prompts):
        clip = synthetic_clip(vision, seed=group)
        prompt = MCQPrompt(f"clip-{group}", QUESTION, dict(OPTIONS), "A", videos=(Path(clip.path),))
        visuals = encode_visuals(videos=[clip], params=params)
        text = tokenizer.apply_chat_template(prompt.messages("grpo"), tokenize=False, add_generation_prompt=True)
        text = expand_vision_placeholders(text, visuals.image_token_counts, visuals.video_token_counts)
        prompt_ids = tokenizer(text, add_special_tokens=False).input_ids
        advantages = torch.randn(args.completions, generator=generator)  # [n]
        advantages = (advantages - advantages.mean()) / advantages.std().clamp_min(1e-6)
        for j in range(args.completions):
            tokens = torch.randint(0, text_vocab, (args.response_len,), generator=generator)  # [R]
            logprobs = -3.0 * torch.rand(args.response_len, generator=generator)  # [R]
            completion = Completion("", tokens.tolist(), logprobs.tolist(), "length")
            reward = {"total": 0.0}
            samples.append(RolloutSample(group, prompt, prompt_ids, completion, reward, visuals, float(advantages[j])))
    return samples


def per_row_copies(samples: list) -> list:
    """The same samples with every completion holding its own copy of its prompt's visuals (nothing shared)."""
    return [dataclasses.replace(s, visuals=copy.deepcopy(s.visuals)) for s in samples]


class VisionAttentionSwitch:
    """Set the vision tower's attention to transformers' per-window kernel or to load_model's grouped wrapper."""

    def __init__(self, model: torch.nn.Module) -> None:
        from physreason.models.vision_attention import ATTENTION_CLASSES, WRAPPED_KERNELS, registered_name

        modules = [m for m in model.modules() if type(m).__name__ in ATTENTION_CLASSES]
        self.configs = list({id(m.config): m.config for m in modules}.values())
        current = {c._attn_implementation for c in self.configs}
        if len(current) != 1:
            raise SystemExit(f"the vision attention modules use several implementations {sorted(current)}")
        self.grouped = current.pop()
        names = {registered_name(kernel): kernel for kernel in WRAPPED_KERNELS}
        # Without grouping applied (a flash kernel, or load_model's probe refused it) setting c cannot run.
        self.native = names.get(self.grouped)
        if self.native is None:
            self.native, self.grouped = self.grouped, None

    def set(self, grouped: bool) -> None:
        for config in self.configs:
            config._attn_implementation = self.grouped if grouped else self.native


def zero_learning_rate(optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
    """lr 0 for good: AdamW still runs its whole step, but no update changes a weight (decay is scaled by lr too)."""
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    scheduler.base_lrs = [0.0] * len(optimizer.param_groups)


def close(a: float, b: float, rtol: float, atol: float) -> bool:
    return abs(a - b) <= rtol * max(abs(a), abs(b)) + atol


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8, help="prompt groups (one clip each)")
    parser.add_argument("--completions", type=int, default=8, help="completions per prompt")
    parser.add_argument("--response-len", type=int, default=256, help="tokens per completion")
    parser.add_argument("--runs", type=int, default=3, help="timed rounds of a, b, c (after one warm-up each)")
    parser.add_argument("--mini-batch", type=int, default=8, help="samples per forward pass ([grpo] mini_batch)")
    parser.add_argument("--mini-batch-tokens", type=int, default=8192,
                        help="tokens per forward pass of setting d ([grpo] mini_batch_tokens)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/physreason-grpo-bench"), help="model folder parent")
    parser.add_argument("--tiny", action="store_true", help="tiny float32 model and clip on CPU (checks the script)")
    harness.add_json(parser)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from physreason.models import loading
    from physreason.models.family import read_vision_tokens
    from physreason.train.grpo import UpdateSettings, build_policy, update_policy
    from physreason.train.policy import build_completion_batch, build_micro_batches
    from physreason.train.runtime import init_runtime, seed_everything

    args.work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    model_dir = build_model_folder(args.work / ("model-tiny" if args.tiny else "model-3b"), "qwen2.5-vl-3b", args.tiny)
    runtime = init_runtime()
    cuda = runtime.device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()  # the bf16 model build's cached blocks
    seed_everything(0)
    config = bench_config(model_dir, args)
    tokenizer = loading.load_tokenizer(config.model)
    vision_tokens = read_vision_tokens(loading.load_model_config(config.model))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    policy = build_policy(config, runtime, total_steps=3 * (args.runs + 1))
    zero_learning_rate(policy.optimizer, policy.scheduler)
    attention = VisionAttentionSwitch(policy.model)
    update = UpdateSettings.from_config(config)
    shared = build_rollout(config, tokenizer, harness.vision_settings(args.tiny), args)
    rollouts = {"a": per_row_copies(shared), "b": shared, "c": shared, "d": shared}
    settings = [s for s in SETTINGS if s not in ("c", "d") or attention.grouped is not None]
    if attention.grouped is None:
        print(f"grouped vision attention is not applied ({attention.native}): settings c and d are left out", flush=True)
    visuals = shared[0].visuals
    grid = visuals.video_grid_thw[0].tolist()
    info = harness.device_line(runtime.device, transformers=__import__("transformers").__version__)
    print(f"{args.prompts} prompts x {args.completions} completions of {args.response_len} tokens, "
          f"micro-batch {args.mini_batch}; clip grid (t, h, w) {grid} = {math.prod(grid)} patches, "
          f"{visuals.video_token_counts[0]} video tokens, prompt {len(shared[0].prompt_ids)} tokens; "
          f"setup {time.perf_counter() - started:.0f} s", flush=True)  # fmt: skip

    def one_update(setting: str) -> dict[str, Any]:
        attention.set(grouped=setting in ("c", "d"))
        samples = rollouts[setting]
        harness.sync(runtime.device)
        harness.reset_peak()
        t0 = time.perf_counter()
        if setting == "d":
            packed = build_micro_batches(samples, pad_id, vision_tokens, len(samples), args.mini_batch_tokens, pack=True)
            batches = [batch.to(runtime.device) for batch in packed]
        else:
            step = update.mini_batch
            batches = [build_completion_batch(samples[i : i + step], pad_id, vision_tokens).to(runtime.device)
                       for i in range(0, len(samples), step)]  # fmt: skip
        harness.sync(runtime.device)
        t1 = time.perf_counter()
        metrics = update_policy(policy.module, batches, policy.optimizer, policy.scheduler, update, runtime, 1,
                                policy.autocast)  # fmt: skip
        harness.sync(runtime.device)
        t2 = time.perf_counter()
        peak = harness.peak_gib(None)
        # update_policy's *_sum entries are already token means (run_grpo drops the suffix when it logs them)
        metrics = {name.removesuffix("_sum"): value for name, value in metrics.items()}
        return {"build_s": t1 - t0, "update_s": t2 - t1, "peak_gib": peak, "metrics": metrics}

    records: dict[str, list[dict[str, Any]]] = {s: [] for s in settings}
    for setting in settings:
        records[setting].append(one_update(setting))
        print(f"warm-up {setting}: {records[setting][-1]['update_s']:.2f} s", flush=True)
    for run in range(args.runs):
        for setting in settings:
            records[setting].append(one_update(setting))
        print(f"run {run + 1}: " + ", ".join(f"{s} {records[s][-1]['update_s']:.2f} s" for s in settings), flush=True)

    completions = args.prompts * args.completions
    rows = []
    for setting in settings:
        timed = records[setting][1:]
        rows.append({"setting": setting, "description": SETTINGS[setting],
                     "update_s_median": statistics.median(r["update_s"] for r in timed),
                     "update_s": [r["update_s"] for r in timed],
                     "build_s_median": statistics.median(r["build_s"] for r in timed),
                     "peak_gib": max(r["peak_gib"] for r in records[setting]) if cuda else None})  # fmt: skip
    for row in rows:
        row["s_per_completion"] = row["update_s_median"] / completions
        row["speedup_vs_a"] = rows[0]["update_s_median"] / row["update_s_median"]

    # bf16: the settings run the tower on different shapes and kernels; float32 agrees to rounding.
    rtol, atol = (1e-4, 1e-6) if args.tiny else (5e-2, 1e-3)
    first = {s: records[s][0]["metrics"] for s in settings}
    mismatches = [f"{s} {name}: {first[s][name]:.6g} vs a {value:.6g}" for s in settings[1:]
                  for name, value in first["a"].items() if not close(first[s][name], value, rtol, atol)]  # fmt: skip

    print(f"\nGRPO policy update, video prompts, on {info['device']} (median of {args.runs} runs, after 1 warm-up each)\n")
    print("| setting | s / update | s / completion | speed-up vs a | build s | peak GPU GiB |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        peak = f"{row['peak_gib']:.1f}" if row["peak_gib"] is not None else "n/a"
        print(f"| {row['setting']}: {row['description']} | {row['update_s_median']:.2f} "
              f"| {row['s_per_completion']:.3f} | {row['speedup_vs_a']:.2f}x | {row['build_s_median']:.2f} | {peak} |")  # fmt: skip
    print("\nfirst-update metrics per setting:")
    for name in sorted(first["a"]):
        print(f"  {name}: " + ", ".join(f"{s} {first[s][name]:.6g}" for s in settings))
    verdict = "agree" if not mismatches else "DISAGREE"
    print(f"first-update metrics {verdict} (rtol {rtol:g}, atol {atol:g})" + "".join(f"\n  {m}" for m in mismatches))

    payload = {**info, "args": {k: str(v) for k, v in vars(args).items()}, "video_grid_thw": grid,
               "video_tokens_per_clip": visuals.video_token_counts[0], "prompt_tokens": len(shared[0].prompt_ids),
               "vision_attention": {"native": attention.native, "grouped": attention.grouped}, "rows": rows,
               "first_update_metrics": first, "metrics_agree": not mismatches, "mismatches": mismatches,
               "records": {s: [{k: v for k, v in r.items() if k != "metrics"} for r in records[s]]
                           for s in settings}}  # fmt: skip
    harness.write_json("policy_update_video.json", payload, args.json)


if __name__ == "__main__":
    main()
