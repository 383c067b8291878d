"""The chunked lm_head + cross-entropy (train/loss.py): the same loss and gradients as the whole-logits loss, made
with three [tokens, vocab] matmuls (the forward's and the backward's two), not four (no recompute)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import physreason.train.loss as loss_module
from physreason.data.sft import IGNORE_INDEX
from physreason.models.lazy_compile import LazyCompiled
from physreason.train.loss import cross_entropy_sum

TOKENS, HIDDEN, VOCAB, CHUNK = 2 * 23, 16, 64, 8  # 23 tokens a row, chunks that do not divide the targets


def _inputs(dtype: torch.dtype, weight_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, TOKENS // 2, HIDDEN, generator=generator).to(dtype).requires_grad_()  # [B, L, H]
    weight = torch.randn(VOCAB, HIDDEN, generator=generator).to(dtype).requires_grad_(weight_grad)  # [V, H]
    targets = torch.randint(0, VOCAB, (2, TOKENS // 2), generator=generator)  # [B, L]
    targets[0, :5] = IGNORE_INDEX  # a prompt: no loss there
    return hidden, weight, targets


def _loss_and_grads(chunk: int, fused: bool, dtype: torch.dtype, monkeypatch, weight_grad: bool = True):
    monkeypatch.setattr(loss_module, "FUSED", fused)
    hidden, weight, targets = _inputs(dtype, weight_grad)
    loss = cross_entropy_sum(hidden, weight, targets, chunk)
    (loss * 0.37).backward()  # the trainer scales the sum by 1 / target tokens
    return loss.detach(), hidden.grad, weight.grad


@pytest.mark.parametrize("weight_grad", [True, False], ids=["lm_head-trained", "lm_head-frozen"])
def test_fused_chunks_give_the_loss_and_gradients_of_the_whole_logits(monkeypatch, weight_grad):
    whole = _loss_and_grads(0, True, torch.float32, monkeypatch, weight_grad)
    fused = _loss_and_grads(CHUNK, True, torch.float32, monkeypatch, weight_grad)
    recomputed = _loss_and_grads(CHUNK, False, torch.float32, monkeypatch, weight_grad)
    assert fused[0].dtype == torch.float32
    for ours in (fused, recomputed):
        assert torch.allclose(ours[0], whole[0], rtol=1e-6)
        assert torch.allclose(ours[1], whole[1], rtol=1e-5, atol=2e-6)
        if weight_grad:
            assert torch.allclose(ours[2], whole[2], rtol=1e-5, atol=2e-6)
        else:
            assert ours[2] is None
    assert not fused[1][0, :5].any()  # no gradient reaches positions without a target


def test_fused_chunks_in_bf16_stay_within_bf16_rounding_of_the_whole_logits(monkeypatch):
    whole = _loss_and_grads(0, True, torch.bfloat16, monkeypatch)
    fused = _loss_and_grads(CHUNK, True, torch.bfloat16, monkeypatch)
    assert torch.allclose(fused[0], whole[0], rtol=1e-3)
    for ours, reference in zip(fused[1:], whole[1:], strict=True):
        assert ours.dtype == torch.bfloat16
        assert torch.allclose(ours.float(), reference.float(), rtol=3e-2, atol=3e-3)


class _VocabMatmuls(TorchDispatchMode):
    """Counts the matrix products with a vocabulary-sized side (the lm_head's), in place ones included."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__.rstrip("_") in ("mm", "addmm", "bmm", "baddbmm"):
            shapes = [a.shape for a in args if isinstance(a, torch.Tensor)]
            self.count += any(VOCAB in shape for shape in shapes)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("fused", "matmuls"), [(True, 3), (False, 4)], ids=["fused", "recompute"])
