"""The pieces tensor parallelism and FSDP2 rely on, in one process: clipping, vision balancing, layouts, checkpointing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from physreason.config import load_config
from physreason.data.collate import collate_padded
from physreason.data.sft import IGNORE_INDEX, SFTSample
from physreason.errors import ConfigError
from physreason.models.loading import decoder_layers, vision_tower
from physreason.models.parallelize import (
    clip_and_step,
    clip_grad_norm,
    dummy_vision_features,
    enable_activation_checkpointing,
)
from physreason.models.tiny import build_tiny_model, build_tiny_tokenizer
from physreason.train.model import CausalLMLoss
from physreason.train.sft import batch_layout


@pytest.fixture(scope="module")
def tiny(vl_kind):
    tokenizer = build_tiny_tokenizer()
    return tokenizer, build_tiny_model(vl_kind, tokenizer)


def _text_batch(tokenizer):
    ids = torch.arange(10, 40)
    labels = ids.clone()
    labels[:8] = IGNORE_INDEX
    return collate_padded([SFTSample(ids, labels, torch.arange(30).expand(3, -1))], tokenizer.pad_token_id, mrope=True)


def test_clip_grad_norm_matches_torch_on_plain_tensors():
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    for a, b in zip(ours, theirs, strict=True):
        a.grad = torch.randn_like(a)
        b.grad = a.grad.clone()
    expected = torch.nn.utils.clip_grad_norm_(theirs, 0.5)
    norm = clip_grad_norm(ours, 0.5)
    assert torch.allclose(norm, expected)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.allclose(a.grad, b.grad)
    assert torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in ours])) == pytest.approx(0.5, rel=1e-4)


def test_clip_grad_norm_zero_only_measures():
    parameter = torch.nn.Parameter(torch.zeros(4))
    parameter.grad = torch.full((4,), 3.0)
    assert float(clip_grad_norm([parameter], 0.0)) == pytest.approx(6.0)
    assert torch.equal(parameter.grad, torch.full((4,), 3.0))


def test_clip_grad_norm_leaves_host_gradients_within_the_limit_untouched(monkeypatch):
    """CPU offload's gradients live on the host: under the limit no multiply pass runs over them; over it they scale."""
    parameter = torch.nn.Parameter(torch.zeros(4))
    parameter.grad = torch.full((4,), 3.0)  # norm 6
    passes = []
    multiply = torch._foreach_mul_
    monkeypatch.setattr(torch, "_foreach_mul_", lambda pieces, scale: passes.append(1) or multiply(pieces, scale))
    assert float(clip_grad_norm([parameter], 10.0)) == pytest.approx(6.0)
    assert passes == [] and torch.equal(parameter.grad, torch.full((4,), 3.0))
    assert float(clip_grad_norm([parameter], 3.0)) == pytest.approx(6.0)
    assert passes == [1] and torch.allclose(parameter.grad, torch.full((4,), 1.5))


def _host_pair(fused: bool):
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(64, 33)) for _ in range(3)]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    make = lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=fused)  # noqa: E731
    return ours, theirs, make(ours), make(theirs)


@pytest.mark.parametrize("max_norm", [0.5, 1e3])
def test_clip_and_step_folds_the_host_clip_into_the_fused_adamw_once(monkeypatch, max_norm):
    """Host gradients under torch's fused AdamW (train.cpu_offload): the clip coefficient goes into the kernel as its
    grad_scale, for that step alone, with no multiply pass; weights, moments and the clipped gradients equal those of
    clip_grad_norm then step() to float32 rounding, over and under the limit."""
    ours, theirs, mine, reference = _host_pair(fused=True)
    passes, scales, norms = [], [], []
    multiply = torch._foreach_mul_
    monkeypatch.setattr(torch, "_foreach_mul_", lambda pieces, scale: passes.append(1) or multiply(pieces, scale))
    mine.register_step_pre_hook(lambda optimizer, *_: scales.append(getattr(optimizer, "grad_scale", None)))
    for _ in range(3):
        grads = [torch.randn(64, 33) * 10 for _ in ours]  # norm about 460
        for a, b, grad in zip(ours, theirs, grads, strict=True):
            a.grad, b.grad = grad.clone(), grad.clone()
        norm = clip_and_step(ours, max_norm, mine)
        norms.append(norm)
        assert not hasattr(mine, "grad_scale")  # the next step starts clean
        assert float(norm) == pytest.approx(float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))))
        assert float(norm) == float(clip_grad_norm(theirs, max_norm))
        reference.step()
        for a, b in zip(ours, theirs, strict=True):
            # the kernel writes the gradient it used back: clipped once (twice would leave a norm of max_norm**2 / 460)
            torch.testing.assert_close(a.grad, b.grad, rtol=2e-7, atol=0)
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
            for key in ("exp_avg", "exp_avg_sq"):
                # near-cancelling moments carry the rounding of larger terms: tolerance relative to the largest
                expected = reference.state[b][key]
                tolerance = 1e-6 * float(expected.abs().max())
                torch.testing.assert_close(mine.state[a][key], expected, rtol=1e-6, atol=tolerance)
    clipped = max_norm < 460
    assert passes == ([1, 1, 1] if clipped else [])  # clip_grad_norm's multiplies for the reference only
    if clipped:
        # the divisor is the clip coefficient's reciprocal: norm / max_norm, about 920 here
        assert [float(scale) for scale in scales] == [pytest.approx(float(n) / max_norm, rel=1e-6) for n in norms]
        total = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in ours]))
        assert float(total) == pytest.approx(max_norm, rel=1e-5)
    else:
        assert scales == [None, None, None]


