"""Apply training parallelism to a plain transformers model: TP plan, FSDP2, activation checkpointing, freezing.

The model code is never changed; these functions wrap or shard modules in place, torchtitan-style.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from physreason.errors import ConfigError
from physreason.models.lazy_compile import LazyCompiled, compiles_here
from physreason.models.loading import decoder_layers, vision_tower


def check_layout(world_size: int, tp_size: int, cp_size: int = 1) -> int:
    """The data-parallel degree world_size / (tp_size x cp_size); ConfigError naming the numbers when it is not whole."""
    if world_size % (tp_size * cp_size):
        raise ConfigError(
            f"policy.parallelism.tp_size ({tp_size}) x policy.parallelism.cp_size ({cp_size}) = {tp_size * cp_size} "
            f"must divide the number of processes ({world_size}); launch with torchrun --nproc-per-node a multiple "
            f"of {tp_size * cp_size}"
        )
    return world_size // (tp_size * cp_size)


def build_mesh(device_type: str, world_size: int, tp_size: int, cp_size: int = 1) -> DeviceMesh:
    """A ("dp", "cp", "tp") mesh over all ranks; dp = world_size / (cp_size x tp_size).

    Rank r is data-parallel rank r // (cp_size x tp_size): the ranks of one context- and tensor-parallel group
    are consecutive and share a batch.
    """
    dp = check_layout(world_size, tp_size, cp_size)
    return init_device_mesh(device_type, (dp, cp_size, tp_size), mesh_dim_names=("dp", "cp", "tp"))


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2 shards over: dp, or dp x cp flattened under context parallelism.

    The ranks of a context-parallel group hold the same weights and each computes part of every gradient, so
    sharding over them too spreads the state further and its gradient reduction adds the parts up.
    """
    if mesh["cp"].size() == 1:
        return mesh["dp"]
    return mesh["dp", "cp"]._flatten("dp_cp")


def freeze_vision_tower(model: nn.Module) -> int:
    """Stop gradients to the vision encoder and its merger; returns the number of frozen parameters."""
    tower = vision_tower(model)
    if tower is None:
        return 0
    count = 0
    for parameter in tower.parameters():
        parameter.requires_grad_(False)
        count += parameter.numel()
    return count


