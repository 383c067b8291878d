"""Float8 training ([train.fp8]): the language model's linear layers run their matmuls in float8 (torchao).

torchao's `convert_to_float8_training` swaps chosen `nn.Linear` modules for `Float8Linear`, which keeps the
weight as a parameter of its own dtype (fp32 masters here) and casts inputs, weights and gradients to float8
with dynamic scales inside each matmul. So parameters, optimizer state, checkpoints and exports stay as they
were; only the compute changes. The vision tower and the lm_head stay in bf16, as cosmos-rl leaves them, and
so does any layer whose sides are not multiples of 16 (float8 matmul kernels need them). Conversion comes
before FSDP2 wraps the blocks; with the 'tensorwise' recipe FSDP2 all-gathers the weights in float8.
Float8 training is refused off CUDA, except inside `emulated_float8_on_cpu()`, which scripts' CPU checks use.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import torch
from torch import nn

from physreason.errors import ConfigError

# torchao's float8 training releases this code was written and tested against (pyproject's `fp8` extra).
TORCHAO_RANGE = ">=0.18,<0.19"
MIN_CAPABILITY = (8, 9)  # Ada / Hopper: the first GPUs with float8 tensor cores
_CPU_EMULATION: ContextVar[bool] = ContextVar("float8_cpu_emulation", default=False)


@contextlib.contextmanager
def emulated_float8_on_cpu() -> Iterator[None]:
    """Within this block, [train.fp8] runs on CPU with torchao's emulated matmuls (for scripts' CPU checks only).

    The casts to float8 and their dynamic scales are the real ones; each matmul then runs on the dequantized values in
    high precision (torchao's `emulate`, its own test mode). torchao's CPU float8 matmul kernel is a reference loop
    (seconds per linear layer for a few hundred tokens), so emulation is what lets a CPU run of a whole SFT job finish.
    It says nothing about float8's speed.
    """
    token = _CPU_EMULATION.set(True)
    try:
        yield
    finally:
        _CPU_EMULATION.reset(token)


def float8_linear_filter(name: str, module: nn.Module) -> bool:
    """Whether module `name` converts: an nn.Linear of the language model, not lm_head, with sides multiple of 16."""
    if not isinstance(module, nn.Linear):
        return False
    if "visual" in name or name.split(".")[-1] == "lm_head":
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


# Below this on any side (input, output, tokens of a micro-batch) torchao's float8 matmuls lose to bf16 (its own
# measurements: about 0.8x for small matmuls), and physreason's own runs found no shape where float8 paid yet.
FLOAT8_MIN_SIDE = 4096
# physreason's measurements (bench/RESULTS.md, one H100, 4,096-token rows, compiled blocks): float8 / bf16 tokens/s.
FLOAT8_MEASURED = "0.83x rowwise and 0.49x tensorwise on the 3B shape (hidden 2048), 0.96x and 0.79x on the Qwen3-VL-8B shape (hidden 4096)"


def float8_outlook(hidden: int, intermediate: int, tokens: int) -> str:
    """One line on whether [train.fp8] can pay for a language model of `hidden` and MLP `intermediate` width with
    `tokens` tokens a micro-batch (start-up summary and `physreason plan` print it; nothing is refused)."""
    side = min(hidden, intermediate, tokens)
    if side < FLOAT8_MIN_SIDE:
        which = "tokens per micro-batch" if side == tokens else "hidden size" if side == hidden else "MLP width"
        return (
            f"float8 is expected to be slower than bf16 here: its smallest matmul side ({which} {side:,}) is under "
            f"{FLOAT8_MIN_SIDE:,}, where float8 casts cost more than the faster matmuls save (measured here: "
            f"{FLOAT8_MEASURED}); set train.fp8.enable_fp8 = false unless bench/fp8.py shows a gain on this shape"
        )
    return (
        f"float8 has not yet been measured faster than bf16 in physreason ({FLOAT8_MEASURED}); this shape's matmuls "
        f"(hidden {hidden:,}, MLP {intermediate:,}, {tokens:,} tokens) are large enough that it may: check with "
        "bench/fp8.py before a long run"
    )


def check_float8_support(device: torch.device) -> None:
    """Raise ConfigError unless torchao is installed and `device` is a CUDA GPU of compute capability 8.9 or more."""
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError(
            f"train.fp8.enable_fp8 = true needs torchao: pip install 'physreason[fp8]' (torchao{TORCHAO_RANGE}), "
            "or set train.fp8.enable_fp8 = false"
        )
    if device.type == "cpu" and _CPU_EMULATION.get():
        return
    if device.type != "cuda":
        raise ConfigError(
            f"train.fp8.enable_fp8 = true runs float8 matmuls on a CUDA GPU, but this run is on {device.type}: "
            "set train.fp8.enable_fp8 = false"
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        raise ConfigError(
            f"train.fp8.enable_fp8 = true needs float8 tensor cores (compute capability 8.9 or more: H100, L40S, "
            f"RTX 4090), but {torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}: set "
            "train.fp8.enable_fp8 = false"
        )


def _torchao_convert(
    model: nn.Module, recipe: str, fsdp: bool, module_filter_fn: Callable[[nn.Module, str], bool], emulate: bool
):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)
    if fsdp and recipe == "tensorwise":
        # One scale per weight lets each rank cast its shard and FSDP2 all-gather float8: half the traffic.
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    return convert_to_float8_training(model, config=config, module_filter_fn=module_filter_fn)


def convert_to_float8(
    model: nn.Module,
    recipe: str = "rowwise",
    fsdp: bool = False,
    convert: Callable[..., Any] | None = None,
    emulate: bool = False,
) -> list[str]:
    """Swap the language model's linear layers (float8_linear_filter) for float8 ones in place; returns their names.

    recipe: torchao's 'rowwise' or 'tensorwise'. fsdp: the model will be wrapped by FSDP2 (tensorwise then
    all-gathers in float8). emulate: float8 casts with high-precision matmuls (CPU checks, see
    emulated_float8_on_cpu). convert: torchao's converter by default (tests pass a stand-in; the signature is
    `convert(model, recipe, fsdp, module_filter_fn, emulate)`).
    """
    if recipe not in ("rowwise", "tensorwise"):
        raise ConfigError(f"train.fp8.quant_recipe = {recipe!r} is not known: use 'rowwise' or 'tensorwise'")
    chosen = [name for name, module in model.named_modules() if float8_linear_filter(name, module)]
    if not chosen:
        raise ConfigError("train.fp8.enable_fp8 = true but the model has no language-model linear layer to convert")
    (convert or _torchao_convert)(model, recipe, fsdp, lambda module, name: float8_linear_filter(name, module), emulate)
    return chosen
