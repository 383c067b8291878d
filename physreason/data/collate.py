"""Collate SFT samples into padded model batches with next-token targets already aligned.

Targets are shifted inside each sample (`targets[t] = labels[t + 1]`, the last position of a sample
gets -100), so the loss needs no shift and a sample's last token never predicts the next sample's
first token: the same code serves padded and packed batches.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from physreason.data.sft import IGNORE_INDEX, SFTSample, SkippedSample


@dataclass
class SFTBatch:
    """One forward pass worth of data, plus bookkeeping for logs."""

    input_ids: torch.Tensor  # [B, L]
    targets: torch.Tensor  # [B, L] next-token ids, IGNORE_INDEX where no loss
    position_ids: torch.Tensor  # [3, B, L] mrope, [4, 1, L] packed mrope, [B, L] text models
    attention_mask: torch.Tensor | None  # [B, L]; None for packed rows (boundaries come from position_ids)
    visual_kwargs: dict[str, torch.Tensor] = field(default_factory=dict)
    num_samples: int = 0
    skipped: Counter = field(default_factory=Counter)
    truncated: int = 0  # samples cut at model_max_length (SFTSample.truncated)

    @property
    def num_targets(self) -> int:
        """Tokens that carry a loss."""
        return int((self.targets != IGNORE_INDEX).sum())

    @property
    def num_tokens(self) -> int:
        """Tokens the model processes, padding excluded."""
        return int(self.attention_mask.sum()) if self.attention_mask is not None else self.input_ids.numel()

    def model_inputs(self) -> dict[str, Any]:
        """Keyword arguments for the transformers model's forward (no labels: the loss is ours)."""
        inputs = {"input_ids": self.input_ids, "position_ids": self.position_ids, **self.visual_kwargs}
        if self.attention_mask is not None:
            inputs["attention_mask"] = self.attention_mask
        return inputs

    def to(self, device: torch.device | str) -> SFTBatch:
        """Move tensors to a device (non-blocking where possible)."""
        move = lambda t: t.to(device, non_blocking=True)
        return SFTBatch(
            move(self.input_ids),
            move(self.targets),
            move(self.position_ids),
            move(self.attention_mask) if self.attention_mask is not None else None,
            {k: move(v) for k, v in self.visual_kwargs.items()},
            self.num_samples,
            self.skipped,
            self.truncated,
        )


def shifted_targets(labels: torch.Tensor) -> torch.Tensor:
    """[L] labels -> [L] targets with targets[t] = labels[t + 1] and IGNORE_INDEX last."""
    return torch.cat([labels[1:], labels.new_full((1,), IGNORE_INDEX)])


def split_samples(items: list[SFTSample | SkippedSample]) -> tuple[list[SFTSample], Counter]:
    """Separate usable samples from skipped ones, counting skip reasons."""
    samples = [s for s in items if isinstance(s, SFTSample)]
    skipped = Counter(s.reason.split(" (")[0] for s in items if isinstance(s, SkippedSample))
    return samples, skipped


def visual_kwargs(samples: list[SFTSample]) -> dict[str, torch.Tensor]:
    """Concatenate the samples' visual inputs in order (the model consumes them in token order)."""
    parts = [s.visuals for s in samples if s.visuals is not None]
    if not parts:
        return {}
    from physreason.models.inputs import concat_visuals

    return concat_visuals(parts).model_kwargs()


def empty_batch(skipped: Counter) -> SFTBatch:
    """A batch with no usable sample: it only carries skip counts (the trainer steps over it)."""
    nothing = torch.zeros(1, 0, dtype=torch.long)  # [1, 0]
    return SFTBatch(nothing, nothing, nothing, None, {}, 0, skipped)


def round_up(length: int, multiple: int) -> int:
    """`length` rounded up to a multiple of `multiple` (float8 matmuls need token counts that are multiples of 16)."""
    return -(-length // multiple) * multiple


def collate_padded(
    items: list[SFTSample | SkippedSample], pad_token_id: int, mrope: bool, pad_multiple: int = 1
) -> SFTBatch:
    """Right-pad samples into [B, L] rows (a batch of skipped samples only carries their reasons).

    pad_multiple: L is rounded up to a multiple of it (16 under [train.fp8]: torch._scaled_mm takes the batch's
    token count as a matmul side in the weight gradient); the extra columns are padding, masked and without targets.
    """
    samples, skipped = split_samples(items)
    if not samples:
        return empty_batch(skipped)
    length = round_up(max(len(s.input_ids) for s in samples), pad_multiple)
    batch = len(samples)
    input_ids = torch.full((batch, length), pad_token_id, dtype=torch.long)  # [B, L]
    targets = torch.full((batch, length), IGNORE_INDEX, dtype=torch.long)  # [B, L]
    attention = torch.zeros(batch, length, dtype=torch.long)  # [B, L]
    positions = torch.zeros(3, batch, length, dtype=torch.long)  # [3, B, L]
    for row, sample in enumerate(samples):
        n = len(sample.input_ids)
        input_ids[row, :n] = sample.input_ids
        targets[row, :n] = shifted_targets(sample.labels)
        attention[row, :n] = 1
        positions[:, row, :n] = sample.position_ids
    return SFTBatch(
        input_ids, targets, positions if mrope else positions[0], attention, visual_kwargs(samples), batch, skipped,
        sum(s.truncated for s in samples),
    )
