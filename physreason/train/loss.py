"""Token cross-entropy that never materialises the full [tokens, vocab] logits.

Chunked (chunk_size > 0), the lm_head and the loss run chunk by chunk and each chunk's gradients are made in the
forward, while its logits exist (as Liger's fused linear cross-entropy does): the backward only scales them by the
incoming gradient. Against checkpointing each chunk (the recompute path, `FUSED = False`), that drops one of the four
[tokens, vocab] matmuls (the forward again in the backward) and the recompute's passes over the logits, and no
[tokens, vocab] tensor outlives its chunk. The logits come from the matmul in the compute dtype; the softmax, the
log-sum-exp and the loss are float32; the gradient of the logits goes back to the compute dtype for its two matmuls.

On CUDA that softmax and gradient of a chunk run as one torch.compile'd function (`LOGIT_GRAD = "cuda"`): its
reductions and its gradient read the compute-dtype logits and write the gradient once, where the eager ops made a
float32 copy of the [chunk, vocab] logits and about ten passes over it (the 3B shape's loss spent about as long on
those passes as on its three matmuls, H100, 2026-11-28).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from physreason.data.sft import IGNORE_INDEX
from physreason.models.lazy_compile import LazyCompiled, compiles_here

# False: each chunk runs under activation checkpointing instead (the path before the fused one; benches A/B it).
FUSED = True
# Where a fused chunk's softmax and logit gradient run compiled (module docstring; lazy_compile.compiles_here).
LOGIT_GRAD = "cuda"


def _chunk_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = (hidden @ weight.t()).float()  # [n, V]
    return F.cross_entropy(logits, targets, reduction="sum")


def _chunk_loss_and_logit_grad(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed cross-entropy, float32; d loss / d logits in the logits' dtype) of one chunk's [c, V] logits."""
    wide = logits.float()  # [c, V]
    top = wide.logsumexp(dim=-1, keepdim=True)  # [c, 1]
    picked = wide.gather(1, targets[:, None])  # [c, 1]
    loss = (top - picked).sum()
    grad = wide.sub_(top).exp_()  # softmax, in place of the float32 logits
    grad.scatter_add_(1, targets[:, None], torch.full_like(picked, -1.0))
    return loss, grad.to(logits.dtype)


def _logit_grad_math(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """_chunk_loss_and_logit_grad without in-place ops, for torch.compile: the same float32 math, the one-hot
    subtracted as a comparison with the column index (no scatter), so the gradient is one pointwise pass."""
    wide = logits.float()  # [c, V]; fused into the reductions and the pointwise pass, never stored
    top = wide.logsumexp(dim=-1, keepdim=True)  # [c, 1]
    picked = wide.gather(1, targets[:, None])  # [c, 1]
    loss = (top - picked).sum()
    hit = torch.arange(wide.shape[-1], device=wide.device)[None, :] == targets[:, None]  # [c, V] one-hot
    grad = (wide - top).exp() - hit.to(wide.dtype)
    return loss, grad.to(logits.dtype)


# dynamic=None: the first chunk length is compiled as it is, a second one (the last chunk of a row set) marks the
# length dynamic, so later lengths reuse that graph
_compiled_logit_grad = LazyCompiled(_logit_grad_math, dynamic=None)


def _logit_grad(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed cross-entropy, d loss / d logits) of one chunk, compiled where LOGIT_GRAD says, eager elsewhere."""
    if compiles_here(LOGIT_GRAD, logits):
        return _compiled_logit_grad(logits, targets)
    return _chunk_loss_and_logit_grad(logits, targets)


class _FusedChunkedCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of hidden @ weight.T over chunks of rows; gradients made in the forward (module docstring)."""

    @staticmethod
    def forward(
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_size: int
    ) -> torch.Tensor:
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None  # [n, H]
        # Summed over chunks by the matmul itself (fp32 accumulation inside, one rounding per chunk), as autograd
        # summed the chunks' weight gradients in the compute dtype before.
        grad_weight = torch.zeros_like(weight) if need_weight else None  # [V, H]
        total = hidden.new_zeros((), dtype=torch.float32)
        for start in range(0, hidden.shape[0], chunk_size):
            rows = hidden[start : start + chunk_size]  # [c, H]
            loss, grad = _logit_grad(rows @ weight.t(), targets[start : start + chunk_size])
            total += loss
            if grad_hidden is not None:
                torch.mm(grad, weight, out=grad_hidden[start : start + chunk_size])
            if grad_weight is not None:
                grad_weight.addmm_(grad.t(), rows)
        ctx.grads = (grad_hidden, grad_weight)  # made here, used once: kept on ctx, not saved for double backward
        return total

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        scale = grad_output.to(torch.float32)
        grad_hidden, grad_weight = (None if grad is None else grad.mul_(scale) for grad in ctx.grads)
        ctx.grads = None
        return grad_hidden, grad_weight, None, None


def cross_entropy_sum(
    hidden: torch.Tensor,  # [..., H] final hidden states
    weight: torch.Tensor,  # [V, H] lm_head weight
    targets: torch.Tensor,  # [...] next-token ids, IGNORE_INDEX where no loss
    chunk_size: int = 0,
) -> torch.Tensor:
    """Sum (fp32) of the cross-entropy over target positions only.

    Positions without a target are dropped before the lm_head. With chunk_size > 0 the lm_head and
    loss run chunk by chunk, each chunk's gradients made in the forward (module docstring; under activation
    checkpointing instead with FUSED = False), so at most [chunk_size, V] logits exist at once.
    """
    keep = targets != IGNORE_INDEX
    selected = hidden[keep]  # [n, H]
    wanted = targets[keep]  # [n]
    if selected.shape[0] == 0:
        # Zero, but tied to the hidden states and the lm_head: every rank gives every parameter a gradient, so the
        # data-parallel (and context-parallel) reductions see the same tensors on all ranks. fp32 as the other path:
        # a bf16 zero on one context-parallel rank beside fp32 losses on the others breaks their all-reduce.
        return (hidden.sum() + weight.sum()).float() * 0.0
    if chunk_size <= 0 or selected.shape[0] <= chunk_size:
        return _chunk_loss(selected, weight, wanted)
    if FUSED and torch.is_grad_enabled() and (selected.requires_grad or weight.requires_grad):
        device_type = selected.device.type
        if not torch.is_autocast_enabled(device_type):
            return _FusedChunkedCrossEntropy.apply(selected, weight, wanted, chunk_size)
        # Under autocast (float32 weights in a plain process): autocast would run the chunk matmuls in its dtype and
        # refuse the float32 gradient buffers, so cast both inputs here, as autocast casts them for a plain matmul;
        # the casts' backward returns float32 gradients, as autocast's would.
        dtype = torch.get_autocast_dtype(device_type)
        with torch.autocast(device_type, enabled=False):
            return _FusedChunkedCrossEntropy.apply(selected.to(dtype), weight.to(dtype), wanted, chunk_size)
    total = selected.new_zeros((), dtype=torch.float32)
    for start in range(0, selected.shape[0], chunk_size):
        piece = slice(start, start + chunk_size)
        total = total + checkpoint(_chunk_loss, selected[piece], weight, wanted[piece], use_reentrant=False)
    return total
