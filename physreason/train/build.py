"""Build the model a training job optimises: load, freeze, LoRA, checkpoint activations, shard (TP, FSDP2), compile, optimizer.

On one process ([train] one_rank_precision = "cast", the default) there is no FSDP2: each block's float32
parameters are cast to param_dtype for its forward (parallelize.apply_compute_cast), FSDP2's numerics without its
collectives and copies.

SFT, colocated GRPO and the Ray policy ranks build their model here; they differ only in the wrapper
around the transformers model (the loss module or the policy scorer) and in the number of optimizer
steps the schedule spans. Every stage is a named function, applied in the order `build_training_model`
lists, so the steps read like the recipe.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from physreason.config import Config, ModelConfig, TrainConfig
from physreason.errors import ConfigError
from physreason.models import loading, parallelize
from physreason.models.context_parallel import ContextParallel
from physreason.train.host_step import OverlappedHostStep
from physreason.train.runtime import Runtime, autocast_context
from physreason.train.schedule import build_optimizer, fused_adamw

log = logging.getLogger(__name__)

# The wrapper a job trains: the transformers model in, a module whose forward is the job's loss or scores out.
# Every parameter stays behind that one forward, so FSDP2's root hooks gather the embedding and lm_head.
Wrap = Callable[[nn.Module], nn.Module]


@dataclass
class TrainingModel:
    """The trained model, laid out on this job's processes, with its optimizer, schedule and autocast context."""

    model: nn.Module  # the transformers model (exports and engine weight pushes read it)
    module: nn.Module  # the wrapper around it that the optimizer trains
    optimizer: torch.optim.Optimizer
    scheduler: Any
    autocast: Any  # the context every forward of `module` runs in
    dp_group: dist.ProcessGroup | None = None  # the data-parallel group under torchrun (None in one process)
    reference: nn.Module | None = None  # a frozen copy wrapped the same way (GRPO's KL reference), or None
    peft: nn.Module | None = None  # with [train.lora]: the PeftModel around `model` (adapter saves), else None
    # train.cpu_offload on one rank: the gradient norm from FSDP2's reduce outputs on the GPU (clip_and_step), else None
    reduced_norm: parallelize.ReducedGradNorm | None = None
    # train.cpu_offload_overlap: the host's AdamW a unit at a time beside the next forward; wait() before reading
    # weights or optimizer state (physreason.train.host_step), else None
    overlap: OverlappedHostStep | None = None

    def wait_for_step(self) -> None:
        """Wait for the optimizer step in flight (train.cpu_offload_overlap); nothing to wait for otherwise."""
        if self.overlap is not None:
            self.overlap.wait()


def check_lora(config: Config) -> None:
    """Reject [train.lora] combinations that cannot work, naming the keys to change."""
    lora = config.train.lora
    if not lora.enable:
        return
    if config.policy.parallelism.tp_size > 1:
        raise ConfigError(
            "train.lora.enable = true with policy.parallelism.tp_size > 1: LoRA layers are not tensor-parallel here; "
            "use tp_size = 1 (FSDP2 shards the frozen base over the data-parallel ranks)"
        )
    if lora.vision and config.train.freeze_vision_tower:
        raise ConfigError(
            "train.lora.vision = true puts trainable adapters on the vision tower, which train.freeze_vision_tower = "
            "true freezes: set one of them to false"
        )


def load_trainable(model_config: ModelConfig, train: TrainConfig) -> tuple[nn.Module, nn.Module | None]:
    """Load fp32 master weights, freeze the vision tower, inject LoRA and turn on activation checkpointing as configured.

    Returns the transformers model and, with [train.lora] enabled, the PeftModel around it (else None). With LoRA
    only the adapters (and lora.modules_to_save) train; the base weights are frozen.
    """
    model = loading.load_model(model_config, dtype=torch.float32)
    if train.freeze_vision_tower:
        parallelize.freeze_vision_tower(model)
    peft_model = None
    if train.lora.enable:
        from physreason.models.lora import apply_lora

        peft_model = apply_lora(model, train.lora)
    if train.gradient_checkpointing:
        every = train.checkpoint_every
        if every == "auto":  # the trainers resolve it against their GPU first (memory_report.resolve_checkpoint_every)
            log.warning("train.checkpoint_every = 'auto' was not resolved against a GPU's memory: every block recomputed")
            every = 1
        parallelize.enable_activation_checkpointing(model, every, train.vision_checkpoint_every)
    return model, peft_model


