"""Float8 training ([train.fp8]): the language model's linear layers run their matmuls in float8 (torchao).

torchao's `convert_to_float8_training` swaps chosen `nn.Linear` modules for `Float8Linear`, which keeps the
weight as a parameter of its own dtype (fp32 masters here) and casts inputs, weights and gradients to float8
with dynamic scales inside each matmul. So parameters, optimizer state, checkpoints and exports stay as they
were; only the compute changes.

The recipe follows torchtitan's (its float8 converter and parallelize order, torchao's float8 training docs):
- which layers: the language model's linears whose sides are multiples of 16 and large enough for float8 to pay
  (float8_pays: torchao's H100 thresholds per recipe); the vision tower and the lm_head stay in bf16, as
  cosmos-rl and torchtitan leave them. train.fp8.skip_small_linears = false converts the small ones too (checks).
- order (train/build.py): convert the plain model, then FSDP2, then torch.compile of each decoder block
  (nn.Module.compile runs FSDP2's hooks outside the graph whichever of the two comes first), so the casts and
  amaxes fuse into the block's other kernels; without train.compile they run one kernel each and float8 loses.
- tensorwise under FSDP2 over more than one rank: weights all-gather in float8 (half the traffic) and one fused
  amax pass after each optimizer step sets all their scales (precompute_scales_after_steps). rowwise all-gathers
  in bf16.
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


RECIPES = ("rowwise", "tensorwise")  # torchao's float8 recipes ([train.fp8] quant_recipe)
# Names of the projections of a decoder block, in the order the start-up and `plan` list them.
BLOCK_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Below this many tokens a micro-batch (the M side of every matmul) float8's casts cost more than its matmuls save
# (torchao's microbenchmarks start at M = 4,096; physreason measured 0.83x rowwise on the 3B shape at 4,096).
FLOAT8_MIN_TOKENS = 4096


def float8_pays(in_features: int, out_features: int, recipe: str) -> bool:
    """Whether float8 `recipe` is expected to beat bf16 on a linear layer with these sides (an H100, 4,096+ tokens).

    The matmul is (tokens x K) @ (K x N) with K = in_features, N = out_features. float8 halves the matmul time only
    when the matmul is large, and pays a cast (an amax and a scaled copy) of the input, the weight and the output
    gradient on every use, so narrow layers lose. The thresholds are torchao's (its per-linear forward + backward
    microbenchmarks on an H100, the rule torchao.float8._auto_filter_for_recipe and torchtitan's
    "auto_filter_small_kn" apply):
      tensorwise: skip K <= 4096 with N <= 1024 (GQA's k_proj / v_proj of hidden 2048 to 4096 models);
      rowwise: skip N <= 2048, K <= 1024, and N <= 4096 with K <= 2048 (a scale per row costs more to compute).
    What that converts of each decoder block (k_proj and v_proj stay in bf16 in every shape below):
      Qwen2.5-VL-3B (hidden 2048, MLP 11008): tensorwise q, o, gate, up, down; rowwise gate, up only.
      Qwen2.5-VL-7B (hidden 3584, MLP 18944) and Qwen3-VL-8B (hidden 4096, MLP 12288): both recipes q, o, gate, up, down.
      Qwen3-VL-2B (hidden 2048, MLP 6144): tensorwise q, o, gate, up, down; rowwise gate, up only.
    """
    if recipe == "tensorwise":
        return not (in_features <= 4096 and out_features <= 1024)
    if recipe == "rowwise":
        return not (out_features <= 2048 or in_features <= 1024 or (out_features <= 4096 and in_features <= 2048))
    raise ConfigError(f"train.fp8.quant_recipe = {recipe!r} is not known: use 'rowwise' or 'tensorwise'")


def float8_linear_filter(name: str, module: nn.Module, recipe: str = "rowwise", skip_small: bool = True) -> bool:
    """Whether module `name` converts: an nn.Linear of the language model, not lm_head, with sides multiple of 16
    (float8 matmul kernels need them) and, with skip_small, large enough for float8 `recipe` to pay (float8_pays)."""
    if not isinstance(module, nn.Linear):
        return False
    if "visual" in name or name.split(".")[-1] == "lm_head":
        return False
    if module.in_features % 16 or module.out_features % 16:
        return False
    return not skip_small or float8_pays(module.in_features, module.out_features, recipe)


def float8_all_gather(recipe: str, shard_ranks: int) -> bool:
    """Whether FSDP2 all-gathers the converted weights in float8: tensorwise only (one scale per weight lets each rank
    cast its own shard), and only when FSDP2 shards over more than one rank, as torchtitan does. On a one-rank mesh the
    "all-gather" is a local copy: casting in the FSDP2 hook (outside the compiled block) would cost more than the
    halved copy saves, so the weight arrives in bf16 and the compiled block casts it, fused with its amax."""
    return recipe == "tensorwise" and shard_ranks > 1


def _leaf(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def float8_outlook(
    linears: list[tuple[str, int, int]], tokens: int, recipe: str = "rowwise", compiled: bool = True,
    skip_small: bool = True,
) -> str:  # fmt: skip
    """One line on what [train.fp8] converts of a decoder block and whether float8 can pay (the start-up summary and
    `physreason plan` print it; nothing is refused).

    linears: (name, in_features, out_features) of one decoder block's linear layers; tokens: tokens per micro-batch;
    compiled: train.compile (float8's casts fuse into their neighbours only in compiled blocks).
    """
    chosen, kept = [], []
    for name, i, o in linears:
        if i % 16 or o % 16:
            kept.append(f"{name} ({i:,}x{o:,}: sides not multiples of 16)")
        elif skip_small and not float8_pays(i, o, recipe):
            kept.append(f"{name} ({i:,}x{o:,}: too small to pay)")
        else:
            chosen.append(name)
    if not chosen:
        return (
            f"no linear layer of this model is large enough for float8 {recipe} to beat bf16 (smallest matmul sides "
            "of torchao's H100 measurements; models/float8.py float8_pays): the model trains in bf16; "
            "train.fp8.skip_small_linears = false converts them anyway (slower), or set train.fp8.enable_fp8 = false"
        )
    line = f"float8 {recipe} runs {', '.join(chosen)} of each decoder block"
    if kept:
        line += f"; {', '.join(kept)} stay in bf16"
    slow = []
    if not compiled:
        slow.append("train.compile = false leaves float8's casts unfused (set train.compile = true)")
    if tokens < FLOAT8_MIN_TOKENS:
        slow.append(f"{tokens:,} tokens per micro-batch is under {FLOAT8_MIN_TOKENS:,} (raise train.mini_batch or the row length)")
    if slow:
        return f"{line}; float8 is expected to be slower than bf16 here: {'; '.join(slow)}"
    if recipe == "rowwise":  # measured, docs/fp8.md: its per-row scaling costs what its GEMMs save on one GPU
        return (
            f"{line}; on one H100 rowwise measured 0.99-1.00x of bf16 at the 3B and 8B shapes, tensorwise 1.13-1.16x "
            "(docs/fp8.md): set train.fp8.quant_recipe = 'tensorwise' for speed; bench/fp8.py sft measures this shape"
        )
    return f"{line}; bench/fp8.py sft measures the gain on this shape"


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
    model: nn.Module, recipe: str, all_gather: bool, module_filter_fn: Callable[[nn.Module, str], bool], emulate: bool
):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    # torchao's recipe as torchtitan takes it: from_recipe_name, then only the FSDP2 switch. (torchao 0.18 deprecates
    # force_recompute_fp8_weight_in_bwd and no longer reads it: recomputation is the activation checkpointing's.)
    config = dataclasses.replace(
        Float8LinearConfig.from_recipe_name(recipe), emulate=emulate, enable_fsdp_float8_all_gather=all_gather
    )
    if recipe == "rowwise":
        # torchtitan's setting for rowwise (pytorch/pytorch#150859): compiled casts round as eager ones do, so a
        # value cast in forward and again in backward lands on the same float8 number.
        import torch._inductor.config

        torch._inductor.config.emulate_precision_casts = True
    return convert_to_float8_training(model, config=config, module_filter_fn=module_filter_fn)


def convert_to_float8(
    model: nn.Module,
    recipe: str = "rowwise",
    all_gather: bool = False,
    convert: Callable[..., Any] | None = None,
    emulate: bool = False,
    skip_small: bool = True,
) -> list[str]:
    """Swap the language model's linear layers (float8_linear_filter) for float8 ones in place; returns their names.

    Call it on the plain transformers model, before torch.compile and before FSDP2 wraps the blocks (train/build.py).
    recipe: torchao's 'rowwise' or 'tensorwise'. all_gather: FSDP2 all-gathers the converted weights in float8
    (float8_all_gather; tensorwise only): then also call precompute_scales_after_steps on the optimizer. emulate:
    float8 casts with high-precision matmuls (CPU checks, see emulated_float8_on_cpu). skip_small: leave the layers
    too small for float8 to pay in bf16 (float8_pays); an empty list is returned when none is large enough.
    convert: torchao's converter by default (tests pass a stand-in; the signature is
    `convert(model, recipe, all_gather, module_filter_fn, emulate)`).
    """
    if recipe not in RECIPES:
        raise ConfigError(f"train.fp8.quant_recipe = {recipe!r} is not known: use 'rowwise' or 'tensorwise'")
    if all_gather and recipe != "tensorwise":
        raise ConfigError(f"float8 all-gather needs one scale per weight (tensorwise), not {recipe!r}")

    def chosen_by_filter(module: nn.Module, name: str) -> bool:
        return float8_linear_filter(name, module, recipe, skip_small)

    candidates = [name for name, module in model.named_modules() if float8_linear_filter(name, module, recipe, False)]
    if not candidates:
        raise ConfigError("train.fp8.enable_fp8 = true but the model has no language-model linear layer to convert")
    chosen = [name for name, module in model.named_modules() if chosen_by_filter(module, name)]
    if chosen:
        (convert or _torchao_convert)(model, recipe, all_gather, chosen_by_filter, emulate)
    return chosen


def _torchao_precompute(module: nn.Module) -> None:
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(module)


def precompute_scales_after_steps(
    optimizer: torch.optim.Optimizer, module: nn.Module, precompute: Callable[[nn.Module], None] | None = None
) -> Any:
    """After every optimizer.step(), compute the float8 scales of all of `module`'s float8-all-gathered weights in one
    pass (torchao's precompute_float8_dynamic_scale_for_fsdp: one foreach amax over the shards, one all-reduce for them
    all), so each FSDP2 all-gather casts its shard with a scale already there instead of an amax and an all-reduce per
    weight, twice a step. Needed exactly when convert_to_float8 ran with all_gather = True: the scale then belongs to
    the weights of the last step, so the hook must follow every step. Returns the hook's handle (remove() ends it).
    precompute: torchao's by default (tests pass a stand-in)."""
    run = precompute or _torchao_precompute

    def after_step(_optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        run(module)

    return optimizer.register_step_post_hook(after_step)
