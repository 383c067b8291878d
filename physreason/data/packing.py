"""Pack several SFT samples into one row with no attention across samples.

How isolation is ensured: the packed row has no 2D attention mask and its text position ids restart
at 0 for every sample. transformers turns such restarts into sample boundaries: with sdpa/eager it
builds a block-diagonal causal mask (`find_packed_sequence_indices` in masking_utils), with
flash-attention it runs the varlen kernel over the same boundaries. For Qwen2.5-VL the position ids are
[4, 1, L]: row 0 is the per-sample text position (used only for the boundaries), rows 1-3 are each
sample's own 3D mrope positions, also restarting per sample. Targets are shifted within each sample
(`collate.shifted_targets`), so no token predicts across a boundary. `tests/test_sft_packing.py`
checks that the packed loss equals the unpacked loss.
"""

from __future__ import annotations

import torch

from physreason.data.collate import SFTBatch, empty_batch, shifted_targets, split_samples, visual_kwargs
from physreason.data.sft import SFTSample, SkippedSample


def collate_packed(items: list[SFTSample | SkippedSample], mrope: bool) -> SFTBatch:
    """Concatenate samples into one [1, sum L] row with per-sample positions (see the module docstring)."""
    samples, skipped = split_samples(items)
    if not samples:
        return empty_batch(skipped)
    input_ids = torch.cat([s.input_ids for s in samples])[None]  # [1, T]
    targets = torch.cat([shifted_targets(s.labels) for s in samples])[None]  # [1, T]
    text_positions = torch.cat([torch.arange(len(s.input_ids)) for s in samples])  # [T]
    if mrope:
        rope = torch.cat([s.position_ids for s in samples], dim=1)  # [3, T]
        positions = torch.cat([text_positions[None], rope])[:, None]  # [4, 1, T]
    else:
        positions = text_positions[None]  # [1, T]
    return SFTBatch(input_ids, targets, positions, None, visual_kwargs(samples), len(samples), skipped)
