"""AdamW and the learning-rate schedule: linear warmup, then cosine, linear or constant decay."""

from __future__ import annotations

import math

import torch
from torch import nn

from physreason.config import TrainConfig
from physreason.train.adamw import AdamWBF16State


def lr_factor(step: int, warmup: int, total: int, decay: str, min_factor: float) -> float:
    """Multiplier of the peak lr for the update after `step` completed updates."""
    if step < warmup:
        return (step + 1) / warmup
    if decay == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if decay == "cosine" else 1.0 - progress
    return min_factor + (1.0 - min_factor) * shape


def fused_adamw(device: torch.device, cpu_offload: bool) -> bool:
    """Whether float32-state AdamW takes torch's fused kernel: on CUDA, and on the host under train.cpu_offload.

    Offloaded parameters are CPU DTensors. Left to its default there, torch's AdamW takes its single-tensor path (its
    foreach kernels exist only on accelerators): about a dozen full passes over memory per parameter, each op
    dispatched through DTensor. The fused CPU kernel (torch >= 2.4) reads weight, gradient and moments once per
    parameter, vectorised over torch's threads (physreason.cpu sizes them).
    """
    return device.type == "cuda" or cpu_offload


def build_optimizer(model: nn.Module, config: TrainConfig, total_steps: int, fused: bool = False):
    """AdamW over trainable parameters (no decay on biases and norms) and its LambdaLR schedule.

    train.optimizer_state_dtype = 'bfloat16' keeps the moments in bfloat16 (physreason.train.adamw).
    """
    decay, no_decay = [], []
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            (no_decay if parameter.ndim < 2 else decay).append(parameter)
    groups = [
        {"params": decay, "weight_decay": config.optm_weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if config.optimizer_state_dtype == "bfloat16":
        optimizer: torch.optim.Optimizer = AdamWBF16State(groups, lr=config.optm_lr, betas=config.optm_betas)
    else:
        optimizer = torch.optim.AdamW(groups, lr=config.optm_lr, betas=config.optm_betas, fused=fused or None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_factor(step, config.optm_warmup_steps, total_steps, config.optm_decay_type, config.optm_min_lr_factor),
    )
    return optimizer, scheduler
