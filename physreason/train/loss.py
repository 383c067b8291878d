"""Token cross-entropy that never materialises the full [tokens, vocab] logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from physreason.data.sft import IGNORE_INDEX


def _chunk_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = (hidden @ weight.t()).float()  # [n, V]
    return F.cross_entropy(logits, targets, reduction="sum")


def cross_entropy_sum(
    hidden: torch.Tensor,  # [..., H] final hidden states
    weight: torch.Tensor,  # [V, H] lm_head weight
    targets: torch.Tensor,  # [...] next-token ids, IGNORE_INDEX where no loss
    chunk_size: int = 0,
) -> torch.Tensor:
    """Sum (fp32) of the cross-entropy over target positions only.

    Positions without a target are dropped before the lm_head. With chunk_size > 0 the lm_head and
    loss run chunk by chunk under activation checkpointing, so at most [chunk_size, V] logits exist at
    once in forward and backward.
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
    total = selected.new_zeros((), dtype=torch.float32)
    for start in range(0, selected.shape[0], chunk_size):
        piece = slice(start, start + chunk_size)
        total = total + checkpoint(_chunk_loss, selected[piece], weight, wanted[piece], use_reentrant=False)
    return total
