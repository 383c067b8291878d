"""LoRA against full fine-tuning on one GPU, in the same run: SFT peak memory and tokens/s; GRPO sync and step time.

How it measures: bench/RESULTS.md ("How the scripts measure"). JSON to $OUT/lora.json (SFT) and $OUT/lora_grpo.json.
Run (one GPU):  python bench/lora.py                         (SFT rows)
                python bench/lora.py --grpo --engine vllm    (GRPO rows)
CPU check:      python bench/lora.py --tiny [--grpo --engine hf]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import harness
import torch
import torch.distributed as dist
from shapes import PEAK_BF16_FLOPS, build_model_folder, make_batch, qwen25_vl_7b, train_flops_per_token

SYNC_TIMES = ("time/sync_s", "time/generate_s", "time/train_s", "time/step_s")


def sft_row(config, lora_rank: int | None, args, device, mesh) -> dict:
    """Peak memory and throughput of physreason's SFT step: full (lora_rank None) or LoRA of that rank."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from physreason.config import LoraConfig
    from physreason.models.lora import apply_lora
    from physreason.models.parallelize import apply_fsdp2, clip_grad_norm, enable_activation_checkpointing
    from physreason.train.model import CausalLMLoss

    harness.reset_peak()
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2_5_VLForConditionalGeneration(config)  # fp32 masters, as the trainer loads them
    if lora_rank is not None:
        apply_lora(model, LoraConfig(enable=True, rank=lora_rank, alpha=2 * lora_rank))
    enable_activation_checkpointing(model)
    module = CausalLMLoss(model)
    compute = torch.bfloat16 if device.type == "cuda" else torch.float32
    apply_fsdp2(module, model, mesh, compute, torch.float32)
    module.train()
    parameters = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=1e-5, fused=device.type == "cuda")
    batch = make_batch(config, args.seq_len, 1, False, device)

    def step() -> None:
        loss = module(batch) / batch.num_targets
        loss.backward()
        clip_grad_norm(parameters, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    seconds = harness.timed_steps(step, args.warmup, args.steps, device)
    trainable = sum(p.numel() for p in parameters)
    total = sum(p.numel() for p in module.parameters())
    tokens_per_s = args.seq_len / seconds
    return {
        "layers": config.text_config.num_hidden_layers,
        "trainable_params": trainable,
        "params": total,
        "seconds_per_step": seconds,
        "tokens_per_s": tokens_per_s,
        "mfu": tokens_per_s * train_flops_per_token(config, args.seq_len) / PEAK_BF16_FLOPS,
        "peak_gib": harness.peak_gib(),
    }


def run_sft_rows(args) -> None:
    device = harness.init_world()
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("dp",))
    full_layers = 2 if args.tiny else args.full_layers
    rows = {
        f"full SFT, {full_layers} layers": (qwen25_vl_7b(args.tiny, full_layers), None),
        f"LoRA r{args.rank}, {full_layers} layers": (qwen25_vl_7b(args.tiny, full_layers), args.rank),
        f"LoRA r{args.rank}, all layers (7B)": (qwen25_vl_7b(args.tiny), args.rank),
    }
    info = harness.device_line(device)
    report = harness.Report("lora.json", args.json, key="rows", **info, args=vars(args))
    report.data["rows"] = {}
    print(f"SFT on {info['device']}, one row of {args.seq_len} tokens per step, mean of {args.steps} steps after {args.warmup} untimed")
    print(f"{'row':<32}{'trainable':>14}{'peak GiB':>10}{'tok/s':>10}{'MFU':>7}")
    for label, (config, rank) in rows.items():
        row = harness.guarded(sft_row, config, rank, args, device, mesh)
        report.rows[label] = row
        if "error" in row:
            print(f"{label:<32}{row['error']:>14}", flush=True)
        else:
            print(f"{label:<32}{row['trainable_params']:>14,}{row['peak_gib']:>10.1f}{row['tokens_per_s']:>10,.0f}"
                  f"{row['mfu']:>7.1%}", flush=True)  # fmt: skip
        report.write()
    dist.destroy_process_group()


