"""The controller's rollout queue and its staleness bound (no Ray needed)."""

from __future__ import annotations

from physreason.distributed.rollout_queue import RolloutQueue, ScoredGroup, generation_budget, is_fresh


def _group(version: int, draw: int) -> ScoredGroup:
    return ScoredGroup(samples=[], version=version, replica=0, draw=draw)


def test_freshness_is_the_step_lag_against_the_bound():
    assert is_fresh(version=3, step=3, allowed_outdated_steps=0)
    assert not is_fresh(version=2, step=3, allowed_outdated_steps=0)
    assert is_fresh(version=1, step=3, allowed_outdated_steps=2)
    assert not is_fresh(version=0, step=3, allowed_outdated_steps=2)


def test_take_hands_out_the_oldest_fresh_groups_and_never_a_stale_one():
    queue = RolloutQueue(allowed_outdated_steps=1)
    for draw, version in enumerate([0, 1, 2, 1, 2]):
        queue.put(_group(version, draw))

    stale = queue.drop_stale(step=2)
    taken = queue.take(step=2, count=2)

    assert [g.draw for g in stale] == [0]
    assert [g.draw for g in taken] == [1, 2]
    assert queue.draws() == [3, 4]
    assert queue.take(step=2, count=3) is None
    assert len(queue) == 2


def test_generation_budget_covers_the_updates_a_group_may_still_train():
    assert generation_budget(groups_per_step=4, allowed_outdated_steps=0) == 4
    assert generation_budget(groups_per_step=4, allowed_outdated_steps=2) == 12