def test_the_fused_chunks_skip_the_recompute_of_the_logits(monkeypatch, fused, matmuls):
    monkeypatch.setattr(loss_module, "FUSED", fused)
    hidden, weight, targets = _inputs(torch.float32)
    with _VocabMatmuls() as counter:
        cross_entropy_sum(hidden, weight, targets, CHUNK).backward()
    chunks = -(-int((targets != IGNORE_INDEX).sum()) // CHUNK)
    assert counter.count == matmuls * chunks  # forward, then d hidden and d weight; the recompute adds a forward


def test_without_gradients_the_chunks_only_compute_the_loss(monkeypatch):
    hidden, weight, targets = _inputs(torch.float32)
    with torch.no_grad():
        loss = cross_entropy_sum(hidden, weight, targets, CHUNK)
    assert torch.allclose(loss, cross_entropy_sum(hidden, weight, targets, 0).detach(), rtol=1e-6)


def test_fused_chunks_under_autocast_with_float32_weights(monkeypatch):
    """A plain process trains float32 weights under bf16 autocast (legacy precision, float8): the fused chunks cast
    their inputs as autocast casts a matmul's and hand float32 gradients back (they once failed in the first chunk's
    `torch.mm(..., out=)` with a bf16 product into a float32 buffer)."""
    monkeypatch.setattr(loss_module, "FUSED", True)
    hidden, weight, targets = _inputs(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = cross_entropy_sum(hidden, weight, targets, CHUNK)
    (loss * 0.37).backward()
    assert loss.dtype == torch.float32
    assert hidden.grad.dtype == torch.float32 and weight.grad.dtype == torch.float32
    reference = _loss_and_grads(CHUNK, True, torch.bfloat16, monkeypatch)  # the same inputs cast to bf16 first
    assert torch.allclose(loss.detach(), reference[0], rtol=1e-6)
    assert torch.equal(hidden.grad, reference[1].float())
    assert torch.equal(weight.grad, reference[2].float())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_compiled_logit_gradient_equals_the_eager_ops(monkeypatch, dtype):
    """LOGIT_GRAD = "cuda" compiles each chunk's softmax and gradient on GPUs; "always" runs that same compiled
    function here (inductor's CPU code), so its math is pinned against the eager ops: the same loss and gradients,
    over chunks of two lengths (the last chunk is shorter, so the length goes dynamic)."""
    fresh = LazyCompiled(loss_module._logit_grad_math, dynamic=None)
    monkeypatch.setattr(loss_module, "_compiled_logit_grad", fresh)
    monkeypatch.setattr(loss_module, "LOGIT_GRAD", "never")
    eager = _loss_and_grads(CHUNK, True, dtype, monkeypatch)
    assert fresh.compiled is None
    monkeypatch.setattr(loss_module, "LOGIT_GRAD", "always")
    compiled = _loss_and_grads(CHUNK, True, dtype, monkeypatch)
    assert fresh.compiled is not None and fresh.failed is None  # the compiled function ran
    assert torch.allclose(compiled[0], eager[0], rtol=1e-6)
    for ours, reference in zip(compiled[1:], eager[1:], strict=True):
        assert ours.dtype == dtype
        if dtype == torch.float32:
            assert torch.allclose(ours, reference, rtol=1e-5, atol=1e-6)
        else:  # one bf16 rounding of the gradient apart at most, where exp's last bit differs
            assert torch.allclose(ours.float(), reference.float(), rtol=1e-2, atol=1e-3)
    assert not compiled[1][0, :5].any()  # no gradient reaches positions without a target


def test_the_eager_logit_gradient_runs_on_the_cpu_by_default(monkeypatch):
    """The default ("cuda") compiles nothing for CPU logits: tests and CPU runs keep the eager ops."""
    fresh = LazyCompiled(loss_module._logit_grad_math, dynamic=None)
    monkeypatch.setattr(loss_module, "_compiled_logit_grad", fresh)
    monkeypatch.setattr(loss_module, "LOGIT_GRAD", "cuda")
    _loss_and_grads(CHUNK, True, torch.float32, monkeypatch)
    assert fresh.compiled is None
