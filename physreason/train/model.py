"""The module the SFT trainer optimises: a transformers causal LM whose forward returns the loss sum.

Wrapping (rather than calling the backbone and lm_head from outside) keeps every parameter behind
one forward, so FSDP2's root hooks gather the embedding, final norm and lm_head when they are needed.
"""

from __future__ import annotations

import torch
from torch import nn

from physreason.data.collate import SFTBatch
from physreason.data.sft import IGNORE_INDEX
from physreason.models.context_parallel import context_of, sum_over_context
from physreason.models.parallelize import dummy_vision_features
from physreason.train import phases
from physreason.train.loss import cross_entropy_sum


class CausalLMLoss(nn.Module):
    """forward(batch) -> summed token cross-entropy (fp32) over the batch's targets.

    balance_vision: run the vision tower on a dummy input for each visual kind the batch lacks, so that
    every FSDP2 data-parallel rank makes the same collectives (see parallelize.dummy_vision_features).
    Needed whenever data-parallel ranks may see different mixes of images, videos and text; off in one
    process, where it would only cost time. The loss is unchanged; the tower's parameters get a zero
    (not absent) gradient on steps without visual input, so AdamW still decays them there.

    Under context parallelism the language model returns this rank's slice of the sequence: the loss of the
    targets in that slice is summed over the group, so every rank returns the whole batch's loss (each rank's
    backward covers its own tokens; see models/context_parallel.py).
    """

    def __init__(self, model: nn.Module, loss_chunk_size: int = 0, balance_vision: bool = False) -> None:
        super().__init__()
        self.model = model
        self.loss_chunk_size = loss_chunk_size
        self.balance_vision = balance_vision
        phases.mark_vision_tower(model)

    def forward(self, batch: SFTBatch) -> torch.Tensor:
        inputs = batch.model_inputs()
        dummies = dummy_vision_features(self.model, inputs, batch.input_ids.device) if self.balance_vision else []
        with phases.phase(phases.LANGUAGE_MODEL):
            hidden = self.model.model(**inputs, use_cache=False).last_hidden_state  # [B, L, H] ([B, L / cp, H] under cp)
        with phases.phase(phases.LOSS):
            context = context_of(self.model)
            targets = batch.targets  # [B, L]
            if context is not None:
                targets = context.shard(targets.shape[1]).take(targets, dim=1, fill=IGNORE_INDEX)  # [B, L / cp]
            loss = cross_entropy_sum(hidden, self.model.lm_head.weight, targets, self.loss_chunk_size)
            if context is not None:
                loss = sum_over_context(loss, context.group)
        for features in dummies:
            loss = loss + 0.0 * features.sum()
        return loss
