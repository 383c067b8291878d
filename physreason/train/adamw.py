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

import importlib.util
import logging
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

log = logging.getLogger(__name__)


class AdamWBF16State(torch.optim.Optimizer):
    """torch's AdamW update with exp_avg and exp_avg_sq stored in bfloat16 (4 bytes per parameter instead of 8)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        grouped: bool = True,
    ) -> None:
        """`grouped` (CUDA): one Triton kernel per parameter group instead of one compiled kernel a parameter."""
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.grouped = grouped
        self.grouped_launches = 0  # kernels the grouped update launched (the GPU check proves it ran)
        self.per_parameter_updates = 0  # updates of one parameter each (compiled kernel, or eager on the host)
        self.table_builds = 0  # pointer tables built (once, then again only when a pointer moved: a new gradient)
        self._tables: dict[tuple, _Tables] = {}

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

        On a GPU the parameters of a group go through one Triton kernel (`grouped_adamw_bf16_update`: tables of
        pointers, one program per chunk of one tensor) that reads weight, gradient and both moments once and writes
        them once. A parameter it cannot take (not contiguous, a dtype other than float32/bfloat16, or Triton missing)
        gets one compiled kernel of its own (torch.compile of `adamw_bf16_update`). The eager form below launched about
        a dozen full-size kernels per parameter (SFT at 0.60x of fused float32 AdamW, H100, 3B shape); one compiled
        kernel a parameter reached 0.924x, the rest being the launch and guard cost of about 400 kernels a step.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grouped = self.grouped and _triton_found()
        for index, group in enumerate(self.param_groups):
            beta1, beta2 = group["betas"]
            lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
            buckets: dict[tuple, _Bucket] = {}
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    # zeros_like keeps a DTensor's mesh and placements, so each FSDP2 rank holds its own shard only
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(param, dtype=torch.bfloat16)
                    state["exp_avg_sq"] = torch.zeros_like(param, dtype=torch.bfloat16)
                step = float(state["step"]) + 1
                state["step"].fill_(step)  # `+= 1` (exact below 2**24 steps) at a third of its host time
                if grouped and (param.is_cuda or _GROUPED_ON_CPU):
                    tensors = (_local(param), _local(param.grad), _local(state["exp_avg"]), _local(state["exp_avg_sq"]))
                    found = _bucket_key(tensors, step)
                    if found is not None:
                        if tensors[0].numel():  # an FSDP2 rank's shard may be empty: nothing to update there
                            buckets.setdefault(found[0], _Bucket()).add(tensors, found[1])
                        continue
                if param.is_cuda:
                    tensors = tuple(
                        _flat(_local(t)) for t in (param, param.grad, state["exp_avg"], state["exp_avg_sq"])
                    )
                    scalars = (lr, beta1, beta2, eps, decay, 1 - beta1**step, math.sqrt(1 - beta2**step))
                    _compiled_update()(*tensors, *_scalar_tensors(scalars, tensors[0].device))
                    self.per_parameter_updates += 1
                    continue
                self.per_parameter_updates += 1
                # Elsewhere torch's single-tensor AdamW, operation for operation (its first step, bit for bit)
                grad = param.grad.float()
                exp_avg = state["exp_avg"].float().lerp_(grad, 1 - beta1)
                exp_avg_sq = state["exp_avg_sq"].float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                state["exp_avg"].copy_(exp_avg)
                state["exp_avg_sq"].copy_(exp_avg_sq)
                param.mul_(1 - lr * decay)
                denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
                param.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1**step))
            for key, bucket in buckets.items():
                step = key[-1]
                scalars = (lr, beta1, beta2, eps, decay, 1 - beta1**step, math.sqrt(1 - beta2**step))
                tables = self._tables.get((index, *key[:-1]))
                if tables is None or tables.rows != bucket.rows:  # a pointer moved (a new gradient, a resume)
                    tables = self._tables[(index, *key[:-1])] = _Tables(bucket, aligned=key[3], previous=tables)
                    self.table_builds += 1
                if self.grouped:
                    try:
                        grouped_adamw_bf16_update(tables, scalars)
                        self.grouped_launches += 1
                        continue
                    except Exception as error:  # noqa: BLE001 - the first launch compiles: a Triton that cannot is named
                        if self.grouped_launches:
                            raise
                        log.warning(
                            "bf16-state AdamW: the grouped Triton update failed to build (%s: %s); each "
                            "parameter gets its own compiled kernel instead (slower)",
                            type(error).__name__,
                            error,
                        )
                        self.grouped = grouped = False
                for tensors in bucket.members:
                    _compiled_update()(*map(_flat, tensors), *_scalar_tensors(scalars, tensors[0].device))
                self.per_parameter_updates += len(bucket.members)
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


# --- The grouped update: one Triton kernel for every parameter of a group ------------------------------------------
# Layout (apex's and torch's multi_tensor_apply, with tables instead of kernel arguments): a table of int64 rows, one
# per tensor (data_ptr of weight, gradient, exp_avg, exp_avg_sq, then numel), and a table of (row, chunk) pairs, one
# per program; a program updates CHUNK = BLOCK x ITERS elements of its tensor. The scalars are kernel arguments (lr
# and the bias corrections change every step; Triton does not specialise on floats), so nothing compiles again.
# A full chunk runs without masks (vectorised loads when every pointer is 16-byte aligned); the last chunk of a tensor
# is masked. The tables stay on the device while the tensors' pointers and sizes are the same (rebuilt when a pointer
# changes: a gradient re-allocated, a resumed run's new moments).

_GROUPED_ON_CPU = False  # host tensors through Triton's interpreter (TRITON_INTERPRET=1): the CPU tests only
BLOCK, ITERS = 1024, 16  # a program updates BLOCK x ITERS elements (16,384: 64 KiB of float32 weights)
WARPS = 4  # warps a program (chosen with bench/adamw_kernel.py, retired: bench/RESULTS.md)
_DTYPES = (torch.float32, torch.bfloat16)


def _triton_found() -> bool:
    if "found" not in _KERNELS:
        _KERNELS["found"] = importlib.util.find_spec("triton") is not None
    return bool(_KERNELS["found"])


def _bucket_key(tensors: tuple[torch.Tensor, ...], step: float) -> tuple[tuple, tuple[int, ...]] | None:
    """The bucket of a parameter the grouped kernel takes, (device index, weight dtype, gradient dtype, all 16-byte
    aligned, step), and its four data pointers; None for the rest: the kernel takes contiguous float32/bfloat16
    weights and gradients with bfloat16 moments. Called for every parameter every step, so kept to cheap calls."""
    param, grad, exp_avg, exp_avg_sq = tensors
    if param.dtype not in _DTYPES or grad.dtype not in _DTYPES:
        return None
    if exp_avg.dtype != torch.bfloat16 or exp_avg_sq.dtype != torch.bfloat16:
        return None
    if not (param.is_contiguous() and grad.is_contiguous() and exp_avg.is_contiguous() and exp_avg_sq.is_contiguous()):
        return None
    numel = param.numel()
    if grad.numel() != numel or exp_avg.numel() != numel or exp_avg_sq.numel() != numel:
        return None
    pointers = (param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr())
    aligned = not (pointers[0] | pointers[1] | pointers[2] | pointers[3]) & 15
    return (param.get_device(), param.dtype, grad.dtype, aligned, step), pointers


def chunk_table(numels: list[int], chunk: int) -> torch.Tensor:
    """int32 (row, chunk) pairs, flattened: one per program, every chunk of every tensor in order."""
    counts = torch.tensor([-(-n // chunk) for n in numels], dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int64), counts)
    first = torch.cumsum(counts, 0) - counts
    chunks = torch.arange(len(rows), dtype=torch.int64) - torch.repeat_interleave(first, counts)
    return torch.stack([rows, chunks], 1).to(torch.int32).reshape(-1)


class _Bucket:
    """The parameters of one group that one launch updates: their (weight, gradient, exp_avg, exp_avg_sq) and the
    pointer table's values (per tensor the four data pointers, then its length)."""

    def __init__(self) -> None:
        self.members: list[tuple[torch.Tensor, ...]] = []
        self.rows: list[int] = []

    def add(self, tensors: tuple[torch.Tensor, ...], pointers: tuple[int, ...]) -> None:
        self.members.append(tensors)
        self.rows.extend(pointers)
        self.rows.append(tensors[0].numel())


