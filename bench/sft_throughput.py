"""SFT throughput and MFU of physreason's trainer step beside a plain transformers baseline, in the same run.

Model: the Qwen2.5-VL-3B language-model shape (--shape qwen3-vl-8b: Qwen3-VL-8B, Cosmos-Reason2-8B's architecture)
with random weights (built from a config on the GPU, no download);
rows of --seq-len text tokens. Both sides run in this process (one per GPU under torchrun), one after the other:
  baseline  transformers model in bf16, gradient checkpointing, fused AdamW, HF loss on full logits, one row per
            optimizer step (DESIGN.md's anchor);
  ours      physreason's CausalLMLoss under FSDP2 (fp32 masters, bf16 compute, fp32 reduction) or, with
            --wrap autocast, as the trainer runs without torchrun (fp32 params under bf16 autocast); fused AdamW,
            global-norm clipping, plus the options below.
tokens/s counts every token of an optimizer step (grad-accum x batch x seq-len x data-parallel ranks) over the whole
step, optimizer included; MFU is per GPU: tokens/s x train FLOP/token / (GPUs x 989 TFLOP/s).

--sweep (the built-in SWEEP) or --rows="A; B; ..." runs several configurations of `ours` in this one process after
one baseline: each row is a string of this script's own options, applied over the command line's; a row that runs
out of memory (or has no attention kernel) prints OOM (or the error) and the sweep goes on. Rows print as they finish; JSON goes to $OUT/sft_throughput.json
after each row when OUT is set.

Run:    python bench/sft_throughput.py --chunked-ce --compile --ac-every 2
Sweep:  python bench/sft_throughput.py --sweep                      (the built-in rows, SWEEP)
        python bench/sft_throughput.py --rows="--compile --ac-every 0; --compile --ac-every 0 --grad-accum 4"
TP:     torchrun --standalone --nproc-per-node 2 bench/sft_throughput.py --tp 2 [--sweep | --rows=...]
CPU:    python bench/sft_throughput.py --tiny --seq-len 256 --steps 1 --warmup 1 --sweep
Qwen3-VL-8B:  python bench/sft_throughput.py --shape qwen3-vl-8b --layers 18 --rows="--chunked-ce --compile --ac-every 2 --batch 4"
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import shlex
import time
from pathlib import Path

import torch
import torch.distributed as dist
from shapes import PEAK_BF16_FLOPS, make_batch, qwen3_vl_8b, qwen25_vl_3b, train_flops_per_token

# Rows of --sweep: the last recorded best first, then no checkpointing, optimizer amortisation,
# larger micro-batches and longer rows, then the attention kernels (those change the compiled graphs, so last).
SWEEP = (
    "--chunked-ce --compile --ac-every 2",
    "--compile --ac-every 0",
    "--chunked-ce --compile --ac-every 0",
    "--chunked-ce --compile --ac-every 0 --grad-accum 4",
    "--compile --ac-every 0 --grad-accum 4",
    "--chunked-ce --compile --ac-every 0 --grad-accum 2 --batch 2",
    "--chunked-ce --compile --ac-every 0 --grad-accum 2 --seq-len 8192",
    "--chunked-ce --compile --ac-every 0 --grad-accum 4 --wrap autocast",
    "--chunked-ce --compile --ac-every 0 --grad-accum 4 --sdpa-backend cudnn",
    "--chunked-ce --compile --ac-every 0 --grad-accum 4 --sdpa-backend flash",
)
# Options that shape the process (its world, its baseline) and so cannot change from row to row.
PROCESS_OPTIONS = ("--tp", "--sweep", "--rows", "--tiny", "--skip-baseline", "--shape")
SHAPES = {"qwen2.5-vl-3b": qwen25_vl_3b, "qwen3-vl-8b": qwen3_vl_8b}  # --shape
ROW_OPTIONS = ("chunked_ce", "ce_chunk", "compile", "packing", "ac_every", "grad_accum", "batch", "seq_len",
               "sdpa_backend", "wrap")


def attention_backend(name: str):
    """Context that restricts F.scaled_dot_product_attention to one kernel ('auto': torch chooses)."""
    if name == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kernels = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
               "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    return sdpa_kernel([kernels[name]])


def timed_steps(step, warmup: int, steps: int, device) -> float:
    """Seconds per step after warmup (synchronised)."""
    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def build_model(config, device, dtype: torch.dtype):
    """The model with random weights, initialised on `device` (fast on a GPU), the same on every rank."""
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(config)
    return model.to(dtype)


def peak_gib(device) -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0


def run_baseline(config, args, device) -> dict:
    """transformers alone: bf16 weights, gradient checkpointing, fused AdamW, one row per step."""
    from physreason.models.parallelize import enable_activation_checkpointing

    model = build_model(config, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    enable_activation_checkpointing(model)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    ids = torch.randint(0, config.text_config.vocab_size, (1, args.seq_len), device=device)

    def step():
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    seconds = timed_steps(step, args.warmup, args.steps, device)
    return {"seconds_per_step": seconds, "tokens_per_step": args.seq_len, "gpus": 1, "peak_gib": peak_gib(device)}


def run_ours(config, args, device, mesh) -> dict:
    """physreason's CausalLMLoss wrapped as the trainer wraps it, with the row's options."""
    from physreason.models.parallelize import (
        apply_fsdp2,
        apply_tensor_parallel,
        clip_grad_norm,
        enable_activation_checkpointing,
    )
    from physreason.train.model import CausalLMLoss

    tp, world = mesh["tp"].size(), mesh.size()
    if args.wrap == "autocast" and world > 1:
        raise ValueError("--wrap autocast is the single-process trainer path; it cannot run under torchrun with more ranks")
    model = build_model(config, device, torch.float32)
    if args.ac_every > 0:
        enable_activation_checkpointing(model, args.ac_every)
    module = CausalLMLoss(model, loss_chunk_size=args.ce_chunk if args.chunked_ce else 0)
    compute_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    autocast = contextlib.nullcontext()
    if args.wrap == "fsdp":
        if tp > 1:
            apply_tensor_parallel(model, mesh["tp"])
        apply_fsdp2(module, model, mesh["dp"], compute_dtype, torch.float32)
    elif compute_dtype != torch.float32:
        autocast = torch.autocast(device.type, dtype=compute_dtype)
    if args.compile:
        for block in model.model.language_model.layers:
            block.compile()
    module.train()
    parameters = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=1e-5, fused=device.type == "cuda")
    batch = make_batch(config, args.seq_len, args.batch, args.packing, device)
    scale = 1.0 / (batch.num_targets * args.grad_accum)

    def step():
        for _ in range(args.grad_accum):
            with autocast, attention_backend(args.sdpa_backend):
                loss = module(batch)
            (loss * scale).backward()
        clip_grad_norm(parameters, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    seconds = timed_steps(step, args.warmup, args.steps, device)
    tokens = batch.input_ids.numel() * args.grad_accum * (world // tp)
    return {"seconds_per_step": seconds, "tokens_per_step": tokens, "gpus": world, "peak_gib": peak_gib(device)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096, help="tokens per row")
    parser.add_argument("--batch", type=int, default=1, help="rows per micro-batch")
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed optimizer steps first (compilation happens here)")
    parser.add_argument("--chunked-ce", action="store_true", help="lm_head + CE in checkpointed sequence chunks")
    parser.add_argument("--ce-chunk", type=int, default=1024, help="tokens per CE chunk")
    parser.add_argument("--compile", action="store_true", help="torch.compile each decoder block")
    parser.add_argument("--packing", action="store_true", help="4 samples packed into the row")
    parser.add_argument("--ac-every", type=int, default=1, help="checkpoint every n-th decoder block (0: none; 2: selective)")
    parser.add_argument("--sdpa-backend", choices=("auto", "flash", "cudnn", "efficient", "math"), default="auto",
                        help="attention kernel (torch.nn.attention.sdpa_kernel); cudnn is the fast one on Hopper")
    parser.add_argument("--wrap", choices=("fsdp", "autocast"), default="fsdp",
                        help="fsdp: the torchrun trainer path; autocast: the single-process trainer path")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree; launch with torchrun --nproc-per-node N")
    parser.add_argument("--sweep", action="store_true", help="run the built-in SWEEP rows after one baseline")
    parser.add_argument("--rows", default=None, metavar='"A; B"',
                        help="rows of options separated by ';' to run after one baseline (write --rows=...)")
    parser.add_argument("--skip-baseline", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes, to check the script on CPU")
    parser.add_argument("--layers", type=int, default=None,
                        help="decoder blocks of the language model (default: the shape's own); a full fine-tune of the "
                             "8B shape with fp32 masters and AdamW (16 bytes/parameter) does not fit one GPU, half its "
                             "blocks do; both sides run the same truncated model and MFU counts its FLOPs")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-vl-3b",
                        help="model architecture and size (random weights)")
    return parser


def row_args(parser: argparse.ArgumentParser, base: argparse.Namespace, options: str) -> argparse.Namespace:
    """The command line's options with one sweep row's options applied over them."""
    tokens = shlex.split(options)
    fixed = [t for t in tokens if t.split("=")[0] in PROCESS_OPTIONS]
    if fixed:
        parser.error(f"sweep row {options!r}: {', '.join(fixed)} apply to the whole process, not to one row")
    return parser.parse_args(tokens, namespace=copy.copy(base))


def describe(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """'physreason' plus every row option that differs from its default."""
    parts = []
    for name in ROW_OPTIONS:
        value, default = getattr(args, name), parser.get_default(name)
        if value != default:
            flag = "--" + name.replace("_", "-")
            parts.append(flag if value is True else f"{flag} {value}")
    return " ".join(["physreason", *parts])


def init_distributed(tp: int) -> torch.device:
    """Join torchrun's process group (or make a world of one) and return this rank's device."""
    cuda = torch.cuda.is_available()
    if "WORLD_SIZE" in os.environ:
        local = int(os.environ.get("LOCAL_RANK", 0))
        device = torch.device("cuda", local) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if cuda else "gloo")
    else:
        device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    if dist.get_world_size() % tp:
        raise SystemExit(f"--tp {tp} must divide the number of processes ({dist.get_world_size()}): "
                         f"launch with torchrun --nproc-per-node {tp}")
    return device


def free_memory(device) -> None:
    """Drop what a finished (or failed) row left behind, so the next row starts from an empty GPU."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def measure(run, config, row, device, *extra) -> dict:
    """One table row: the run's figures, or its OOM / missing-kernel error so the sweep can go on."""
    error = None
    try:
        result = run(config, row, device, *extra)
    except torch.cuda.OutOfMemoryError:
        error = "OOM"
    except (RuntimeError, ValueError) as failure:  # e.g. "No available kernel" for an --sdpa-backend on this device
        error = f"error: {str(failure).strip().splitlines()[0][:120]}"
    free_memory(device)  # after the except block, whose exception held the failed row's tensors
    if error is not None:
        return {"error": error}
    flops = train_flops_per_token(config, row.seq_len)
    result["tokens_per_s"] = result["tokens_per_step"] / result["seconds_per_step"]
    result["mfu"] = result["tokens_per_s"] * flops / (result["gpus"] * PEAK_BF16_FLOPS)
    return result


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    device = init_distributed(args.tp)
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    main_rank = dist.get_rank() == 0
    config = SHAPES[args.shape](args.tiny)
    if args.layers:
        config.text_config.num_hidden_layers = args.layers
    config.text_config._attn_implementation = "sdpa"
    # every row builds new blocks; let dynamo keep their compiled code instead of falling back to eager
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    if args.rows is not None:
        rows_options = [row.strip() for row in args.rows.split(";")]
    else:
        rows_options = list(SWEEP) if args.sweep else [""]
    report = {"device": name, "gpus": world, "tp": args.tp, "args": vars(args), "date": time.strftime("%Y-%m-%d"), "runs": {}}

    def emit(label: str, row: dict) -> None:
        report["runs"][label] = row
        if not main_rank:
            return
        base = report["runs"].get("transformers baseline", {}).get("tokens_per_s")
        if "error" in row:
            print(f"{label:<100} {row['error']}", flush=True)
        else:
            ratio = f"{row['tokens_per_s'] / base:.2f}x" if base else "-"
            print(f"{label:<100} {row['tokens_per_s']:>10,.0f} {row['mfu']:>7.1%} {row['peak_gib']:>9.1f} {ratio:>12}", flush=True)
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], "sft_throughput.json").write_text(json.dumps(report, indent=2))

    if main_rank:
        print(f"device {name} x {world} (tp {args.tp}), {train_flops_per_token(config, args.seq_len) / 1e9:.1f} GFLOP/token "
              f"at seq_len {args.seq_len}; MFU per GPU of {PEAK_BF16_FLOPS / 1e12:.0f} TFLOP/s")
        print(f"{'run':<100} {'tok/s':>10} {'MFU':>7} {'peak GiB':>9} {'vs baseline':>12}", flush=True)
    if not args.skip_baseline:
        emit("transformers baseline", measure(run_baseline, config, args, device))
    compiled_backend = None
    for options in rows_options:
        row = row_args(parser, args, options)
        if row.compile and compiled_backend not in (None, row.sdpa_backend):
            torch._dynamo.reset()  # compiled graphs bake in the attention kernel chosen when they were traced
        compiled_backend = row.sdpa_backend if row.compile else compiled_backend
        emit(describe(parser, row), measure(run_ours, config, row, device, mesh))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