def grpo_child(args) -> None:
    """One colocated GRPO run with LoRA in `args.sync` mode; prints its medians as one JSON line."""
    from physreason.config import load_config
    from physreason.train.grpo import run_grpo

    model = build_model_folder(args.work / ("model-tiny" if args.tiny else "model-7b"), "qwen2.5-vl-7b", args.tiny)
    data = harness.write_mcq_prompts(args.work / "prompts.jsonl", args.prompts * (args.warmup + args.steps))
    bf16 = not args.tiny and torch.cuda.is_available()
    out = args.work / f"run-{args.sync}-{int(time.time())}"
    steps = args.warmup + args.steps
    config = load_config(None, harness.grpo_settings(model, data, out, args, args.engine, bf16, steps, 4096) + [
        "train.gradient_checkpointing=true", "train.lora.enable=true", f"train.lora.rank={args.rank}",
        f"train.lora.alpha={2 * args.rank}", f"train.lora.sync='{args.sync}'",
    ])  # fmt: skip
    result = run_grpo(config)
    timed = result.metrics[args.warmup:]
    row = {key: statistics.median(m[key] for m in timed) for key in SYNC_TIMES}
    print("ROW " + json.dumps(row))


def run_grpo_rows(args) -> None:
    """Each sync mode in its own process (each builds its own engine and policy), then one table."""
    modes = ["merged"] if args.engine == "hf" else ["auto", "merged"]
    info = harness.device_line(engine=args.engine)
    report = {**info, "args": {k: str(v) for k, v in vars(args).items()}, "rows": {}}
    name = info["device"]
    args.work.mkdir(parents=True, exist_ok=True)
    for mode in modes:
        command = [sys.executable, __file__, "--grpo-child", "--sync", mode, *sys.argv[1:]]
        done = subprocess.run(command, capture_output=True, text=True)
        rows = [line[4:] for line in done.stdout.splitlines() if line.startswith("ROW ")]
        report["rows"][mode] = json.loads(rows[-1]) if rows else {"error": done.stderr[-2000:]}
    label = {"auto": "adapter sync", "merged": "merged sync"}
    print(f"GRPO with LoRA r{args.rank} on {name}, engine {args.engine}, {args.prompts} prompts x {args.n}, "
          f"{args.response_len} new tokens max (median of {args.steps} steps)")
    print(f"{'row':<16}" + "".join(f"{k.split('/')[1]:>12}" for k in SYNC_TIMES))
    for mode, row in report["rows"].items():
        if "error" in row:
            print(f"{label[mode]:<16}error: {row['error'].strip().splitlines()[-1] if row['error'].strip() else '?'}")
        else:
            print(f"{label[mode]:<16}" + "".join(f"{row[k]:>12.3f}" for k in SYNC_TIMES))
    harness.write_json("lora_grpo.json", report, args.json)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096, help="SFT: tokens per step (one row)")
    harness.add_steps(parser, 5, 2)
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha = 2 x rank)")
    parser.add_argument("--full-layers", type=int, default=8,
                        help="SFT: decoder layers of the full-SFT baseline (and the like-for-like LoRA row)")
    parser.add_argument("--grpo", action="store_true", help="run the GRPO sync rows instead of the SFT rows")
    parser.add_argument("--engine", choices=("vllm", "hf"), default="vllm", help="GRPO: the rollout engine")
    harness.add_grpo_sizes(parser, "GRPO: ")
    parser.add_argument("--work", type=Path, default=Path("/tmp/physreason-lora-bench"), help="GRPO: model folder")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on CPU, to check the script")
    parser.add_argument("--grpo-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--sync", choices=("auto", "merged"), default="auto", help=argparse.SUPPRESS)
    harness.add_json(parser)
    args = parser.parse_args()
    if args.tiny:
        args.seq_len, args.steps, args.warmup = min(args.seq_len, 128), min(args.steps, 2), min(args.warmup, 1)
        args.prompts, args.n, args.response_len, args.mini_batch = 2, 4, 8, 4
    if args.grpo_child:
        grpo_child(args)
    elif args.grpo:
        with contextlib.suppress(KeyboardInterrupt):
            run_grpo_rows(args)
    else:
        run_sft_rows(args)


if __name__ == "__main__":
    main()
