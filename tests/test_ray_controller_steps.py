"""What the disaggregated controller does when an update finishes (no Ray needed: the controller's state is built
directly and its remote calls are recorded)."""

from __future__ import annotations

import math

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
