"""The vision tower's patch embedding as one matrix multiply instead of a 3-D convolution.

Qwen2-VL, Qwen2.5-VL and Qwen3-VL embed each patch (channels x 2 frames x 14 or 16 pixels squared, already cut out by
the image processor) with an `nn.Conv3d` whose stride equals its kernel: every output is one patch's dot product with
each filter, which is a linear layer over the flattened patch. cuDNN runs that shape through convolution kernels,
slow on some GPU, cuDNN and dtype combinations (transformers #45750 and vLLM, which computes it as a linear layer);
`torch.nn.functional.linear` over the patch and a view of the same weight is one GEMM forward and two backward.

The module and its parameters stay as they are (the Conv3d weight, 5-D, under its own name), so checkpoints, weight
pushes to an engine, export, FSDP2 and LoRA see nothing new: only `forward` changes, to what vLLM computes.
"""

from __future__ import annotations

import copy
import logging

import torch
from torch import nn

log = logging.getLogger(__name__)

# transformers' patch-embedding classes whose forward is `proj(x.view(-1, C, T, P, P)).view(-1, embed_dim)`
PATCH_EMBED_CLASSES = ("Qwen2_5_VisionPatchEmbed", "Qwen3VLVisionPatchEmbed", "PatchEmbed")  # PatchEmbed: Qwen2-VL


def _as_linear(module: nn.Module) -> bool:
    """Whether `module` is a patch embedding whose Conv3d visits each patch once (stride == kernel, no padding)."""
    proj = getattr(module, "proj", None)
    return (
        type(module).__name__ in PATCH_EMBED_CLASSES
        and isinstance(proj, nn.Conv3d)
        and tuple(proj.stride) == tuple(proj.kernel_size)
        and tuple(proj.padding) == (0, 0, 0)
        and tuple(proj.dilation) == (1, 1, 1)
        and proj.groups == 1
        and hasattr(module, "embed_dim")
    )


class LinearPatchEmbed(nn.Module):
    """Mixed into a patch-embedding class (in front of it): forward as one linear layer over each flattened patch."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if type(self.proj) is not nn.Conv3d:  # replaced since (an adapter's wrapper): its own forward, as transformers
            return super().forward(hidden_states)
        weight = self.proj.weight  # [embed_dim, C, T, P, P]: flattened in the order the processor flattens a patch
        patch = weight[0].numel()
        hidden_states = hidden_states.reshape(-1, patch).to(dtype=weight.dtype)
        return nn.functional.linear(hidden_states, weight.reshape(weight.shape[0], patch), self.proj.bias)


_LINEAR_CLASSES: dict[type, type] = {}


def _linear_class(cls: type) -> type:
    if cls not in _LINEAR_CLASSES:
        _LINEAR_CLASSES[cls] = type(f"Linear{cls.__name__}", (LinearPatchEmbed, cls), {})
    return _LINEAR_CLASSES[cls]


def _probe_matches(module: nn.Module) -> bool:
    """transformers' forward of `module`'s class and the linear form agree on random patches (float32, CPU, a fresh
    convolution of the same shape: the module's own weights are not touched)."""
    proj = module.proj
    with torch.device("cpu"), torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(0)
        conv = nn.Conv3d(proj.in_channels, proj.out_channels, proj.kernel_size, proj.kernel_size, bias=proj.bias is not None)
        probe = copy.copy(module)  # the same class and settings; its own module table holding the fresh convolution
        probe._modules = {**module._modules, "proj": conv}
        patches = torch.randn(5, conv.weight[0].numel())
        expected = type(module).forward(probe, patches)
        got = LinearPatchEmbed.forward(probe, patches)
    return expected.shape == got.shape and torch.allclose(expected, got, rtol=1e-5, atol=1e-5)


def use_linear_patch_embed(model: nn.Module) -> int:
    """Compute every Qwen-VL patch embedding in `model` as a linear layer; returns how many now do (also those that
    already did). A module whose class behaves differently from a Conv3d over each patch (checked once on CPU) is left
    as it is, with a warning."""
    count = 0
    for module in model.modules():
        if isinstance(module, LinearPatchEmbed):
            count += 1
            continue
        if not _as_linear(module):
            continue
        try:
            matches = _probe_matches(module)
        except Exception as exc:  # a class whose forward is not the one understood here
            log.warning("patch embedding %s kept as a convolution: probe failed: %r", type(module).__name__, exc)
            continue
        if not matches:
            log.warning("patch embedding %s kept as a convolution: the linear form differs", type(module).__name__)
            continue
        module.__class__ = _linear_class(type(module))
        count += 1
    return count
