"""Grouped Qwen2.5-VL / Qwen3-VL vision attention: same features and gradients as transformers' per-segment loop."""

from __future__ import annotations

import copy
import json
import logging

import pytest
import torch

from physreason.config import ModelConfig
from physreason.models import loading, vision_attention
from physreason.models.tiny import build_tiny_model, build_tiny_tokenizer
from physreason.models.vision_attention import group_segments, registered_name, use_grouped_vision_attention

# A 2-frame-pair video of 140x196 px (merged grid 5 x 7: windows of 4x4, 4x3, 1x4 and 1x3 units, so 64/48/16/12
# patches) and a 84x112 image (one 48-patch window): window and full-attention segments both have unequal lengths.
# (Qwen3-VL: one segment per frame pair and per image, of 140, 140 and 48 patches.)
GRID_THW = torch.tensor([[2, 10, 14], [1, 6, 8]])


@pytest.fixture(scope="module")
def tiny_vl(vl_kind) -> torch.nn.Module:
    # scale 2: vision depth 4 (Qwen2.5-VL: window, full, window, full, so both kinds of cu_seqlens alternate)
    return build_tiny_model(vl_kind, build_tiny_tokenizer(), scale=2)


def patch_dim(tower: torch.nn.Module) -> int:
    """Values per patch: channels x temporal patch x patch side squared (14 Qwen2.5-VL, 16 Qwen3-VL)."""
    return 3 * 2 * tower.config.patch_size**2


def features_and_grads(tower: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Merged visual features of the fixed inputs and the vision parameters' gradients of a fixed projection."""
    device, dtype = tower.blocks[0].attn.qkv.weight.device, tower.blocks[0].attn.qkv.weight.dtype
    generator = torch.Generator().manual_seed(0)
    pixels = torch.randn(int(GRID_THW.prod(-1).sum()), patch_dim(tower), generator=generator)  # [patches, C*T*P*P]
    tower.zero_grad(set_to_none=True)
    output = tower(pixels.to(device, dtype), grid_thw=GRID_THW.to(device))
    features = output.pooler_output  # [merged, out_hidden]
    # Qwen3-VL's DeepStack taps (merged features of early blocks, each [merged, out_hidden]) are outputs too
    taps = list(getattr(output, "deepstack_features", None) or [])
    weights = torch.randn(features.shape, generator=generator).to(device)
    sum((f.float() * weights).sum() for f in [features, *taps]).backward()
    return features.detach().float(), {name: p.grad.float() for name, p in tower.named_parameters()}


@pytest.mark.parametrize("kernel", ["sdpa", "eager"])
def test_grouped_tower_matches_per_window_features_and_gradients(tiny_vl, kernel):
    native = copy.deepcopy(tiny_vl.model.visual)
    native.config._attn_implementation = kernel
    grouped = copy.deepcopy(native)
    assert use_grouped_vision_attention(grouped)
    assert grouped.blocks[0].attn.config._attn_implementation == registered_name(kernel)
    assert native.config._attn_implementation == kernel

    expected, expected_grads = features_and_grads(native)
    got, got_grads = features_and_grads(grouped)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert got_grads.keys() == expected_grads.keys()
    for name, grad in expected_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_grouped_tower_matches_per_window_path_in_bf16_on_cuda(tiny_vl):
    native = copy.deepcopy(tiny_vl.model.visual).to("cuda", torch.bfloat16)
    grouped = copy.deepcopy(native)
    assert use_grouped_vision_attention(grouped)
    expected, expected_grads = features_and_grads(native)
    got, got_grads = features_and_grads(grouped)
    # the same SDPA kernel per window, batched; bf16 allows a last-bit difference where the kernel tiles differently
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=5e-2, atol=5e-2, msg=name)


def test_segments_grouped_once_per_cu_seqlens_per_forward(tiny_vl, vl_kind, monkeypatch):
    tower = copy.deepcopy(tiny_vl.model.visual)
    assert use_grouped_vision_attention(tower)
    seen = []

    def counting(cu_seqlens):
        seen.append(cu_seqlens.tolist())
        return group_segments(cu_seqlens)

    monkeypatch.setattr(vision_attention, "group_segments", counting)
    with torch.no_grad():
        tower(torch.randn(int(GRID_THW.prod(-1).sum()), patch_dim(tower)), grid_thw=GRID_THW)
    # four layers; Qwen2.5-VL has two distinct cu_seqlens tensors (windows; whole frame pairs and the image),
    # Qwen3-VL one (frame pairs and the image)
    assert len(seen) == (2 if vl_kind == "qwen2_5_vl" else 1)
    assert seen[-1] == [0, 140, 280, 328]