def load_frozen(model_config: ModelConfig) -> nn.Module:
    """Load fp32 weights that never train (a KL reference)."""
    return loading.load_model(model_config, dtype=torch.float32).requires_grad_(False)


def apply_float8(model: nn.Module, config: Config, runtime: Runtime) -> bool:
    """[train.fp8]: float8 matmuls in the language model's linear layers, before FSDP2 wraps them and before the blocks
    compile (models/float8.py). Returns whether FSDP2 all-gathers the weights in float8 (then the optimizer needs
    float8.precompute_scales_after_steps)."""
    from physreason.models.float8 import (
        check_float8_support,
        convert_to_float8,
        float8_all_gather,
        float8_outlook,
    )

    fp8 = config.train.fp8
    if config.train.lora.enable:
        raise ConfigError(
            "train.fp8.enable_fp8 = true with train.lora.enable = true: float8 training covers full fine-tuning; "
            "turn one of them off"
        )
    if config.policy.parallelism.tp_size > 1:
        raise ConfigError(
            "train.fp8.enable_fp8 = true with policy.parallelism.tp_size > 1: float8 layers are not tensor-parallel "
            "here; use tp_size = 1 (FSDP2)"
        )
    check_float8_support(runtime.device)
    # Off CUDA only under emulated_float8_on_cpu (the check refuses CPU otherwise).
    emulate = runtime.device.type == "cpu"
    # FSDP2 shards over dp x cp, i.e. every process (tp_size is 1 here).
    all_gather = float8_all_gather(fp8.quant_recipe, runtime.world_size if runtime.distributed else 1)
    block = loading.decoder_layers(model)[0]
    linears = [(name.rsplit(".", 1)[-1], m.in_features, m.out_features)
               for name, m in block.named_modules() if isinstance(m, nn.Linear)]  # fmt: skip
    chosen = convert_to_float8(model, fp8.quant_recipe, all_gather, emulate=emulate, skip_small=fp8.skip_small_linears)
    tokens = config.model.model_max_length * config.train.mini_batch
    if runtime.is_main:
        outlook = float8_outlook(linears, tokens, fp8.quant_recipe, config.train.compile, fp8.skip_small_linears)
        log.warning("[train.fp8] %s (%d layers converted%s)", outlook, len(chosen),
                    ", float8 all-gather" if all_gather and chosen else "")  # fmt: skip
    return all_gather and bool(chosen)


def compute_cast(config: Config, runtime: Runtime) -> bool:
    """Whether this run takes the one-rank path (parallelize.apply_compute_cast; a plain module in float32): one
    process, [train] one_rank_precision = "cast" and no CPU offload (which keeps FSDP2). float8 takes it too: its
    layers cast the bf16 copies (H100, 3B shape, 2026-11-28: tensorwise 1.16x of bf16 there; under FSDP2's one-rank
    copies it had been 0.74x)."""
    train = config.train
    return runtime.world_size == 1 and train.one_rank_precision == "cast" and not train.cpu_offload


def shard(
    wrapper: nn.Module, model: nn.Module, runtime: Runtime, mesh: DeviceMesh | None, train: TrainConfig,
    cast: bool = False,
) -> None:
    """Tensor-parallel, context-parallel hooks, then FSDP2 over `mesh` (under torchrun), or just onto this process's
    device: there, with `cast`, each block's parameters are cast to param_dtype for its forward (apply_compute_cast)."""
    if mesh is None:
        wrapper.to(runtime.device)
        if cast:
            parallelize.apply_compute_cast(wrapper, model, loading.DTYPES[train.param_dtype])
        return
    if mesh["tp"].size() > 1:
        parallelize.apply_tensor_parallel(model, mesh["tp"])
    if mesh["cp"].size() > 1:
        ContextParallel(mesh["cp"].get_group()).install(model, mesh["tp"].size())
    # No model.to(device) first: fully_shard moves one unit at a time, so a 32B model never sits whole on one GPU.
    parallelize.apply_fsdp2(
        wrapper, model, parallelize.fsdp_mesh(mesh), loading.DTYPES[train.param_dtype],
        loading.DTYPES[train.fsdp_reduce_dtype],
        cpu_offload=train.cpu_offload,
    )


# Compiled variants of the one decoder-block code every block shares: checkpointed or not (train.ac_every), the first
# row length and then a dynamic one, training and no-grad passes (validation, GRPO's old log-probs), x float8 or not.
# A CPU trace of a Qwen2.5-VL block with ac_every 2 and a validation pass already made 7; torch's default limit is 8,
# past which dynamo runs the block eagerly from then on, silently.
BLOCK_RECOMPILE_LIMIT = 64


