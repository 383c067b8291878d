"""Push the policy's weights into a rollout engine: full tensors under Hugging Face names, one at a time."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from physreason.engines import Engine


def full_named_parameters(model: nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (Hugging Face name, full tensor) for each parameter of a plain, FSDP2 or TP model, cast to `dtype`.

    Sharded parameters are gathered one at a time (a collective: every rank must iterate in step),
    so peak extra memory is one full parameter, not the whole model.
    """
    for name, parameter in model.named_parameters():
        tensor = parameter.detach()
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        yield name, tensor if dtype is None else tensor.to(dtype)


@torch.no_grad()
def push_weights(engine: Engine, model: nn.Module, dtype: torch.dtype | None = None) -> None:
    """Load the policy's current weights into the engine (every rank calls this; each feeds its own engine)."""
    engine.update_weights(full_named_parameters(model, dtype))
