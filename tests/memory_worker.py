"""torchrun worker for tests/test_memory_plan.py: one FSDP2 step of a tiny model, then the bytes each rank holds."""

import json
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from physreason.config import load_config
from physreason.train.adamw import AdamWBF16State
from physreason.train.build import build_training_model
from physreason.train.runtime import init_runtime


class LogitMean(nn.Module):
    """A text-only loss: enough to give every language parameter a gradient."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, use_cache=False).logits.float().square().mean()


def local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def held(trained, optimizer) -> dict:
    params = list(trained.module.parameters())
    states = [t for s in optimizer.state.values() for k, t in s.items() if k != "step"]
    return {
        "parameters": sum(local_bytes(p) for p in params),
        "gradients": sum(local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer state": sum(local_bytes(t) for t in states),
        "devices": sorted({str((p.to_local() if isinstance(p, DTensor) else p).device) for p in params}),
    }


def main() -> None:
    config = load_config(None, json.loads(sys.argv[1]))
    runtime = init_runtime()
    trained = build_training_model(config, runtime, LogitMean, optimizer_steps=4)
    ids = torch.arange(12).reshape(2, 6) + 3 * runtime.rank
    losses, report = [], {}
    for name in ("float32", "bfloat16"):
        optimizer = trained.optimizer if name == "float32" else AdamWBF16State(
            [p for p in trained.module.parameters() if p.requires_grad], lr=1e-3
        )
        loss = trained.module(ids)
        loss.backward()
        optimizer.step()
        report[name] = held(trained, optimizer)
        losses.append(float(loss.detach()))
        optimizer.zero_grad(set_to_none=True)
    report["losses"] = losses
    with open(f"{sys.argv[2]}.rank{runtime.rank}.json", "w") as out:
        json.dump(report, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
