"""AdamW whose two moments are kept in bfloat16 while the master weights stay float32 (train.optimizer_state_dtype).

Why written here: torch.optim.AdamW keeps its moments in the parameter's dtype (its kernels take one dtype for
parameter, gradient and state), and torchao's AdamW does the same; torchao's and bitsandbytes' smaller states are
8-bit / 4-bit block-quantised, compile a kernel per parameter shape with torch.compile (torchao) or target CUDA
without DTensor parameters (bitsandbytes). Rounding a float32 moment to bfloat16 needs no library: the update
below is torch's AdamW (decoupled decay, bias correction) computed in float32 from the stored moments, and only
the stored moments are rounded (to nearest, so a resumed run repeats the same bits).

Numerics: bfloat16 holds 8 significant bits, so a second moment whose decay per step, (1 - beta2) x v, is below
about 1/256 of v (beta2 = 0.999) keeps its value instead of decaying; it still grows with larger gradients. The
effect is a slightly more conservative step after a gradient spike.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch


class AdamWBF16State(torch.optim.Optimizer):
    """torch's AdamW update with exp_avg and exp_avg_sq stored in bfloat16 (4 bytes per parameter instead of 8)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's loader, then the moments back to bfloat16.

        torch.optim.Optimizer.load_state_dict casts every floating state tensor to its parameter's dtype: a resumed
        run would otherwise hold float32 moments (twice the memory, and steps that differ from an unbroken run).
        """
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    state[key] = state[key].to(torch.bfloat16)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One AdamW update of every parameter that has a gradient; returns closure's loss when given one.

        On a GPU each parameter's update is one fused kernel (torch.compile of `adamw_bf16_update`, one kernel for
        every shape): read weight, gradient and both moments once, write them once. The eager form below launched
        about a dozen full-size kernels per parameter and ran SFT at 0.60x of fused float32 AdamW (H100, 3B shape).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    # zeros_like keeps a DTensor's mesh and placements, so each FSDP2 rank holds its own shard only
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(param, dtype=torch.bfloat16)
                    state["exp_avg_sq"] = torch.zeros_like(param, dtype=torch.bfloat16)
                state["step"] += 1
                step = float(state["step"])
                if param.device.type == "cuda":
                    tensors = [_flat(_local(t)) for t in (param, param.grad, state["exp_avg"], state["exp_avg_sq"])]
                    scalars = (lr, beta1, beta2, eps, decay, 1 - beta1**step, math.sqrt(1 - beta2**step))
                    _compiled_update()(*tensors, *_scalar_tensors(scalars, tensors[0].device))
                    continue
                # Elsewhere torch's single-tensor AdamW, operation for operation (its first step, bit for bit)
                grad = param.grad.float()
                exp_avg = state["exp_avg"].float().lerp_(grad, 1 - beta1)
                exp_avg_sq = state["exp_avg_sq"].float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                state["exp_avg"].copy_(exp_avg)
                state["exp_avg_sq"].copy_(exp_avg_sq)
                param.mul_(1 - lr * decay)
                denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
                param.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1**step))
        return loss


def adamw_bf16_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    lr: torch.Tensor,
    beta1: torch.Tensor,
    beta2: torch.Tensor,
    eps: torch.Tensor,
    decay: torch.Tensor,
    bias1: torch.Tensor,
    bias2_sqrt: torch.Tensor,
) -> None:
    """torch's AdamW update of one tensor in float32 from bfloat16 moments, in place; scalars as 0-dim float32 tensors
    (so a compiled kernel takes every step's learning rate and bias corrections without compiling again)."""
    g = grad.float()
    m = exp_avg.float()
    m = m + (g - m) * (1 - beta1)
    v = exp_avg_sq.float() * beta2 + g * g * (1 - beta2)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    denom = v.sqrt() / bias2_sqrt + eps
    param.copy_(param * (1 - lr * decay) - (lr / bias1) * m / denom)


_COMPILED: dict[str, Callable[..., None]] = {}


def _compiled_update() -> Callable[..., None]:
    """adamw_bf16_update compiled once for every shape (dynamic shapes; scalars are tensors, so no recompiles)."""
    if "update" not in _COMPILED:
        _COMPILED["update"] = torch.compile(adamw_bf16_update, dynamic=True, fullgraph=True)
    return _COMPILED["update"]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the update is elementwise, so each rank updates its own), else the tensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D view of a contiguous tensor: one compiled kernel then serves every size (only the length varies)."""
    return tensor.view(-1) if tensor.is_contiguous() else tensor


_SCALARS: dict[tuple, list[torch.Tensor]] = {}


def _scalar_tensors(values: tuple[float, ...], device: torch.device) -> list[torch.Tensor]:
    """0-dim float32 tensors of `values` on `device` (one small copy a parameter group would need; cached by value)."""
    key = (values, str(device))
    found = _SCALARS.get(key)
    if found is None:
        if len(_SCALARS) > 64:
            _SCALARS.clear()
        found = list(torch.tensor(values, dtype=torch.float32, device=device).unbind())
        _SCALARS[key] = found
    return found
