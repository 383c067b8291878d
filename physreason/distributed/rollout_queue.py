"""The controller's rollout queue: scored groups tagged with the weight version that made them, under a staleness bound.

Versions count optimizer steps: weights of version `v` are the policy after `v` updates, and the
update that makes step `s + 1` runs on weights `s`. A group made with weights `v` may train that
update only when `s - v <= allowed_outdated_steps`; older groups are dropped, not
importance-corrected. Why: the only behaviour log-probabilities at hand are the engine's, which
differ from the policy's own by kernel noise (up to ~4e-3 after video tokens with vLLM), so a ratio
built on them would mix that noise into every token's weight; within a small bound the clipped
GRPO objective tolerates the lag (the colocated loop accepts the same lag with
`sync_weight_interval > 1`), and the controller throttles generation so drops stay rare.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from physreason.train.rollout import RolloutSample


@dataclass
class ScoredGroup:
    """The completions of one prompt draw, with advantages, and where they came from."""

    samples: list[RolloutSample]
    version: int  # weight version that generated them
    replica: int  # rollout replica id
    draw: int  # index of the prompt draw in the controller's PromptStream


def is_fresh(version: int, step: int, allowed_outdated_steps: int) -> bool:
    """True when weights `version` may train the update made at `step` (the policy holds weights `step`)."""
    return step - version <= allowed_outdated_steps


def generation_room(
    version: int, next_step: int, groups_per_step: int, allowed_outdated_steps: int, pending: int
) -> int:
    """Prompt groups a replica holding weights `version` may start: what the updates it can still feed will consume.

    Its groups can train the updates made at steps `next_step` (the next one to take a batch) through
    `version + allowed_outdated_steps`; `pending` groups (queued or being generated) are counted as consumed
    first, which holds when they carry weights no newer (the queue hands out the oldest weights first).
    Anything beyond that would only be generated to be dropped as stale.
    """
    updates = version + allowed_outdated_steps - next_step + 1
    return max(0, updates * groups_per_step - pending)


class RolloutQueue:
    """Scored groups in arrival order; `take` hands out fresh ones, oldest weights first, and never the stale."""

    def __init__(self, allowed_outdated_steps: int) -> None:
        self.allowed = allowed_outdated_steps
        self._groups: deque[ScoredGroup] = deque()

    def __len__(self) -> int:
        return len(self._groups)

    def put(self, group: ScoredGroup) -> None:
        """Append one group."""
        self._groups.append(group)

    def drop_stale(self, step: int) -> list[ScoredGroup]:
        """Remove and return the groups too old to train the update made at `step`."""
        stale = [g for g in self._groups if not is_fresh(g.version, step, self.allowed)]
        if stale:
            self._groups = deque(g for g in self._groups if is_fresh(g.version, step, self.allowed))
        return stale

    def take(self, step: int, count: int) -> list[ScoredGroup] | None:
        """`count` groups fresh at `step`, removed from the queue; None (queue unchanged) when fewer exist.

        Groups of the oldest weights go first (they are the first to expire), in arrival order within a
        version. Call drop_stale(step) first; stale groups are never returned.
        """
        fresh = sorted((g for g in self._groups if is_fresh(g.version, step, self.allowed)), key=lambda g: g.version)
        if len(fresh) < count:
            return None
        taken = fresh[:count]
        chosen = {id(g) for g in taken}
        self._groups = deque(g for g in self._groups if id(g) not in chosen)
        return taken

    def clear(self) -> list[ScoredGroup]:
        """Empty the queue; returns what it held."""
        groups = list(self._groups)
        self._groups.clear()
        return groups

    def draws(self) -> list[int]:
        """Prompt draw indices of the queued groups."""
        return [g.draw for g in self._groups]
