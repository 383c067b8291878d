"""The process runtime of a training job: process group and device, seeding, cross-rank sums, autocast.

Every job that trains (SFT, colocated GRPO, the Ray policy ranks) and the benches start here; the
trainers never set up torch.distributed themselves.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from physreason.cpu import apply_cpu_share
from physreason.errors import ConfigError
from physreason.train.allocator import use_expandable_segments


@dataclass
class Runtime:
    """Process layout of this run."""

    rank: int
    world_size: int
    device: torch.device
    # True when launched by torchrun: an in-process vLLM engine initialises torch.distributed too,
    # and that world of one must not turn the policy into an FSDP model.
    distributed: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def balances_vision(self) -> bool:
        """Whether a text batch runs the vision tower on a dummy input (parallelize.dummy_vision_features): only
        when other ranks share the tower's collectives. One process, under torchrun or not, has no one to keep in
        step with, so the dummy pass would only cost time."""
        return self.world_size > 1


def init_runtime() -> Runtime:
    """Join the torchrun process group when launched by torchrun (NCCL for GPU tensors and gloo for host ones on GPUs; gloo on CPU).

    Each process takes the GPU of its LOCAL_RANK, before the process group starts. With more processes on a node
    than visible GPUs this raises ConfigError naming both counts (CUDA_VISIBLE_DEVICES= runs on CPU with gloo).
    Its torch threads are sized to its share of the host's CPUs (physreason.cpu), logged once. On GPUs the CUDA
    allocator gets expandable segments unless the user set it (physreason.train.allocator), before the first allocation.
    """
    apply_cpu_share()
    cuda = torch.cuda.is_available()
    device = torch.device("cpu")
    if cuda:
        use_expandable_segments()
        local, visible = int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.device_count()
        if local >= visible:
            per_node = os.environ.get("LOCAL_WORLD_SIZE", str(local + 1))
            raise ConfigError(
                f"this process has LOCAL_RANK {local} (torchrun started {per_node} processes on this node) but only "
                f"{visible} GPU(s) are visible: launch with --nproc-per-node {visible} or fewer, check "
                "CUDA_VISIBLE_DEVICES, or set CUDA_VISIBLE_DEVICES= to run on CPU with gloo"
            )
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        # On GPUs, gloo beside NCCL for collectives on host tensors: with train.cpu_offload the gradients live in
        # host memory, and the gradient norm's reduction over ranks runs on them (NCCL takes no CPU tensors).
        dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    return Runtime(rank, world, device, distributed="WORLD_SIZE" in os.environ)


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch generators."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def all_reduce_max(value: float, runtime: Runtime, group: dist.ProcessGroup | None = None) -> float:
    """The largest `value` over the ranks of `group` (all ranks when None; the value itself in a single process)."""
    if not runtime.distributed or runtime.world_size == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=runtime.device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return float(tensor.item())


def all_reduce_sums(
    values: list[float], runtime: Runtime, group: dist.ProcessGroup | None = None
) -> list[float]:
    """all_reduce_sum of several values in one collective (one device sync a step instead of one a value)."""
    if not runtime.distributed or runtime.world_size == 1:
        return [float(v) for v in values]
    tensor = torch.tensor(values, dtype=torch.float64, device=runtime.device)
    dist.all_reduce(tensor, group=group)
    return tensor.tolist()


def gathered_counts(counts: Counter, runtime: Runtime, group: dist.ProcessGroup | None = None) -> Counter:
    """The sum of every rank's `counts` over `group` (keys may differ between ranks; the counts themselves in a single
    process)."""
    if not runtime.distributed or runtime.world_size == 1:
        return Counter(counts)
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, dict(counts), group=group)
    return sum((Counter(c) for c in everyone), Counter())


def all_reduce_sum(value: float, runtime: Runtime, group: dist.ProcessGroup | None = None) -> float:
    """Sum of `value` over the ranks of `group` (all ranks when None; the value itself in a single process).

    Under tensor parallelism the ranks of one TP group hold the same batch, so batch totals are summed
    over the data-parallel group only.
    """
    if not runtime.distributed or runtime.world_size == 1:  # a world of one: the sum is the value, no collective
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=runtime.device)
    dist.all_reduce(tensor, group=group)
    return float(tensor.item())


def autocast_context(runtime: Runtime, fsdp: bool, param_dtype: torch.dtype) -> Any:
    """Autocast to param_dtype for an unsharded model; FSDP2 (mixed-precision policy), the one-rank cast
    (parallelize.apply_compute_cast; pass fsdp=True for it too) and fp32 need none."""
    if fsdp or param_dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(runtime.device.type, dtype=param_dtype)
