"""Deterministic, resumable sample order shared by any number of data-parallel ranks.

Step s of epoch e uses the global batch perm_e[s*G : (s+1)*G] (G = global batch); rank r takes its
contiguous slice of it. The order depends only on (seed, epoch), never on the world size, so one
process and N processes see the same samples per step, and a resumed run restarts at a step exactly.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


class StepSampler(Sampler[int]):
    """Yield this rank's sample indices for steps start_step .. steps_per_epoch - 1 of one epoch."""

    def __init__(
        self, num_samples: int, global_batch: int, rank: int, world_size: int, seed: int, shuffle: bool = True
    ) -> None:
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.per_rank = global_batch // world_size
        self.rank = rank
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.start_step = 0

    @property
    def steps_per_epoch(self) -> int:
        """Full global batches in one pass (the remainder is dropped so every step is the same size)."""
        return self.num_samples // self.global_batch

    def set_position(self, epoch: int, start_step: int) -> None:
        """Start the next iteration at a given epoch and step within it."""
        self.epoch = epoch
        self.start_step = start_step

    def order(self) -> list[int]:
        """The epoch's global sample order."""
        if not self.shuffle:
            return list(range(self.num_samples))
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_samples, generator=generator).tolist()

    def __iter__(self) -> Iterator[int]:
        order = self.order()
        for step in range(self.start_step, self.steps_per_epoch):
            first = step * self.global_batch + self.rank * self.per_rank
            yield from order[first : first + self.per_rank]

    def __len__(self) -> int:
        return (self.steps_per_epoch - self.start_step) * self.per_rank