class _Tables:
    """The pointer and chunk tables of a bucket, on its device (kept while the bucket's `rows` stay the same)."""

    def __init__(self, bucket: _Bucket, aligned: bool, previous: _Tables | None = None) -> None:
        first = bucket.members[0]
        self.device = first[0].device
        self.param_dtype, self.grad_dtype = first[0].dtype, first[1].dtype
        self.aligned = aligned  # every pointer 16-byte aligned (the bucket's key says so)
        self.rows = list(bucket.rows)
        self.pointers = _to_device(torch.tensor(self.rows, dtype=torch.int64), self.device)
        self.numels = (self.rows[4::5], BLOCK * ITERS)
        if previous is not None and previous.numels == self.numels:  # only pointers moved: the same chunks
            self.chunks = previous.chunks
        else:
            self.chunks = _to_device(chunk_table(self.numels[0], BLOCK * ITERS), self.device)
        self.programs = self.chunks.numel() // 2


def _to_device(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`table` on `device` without stopping the host: a pinned copy (torch's host allocator keeps it until copied)."""
    if device.type != "cuda":
        return table.to(device)
    return table.pin_memory().to(device, non_blocking=True)


def grouped_adamw_bf16_update(tables: _Tables, scalars: tuple[float, ...]) -> None:
    """`adamw_bf16_update` of every tensor in `tables`, in one kernel launch; scalars as in `step`."""
    kernel = _grouped_kernel()
    lr, beta1, beta2, eps, decay, bias1, bias2_sqrt = (float(s) for s in scalars)
    arguments = dict(PARAM_BF16=tables.param_dtype == torch.bfloat16, GRAD_BF16=tables.grad_dtype == torch.bfloat16,
                     ALIGNED=tables.aligned, BLOCK=BLOCK, ITERS=ITERS)  # fmt: skip
    launch = kernel[(tables.programs,)]
    if tables.device.type == "cuda":
        with torch.cuda.device(tables.device):
            launch(tables.pointers, tables.chunks, lr, beta1, beta2, eps, decay, bias1, bias2_sqrt, **arguments,
                   num_warps=WARPS)  # fmt: skip
    else:  # Triton's interpreter (TRITON_INTERPRET=1) on host tensors: the CPU tests
        launch(tables.pointers, tables.chunks, lr, beta1, beta2, eps, decay, bias1, bias2_sqrt, **arguments)


_KERNELS: dict[str, Any] = {}


def _grouped_kernel() -> Any:
    """The Triton kernel (physreason.train.adamw_triton), imported at first use: only a GPU update needs Triton."""
    if "kernel" not in _KERNELS:
        from physreason.train.adamw_triton import adamw_bf16_grouped_kernel

        _KERNELS["kernel"] = adamw_bf16_grouped_kernel
    return _KERNELS["kernel"]
