"""Push the policy's weights into a rollout engine: full tensors under Hugging Face names, one at a time.

With [train.lora] the policy pushes either its adapter alone (an engine that serves runtime adapters: vLLM
built with a LoRA slot) or its weights with the adapters merged in (every other engine), always under the
plain Hugging Face names the engine's model has.

With FP8 rollouts ([rollout] quantization = "fp8") the language model's linear weights are quantized as they
are gathered, one at a time, and travel as float8 weights with their block scales (models/fp8.py); LoRA
policies then push merged weights.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from physreason.config import LoraConfig
from physreason.engines import Engine
from physreason.errors import ConfigError


def full_named_parameters(
    model: nn.Module, dtype: torch.dtype | None = None, fsdp_root: nn.Module | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (Hugging Face name, full tensor) for each parameter of a plain, FSDP2 or TP model, cast to `dtype`.

    The order, names, dtypes and values are model.named_parameters()'s, each parameter gathered whole. Gathers are
    collective: every rank must iterate in step. A LoRA model yields its merged weights (models/lora.py:
    merged_named_tensors) under the same names a plain model has.

    Under FSDP2 each unit (a fully_shard'd module: a decoder block, a vision block, the root) is gathered by one
    all-gather (FSDPModule.unshard, in the unit's param_dtype) when the walk reaches its first parameter, and
    resharded before its last parameter is yielded; one all-gather per parameter made a push of ~700 small
    collectives. The root's parameters sit at both ends of the order (patch embedding and merger first, embeddings,
    final norm and lm_head last), so the root stays gathered through the walk: peak extra memory is the root's
    parameters plus one block's, in param_dtype, plus the tensor being yielded. A walk closed early or raising
    reshards what it gathered. Yielded tensors are the caller's own copies (a unit's gathered buffers are freed when
    it reshards); with train.cpu_offload they lie on the device FSDP2 gathers on.

    `fsdp_root`: the module FSDP2's root unit wraps when it is not `model` (the policy's loss wrapper), so the root's
    parameters are gathered whole from the first push on. Still gathered one parameter at a time (the shard cast to
    `dtype`, then DTensor.full_tensor): the parameters of a unit this walk cannot reach (a root around `model` not
    given as `fsdp_root`, before the first forward lazily initialises FSDP2), of a unit whose param_dtype is neither the parameter's dtype nor `dtype`
    (gathering in it would round what the push keeps: bf16 param_dtype with `dtype` None or float32), of a unit
    already unsharded when the walk starts (left as it is), and every parameter on a torch release without the
    FSDP2 state read here. A parameter still a DTensor after its unit's unshard (tensor parallel) is then gathered
    over its tensor-parallel mesh by full_tensor.
    """
    from physreason.models.lora import has_lora, merged_named_tensors

    if has_lora(model):
        yield from merged_named_tensors(model, dtype)
        return
    named = list(model.named_parameters())  # read before any unshard swaps a unit's parameters
    try:  # FSDP2's unit state is private and changes between torch releases: without it, per-parameter gathers
        owners = _gatherable_units(fsdp_root if fsdp_root is not None else model, dtype)
    except AttributeError:
        owners = {}
    last: dict[nn.Module, int] = {}  # unit -> index of its last parameter in the walk
    for index, (_, parameter) in enumerate(named):
        if (unit := owners.get(id(parameter))) is not None:
            last[unit] = index
    gathered: set[nn.Module] = set()  # units this walk unsharded and has not resharded yet
    try:
        for index, (name, parameter) in enumerate(named):
            unit = owners.get(id(parameter))
            if unit is None:
                yield name, _gather_one(parameter, dtype)
                continue
            if unit not in gathered:
                unit.unshard()  # one all-gather of all the unit's parameters
                gathered.add(unit)
            path, _, attribute = name.rpartition(".")
            tensor = _own_full_copy(getattr(model.get_submodule(path), attribute), dtype or parameter.dtype)
            if index == last[unit]:
                unit.reshard()
                gathered.discard(unit)
            yield name, tensor
    finally:
        for unit in gathered:
            unit.reshard()