def compile_blocks(model: nn.Module, decoder: bool = True, vision: bool = False) -> None:
    """torch.compile each decoder block (`decoder`) and each vision-encoder block (`vision`) in place; the blocks
    repeat, so one graph serves them all.

    Rows of varying length (SFT pads to multiples of 16 under float8) cost one recompile at the second length, which
    marks the length dynamic; later lengths reuse that graph. Vision blocks likewise: the grouped vision attention
    (models/vision_attention.py) takes its segment lengths and counts as integers, which torch makes dynamic after the
    first recompiles; new patch grids then reuse the graphs (tests/test_compile_vision_shapes.py: six grids, five
    graphs), and only a new number of distinct segment lengths (a loop of another length) compiles again.
    """
    tower = loading.vision_tower(model)
    if vision and tower is None:
        raise ConfigError(
            f"train.compile_vision = true, but {type(model).__name__} has no vision encoder: set "
            "train.compile_vision = false"
        )
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), BLOCK_RECOMPILE_LIMIT))
    blocks = [*(loading.decoder_layers(model) if decoder else ()), *(tower.blocks if vision else ())]
    for block in blocks:
        block.compile()


def build_training_model(
    config: Config,
    runtime: Runtime,
    wrap: Wrap,
    optimizer_steps: int,
    reference: ModelConfig | None = None,
    overlaps_step: bool = False,
) -> TrainingModel:
    """Load config.model, wrap it, shard it over the job's processes, compile it and build its optimizer.

    wrap: builds the module the optimizer trains around the transformers model. optimizer_steps: the
    optimizer steps the learning-rate schedule spans. reference: a checkpoint loaded frozen, wrapped
    the same way and sharded like the policy (GRPO's KL reference); None loads none. overlaps_step: the caller
    steps through TrainingModel.overlap under train.cpu_offload_overlap (SFT); other callers refuse that key.
    """
    train = config.train
    if train.cpu_offload_overlap and not overlaps_step:
        raise ConfigError(
            "train.cpu_offload_overlap = true is implemented for SFT only: set train.cpu_offload_overlap = false"
        )
    check_lora(config)
    cp = config.policy.parallelism.cp_size
    if cp > 1 and not runtime.distributed:
        raise ConfigError(
            f"policy.parallelism.cp_size = {cp} splits each row over {cp} processes, but this run has 1 process: launch "
            f"with torchrun --nproc-per-node a multiple of {cp}, or set policy.parallelism.cp_size = 1"
        )
    if train.cpu_offload and not runtime.distributed:
        raise ConfigError(
            "train.cpu_offload = true offloads FSDP2's shards, and FSDP2 runs under torchrun: launch with "
            "torchrun --nproc-per-node N (1 works), or set train.cpu_offload = false"
        )
    model, peft_model = load_trainable(config.model, train)
    float8_all_gather = apply_float8(model, config, runtime) if train.fp8.enable_fp8 else False
    module = wrap(model)
    frozen = wrap(load_frozen(reference)).eval() if reference is not None else None
    mesh = None
    cast = compute_cast(config, runtime)
    if runtime.distributed and not cast:
        parallelism = config.policy.parallelism
        mesh = parallelize.build_mesh(runtime.device.type, runtime.world_size, parallelism.tp_size, parallelism.cp_size)
    for wrapper in (module, frozen):
        if wrapper is not None:
            shard(wrapper, wrapper.model, runtime, mesh, train, cast)
    if train.compile or train.compile_vision:
        compile_blocks(model, decoder=train.compile, vision=train.compile_vision)
    module.train()
    fused = fused_adamw(runtime.device, train.cpu_offload)  # offloaded shards step on the host, fused there too
    optimizer, scheduler = build_optimizer(module, train, optimizer_steps, fused=fused)
    if float8_all_gather:
        from physreason.models.float8 import precompute_scales_after_steps

        precompute_scales_after_steps(optimizer, module)
    return TrainingModel(
        model,
        module,
        optimizer,
        scheduler,
        autocast_context(runtime, mesh is not None or cast, loading.DTYPES[train.param_dtype]),
        mesh["dp"].get_group() if mesh is not None else None,
        frozen,
        peft_model,
        # offloaded gradients: their norm on the GPU saves clipping a read of all of them on the host
        parallelize.ReducedGradNorm.attach(module) if train.cpu_offload else None,
        OverlappedHostStep(module, optimizer) if train.cpu_offload_overlap else None,
    )
