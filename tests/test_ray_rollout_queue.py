"""The controller's rollout queue and its staleness bound (no Ray needed)."""

from __future__ import annotations

from physreason.distributed.rollout_queue import RolloutQueue, ScoredGroup, generation_room, is_fresh


def _group(version: int, draw: int) -> ScoredGroup:
    return ScoredGroup(samples=[], version=version, replica=0, draw=draw)


def test_freshness_is_the_step_lag_against_the_bound():
    assert is_fresh(version=3, step=3, allowed_outdated_steps=0)
    assert not is_fresh(version=2, step=3, allowed_outdated_steps=0)
    assert is_fresh(version=1, step=3, allowed_outdated_steps=2)
    assert not is_fresh(version=0, step=3, allowed_outdated_steps=2)


def test_take_hands_out_fresh_groups_of_the_oldest_weights_first_and_never_a_stale_one():
    queue = RolloutQueue(allowed_outdated_steps=1)
    for draw, version in enumerate([0, 1, 2, 1, 2]):
        queue.put(_group(version, draw))

    stale = queue.drop_stale(step=2)
    taken = queue.take(step=2, count=2)

    assert [g.draw for g in stale] == [0]
    assert [g.draw for g in taken] == [1, 3]  # both of weights 1 (they expire first), in arrival order
    assert queue.draws() == [2, 4]
    assert queue.take(step=2, count=3) is None
    assert len(queue) == 2


def test_generation_room_is_what_the_updates_a_replica_can_still_feed_will_consume():
    # On-policy: weights 3 feed only the update taken at step 3.
    assert generation_room(version=3, next_step=3, groups_per_step=4, allowed_outdated_steps=0, pending=0) == 4
    assert generation_room(version=3, next_step=4, groups_per_step=4, allowed_outdated_steps=0, pending=0) == 0
    # One step of lag: weights 3 feed the updates taken at steps 3 and 4.
    assert generation_room(version=3, next_step=3, groups_per_step=4, allowed_outdated_steps=1, pending=0) == 8
    assert generation_room(version=3, next_step=3, groups_per_step=4, allowed_outdated_steps=1, pending=6) == 2
    # While update 3 trains (next batch is taken at step 4), a replica still on weights 2 that already has a
    # step's worth queued must wait for weights 3: what it made now would be stale at step 4.
    assert generation_room(version=2, next_step=4, groups_per_step=4, allowed_outdated_steps=1, pending=4) == 0
    assert generation_room(version=3, next_step=4, groups_per_step=4, allowed_outdated_steps=1, pending=4) == 0
    assert generation_room(version=3, next_step=4, groups_per_step=4, allowed_outdated_steps=1, pending=0) == 4
    # Stale weights never get room, whatever is pending.
    assert generation_room(version=1, next_step=4, groups_per_step=4, allowed_outdated_steps=1, pending=0) == 0
