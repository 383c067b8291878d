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
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from physreason.config import LoraConfig
from physreason.engines import Engine
from physreason.errors import ConfigError


def full_named_parameters(model: nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (Hugging Face name, full tensor) for each parameter of a plain, FSDP2 or TP model, cast to `dtype`.

    Sharded parameters are gathered one at a time (a collective: every rank must iterate in step),
    so peak extra memory is one full parameter, not the whole model. A LoRA model yields its merged
    weights (models/lora.py: merged_named_tensors) under the same names a plain model has.
    """
    from physreason.models.lora import has_lora, merged_named_tensors

    if has_lora(model):
        yield from merged_named_tensors(model, dtype)
        return
    for name, parameter in model.named_parameters():
        tensor = parameter.detach()
        if dtype is not None:
            tensor = tensor.to(dtype)  # cast the shard, then gather: fp32 masters gather half the bytes in bf16
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        yield name, tensor


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
