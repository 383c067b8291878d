"""What the disaggregated controller does when an update finishes (no Ray needed: the controller's state is built
directly and its remote calls are recorded)."""

from __future__ import annotations

import math
from collections import deque

import pytest

from physreason.config import Config
from physreason.distributed.controller import Controller, DisaggregatedResult, _Op, _StepWindow
from physreason.distributed.rollout_queue import ScoredGroup
from physreason.errors import TrainingDiverged
from physreason.train.loop import DivergenceWatch


def _controller(tmp_path) -> tuple[Controller, list[int], list[int]]:
    controller = object.__new__(Controller)  # no Ray session, no model: only what _on_train reads
    controller.config = Config.model_validate({"train": {"output_dir": str(tmp_path), "ckpt": {"enable_checkpoint": False}}})
    controller.step, controller.total_steps = 0, 10
    controller.result, controller._window = DisaggregatedResult(), _StepWindow()
    controller.divergence = DivergenceWatch(tmp_path)
    controller.replicas, controller._train_op = {}, None
    synced: list[int] = []
    logged: list[int] = []
    controller._sync = lambda replicas: synced.append(controller.step)
    controller._log_step = lambda metrics, groups: logged.append(controller.step)
    return controller, synced, logged


def _trained(loss: float, grad_norm: float = 1.0) -> _Op:
    op = _Op("train", [object()], timeline=0, payload=[ScoredGroup([], version=0, replica=0, draw=0)])
    op.results[0] = {"loss": loss, "policy/grad_norm": grad_norm}
    return op


def test_a_non_finite_loss_stops_the_run_before_its_weights_reach_a_replica(tmp_path):
    controller, synced, logged = _controller(tmp_path)
    controller._on_train(_trained(0.5), None)

    with pytest.raises(TrainingDiverged, match=r"^step 2: the loss is nan and the gradient norm 1.0: training diverged"):
        controller._on_train(_trained(math.nan), None)
    assert synced == [1] and logged == [1]  # step 2's weights were neither published nor logged


def test_an_infinite_gradient_norm_stops_the_run_too(tmp_path):
    controller, synced, _ = _controller(tmp_path)
    with pytest.raises(TrainingDiverged, match=r"step 1: the loss is 0.5 and the gradient norm inf"):
        controller._on_train(_trained(0.5, math.inf), None)
    assert synced == []


class _Remote:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def remote(self, *args) -> None:
        self.calls.append(args)


class _Handle:
    def __init__(self) -> None:
        self.close_channel = _Remote()


class _FakeRay:
    def __init__(self) -> None:
        self.killed: list[object] = []

    def kill(self, handle, no_restart: bool = True) -> None:
        self.killed.append(handle)


def test_a_lost_replicas_prompts_are_handed_out_again_before_fresh_ones(tmp_path):
    from physreason.data.mcq import MCQPrompt, PromptStream
    from physreason.distributed.controller import _Replica

    controller, _, _ = _controller(tmp_path)
    prompts = [MCQPrompt(f"q{i}", f"question {i}", {"A": "yes", "B": "no"}, "A") for i in range(10)]
    controller.stream = PromptStream(prompts, seed=0, shuffle=False, shuffle_options=False)
    controller._replay = PromptStream(prompts, seed=0, shuffle=False, shuffle_options=False)
    controller.retry, controller.timeline, controller.ops = deque(), 0, []
    controller.ray, controller.policy, controller._failed_starts = _FakeRay(), [_Handle()], 0
    controller.result.dispatched = [[0, 1, 2], [3, 4]]
    controller.stream.cursor = 5
    victim = _Replica(7, handle=object(), state="ready", produced=True)
    victim.generating = _Op("generate", [object()], timeline=0, replica=7,
                            payload=[(3, prompts[3]), (4, prompts[4])])
    controller.ops.append(victim.generating)
    controller.replicas = {7: victim}

    controller._lose_rollout(7, "generate: RayActorError")

    assert controller.replicas == {} and controller.ray.killed == [victim.handle] and controller.ops == []
    assert controller.result.redrawn == [(2, 3), (2, 4)]  # after the 2 calls dispatched so far
    draws = controller._draws(3)
    assert [draw for draw, _ in draws] == [3, 4, 5]  # the lost ones first, then the stream goes on
    assert [prompt.id for _, prompt in draws] == ["q3", "q4", "q5"]


def test_a_replica_that_dies_in_a_generate_call_hands_its_prompts_back(tmp_path):
    # The generate call's own failure is how the controller usually learns of the death: its handler must hand the
    # call's prompts back (it used to drop them, since the call was already taken off the replica).
    from physreason.data.mcq import MCQPrompt, PromptStream
    from physreason.distributed.controller import _Replica

    controller, _, _ = _controller(tmp_path)
    prompts = [MCQPrompt(f"q{i}", f"question {i}", {"A": "yes", "B": "no"}, "A") for i in range(10)]
    controller.stream = PromptStream(prompts, seed=0, shuffle=False, shuffle_options=False)
    controller._replay = PromptStream(prompts, seed=0, shuffle=False, shuffle_options=False)
    controller.retry, controller.timeline, controller._failed_starts = deque(), 0, 0
    controller.ray, controller.policy = _FakeRay(), [_Handle()]
    controller.stream.cursor = 6
    victim = _Replica(3, handle=object(), state="ready", produced=True)
    victim.generating = _Op("generate", [object()], timeline=0, replica=3, payload=[(4, prompts[4]), (5, prompts[5])])
    victim.generating.error, victim.generating.results[0] = RuntimeError("the actor died"), None
    controller.replicas, controller.ops = {3: victim}, []

    controller._complete(victim.generating)

    assert controller.replicas == {} and list(controller.retry) == [4, 5]
    assert any("rollout replica 3 lost (generate: RuntimeError)" in event for event in controller.result.events)
    assert [draw for draw, _ in controller._draws(3)] == [4, 5, 6]


def _generated(drawn: int, failed: int, error: str | None = None) -> _Op:
    from collections import Counter

    from physreason.distributed.rollout_replica import RolloutOutput

    op = _Op("generate", [object()], timeline=0, payload=[])
    counts = Counter(prompts_drawn=drawn, requests_failed=failed)
    op.results[0] = RolloutOutput(replica=1, version=0, counts=counts, first_error=error)
    return op


def test_every_request_failing_in_generate_call_after_call_stops_the_run(tmp_path):
    from physreason.distributed.controller import _Replica
    from physreason.errors import PhysReasonError

    controller, _, _ = _controller(tmp_path)
    controller.target_rollouts, controller.allowed = 2, 1
    controller._failed_starts = controller._failed_generates = 0
    controller.queue = deque()
    replica = _Replica(1, _Handle())
    for _ in range(4):  # one call with a success between resets the count; 5 in a row of 6 allowed (3 x 2 replicas)
        controller._on_generate(_generated(4, 4, "request q1: vLLM refused the request"), replica)
    controller._on_generate(_generated(4, 3), replica)
    for _ in range(5):
        controller._on_generate(_generated(4, 4, "request q1: vLLM refused the request"), replica)
    with pytest.raises(PhysReasonError, match=r"every rollout request failed in the last 6 generate calls .*4 of 4.*"
                                              r"First error of that call: request q1: vLLM refused the request"):
        controller._on_generate(_generated(4, 4, "request q1: vLLM refused the request"), replica)
