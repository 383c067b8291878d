"""physreason/models/patch_embed.py: the Qwen-VL patch embedding as one linear layer, the same as transformers' Conv3d."""

from __future__ import annotations

import copy
import logging
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from physreason.models import patch_embed


def _qwen3_embed():
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionPatchEmbed

    return Qwen3VLVisionPatchEmbed(SimpleNamespace(patch_size=16, temporal_patch_size=2, in_channels=3, hidden_size=48))


def _qwen25_embed():
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionPatchEmbed

    return Qwen2_5_VisionPatchEmbed(patch_size=14, temporal_patch_size=2, in_channels=3, embed_dim=40)


@pytest.mark.parametrize("make", [_qwen3_embed, _qwen25_embed], ids=["qwen3_vl", "qwen2_5_vl"])
def test_linear_form_matches_the_convolution_forward_and_backward(make):
    torch.manual_seed(0)
    native = make()
    linear = copy.deepcopy(native)
    assert patch_embed.use_linear_patch_embed(linear) == 1
    assert type(linear).__name__.startswith("Linear") and isinstance(linear, type(native))
    # the same parameters under the same names and shapes: checkpoints and weight pushes see nothing new
    assert {k: v.shape for k, v in linear.state_dict().items()} == {k: v.shape for k, v in native.state_dict().items()}
    patches = torch.randn(9, native.proj.weight[0].numel(), requires_grad=True)
    expected, got = native(patches), linear(patches)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    cotangent = torch.randn_like(expected)
    expected.backward(cotangent)
    got_patches_grad = patches.grad.clone()
    patches.grad = None
    got.backward(cotangent)
    for name, parameter in linear.named_parameters():
        torch.testing.assert_close(parameter.grad, dict(native.named_parameters())[name].grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(patches.grad, got_patches_grad, rtol=1e-5, atol=1e-5)
    # once is enough: a second call counts it and changes nothing
    assert patch_embed.use_linear_patch_embed(linear) == 1 and type(linear).__mro__.count(patch_embed.LinearPatchEmbed) == 1


def test_a_projection_replaced_after_the_switch_runs_its_own_forward():
    """An adapter library that wraps `proj` later (its weight then is not the whole computation) is called, not read."""
    embed = _qwen3_embed()
    patch_embed.use_linear_patch_embed(embed)

    class Wrapped(nn.Module):
        def __init__(self, base: nn.Conv3d) -> None:
            super().__init__()
            self.base, self.weight, self.bias = base, base.weight, base.bias

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.base(x) + 1.0  # what a LoRA delta would add

    patches = torch.randn(3, embed.proj.weight[0].numel())
    plain = embed(patches)
    embed.proj = Wrapped(embed.proj)
    torch.testing.assert_close(embed(patches), plain + 1.0, rtol=1e-5, atol=1e-5)


def test_a_convolution_that_overlaps_patches_or_an_unknown_class_is_left_alone():
    overlapping = _qwen3_embed()
    overlapping.proj = nn.Conv3d(3, 48, kernel_size=(2, 16, 16), stride=(1, 8, 8))
    assert patch_embed.use_linear_patch_embed(overlapping) == 0 and type(overlapping).__name__ == "Qwen3VLVisionPatchEmbed"

    class Stem(nn.Module):  # a Conv3d with stride == kernel, but not a class whose forward is understood here
        def __init__(self) -> None:
            super().__init__()
            self.proj, self.embed_dim = nn.Conv3d(3, 8, 2, 2), 8

    assert patch_embed.use_linear_patch_embed(Stem()) == 0


def test_a_class_whose_forward_differs_is_kept_with_a_warning(caplog):
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionPatchEmbed

    class Qwen3VLVisionPatchEmbed(Qwen3VLVisionPatchEmbed):  # same name and layout, another computation
        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(hidden_states)

    module = Qwen3VLVisionPatchEmbed(SimpleNamespace(patch_size=16, temporal_patch_size=2, in_channels=3, hidden_size=48))
    with caplog.at_level(logging.WARNING, logger=patch_embed.__name__):
        assert patch_embed.use_linear_patch_embed(module) == 0
    assert type(module).forward is Qwen3VLVisionPatchEmbed.forward
    assert "kept as a convolution: the linear form differs" in caplog.text


def test_the_loader_switches_each_family_s_tower_and_leaves_its_weights(vl_model_dir):
    from safetensors.torch import load_file

    from physreason.config import ModelConfig
    from physreason.models.loading import load_model

    model = load_model(ModelConfig(model_name_or_path=str(vl_model_dir)), dtype=torch.float32)
    embed = model.model.visual.patch_embed
    assert isinstance(embed, patch_embed.LinearPatchEmbed)
    stored = {}
    for shard in vl_model_dir.glob("*.safetensors"):
        stored.update(load_file(shard))
    name = next(k for k in stored if k.endswith("patch_embed.proj.weight"))
    assert stored[name].dim() == 5 and torch.equal(embed.proj.weight, stored[name].float())