def test_on_the_gpu_the_fold_always_runs_with_a_divisor_of_at_least_one(monkeypatch):
    """GPU gradients: the clip coefficient stays a device tensor (no sync to learn whether it clips), so the fused
    kernel always gets it, as max(norm / max_norm, 1): under the limit the divisor is exactly 1 and the step equals
    an unclipped one. Simulated on the host by the GPU's coefficient (a tensor even at 1) and a GPU group key."""
    import physreason.models.parallelize as parallelize

    assert parallelize._folds_grad_scale(torch.optim.AdamW([torch.nn.Parameter(torch.ones(1))], fused=True),
                                         {(torch.device("cuda", 0), torch.float32): []})  # fmt: skip
    assert not parallelize._folds_grad_scale(torch.optim.AdamW([torch.nn.Parameter(torch.ones(1))], fused=True),
                                             {(torch.device("cuda", 0), torch.bfloat16): []})  # fmt: skip
    monkeypatch.setattr(parallelize, "_clip_coefficient", lambda total, max_norm: (max_norm / (total + 1e-6)).clamp(max=1.0))
    ours, theirs, mine, reference = _host_pair(fused=True)
    scales = []
    mine.register_step_pre_hook(lambda optimizer, *_: scales.append(getattr(optimizer, "grad_scale", None)))
    for a, b in zip(ours, theirs, strict=True):
        a.grad = torch.randn(64, 33) * 10  # norm about 460, under 1e3
        b.grad = a.grad.clone()
    clip_and_step(ours, 1e3, mine)
    reference.step()
    assert [float(scale) for scale in scales] == [1.0]
    assert all(torch.equal(a, b) and torch.equal(a.grad, b.grad) for a, b in zip(ours, theirs, strict=True))


def test_clip_and_step_scales_in_place_for_optimizers_without_the_fused_kernel(monkeypatch):
    """Unfused AdamW (and bf16-state AdamW): the gradients are multiplied as clip_grad_norm does, and the step is
    exactly clip_grad_norm then step()."""
    ours, theirs, mine, reference = _host_pair(fused=False)
    for a, b in zip(ours, theirs, strict=True):
        a.grad = torch.randn(64, 33) * 10
        b.grad = a.grad.clone()
    clip_and_step(ours, 0.5, mine)
    clip_grad_norm(theirs, 0.5)
    reference.step()
    assert all(torch.equal(a, b) and torch.equal(a.grad, b.grad) for a, b in zip(ours, theirs, strict=True))


def test_balanced_vision_runs_the_tower_for_images_and_videos_on_a_text_batch_without_changing_the_loss(tiny):
    tokenizer, model = tiny
    batch = _text_batch(tokenizer)
    calls = []
    hook = vision_tower(model).register_forward_hook(lambda *_: calls.append(1))
    try:
        plain = CausalLMLoss(model)(batch)
        assert calls == []
        balanced = CausalLMLoss(model, balance_vision=True)(batch)
    finally:
        hook.remove()
    assert len(calls) == 2
    assert torch.equal(plain, balanced)
    model.zero_grad(set_to_none=True)
    balanced.backward()
    tower_grads = [p.grad for p in vision_tower(model).parameters()]
    # every rank's tower takes part in backward too (so FSDP2 reduce-scatters match), with zero gradient
    assert all(g is not None and not g.any() for g in tower_grads)
    model.zero_grad(set_to_none=True)


def test_balanced_vision_adds_only_the_missing_kind_to_an_image_batch(tiny):
    from physreason.models.family import model_family, read_vision_tokens
    from physreason.models.inputs import encode_visuals

    tokenizer, model = tiny
    params = model_family(model.config).processor
    side = 2 * params.factor
    visuals = encode_visuals([np.zeros((side, side, 3), np.uint8)], [], params)
    spec = read_vision_tokens(model.config)
    ids = torch.tensor([1, 2] + [spec.image_token_id] * visuals.image_token_counts[0] + list(range(20, 30)))
    positions = spec.positions(ids, visuals)
    batch = collate_padded([SFTSample(ids, ids.clone(), positions, visuals)], tokenizer.pad_token_id, mrope=True)
    # one dummy video through the tower: its merged features, plus Qwen3-VL's DeepStack taps
    taps = len(getattr(model.config.vision_config, "deepstack_visual_indexes", None) or [])
    assert len(dummy_vision_features(model, batch.model_inputs(), torch.device("cpu"))) == 1 + taps
    calls = []
    hook = vision_tower(model).register_forward_hook(lambda *_: calls.append(1))
    try:
        with torch.no_grad():
            CausalLMLoss(model, balance_vision=True)(batch)
    finally:
        hook.remove()
    assert len(calls) == 2  # the real image call and one dummy video call, as on a text-only rank


def test_text_only_models_need_no_dummy_vision():
    model = build_tiny_model("qwen2", build_tiny_tokenizer())
    assert dummy_vision_features(model, {"input_ids": torch.zeros(1, 4, dtype=torch.long)}, torch.device("cpu")) == []


def test_tp_size_that_does_not_divide_the_processes_is_a_config_error():
    config = load_config(None, ["policy.parallelism.tp_size=2", "train.train_batch_per_replica=4"])
    with pytest.raises(ConfigError, match="tp_size"):
        batch_layout(config, 1, 2)
    assert batch_layout(config, 4, 2) == (2, 2)


def test_selective_activation_checkpointing_marks_every_nth_decoder_block():
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model("qwen2_5_vl", tokenizer)
    enable_activation_checkpointing(model, every=2)
    flags = [block.gradient_checkpointing for block in decoder_layers(model)]
    assert flags == [i % 2 == 0 for i in range(len(flags))] and len(flags) >= 2
    with pytest.raises(ConfigError):
        enable_activation_checkpointing(model, every=0)
