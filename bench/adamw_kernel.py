"""bf16-state AdamW's grouped Triton update against torch's fused float32 AdamW, kernel alone, one GPU.

Tensors of the Qwen2.5-VL-3B decoder's shapes (--blocks of its 36; fp32 weights and gradients); per configuration of
(BLOCK, ITERS, WARPS) of physreason.train.adamw the median step time and the bytes moved a second (bf16 state reads
and writes 20 bytes an element, fused fp32 AdamW 28). Rows print as they finish; JSON to $OUT/adamw_kernel.json.

    python bench/adamw_kernel.py --configs 1024,16,4 4096,1,8 2048,4,8
"""

from __future__ import annotations

import argparse

import harness
import torch

import physreason.train.adamw as adamw

SHAPES = [(2048, 2048), (256, 2048), (256, 2048), (2048, 2048), (11008, 2048), (11008, 2048), (2048, 11008), (2048,),
          (2048,)]  # fmt: skip


def time_step(optimizer: torch.optim.Optimizer, steps: int) -> float:
    """Seconds a step after one warm-up step (which compiles the kernel and builds the tables)."""
    return harness.timed_steps(optimizer.step, 1, steps, torch.device("cuda"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=12, help="decoder blocks' worth of tensors")
    parser.add_argument("--configs", nargs="+", default=["1024,16,4", "4096,1,8", "2048,4,8", "1024,4,4", "8192,1,16"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    harness.emit(what="device", **harness.device_info(torch.device("cuda")))
    report = harness.Report("adamw_kernel", args.json)
    params = [torch.nn.Parameter(torch.randn(s, device="cuda")) for _ in range(args.blocks) for s in SHAPES]
    for p in params:
        p.grad = torch.randn_like(p)
    elements = sum(p.numel() for p in params)
    fused = torch.optim.AdamW(params, lr=1e-4, fused=True)
    seconds = time_step(fused, args.steps)
    report.row(dict(what="fused fp32 AdamW", tensors=len(params), elements=elements, ms=seconds * 1e3,
                    gb_per_s=28 * elements / seconds / 1e9))  # fmt: skip
    del fused
    for config in args.configs:
        adamw.BLOCK, adamw.ITERS, adamw.WARPS = (int(v) for v in config.split(","))
        optimizer = adamw.AdamWBF16State(params, lr=1e-4)
        seconds = time_step(optimizer, args.steps)
        report.row(dict(what=f"bf16 grouped {config}", tensors=len(params), elements=elements, ms=seconds * 1e3,
                        gb_per_s=20 * elements / seconds / 1e9, grouped_launches=optimizer.grouped_launches))  # fmt: skip
        del optimizer


if __name__ == "__main__":
    main()