def _gather_one(parameter: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """One parameter whole: the shard cast to `dtype` (fp32 masters gather half the bytes in bf16), then gathered."""
    tensor = parameter.detach()
    if dtype is not None:
        tensor = tensor.to(dtype)
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    return tensor


def _own_full_copy(unsharded: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A gathered unit's parameter as a new tensor in `dtype`, gathered over its tensor-parallel mesh if it has one."""
    tensor = unsharded.detach()
    if isinstance(tensor, DTensor):  # FSDP2 gathered the data-parallel dimension only
        tensor = tensor.to(dtype).full_tensor()  # cast first, as the per-parameter path does
    return tensor.to(dtype, copy=True)


def _gatherable_units(model: nn.Module, dtype: torch.dtype | None) -> dict[int, nn.Module]:
    """id(parameter) -> the FSDP2 unit (a module to unshard) managing it, for the units full_named_parameters gathers
    whole: sharded now, and gathering in their param_dtype then casting to `dtype` gives exactly the per-parameter
    values. AttributeError where this torch release lacks the FSDP2 state read here.

    The units are the fully_shard'd modules in `model` and, once the first forward lazily initialised FSDP2, every
    unit of the root's tree (FSDP2 shares one list of them), the root around `model` included. A unit manages the
    parameters of its modules outside any nested unit, as fully_shard assigns them.
    """
    from torch.distributed.fsdp import FSDPModule

    from physreason.models.parallelize import unit_param_groups

    states: dict[Any, None] = {}  # FSDP2 unit states, in order, each once
    for module in model.modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            states.update(dict.fromkeys([state, *state._state_ctx.all_states]))
    owners: dict[int, nn.Module] = {}
    for state in states:
        unit = state._modules[0]  # unshard and reshard act on the whole state, whichever of its modules is called
        groups = unit_param_groups(unit)
        if not groups or not all(group.is_sharded for group in groups):
            continue
        param_dtypes = {group.mp_policy.param_dtype for group in groups}
        managed = _managed_parameters(state._modules)
        if all(param_dtypes <= {None, p.dtype, dtype or p.dtype} for p in managed):
            owners.update(dict.fromkeys(map(id, managed), unit))
    return owners


def _managed_parameters(modules: Iterable[nn.Module]) -> list[nn.Parameter]:
    """The parameters of these modules and their submodules, stopping at submodules that are FSDP2 units of their own."""
    from torch.distributed.fsdp import FSDPModule

    found: list[nn.Parameter] = []
    pending = list(modules)
    while pending:
        module = pending.pop()
        found.extend(module.parameters(recurse=False))
        pending.extend(child for child in module.children() if not isinstance(child, FSDPModule))
    return found


@torch.no_grad()
def push_weights(engine: Engine, model: nn.Module, dtype: torch.dtype | None = None, quantization: str = "none") -> None:
    """Load the policy's current weights into the engine (every rank calls this; each feeds its own engine).

    quantization "fp8": language-model linear weights go as float8 + `<name>_scale_inv` (models/fp8.py).
    """
    named = full_named_parameters(model, dtype)
    if quantization == "fp8":
        from physreason.models.fp8 import fp8_rollout_weights

        named = fp8_rollout_weights(named)
    elif quantization != "none":
        raise ConfigError(f"rollout.quantization = {quantization!r} is not known: use 'none' or 'fp8'")
    engine.update_weights(named)


SyncMode = Literal["full", "merged", "adapter"]


def adapter_push_supported(lora: LoraConfig) -> bool:
    """Whether an adapter of these settings can go to vLLM as a runtime adapter: language-block adapters only.

    vLLM's runtime LoRA covers the language model's linear layers; vision-tower adapters and fully trained
    modules (modules_to_save) go to the engine merged instead, as they do when `lora.sync` is "merged".
    """
    return lora.sync == "auto" and not lora.vision and not lora.modules_to_save


class PolicySync:
    """Pushes a policy to its rollout engine every sync: full weights, or with LoRA the adapter or merged weights.

    mode "adapter": every rank writes its gathered adapter to a fresh folder and the engine loads it as a new
    runtime adapter (the previous folder is deleted); "merged": base + adapters as full tensors through
    `update_weights`; "full": the policy without LoRA, as `push_weights`. Every rank calls `push` (gathers are
    collective). `close` removes the adapter folders.
    """

    def __init__(
        self,
        engine: Engine,
        model: nn.Module,
        peft_model: nn.Module | None,
        lora: LoraConfig,
        dtype: torch.dtype | None,
        quantization: str = "none",
    ) -> None:
        self.engine, self.model, self.peft_model, self.dtype = engine, model, peft_model, dtype
        self.quantization = quantization
        self.mode: SyncMode = "full"
        if peft_model is not None:
            # An FP8 engine's base weights are the policy's, quantized: adapters go in merged before quantization.
            adapter = engine.serves_adapters and adapter_push_supported(lora) and quantization == "none"
            self.mode = "adapter" if adapter else "merged"
        self.folder = Path(tempfile.mkdtemp(prefix="physreason-adapter-")) if self.mode == "adapter" else None
        if self.folder is not None:  # removed at close, or when the sync is dropped (a run that raised)
            weakref.finalize(self, shutil.rmtree, self.folder, True)
        self.version = 0
        self._last: Path | None = None

    @torch.no_grad()
    def push(self) -> None:
        """Send the policy's current weights to the engine in this sync's mode."""
        if self.mode != "adapter":
            push_weights(self.engine, self.model, self.dtype, self.quantization)
            return
        from physreason.models.lora import adapter_state, save_adapter

        self.version += 1
        target = self.folder / f"v{self.version}"
        save_adapter(self.peft_model, target, adapter_state(self.peft_model))
        self.engine.load_adapter(str(target))
        if self._last is not None:
            shutil.rmtree(self._last, ignore_errors=True)
        self._last = target

    def close(self) -> None:
        """Delete the adapter folders written for the engine."""
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
