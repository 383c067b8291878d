"""Measured peak GPU memory of one SFT step beside physreason's memory plan for the same shape and layout.

The model is built from a config.json with random weights (no download): --config names a folder (default: the
Qwen3-VL-32B config in tests/fixtures), --layers truncates its decoder to the first N blocks so a 32B shape fits one
GPU, and the plan is made for that truncated shape. One step runs through the trainer's own pieces: fp32 masters,
activation checkpointing, FSDP2 under torchrun (or one plain process), CausalLMLoss with --loss-chunk, AdamW (fp32
or bf16 state), --offload. Rows are --seq-len text tokens. Prints planned parts, planned total and
torch.cuda.max_memory_allocated (+ the CUDA context is not in either); JSON to $OUT/memory_plan.json when OUT is set.

Run (one GPU, FSDP2 on one rank as the trainers do under torchrun):
  torchrun --standalone --nproc-per-node 1 bench/memory_plan.py --config tests/fixtures/qwen3_vl_32b --layers 4
  torchrun --standalone --nproc-per-node 1 bench/memory_plan.py --config tests/fixtures/qwen3_vl_32b --layers 4 --state bfloat16
  torchrun --standalone --nproc-per-node 1 bench/memory_plan.py --config tests/fixtures/qwen3_vl_32b --layers 4 --offload
CPU check of the script: python bench/memory_plan.py --tiny
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from shapes import SHAPES
from transformers import AutoConfig

from physreason.config import LoraConfig, TrainConfig
from physreason.data.collate import SFTBatch
from physreason.models import parallelize
from physreason.models.family import model_family, vision_special_token_ids
from physreason.models.lora import apply_lora
from physreason.models.sizes import shape_from_hf_config
from physreason.train.build import shard
from physreason.train.memory import GIB, Layout, Workload, plan_memory
from physreason.train.model import CausalLMLoss
from physreason.train.runtime import init_runtime
from physreason.train.schedule import build_optimizer

ROOT = Path(__file__).resolve().parents[1]


def build_config(args: argparse.Namespace):
    """The transformers config of --config, truncated to --layers decoder blocks (--tiny: the tiny Qwen3-VL)."""
    if args.tiny:
        from physreason.models.tiny import save_tiny_model

        folder = save_tiny_model("qwen3_vl", Path(os.environ.get("TMPDIR", "/tmp")) / "memory_plan_tiny")
        return AutoConfig.from_pretrained(folder)
    config = SHAPES[args.shape](False) if args.shape else AutoConfig.from_pretrained(args.config)
    text = getattr(config, "text_config", config)
    if args.layers:
        text.num_hidden_layers = args.layers
    return config


def synthetic_batch(rows: int, seq_len: int, below: int, device: torch.device) -> SFTBatch:
    """Text rows of random tokens below `below` (the first vision token id), every position a target; mrope positions."""
    ids = torch.randint(0, below, (rows, seq_len), device=device)  # [B, L]
    positions = torch.arange(seq_len, device=device).expand(3, rows, seq_len)  # [3, B, L]
    return SFTBatch(ids, ids.roll(-1, dims=1), positions, torch.ones_like(ids), num_samples=rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "tests" / "fixtures" / "qwen3_vl_32b"))
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None, help="a bench shape instead of --config")
    parser.add_argument("--layers", type=int, default=4, help="decoder blocks kept (0: all)")
    parser.add_argument("--lora", type=int, default=0, metavar="RANK",
                        help="train LoRA adapters of this rank on the decoder's linear layers (0: full training)")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--loss-chunk", type=int, default=0)
    parser.add_argument("--state", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--offload", action="store_true")
    parser.add_argument("--no-checkpointing", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="the tiny Qwen3-VL on CPU, to check the script")
    args = parser.parse_args()

    runtime = init_runtime()
    hf_config = build_config(args)
    train = TrainConfig(
        gradient_checkpointing=not args.no_checkpointing, loss_chunk_size=args.loss_chunk,
        optimizer_state_dtype=args.state, cpu_offload=args.offload, mini_batch=args.batch,
        lora=LoraConfig(enable=args.lora > 0, rank=max(args.lora, 1)),
    )
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    cls = AutoModelForImageTextToText if model_family(hf_config).is_vision_language else AutoModelForCausalLM
    torch.manual_seed(0)
    # Random weights are drawn on the GPU (minutes faster than a CPU draw for a 7B shape); with --offload they start on
    # the host as the trainer's do. The peak is measured from the first step on, after sharding, either way.
    with torch.device("cpu" if args.offload else runtime.device):
        model = cls.from_config(hf_config, dtype=torch.float32, attn_implementation="sdpa")
    if train.lora.enable:  # as the trainer's load_trainable: adapters before checkpointing, the base frozen
        apply_lora(model, train.lora)
    if train.gradient_checkpointing:
        parallelize.enable_activation_checkpointing(model)
    module = CausalLMLoss(model, train.loss_chunk_size)
    mesh = None
    if runtime.distributed:
        mesh = parallelize.build_mesh(runtime.device.type, runtime.world_size, 1)
    shard(module, model, runtime, mesh, train)
    module.train()
    optimizer, _ = build_optimizer(module, train, 1, fused=runtime.device.type == "cuda" and not args.offload)
    text = getattr(hf_config, "text_config", hf_config)
    below = min(vision_special_token_ids(hf_config) or [text.vocab_size])
    batch = synthetic_batch(args.batch, args.seq_len, below, runtime.device)
    cuda = runtime.device.type == "cuda"
    autocast = torch.autocast(runtime.device.type, dtype=torch.bfloat16) if not runtime.distributed else None
    for _ in range(2):  # the second step holds the optimizer state from the start, as every later step does
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        if autocast is not None:
            with autocast:
                loss = module(batch)
        else:
            loss = module(batch)
        (loss / batch.num_targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    measured = torch.cuda.max_memory_allocated() if cuda else 0

    shape = shape_from_hf_config(hf_config)
    layout = Layout(gpus=runtime.world_size, distributed=runtime.distributed, cpu_offload=args.offload,
                    optimizer_state_dtype=args.state, gradient_checkpointing=train.gradient_checkpointing,
                    mini_batch=args.batch, lora=train.lora.enable)
    # Text rows: the vision tower never runs, so it gets no gradients and no AdamW state (train_vision=False).
    workload = Workload(seq_len=args.seq_len, loss_chunk_size=args.loss_chunk, vision_tokens=0, train_vision=False,
                        lora_rank=train.lora.rank, lora_targets=tuple(train.lora.target_modules))
    plan = plan_memory(shape, layout, workload)
    planned = plan.total - plan.parts["runtime overhead"]  # max_memory_allocated sees tensors only
    if runtime.is_main:
        for part, value in plan.parts.items():
            print(f"  planned {part:<22} {value / GIB:8.2f} GiB")
        print(f"planned tensors {planned / GIB:.2f} GiB, measured max_memory_allocated {measured / GIB:.2f} GiB, "
              f"ratio {measured / max(planned, 1):.3f} ({shape.total_params / 1e9:.2f} B parameters, {shape.layers} blocks)")
        if os.environ.get("OUT"):
            record = {"args": vars(args), "parts": plan.parts, "planned": planned, "measured": measured,
                      "device": torch.cuda.get_device_name() if cuda else "cpu", "world_size": runtime.world_size}
            Path(os.environ["OUT"], "memory_plan.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
