"""torchrun worker for tests/test_grad_norm_parallel.py: the clipped gradient norm over dp x tp vs one process.

argv: layouts as "DPxTP,..." (DP x TP = the number of processes), output JSON path. Per layout every rank builds the
tiny Qwen3-VL model twice (same seed): one whole in this process, the other tensor-parallel over TP ranks and FSDP2
over DP ranks (as physreason.train.build.shard lays a run out). Both take the same batch (a video row and a text row)
on every rank, so FSDP2's mean over the dp ranks is the whole model's gradient. Both are clipped to half their norm
(torch.nn.utils.clip_grad_norm_ for the whole model, parallelize.clip_grad_norm counted by CommDebugMode for the
split one) and take one SGD step. Rank 0 writes, per layout, both norms, the collectives the clip made, and the
largest clipped-gradient and parameter differences relative to each parameter's largest entry.

On GPUs (one per rank, NCCL) it runs the same in float32 without TF32:
    torchrun --standalone --nproc-per-node 2 tests/grad_norm_worker.py 2x1,1x2 norms.json
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from cp_worker import text_sample, video_sample
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from physreason.data.collate import collate_padded
from physreason.models.parallelize import apply_fsdp2, apply_tensor_parallel, build_mesh, clip_grad_norm
from physreason.models.tiny import build_tiny_model, build_tiny_tokenizer
from physreason.train.model import CausalLMLoss


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def relative_gaps(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> float:
    """The largest difference over all parameters, each relative to that parameter's largest entry."""
    assert want.keys() == got.keys(), sorted(set(want) ^ set(got))
    return max(float((got[n] - w).abs().max()) / (float(w.abs().max()) + 1e-12) for n, w in want.items())


def compare(layout: str, device: torch.device) -> dict:
    dp, tp = (int(part) for part in layout.split("x"))
    assert dp * tp == dist.get_world_size(), layout
    tokenizer = build_tiny_tokenizer()
    whole = build_tiny_model("qwen3_vl", tokenizer, seed=0).to(device).train()
    split = build_tiny_model("qwen3_vl", tokenizer, seed=0).to(device).train()
    mesh = build_mesh(device.type, dp * tp, tp)
    if tp > 1:
        apply_tensor_parallel(split, mesh["tp"])
    split_loss = CausalLMLoss(split)  # the wrapper FSDP2's root shards, as a run wraps the model it trains
    apply_fsdp2(split_loss, split, mesh["dp"], param_dtype=torch.float32)
    samples = [video_sample(whole, 4, 3, 7, seed=1), text_sample(whole, 14, 6, seed=2)]
    batch = collate_padded(samples, tokenizer.pad_token_id, mrope=True).to(device)
    for loss in (CausalLMLoss(whole), split_loss):
        loss(batch).backward()
    whole_params = [p for p in whole.parameters() if p.grad is not None]
    before = float(torch.nn.utils.get_total_norm([p.grad for p in whole_params]))
    whole_norm = float(torch.nn.utils.clip_grad_norm_(whole_params, before / 2))
    counter = CommDebugMode()
    with counter:
        split_norm = float(clip_grad_norm([p for p in split.parameters() if p.grad is not None], before / 2))
    want = {n: p.grad.clone() for n, p in whole.named_parameters() if p.grad is not None}
    got = {n: full(p.grad) for n, p in split.named_parameters() if p.grad is not None}
    grad_gap = relative_gaps(want, got)
    for model in (whole, split):
        torch.optim.SGD(model.parameters(), lr=1.0).step()
    param_gap = relative_gaps(dict(whole.named_parameters()), {n: full(p) for n, p in split.named_parameters()})
    return {
        "whole_norm": whole_norm,
        "split_norm": split_norm,
        "collectives": counter.get_total_counts(),
        "grad_gap": grad_gap,
        "param_gap": param_gap,
        "grads": len(want),
        "tower_grads": sum(name.startswith("model.visual.") for name in want),
    }


def main() -> None:
    layouts, out = sys.argv[1], sys.argv[2]
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo")
    results = {layout: compare(layout, device) for layout in layouts.split(",")}
    if dist.get_rank() == 0:
        with open(out, "w") as handle:
            json.dump(results, handle)
        print(json.dumps(results), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
