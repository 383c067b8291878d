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

from physreason.data.collate import (
    IGNORE_INDEX,
    SFTBatch,
    empty_batch,
    round_up,
    shifted_targets,
    split_samples,
    visual_kwargs,
)
from physreason.data.sft import SFTSample, SkippedSample


def collate_packed(
    items: list[SFTSample | SkippedSample], mrope: bool, pad_multiple: int = 1, pad_token_id: int = 0
) -> SFTBatch:
    """Concatenate samples into one [1, sum L] row with per-sample positions (see the module docstring).

    pad_multiple: the row is rounded up to a multiple of it with one padding segment of its own (positions restart
    at 0, no targets), so no sample attends to it and it changes no loss (16 under [train.fp8]).
    """
    samples, skipped = split_samples(items)
    if not samples:
        return empty_batch(skipped)
    input_ids = torch.cat([s.input_ids for s in samples])[None]  # [1, T]
    targets = torch.cat([shifted_targets(s.labels) for s in samples])[None]  # [1, T]
    text_positions = torch.cat([torch.arange(len(s.input_ids)) for s in samples])  # [T]
    rope = torch.cat([s.position_ids for s in samples], dim=1) if mrope else None  # [3, T]
    extra = round_up(input_ids.shape[1], pad_multiple) - input_ids.shape[1]
    if extra:
        input_ids = torch.cat([input_ids, torch.full((1, extra), pad_token_id, dtype=input_ids.dtype)], dim=1)
        targets = torch.cat([targets, torch.full((1, extra), IGNORE_INDEX, dtype=targets.dtype)], dim=1)
        text_positions = torch.cat([text_positions, torch.arange(extra)])
        if rope is not None:
            rope = torch.cat([rope, torch.arange(extra, dtype=rope.dtype).expand(3, extra)], dim=1)
    if rope is not None:
        positions = torch.cat([text_positions[None], rope])[:, None]  # [4, 1, T]
    else:
        positions = text_positions[None]  # [1, T]
    return SFTBatch(
        input_ids, targets, positions, None, visual_kwargs(samples), len(samples), skipped, sum(s.truncated for s in samples)
    )
