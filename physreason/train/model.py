"""The module the SFT trainer optimises: a transformers causal LM whose forward returns the loss sum.

Wrapping (rather than calling the backbone and lm_head from outside) keeps every parameter behind
one forward, so FSDP2's root hooks gather the embedding, final norm and lm_head when they are needed.
"""

from __future__ import annotations

import torch
from torch import nn

from physreason.data.collate import SFTBatch
from physreason.models.loading import vision_tower
from physreason.train.loss import cross_entropy_sum

# transformers' Qwen2.5-VL runs its vision tower once for the batch's images and once for its videos.
_VISUAL_INPUTS = ("pixel_values", "pixel_values_videos")


class CausalLMLoss(nn.Module):
    """forward(batch) -> summed token cross-entropy (fp32) over the batch's targets.

    balance_vision: run the vision tower on a one-token dummy input for each visual kind (images,
    videos) the batch lacks and add 0 x its output to the loss. Under FSDP2 every data-parallel rank
    must make the same collectives; without this, a rank with a text-only micro-batch skips the tower's
    all-gathers and reduce-scatters while another rank runs them, and the job crashes (gloo) or hangs
    (NCCL). Off in one process, where it would only cost time.
    """

    def __init__(self, model: nn.Module, loss_chunk_size: int = 0, balance_vision: bool = False) -> None:
        super().__init__()
        self.model = model
        self.loss_chunk_size = loss_chunk_size
        self.balance_vision = balance_vision and vision_tower(model) is not None

    def forward(self, batch: SFTBatch) -> torch.Tensor:
        inputs = batch.model_inputs()
        # The dummy calls come first so every rank gathers the tower's blocks before the decoder's, in one order.
        dummy = [
            self._dummy_vision_output(batch.input_ids.device)
            for name in _VISUAL_INPUTS
            if self.balance_vision and inputs.get(name) is None
        ]
        hidden = self.model.model(**inputs, use_cache=False).last_hidden_state  # [B, L, H]
        loss = cross_entropy_sum(hidden, self.model.lm_head.weight, batch.targets, self.loss_chunk_size)
        for features in dummy:
            loss = loss + 0.0 * features.sum()
        return loss

    def _dummy_vision_output(self, device: torch.device) -> torch.Tensor:
        """The vision tower's merged features of one all-zero image of merge x merge patches: [1, H_out]."""
        spec = self.model.config.vision_config
        merge = spec.spatial_merge_size
        row = spec.in_channels * spec.temporal_patch_size * spec.patch_size**2
        pixels = torch.zeros(merge * merge, row, device=device)  # [patches, C * T * P * P]
        grid = torch.tensor([[1, merge, merge]], device=device)  # [images, (t, h, w)] in patches
        return vision_tower(self.model)(pixels, grid_thw=grid).pooler_output