def enable_activation_checkpointing(model: nn.Module, every: int = 1, vision_every: int = 1) -> None:
    """Recompute decoder and vision blocks in backward; non-reentrant so FSDP2 and frozen inputs work.

    every = n keeps checkpointing on decoder blocks 0, n, 2n, ... only (selective checkpointing: memory for
    speed), vision_every the same on vision-encoder blocks (0: none of them). 1 checkpoints every block.
    """
    if every < 1:
        raise ConfigError(f"activation checkpointing every {every} blocks: use 1 or more (or turn checkpointing off)")
    if vision_every < 0:
        raise ConfigError(f"vision checkpointing every {vision_every} blocks: use 0 (none) or more")
    options = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x; the older name is deprecated there
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)
    # transformers' GradientCheckpointingLayer recomputes a block only while its own flag is set
    for index, block in enumerate(decoder_layers(model)):
        block.gradient_checkpointing = index % every == 0
    tower = vision_tower(model)
    for index, block in enumerate(tower.blocks if tower is not None else ()):
        block.gradient_checkpointing = vision_every > 0 and index % vision_every == 0


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Shard attention heads and MLP columns of each Qwen2/Qwen3-family decoder block over tp_mesh.

    q/k/v and gate/up are column-parallel (each rank holds whole heads; Qwen3's per-head q/k norms act on
    each rank's own heads, their gradients summed over the ranks), o/down row-parallel with an all-reduce; embeddings, norms, lm_head and the vision
    tower stay replicated. Mixture-of-experts blocks (Qwen3-MoE, Qwen3-VL-MoE) shard their attention only:
    the experts stay replicated.
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    tp = tp_mesh.size()
    text_config = getattr(model.config, "text_config", model.config)
    for name in ("num_attention_heads", "num_key_value_heads"):
        if getattr(text_config, name) % tp:
            raise ConfigError(f"tp_size {tp} must divide the model's {name} ({getattr(text_config, name)})")
    attention = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
    }
    dense_mlp = {
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    # Qwen3's q/k RMSNorms (one weight over head_dim, shared by all heads) see only this rank's heads: as
    # replicated DTensors fed head-sharded inputs, their weight gradients are summed over the TP ranks
    # (plain replicated weights would each get a partial gradient and drift apart).
    head_norms = {
        "self_attn.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "self_attn.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
    }
    for block in decoder_layers(model):
        plan = dict(attention)
        if isinstance(getattr(block.mlp, "gate_proj", None), nn.Linear):
            plan.update(dense_mlp)
        if hasattr(block.self_attn, "q_norm"):
            plan.update(head_norms)
        parallelize_module(block, tp_mesh, plan)


RESHARD_CHOICES = ("all", "all-but-last", "none")  # apply_fsdp2's reshard


def apply_fsdp2(
    wrapper: nn.Module,
    model: nn.Module,
    dp_mesh: DeviceMesh,
    param_dtype: torch.dtype = torch.bfloat16,
    reduce_dtype: torch.dtype = torch.float32,
    cpu_offload: bool = False,
    reshard: str = "all",
) -> None:
    """fully_shard each decoder block and vision block, then the wrapper as root.

    Parameters stay fp32 masters; MixedPrecisionPolicy casts them to param_dtype for compute and
    reduces gradients in reduce_dtype. fully_shard moves each unit to the mesh's device as it shards it, so a
    model loaded on the host never has to fit one GPU whole. cpu_offload: the sharded parameters, their gradients
    and so the optimizer state stay in host memory (pinned when the mesh is on CUDA); each unit is copied to
    the device for its forward and backward.
    reshard: which blocks free their gathered (param_dtype) parameters after the forward, to gather them again
    for the backward: "all"; "all-but-last" (the last decoder block's backward follows its forward at once, so
    regathering it only costs time); "none" (no regathering, the memory of every block's gathered parameters
    held from forward to backward).
    """
    if reshard not in RESHARD_CHOICES:
        raise ValueError(f"reshard must be one of {RESHARD_CHOICES}, got {reshard!r}")
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    offload = CPUOffloadPolicy(pin_memory=dp_mesh.device_type == "cuda") if cpu_offload else OffloadPolicy()
    options = {"mesh": dp_mesh, "mp_policy": policy, "offload_policy": offload}
    tower = vision_tower(model)
    if tower is not None:
        for block in tower.blocks:
            fully_shard(block, reshard_after_forward=reshard != "none", **options)
    blocks = decoder_layers(model)
    for index, block in enumerate(blocks):
        last = index == len(blocks) - 1
        keep = reshard == "none" or (reshard == "all-but-last" and last)
        fully_shard(block, reshard_after_forward=not keep, **options)
    fully_shard(wrapper, **options)


# Where the cast path widens each parameter's param_dtype gradient to its float32 master with one compiled pointwise
# kernel (lazy_compile.compiles_here; on GPUs by default: torch's own bf16 -> fp32 copy takes a scalar kernel there,
# about 1.2 TB/s on an H100, 2026-11-28). Exact either way.
WIDEN = "cuda"


def _to_float32(grad: torch.Tensor) -> torch.Tensor:
    return grad.to(torch.float32)


# sizes dynamic: one graph per number of dimensions (a flattened view would be guarded on its base's sizes, a
# recompile per parameter shape)
_compiled_widen = LazyCompiled(_to_float32, dynamic=True)


def _widen(grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`grad` (param_dtype) as `dtype`, the master's: compiled where WIDEN says, for float32 masters."""
    if dtype == torch.float32 and compiles_here(WIDEN, grad):
        return _compiled_widen(grad)
    return grad.to(dtype)


class _CastForCompute(torch.autograd.Function):
    """`parameter.to(dtype)` whose backward widens the gradient back to the parameter's dtype through _widen."""

    @staticmethod
    def forward(ctx: Any, parameter: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.master_dtype = parameter.dtype
        return parameter.to(dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _widen(grad, ctx.master_dtype), None


class _ComputeCast:
    """The hooks of one unit: its own parameters are replaced by param_dtype copies for its forward.

    The copies come from `Tensor.to` (_CastForCompute), so autograd carries each copy's gradient back through the
    cast: the gradient is computed in param_dtype and accumulated into the float32 master's `.grad` in float32, as FSDP2
    with MixedPrecisionPolicy(param_dtype, reduce_dtype=float32) does on one rank. A parameter held under
    several names (tied embedding and lm_head) gets one copy, so its gradients add up in param_dtype first, as
    in FSDP2's unsharded parameter. Outside its forward the unit holds its float32 Parameters again.

    A recomputed block (transformers checkpoints a layer's `forward`, inside these hooks) runs its forward again
    in the backward: fresh copies go in when its outputs' gradients arrive and out when its inputs' gradients
    are done (or at the end of the backward, for a block whose inputs need none), as FSDP2 gathers again.
    """

    def __init__(self, slots: list[tuple[nn.Module, str, nn.Parameter]], dtype: torch.dtype) -> None:
        self.slots = slots  # (owning module, attribute name, float32 parameter)
        self.dtype = dtype

    def install(self) -> None:
        copies: dict[int, torch.Tensor] = {}
        for owner, name, parameter in self.slots:
            copy = copies.get(id(parameter))
            if copy is None:
                copy = copies[id(parameter)] = _CastForCompute.apply(parameter, self.dtype)
            owner._parameters[name] = copy  # as torch.nn.utils.stateless swaps tensors in for a call

    def restore(self) -> None:
        for owner, name, parameter in self.slots:
            owner._parameters[name] = parameter

    @torch._dynamo.disable
    def before_forward(self, unit: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        self.install()
        if not _recomputes(unit):
            return None
        flat, spec = tree_flatten((args, kwargs))
        where = [i for i, value in enumerate(flat) if isinstance(value, torch.Tensor) and value.requires_grad]
        if not where:
            return None
        for i, tensor in zip(where, _RestoreAfterBackward.apply(self, *(flat[i] for i in where)), strict=True):
            flat[i] = tensor
        return tree_unflatten(flat, spec)

    @torch._dynamo.disable
    def after_forward(self, unit: nn.Module, _args: tuple, _kwargs: dict, output: Any) -> None:
        self.restore()
        if _recomputes(unit):
            outputs = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if outputs:
                torch.autograd.graph.register_multi_grad_hook(outputs, self._before_backward, mode="any")

    def _before_backward(self, _grad: torch.Tensor) -> None:
        with torch.enable_grad():  # the recompute must save what the forward saved: copies that require grad
            self.install()
        torch.autograd.Variable._execution_engine.queue_callback(self.restore)


def _recomputes(unit: nn.Module) -> bool:
    """Whether this forward of `unit` is checkpointed (transformers' per-layer flag) and so runs again in backward."""
    return torch.is_grad_enabled() and unit.training and bool(getattr(unit, "gradient_checkpointing", False))


class _RestoreAfterBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward (the unit's backward is then done) puts the float32 Parameters back."""

    @staticmethod
    def forward(ctx: Any, cast: _ComputeCast, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.cast = cast
        return tensors

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.cast.restore()
        return (None, *grads)


def apply_compute_cast(wrapper: nn.Module, model: nn.Module, param_dtype: torch.dtype = torch.bfloat16) -> int:
    """One rank's mixed precision without FSDP2: each unit's float32 parameters are cast to param_dtype for its forward.

    The units are FSDP2's (apply_fsdp2): each vision block, each decoder block, and the wrapper for every other
    parameter (embedding, final norm, lm_head, the tower's patch embedding and mergers), so compute, gradients and
    checkpoints keep FSDP2's contract on one rank: float32 masters and gradients, param_dtype compute everywhere (norms
    included), buffers untouched, the same parameter names and state dicts. What goes is FSDP2's copy-in, all-gather
    (a copy on one rank), copy-out and the reduce-scatter's copies: one cast per parameter and forward is left
    (recomputed blocks cast again for their recompute, as FSDP2 gathers again). A block that is not recomputed keeps its param_dtype
    copies from its forward to its backward, as FSDP2 with reshard "none" would. Call after moving the wrapper to its
    device; float32 needs no cast (nothing is installed). Returns the number of units hooked.
    """
    if param_dtype == torch.float32:
        return 0
    tower = vision_tower(model)
    units: list[nn.Module] = list(tower.blocks) if tower is not None else []
    units += list(decoder_layers(model))
    inner = {id(unit) for unit in units}
    for unit in [*units, wrapper]:
        slots = []
        for owner in _own_modules(unit, inner):
            for name, parameter in owner._parameters.items():
                if parameter is not None:
                    slots.append((owner, name, parameter))
        cast = _ComputeCast(slots, param_dtype)
        unit.register_forward_pre_hook(cast.before_forward, with_kwargs=True)
        # always_call: the float32 Parameters are back even when the forward raises
        unit.register_forward_hook(cast.after_forward, with_kwargs=True, always_call=True)
    return len(units) + 1


def _own_modules(unit: nn.Module, inner: set[int]) -> list[nn.Module]:
    """`unit` and its submodules, less those inside another unit (ids in `inner`, `unit` itself excepted)."""
    found, stack = [], [unit]
    while stack:
        module = stack.pop()
        found.append(module)
        stack.extend(child for child in module.children() if id(child) not in inner)
    return found


def _copies(grad: torch.Tensor, world: int) -> int:
    """How many ranks of the world hold each element of this rank's local piece of `grad`.

    A DTensor's local shard is repeated along each mesh dimension it is Replicate on, and the whole mesh is
    repeated world / mesh.size() times (embeddings and norms sharded on the dp mesh alone are the same on every
    tp rank). A plain tensor is taken as the same on every rank. Partial placements hold no full values: ValueError.
    """
    if not isinstance(grad, DTensor):
        return world
    mesh = grad.device_mesh
    copies = world // mesh.size()
    for size, placement in zip(mesh.mesh.shape, grad.placements, strict=True):
        if placement.is_partial():
            raise ValueError(f"a gradient with placements {grad.placements} is partial: reduce it before clipping")
        if placement.is_replicate():
            copies *= size
    return copies


def clip_grad_norm(parameters: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Scale gradients so their global L2 norm is at most max_norm (0: never); returns the norm before (0-dim, fp32).

    Gradients may be plain tensors or DTensors on different meshes: under TP the decoder blocks live on the
    (dp, tp) mesh while embeddings, norms and the vision tower are sharded on the dp mesh alone. Each rank sums the
    squares of its local pieces, each weighted by 1 / the number of ranks that hold the same piece (_copies), and one
    all_reduce over the world adds them up: one collective per step whatever the meshes (DTensor's own norm makes one
    all-reduce per mesh dimension, one after another, and one more per mesh). The gradients are then scaled in place
    by one foreach multiply per device and dtype, on the local pieces; gradients on the host (CPU offload) whose norm
    is within max_norm are not touched. clip_and_step also steps the optimizer, and on the host folds the scaling
    into the fused AdamW.
    """
    total, groups = _grad_norm(parameters)
    scale = _clip_coefficient(total, max_norm)
    if scale is not None:
        _scale_grads(groups, scale)
    return total


def clip_and_step(
    parameters: Iterable[nn.Parameter],
    max_norm: float,
    optimizer: torch.optim.Optimizer,
    on_norm: Callable[[], None] | None = None,
    reduced: ReducedGradNorm | None = None,
    step: Callable[[torch.Tensor | None], None] | None = None,
) -> torch.Tensor:
    """clip_grad_norm(parameters, max_norm), then optimizer.step(); returns the norm before clipping (0-dim, fp32).

    float32 gradients stepped by torch's fused AdamW (on the GPU, or on the host under train.cpu_offload) are not
    multiplied by the clip coefficient in a pass of their own: the fused kernel takes it as its grad_scale (it divides
    each gradient by grad_scale as it reads it, the same read the update makes anyway) and writes the clipped gradient
    back, so every gradient is read once for the norm and once in AdamW, instead of three times and one more write
    (a 9 ms multiply a step at the 3B shape on an H100). On the GPU the divisor is max(norm / max_norm, 1), a device
    tensor (no sync); the host folds only when it clips. The coefficient applies once, in this step: grad_scale is
    set for it alone. Elsewhere (bf16 AdamW state, other optimizers) the gradients are scaled in place as
    clip_grad_norm does. The result equals clip_grad_norm then step() to float32 rounding
    (g / (1 / c) against g x c). on_norm: called once the norm (and any scaling) is done, before the step; the
    bench times the two parts with it. reduced: the norm FSDP2's reduce-scatter outputs gave on the GPU, used when it
    covers this step's gradients (ReducedGradNorm.take), instead of a pass over them on the host. step: called in
    place of optimizer.step() with the fused kernel's grad_scale (the clip coefficient as a divisor) or None
    (train.cpu_offload_overlap: OverlappedHostStep.start).
    """
    total, groups = _grad_norm(parameters, reduced)
    scale = _clip_coefficient(total, max_norm)
    fold = scale is not None and _folds_grad_scale(optimizer, groups)
    if scale is not None and not fold:
        _scale_grads(groups, scale)
    if on_norm is not None:
        on_norm()
    # the same coefficient as the multiply's, as the divisor the kernel wants (1 where the norm is within max_norm)
    divisor = ((total + 1e-6) / max_norm).clamp(min=1.0) if fold else None
    if step is not None:
        step(divisor)
        return total
    if not fold:
        optimizer.step()
        return total
    optimizer.grad_scale = divisor  # type: ignore[attr-defined]
    try:
        optimizer.step()
    finally:
        del optimizer.grad_scale  # type: ignore[attr-defined]
    return total


_Groups = dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]  # gradients' local pieces by (device, dtype)


def _grad_norm(parameters: Iterable[nn.Parameter], reduced: ReducedGradNorm | None = None) -> tuple[torch.Tensor, _Groups]:
    """(global L2 norm of the gradients, fp32 0-dim; their local pieces grouped by (device, dtype)); see clip_grad_norm.

    One read of every gradient: torch._foreach_norm in float32 per group of pieces, or none where `reduced` has the
    norm from the GPU.
    """
    parameters = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in parameters]
    if not grads:
        return torch.zeros((), dtype=torch.float32), {}
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if distributed else 1
    # local pieces grouped by (device, dtype) for the foreach kernels, and by copies for the weighting
    groups: _Groups = {}
    weighted: dict[tuple[torch.device, int], list[torch.Tensor]] = {}
    with torch.no_grad():
        for grad in grads:
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            groups.setdefault((local.device, local.dtype), []).append(local)
            weighted.setdefault((local.device, _copies(grad, world)), []).append(local)
        device = next(iter(groups))[0]
        from_gpu = reduced.take(parameters) if reduced is not None else None
        if from_gpu is not None:
            return from_gpu.to(device), groups
        total = torch.zeros((), dtype=torch.float32, device=device)
        for (_where, copies), pieces in weighted.items():
            norms = torch._foreach_norm(pieces, 2.0, dtype=torch.float32)
            total += torch.stack(norms).square().sum().to(device) / copies  # []
        if world > 1:
            dist.all_reduce(total)
    return total.sqrt(), groups


class ReducedGradNorm:
    """The gradients' squared L2 norm summed on the GPU from FSDP2's reduce-scatter outputs, for clip_and_step.

    Under train.cpu_offload the gradients reach the host as FSDP2 copies them there, and clipping would read all of
    them once more on the host for their norm (15 GB a step at the 3B shape, fp32). Each FSDP2 unit's reduce-scatter
    output is still on the GPU when FSDP2's public all-reduce hook (FSDPModule.set_all_reduce_hook) sees it, and on
    one rank it holds exactly the unit's gradients (a SUM over one rank: no division, no padding), so a norm kernel
    there costs a fraction of a millisecond. attach() installs it only on a one-rank mesh; take() returns the norm
    only when every gradient being clipped came from one reduce of its unit this step (one micro-batch: a second
    micro-batch's gradients are added on the host, whose sum the GPU never sees) and each output had the size of its
    unit's gradients; otherwise None, and clip_and_step reads the host gradients as before.
    """

    def __init__(self) -> None:
        self.owner: dict[int, int] = {}  # id(parameter) -> index of its unit
        self.squares: dict[int, torch.Tensor] = {}  # unit -> squared norm of its last reduce-scatter output, [] fp32
        self.sizes: dict[int, int] = {}  # unit -> elements of that output
        self.reduces: dict[int, int] = {}  # unit -> reduce-scatters since the last take()
        self.served = 0  # the take() calls answered with a norm (the rest fell back to the host)

    @classmethod
    def attach(cls, module: nn.Module) -> ReducedGradNorm | None:
        """Hook every FSDP2 unit under `module` (itself included); None where the norm cannot come from the reduce
        outputs (no FSDP2 unit, a mesh of more than one rank, a unit of several parameter groups)."""
        from torch.distributed.fsdp import FSDPModule

        units = [m for m in module.modules() if isinstance(m, FSDPModule)]
        if not units:
            return None
        units.reverse()  # innermost first: a parameter belongs to the unit nearest it
        for unit in units:  # every unit checked before any is hooked
            try:  # FSDP2's unit state is private and changes between torch releases: without it, the host norm
                groups = unit_param_groups(unit)
                one_rank = len(groups) <= 1 and all(group.mesh_info.mesh.size() == 1 for group in groups)
            except AttributeError:
                return None
            if not one_rank:
                return None
        tracker = cls()
        claimed: set[int] = set()
        for index, unit in enumerate(units):
            for parameter in unit.parameters():
                if id(parameter) not in claimed:
                    claimed.add(id(parameter))
                    tracker.owner[id(parameter)] = index
            unit.set_all_reduce_hook(tracker._hook(index))
        return tracker

    def _hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def seen(output: torch.Tensor) -> None:  # runs on FSDP2's stream, before the copy to the host
            self.squares[index] = torch.linalg.vector_norm(output, dtype=torch.float32).square()
            self.sizes[index] = output.numel()
            self.reduces[index] = self.reduces.get(index, 0) + 1

        return seen

    def take(self, parameters: list[nn.Parameter]) -> torch.Tensor | None:
        """The norm of these parameters' gradients (0-dim fp32, on the host), or None where the reduce outputs do not
        cover them exactly; either way the counts start again for the next step."""
        reduces, squares, sizes = self.reduces, self.squares, self.sizes
        self.reduces, self.squares, self.sizes = {}, {}, {}
        expected: dict[int, int] = {}  # unit -> elements of its gradients being clipped
        for parameter in parameters:
            unit = self.owner.get(id(parameter))
            if unit is None:
                return None
            expected[unit] = expected.get(unit, 0) + parameter.grad.numel()
        if any(reduces.get(unit) != 1 or sizes.get(unit) != size for unit, size in expected.items()):
            return None
        if set(reduces) != set(expected):  # a reduce of gradients not being clipped
            return None
        # FSDP2's final backward callback made the current stream wait for the reduce streams' work
        self.served += 1
        return torch.stack([squares[unit] for unit in sorted(expected)]).sum().sqrt().cpu()


def unit_param_groups(unit: nn.Module) -> list[Any]:
    """The FSDP2 parameter groups of one fully_shard unit: a list in torch >= 2.12 (`_fsdp_param_groups`), at most
    one before (`_fsdp_param_group`, None for a unit without parameters of its own); AttributeError when neither."""
    state = unit._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = state._fsdp_param_group  # torch 2.11 (the GPU image): one group a unit
    return [] if group is None else [group]


def _scale_grads(groups: _Groups, scale: torch.Tensor) -> None:
    """Multiply the gradients' local pieces in place by the clip coefficient: one foreach kernel per (device, dtype)."""
    with torch.no_grad():
        for (where, _dtype), pieces in groups.items():
            torch._foreach_mul_(pieces, scale.to(where))


def _clip_coefficient(total: torch.Tensor, max_norm: float) -> torch.Tensor | None:
    """The factor clipping multiplies the gradients by (0-dim, on total's device), or None when there is nothing to do.

    Host gradients (train.cpu_offload) under the limit are left as they are: the factor is known without a device
    sync there, and multiplying by 1 would cost a pass over every gradient for the same values.
    """
    if max_norm <= 0:
        return None
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    if scale.device.type == "cpu" and float(scale) >= 1.0:
        return None
    return scale


def _folds_grad_scale(optimizer: torch.optim.Optimizer, groups: _Groups) -> bool:
    """Whether clip_and_step hands the clip coefficient to the optimizer's fused kernel: torch's Adam or AdamW with
    fused=True in every group, float32 gradients all on one device (the host, or one GPU), and no grad_scale of
    someone else's (GradScaler)."""
    return (
        isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW)
        and all(group.get("fused") for group in optimizer.param_groups)
        and len(groups) == 1
        and all(device.type in ("cpu", "cuda") and dtype == torch.float32 for device, dtype in groups)
        and getattr(optimizer, "grad_scale", None) is None
        and getattr(optimizer, "found_inf", None) is None
    )


# transformers' Qwen2.5-VL runs its vision tower once for a batch's images and once for its videos.
_VISUAL_INPUTS = ("pixel_values", "pixel_values_videos")


def dummy_vision_features(model: nn.Module, inputs: Mapping[str, Any], device: torch.device) -> list[torch.Tensor]:
    """Run the vision tower once on a one-token all-zero image per visual kind `inputs` lacks; the outputs, [1, H] each.

    Under FSDP2 every data-parallel rank must make the same collectives in the same order. A rank whose
    micro-batch has no images (or no videos) would skip the tower's all-gathers and reduce-scatters while
    another rank runs them, and the job crashes (gloo) or hangs (NCCL). Call this before the model's
    forward (so the tower's blocks are gathered before the decoder's on every rank) and add 0 x each
    output's sum to the loss (so the backward runs through the tower too). Text-only models: [].
    """
    tower = vision_tower(model)
    if tower is None:
        return []
    spec = model.config.vision_config
    merge = spec.spatial_merge_size
    row = spec.in_channels * spec.temporal_patch_size * spec.patch_size**2
    features = []
    for name in _VISUAL_INPUTS:
        if inputs.get(name) is None:
            pixels = torch.zeros(merge * merge, row, device=device)  # [patches, C * T * P * P]
            grid = torch.tensor([[1, merge, merge]], device=device)  # [images, (t, h, w)] in patches
            output = tower(pixels, grid_thw=grid)
            features.append(output.pooler_output)
            # Qwen3-VL's DeepStack mergers are tower parameters too: their outputs join the dummy loss
            features += list(getattr(output, "deepstack_features", None) or [])
    return features
