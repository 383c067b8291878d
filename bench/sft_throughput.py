"""SFT throughput and MFU of physreason's trainer step beside a plain transformers baseline, in one process.

Model: the Qwen2.5-VL-3B language-model shape with random weights (built from a config, no download);
sequences of --seq-len tokens of text. Both sides run in this process on one GPU, one after the other:
  baseline  transformers model in bf16, gradient checkpointing, fused AdamW, HF loss on full logits;
  ours      physreason's CausalLMLoss under FSDP2 (fp32 masters, bf16 compute, fp32 reduction), fused
            AdamW, plus the options chosen below (chunked CE, per-block compile, packing, selective AC).
Prints a table; writes JSON to $OUT/sft_throughput.json when OUT is set.
Run: python bench/sft_throughput.py [--chunked-ce] [--compile] [--packing] [--ac-every 2]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

PEAK_BF16_FLOPS = 989e12  # H100/H200 SXM dense bf16, the MFU convention of DESIGN.md's anchors


def qwen25_vl_3b_config(tiny: bool):
    """The Qwen2.5-VL-3B-Instruct architecture (or a tiny stand-in to check the script on CPU)."""
    from transformers import Qwen2_5_VLConfig

    text = dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=128000, rms_norm_eps=1e-6,
                tie_word_embeddings=True,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]})
    vision = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                  fullatt_block_indexes=[7, 15, 23, 31])
    if tiny:
        text.update(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [4, 6, 6]})
        vision.update(depth=1, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=128, fullatt_block_indexes=[0])
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=text["tie_word_embeddings"])


def train_flops_per_token(config, seq_len: int) -> float:
    """6 x matmul parameters of the language model (lm_head included) + causal attention score/value flops."""
    t = config.text_config
    head_dim = t.hidden_size // t.num_attention_heads
    kv = t.num_key_value_heads * head_dim
    per_layer = t.hidden_size * (t.hidden_size + 2 * kv) + t.hidden_size * t.hidden_size + 3 * t.hidden_size * t.intermediate_size
    matmul_params = t.num_hidden_layers * per_layer + t.vocab_size * t.hidden_size
    attention = 6 * t.num_hidden_layers * seq_len * t.hidden_size  # 12 * L * s * d, halved by causality
    return 6 * matmul_params + attention


def make_batch(config, seq_len: int, packing: bool, device):
    """One row of seq_len tokens: a single sample, or four samples packed with restarting positions."""
    from physreason.data.collate import collate_padded
    from physreason.data.packing import collate_packed
    from physreason.data.sft import SFTSample

    generator = torch.Generator().manual_seed(0)
    parts = 4 if packing else 1
    samples = []
    for _ in range(parts):
        n = seq_len // parts
        ids = torch.randint(0, config.text_config.vocab_size, (n,), generator=generator)
        samples.append(SFTSample(ids, ids.clone(), torch.arange(n).expand(3, -1)))
    batch = collate_packed(samples, mrope=True) if packing else collate_padded(samples, 0, mrope=True)
    return batch.to(device)


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


def run_baseline(config, seq_len: int, device, warmup: int, steps: int) -> dict:
    from transformers import Qwen2_5_VLForConditionalGeneration

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = Qwen2_5_VLForConditionalGeneration(config).to(device=device, dtype=dtype)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    ids = torch.randint(0, config.text_config.vocab_size, (1, seq_len), device=device)

    def step():
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    seconds = timed_steps(step, warmup, steps, device)
    memory = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
    del model, optimizer
    return {"seconds_per_step": seconds, "peak_gib": memory}


def run_ours(config, seq_len: int, device, warmup: int, steps: int, args) -> dict:
    from transformers import Qwen2_5_VLForConditionalGeneration

    from physreason.models.parallelize import apply_fsdp2, build_mesh, enable_activation_checkpointing
    from physreason.train.model import CausalLMLoss

    model = Qwen2_5_VLForConditionalGeneration(config).to(device=device, dtype=torch.float32)
    if args.ac_every > 0:
        enable_activation_checkpointing(model)
        # selective: keep checkpointing on every n-th decoder block only (works on every transformers 5.x)
        for index, block in enumerate(model.model.language_model.layers):
            block.gradient_checkpointing = index % args.ac_every == 0
    module = CausalLMLoss(model, loss_chunk_size=args.ce_chunk if args.chunked_ce else 0)
    param_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    mesh = build_mesh(device.type, 1, 1)
    apply_fsdp2(module, model, mesh["dp"], param_dtype, torch.float32)
    if args.compile:
        for block in model.model.language_model.layers:
            block.compile()
    module.train()
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-5, fused=device.type == "cuda")
    batch = make_batch(config, seq_len, args.packing, device)
    targets = batch.num_targets

    def step():
        (module(batch) / targets).backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    seconds = timed_steps(step, warmup, steps, device)
    memory = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
    del model, module, optimizer
    return {"seconds_per_step": seconds, "peak_gib": memory}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--chunked-ce", action="store_true", help="lm_head + CE in checkpointed sequence chunks")
    parser.add_argument("--ce-chunk", type=int, default=1024, help="tokens per CE chunk")
    parser.add_argument("--compile", action="store_true", help="torch.compile each decoder block")
    parser.add_argument("--packing", action="store_true", help="4 samples packed into the row")
    parser.add_argument("--ac-every", type=int, default=1, help="checkpoint every n-th block (0: none; 2: selective)")
    parser.add_argument("--skip-baseline", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes, to check the script on CPU")
    args = parser.parse_args()

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    config = qwen25_vl_3b_config(args.tiny)
    config.text_config._attn_implementation = "sdpa"
    flops = train_flops_per_token(config, args.seq_len)
    rows = {}
    if not args.skip_baseline:
        rows["transformers baseline"] = run_baseline(config, args.seq_len, device, args.warmup, args.steps)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    label = "physreason" + "".join(
        f" +{name}" for name, on in (("chunked-ce", args.chunked_ce), ("compile", args.compile), ("packing", args.packing),
                                    (f"ac-every-{args.ac_every}", args.ac_every != 1)) if on
    )
    rows[label] = run_ours(config, args.seq_len, device, args.warmup, args.steps, args)
    for row in rows.values():
        row["tokens_per_s"] = args.seq_len / row["seconds_per_step"]
        row["mfu"] = row["tokens_per_s"] * flops / PEAK_BF16_FLOPS
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    print(f"device {name}, seq_len {args.seq_len}, {flops / 1e9:.1f} GFLOP/token")
    print(f"{'run':<48} {'tok/s':>10} {'MFU':>7} {'peak GiB':>9} {'vs baseline':>12}")
    base = rows.get("transformers baseline", {}).get("tokens_per_s")
    for run, row in rows.items():
        ratio = f"{row['tokens_per_s'] / base:.2f}x" if base else "-"
        print(f"{run:<48} {row['tokens_per_s']:>10,.0f} {row['mfu']:>7.1%} {row['peak_gib']:>9.1f} {ratio:>12}")
    if os.environ.get("OUT"):
        payload = {"device": name, "args": vars(args), "flops_per_token": flops, "runs": rows, "date": time.strftime("%Y-%m-%d")}
        Path(os.environ["OUT"], "sft_throughput.json").write_text(json.dumps(payload, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