def test_compiled_checkpointed_vision_blocks_are_traced_and_match_eager(tiny_vl):
    """Vision blocks compiled under activation checkpointing (as the trainer's recompute wraps them): the segment
    groups come from each block's pre-hook, so dynamo traces the checkpointed forward (a host read or a cache write
    inside torch.utils.checkpoint made it run every block eagerly); the same features and gradients as eager."""
    from torch._dynamo.utils import counters

    from physreason.models.parallelize import enable_activation_checkpointing

    tiny = copy.deepcopy(tiny_vl)
    tiny.model.visual.config._attn_implementation = "sdpa"
    assert use_grouped_vision_attention(tiny)
    enable_activation_checkpointing(tiny)
    tower = tiny.model.visual.train()
    expected, expected_grads = features_and_grads(tower)
    torch._dynamo.reset()
    counters.clear()
    for block in tower.blocks:
        block.compile()
    try:
        got, got_grads = features_and_grads(tower)
    finally:
        for block in tower.blocks:
            block._compiled_call_impl = None
    reasons = " ".join(counters["graph_break"])
    assert "HOP" not in reasons and "checkpoint" not in reasons, reasons
    assert counters["stats"]["unique_graphs"] >= 1  # the checkpointed block was compiled, not run eagerly
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_group_segments_orders_tokens_by_length_and_restores():
    cu_seqlens = torch.tensor([0, 3, 7, 10, 10, 14], dtype=torch.int32)
    groups = group_segments(cu_seqlens)
    assert groups.lengths == (3, 4)
    assert groups.counts == (2, 2)
    assert groups.order.tolist() == [0, 1, 2, 7, 8, 9, 3, 4, 5, 6, 10, 11, 12, 13]
    assert groups.order[groups.restore].tolist() == list(range(14))


def test_group_segments_keeps_sequence_order_when_already_grouped():
    groups = group_segments(torch.tensor([0, 4, 8, 11]))
    assert (groups.lengths, groups.counts) == ((4, 3), (2, 1))
    assert groups.order is None and groups.restore is None


def test_text_model_is_left_untouched():
    model = build_tiny_model("qwen2", build_tiny_tokenizer())
    assert not use_grouped_vision_attention(model)
    assert model.config._attn_implementation == "sdpa"


def test_flash_configured_tower_is_left_untouched(tiny_vl):
    tower = copy.deepcopy(tiny_vl.model.visual)
    tower.config._attn_implementation = "flash_attention_2"
    assert not use_grouped_vision_attention(tower)
    assert tower.config._attn_implementation == "flash_attention_2"


def test_probe_mismatch_keeps_transformers_path_with_warning(tiny_vl, monkeypatch, caplog):
    tower = copy.deepcopy(tiny_vl.model.visual)
    monkeypatch.setattr(
        vision_attention, "grouped_attention", lambda kernel, module, query, *a, **k: query.transpose(1, 2) * 0
    )
    with caplog.at_level(logging.WARNING, logger=vision_attention.__name__):
        assert not use_grouped_vision_attention(tower)
    assert tower.config._attn_implementation == "sdpa"
    assert "probe output differs" in caplog.text


def test_probe_failure_keeps_transformers_path_with_warning(tiny_vl, monkeypatch, caplog):
    tower = copy.deepcopy(tiny_vl.model.visual)

    def broken(*args, **kwargs):
        raise TypeError("unexpected signature")

    monkeypatch.setattr(vision_attention, "grouped_attention", broken)
    with caplog.at_level(logging.WARNING, logger=vision_attention.__name__):
        assert not use_grouped_vision_attention(tower)
    assert tower.config._attn_implementation == "sdpa"
    assert "probe failed" in caplog.text


def test_loaded_model_uses_grouped_attention_and_exports_plain_config(vl_model_dir, tmp_path):
    model = loading.load_model(ModelConfig(model_name_or_path=str(vl_model_dir), dtype="float32"))
    assert model.model.visual.blocks[0].attn.config._attn_implementation == registered_name("sdpa")
    assert model.config.text_config._attn_implementation == "sdpa"
    model.save_pretrained(tmp_path)
    assert "physreason" not in json.dumps(json.loads((tmp_path / "config.json").read_text()))


def test_config_can_keep_transformers_per_window_attention(vl_model_dir):
    config = ModelConfig(model_name_or_path=str(vl_model_dir), dtype="float32", grouped_vision_attention=False)
    model = loading.load_model(config)
    assert model.model.visual.blocks[0].attn.config._attn_implementation == "sdpa"


def test_applying_leaves_the_global_random_stream_where_it_was(tiny_vl):
    tower = copy.deepcopy(tiny_vl.model.visual)
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    assert use_grouped_vision_attention(tower)
    assert torch.equal(torch.rand(4), expected)
