"""The module the SFT trainer optimises: a transformers causal LM whose forward returns the loss sum.

Wrapping (rather than calling the backbone and lm_head from outside) keeps every parameter behind
one forward, so FSDP2's root hooks gather the embedding, final norm and lm_head when they are needed.
"""

from __future__ import annotations

import torch
from torch import nn

from physreason.data.collate import SFTBatch
from physreason.train.loss import cross_entropy_sum


class CausalLMLoss(nn.Module):
    """forward(batch) -> summed token cross-entropy (fp32) over the batch's targets."""

    def __init__(self, model: nn.Module, loss_chunk_size: int = 0) -> None:
        super().__init__()
        self.model = model
        self.loss_chunk_size = loss_chunk_size

    def forward(self, batch: SFTBatch) -> torch.Tensor:
        hidden = self.model.model(**batch.model_inputs(), use_cache=False).last_hidden_state  # [B, L, H]
        return cross_entropy_sum(hidden, self.model.lm_head.weight, batch.targets, self.loss_chunk_size)
