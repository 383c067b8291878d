"""Disaggregated asynchronous GRPO on Ray: one controller (this process, the Ray driver), policy ranks, rollout replicas.

The controller owns the prompt stream, the rollout queue with its staleness bound, the global
step, checkpoints and metrics. It is an event loop over Ray object refs: rollout replicas generate
continuously (each has one batch of prompts whenever its groups could still train an update), finished
groups go to the queue, and as soon as the queue holds a step's worth of fresh groups and the
policy is free, the policy trains on them; rollouts meanwhile go on with the previous weights.
After each update the policy publishes the new version to every ready replica over its weight
channel; replicas load it between generation batches.

Faults: a rollout replica that dies (or whose transfer fails) is removed, its unfinished prompts
are drawn again first, and a new replica is started to keep `[rollout.parallelism] n_init_replicas`
(it waits for free GPUs, so one that appears when a node joins the Ray cluster fills the slot).
A replica joins mid-run by receiving the current weights before its first batch. If a policy rank
dies, the whole policy replica restarts from the last checkpoint (`[train.ckpt]`), the queue is
cleared, and results generated before the restart are discarded.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from physreason.config import Config
from physreason.data.mcq import MCQPrompt, PromptStream, load_mcq_prompts
from physreason.data.structural_tokens import structural_tokens
from physreason.distributed.policy_worker import PolicyWorker
from physreason.distributed.rollout_queue import RolloutQueue, ScoredGroup, generation_room, is_fresh
from physreason.distributed.rollout_replica import RolloutOutput, RolloutReplica
from physreason.distributed.weight_transfer import DEFAULT_BUCKET_BYTES
from physreason.errors import ConfigError, PhysReasonError
from physreason.models import loading
from physreason.models.family import read_vision_tokens
from physreason.models.parallelize import check_layout
from physreason.ray_setup import import_ray
from physreason.rewards import check_reward_options
from physreason.train.grpo import (
    FAILING_STEPS_LIMIT,
    GRPOResult,
    _Stats,
    groups_per_rank,
    print_grpo_startup,
    rollout_metrics,
)
from physreason.train.loop import DivergenceWatch, StepLog, checkpoint_due, prepare_output
from physreason.train.rollout import RolloutBatch, RolloutSample, every_request_failed, logged_reward_names
from physreason.train.runlock import releases_output_lock
from physreason.train.runtime import Runtime

log = logging.getLogger(__name__)

MAX_POLICY_RESTARTS = 3
# Rollout replicas in a row lost before producing anything: the recipe or the nodes are broken.
MAX_FAILED_STARTS = 3
POLL_S = 1.0
# With nothing finishing for this long, the controller logs what it waits on (a hang's first clue).
WAITING_LOG_S = 60.0
# Replica calls that rollout.replica_timeout_s bounds; "ready" (engine start-up) is not bounded.
TIMED_REPLICA_CALLS = ("connect", "receive", "generate")


@dataclass
class DisaggregatedResult(GRPOResult):
    """GRPOResult plus where each trained group came from and what happened to the replicas."""

    # (step it trained, weight version, replica) of every trained group
    group_versions: list[tuple[int, int, int]] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    policy_restarts: int = 0
    dispatched: list[list[int]] = field(default_factory=list)  # draw indices of every generate call, in order
    # (generate calls dispatched before, draw index) of every prompt drawn again because its replica was lost
    redrawn: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class _Op:
    """Remote calls awaited together; `kind` picks the handler, `timeline` discards results from before a policy restart."""

    kind: str
    refs: list[Any]
    timeline: int
    replica: int | None = None
    payload: Any = None
    results: dict[int, Any] = field(default_factory=dict)  # by position in refs
    error: BaseException | None = None
    started: float = field(default_factory=time.monotonic)

    @property
    def pending(self) -> list[Any]:
        return [ref for i, ref in enumerate(self.refs) if i not in self.results]


@dataclass
class _Replica:
    id: int
    handle: Any
    state: str = "starting"  # starting -> loaded (engine up) -> connecting -> ready (has weights)
    version: int | None = None
    generating: _Op | None = None
    produced: bool = False  # returned at least one batch


def _import_ray():
    # ray.init() without an address starts a local instance unless RAY_ADDRESS names a cluster
    return import_ray("RAY_ADDRESS" not in os.environ,
                      "grpo.mode = 'disaggregated' runs on Ray, which is not installed: pip install 'physreason[ray]'")


def policy_world_size(config: Config, cluster_gpus: float) -> int:
    """Processes of the policy replica: tp_size x cp_size x dp_shard_size; dp_shard_size -1 takes the GPUs rollouts leave.

    On CPU (no GPUs) dp_shard_size -1 means 1.
    """
    policy, rollout = config.policy.parallelism, config.rollout.parallelism
    if config.policy.parallelism.n_init_replicas != 1:
        raise ConfigError(
            "policy.parallelism.n_init_replicas must be 1 in disaggregated GRPO: the policy is one FSDP replica; "
            "raise policy.parallelism.dp_shard_size for more data parallelism"
        )
    replica = policy.tp_size * policy.cp_size  # processes that share one data-parallel share
    if policy.dp_shard_size > 0:
        return replica * policy.dp_shard_size
    left = int(cluster_gpus) - rollout.n_init_replicas * rollout.tp_size
    return max(left // replica, 1) * replica if cluster_gpus else replica


def policy_shares(groups: list[ScoredGroup], world: int, dp_size: int) -> list[list[RolloutSample]]:
    """Each policy rank's samples of a step: groups dealt round-robin to data-parallel shares, one per rank.

    The ranks of one tensor- x context-parallel replica (world / dp_size consecutive ranks, as build_mesh lays them
    out) get the same share: they split its heads or its rows, never its samples.
    """
    shares: list[list[RolloutSample]] = [[] for _ in range(dp_size)]
    for i, group in enumerate(groups):
        shares[i % dp_size].extend(group.samples)
    replica = world // dp_size
    return [shares[rank // replica] for rank in range(world)]


class Controller:
    """Runs one disaggregated GRPO training (see the module docstring); `on_step(controller, step)` runs after each step."""

    def __init__(
        self,
        config: Config,
        on_step: Callable[[Controller, int], None] | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        if config.rollout.quantization != "none":
            raise ConfigError(
                f"rollout.quantization = {config.rollout.quantization!r} is supported in colocated GRPO only: set "
                "grpo.mode = 'colocated', or rollout.quantization = 'none'"
            )
        self.ray = _import_ray()
        self.config = config
        self.on_step = on_step
        self.bucket_bytes = bucket_bytes
        train, data = config.train, config.data
        # a question that writes a turn marker or vision placeholder is refused here, before any worker starts
        tokens = structural_tokens(loading.load_tokenizer(config.model))
        self.prompts = load_mcq_prompts(data.dataset, data.max_samples, tokens)
        self.stream = PromptStream(self.prompts, train.seed, data.shuffle, config.grpo.shuffle_options)
        self._replay = PromptStream(self.prompts, train.seed, data.shuffle, config.grpo.shuffle_options)
        self.allowed = config.grpo.allowed_outdated_steps
        self.queue = RolloutQueue(self.allowed)
        self.target_rollouts = config.rollout.parallelism.n_init_replicas
        self.replicas: dict[int, _Replica] = {}
        self.policy: list[Any] = []
        self._policy_group: Any = None
        self.ops: list[_Op] = []
        self.retry: deque[int] = deque()
        self.timeline = 0
        self.step = 0
        self.result = DisaggregatedResult()
        self._next_replica = 0
        self._dispatches = 0
        self._failed_starts = 0
        self._failed_generates = 0  # generate calls in a row in which every request failed
        self._train_op: _Op | None = None
        self._window = _StepWindow()
        self._last_progress = time.monotonic()  # when an operation last finished
        self.divergence = DivergenceWatch(config.train.output_dir)  # which saved steps the losses after them vouch for
        hf_config = loading.load_model_config(config.model)
        self.vision_tokens = read_vision_tokens(hf_config)
        self.reward_names = logged_reward_names(config)

    # ---- layout -------------------------------------------------------------------------------

    def _layout(self) -> None:
        config = self.config
        resources = self.ray.cluster_resources()
        self.use_gpu = resources.get("GPU", 0) > 0
        self.policy_world = policy_world_size(config, resources.get("GPU", 0))
        parallelism = config.policy.parallelism
        self.dp_size = check_layout(self.policy_world, parallelism.tp_size, parallelism.cp_size)
        per_rank = groups_per_rank(config, self.dp_size)
        self.groups_per_step = per_rank * self.dp_size
        self.total_steps = config.train.max_steps or config.train.epoch * (len(self.prompts) // self.groups_per_step)
        if self.total_steps < 1:
            raise ConfigError(
                f"{len(self.prompts)} prompts do not fill one step of {self.groups_per_step} prompt groups "
                "(train.train_batch_per_replica / rollout.n_generation): lower it, set train.max_steps, or add data"
            )
        rollout = config.rollout.parallelism
        needed = self.policy_world + rollout.n_init_replicas * rollout.tp_size
        if self.use_gpu and resources["GPU"] < needed:
            raise ConfigError(
                f"the Ray cluster has {resources['GPU']:.0f} GPUs but the recipe needs {needed}: policy {self.policy_world} "
                f"+ rollout.parallelism.n_init_replicas ({rollout.n_init_replicas}) x tp_size ({rollout.tp_size}); "
                "add nodes (ray start --address=...) or lower the counts"
            )
        gpus = 1 if self.use_gpu else 0
        self._policy_cls = self.ray.remote(num_cpus=1, num_gpus=gpus)(PolicyWorker)
        self._rollout_cls = self.ray.remote(
            num_cpus=1, num_gpus=rollout.tp_size if self.use_gpu else 0, max_concurrency=2
        )(RolloutReplica)

    # ---- policy -------------------------------------------------------------------------------

    def _start_policy(self, resume: bool | str) -> None:
        """Start the policy ranks (gang-scheduled in one placement group) and restore the run's position."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = {"CPU": 1, "GPU": 1} if self.use_gpu else {"CPU": 1}
        self._policy_group = group = placement_group([bundle] * self.policy_world, strategy="PACK")
        self.ray.get(group.ready())
        self.policy = [
            self._policy_cls.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank)
            ).remote(self.config, rank, self.policy_world)
            for rank in range(self.policy_world)
        ]
        master = self.ray.get(self.policy[0].address.remote()) if self.policy_world > 1 else None
        infos = self.ray.get([w.setup.remote(master, self.total_steps, resume, self.bucket_bytes) for w in self.policy])
        info = infos[0]
        self.buckets, self.store_address = info["buckets"], info["store"]
        state = info["trainer_state"]
        self.step = int(state["step"]) if state else 0
        self.stream.cursor = int(state["prompt_cursor"]) if state else 0
        self.retry = deque(sorted(state.get("pending_draws", []))) if state else deque()
        self._event(f"policy ranks on GPUs {[rank_info['gpus'] for rank_info in infos]}")
        if info["checkpoint"]:
            self._event(f"policy resumed from {info['checkpoint']}")

    def _restart_policy(self, reason: str) -> None:
        self.result.policy_restarts += 1
        self._event(f"policy lost ({reason}); restarting from the last checkpoint")
        if self.result.policy_restarts > MAX_POLICY_RESTARTS:
            raise PhysReasonError(f"the policy failed {self.result.policy_restarts} times; last failure: {reason}")
        self._stop_policy()
        self.timeline += 1
        # Generate calls stay tracked so their replicas become free again; their results are discarded.
        self.ops = [op for op in self.ops if op.kind in ("generate", "ready")]
        self._train_op = None
        self.queue.clear()
        for replica in self.replicas.values():
            if replica.state in ("connecting", "ready"):
                replica.state, replica.version = "loaded", None
        self._start_policy(resume=True)

    def _stop_policy(self) -> None:
        """Kill the policy ranks and free their placement group's reservation."""
        from ray.util.placement_group import remove_placement_group

        for handle in self.policy:
            self.ray.kill(handle, no_restart=True)
        self.policy = []
        if self._policy_group is not None:
            remove_placement_group(self._policy_group)
            self._policy_group = None

    def _policy_failed(self, op: _Op) -> bool:
        """Restart the policy when one of its ranks died; re-raise errors of the code itself."""
        if op.error is None:
            return False
        if isinstance(op.error, self.ray.exceptions.RayActorError):
            self._restart_policy(f"{op.kind}: {type(op.error).__name__}")
            return True
        raise op.error

    # ---- rollout replicas -----------------------------------------------------------------------

    def add_rollout_replica(self) -> None:
        """Raise the number of rollout replicas kept alive by one (started on the next loop turn)."""
        self.target_rollouts += 1

    def rollout_handle(self, replica: int) -> Any:
        """The Ray actor handle of a live replica (tests kill it to simulate a failure)."""
        return self.replicas[replica].handle

    def ready_replicas(self) -> list[int]:
        """Ids of the replicas that hold weights and may generate."""
        return sorted(r.id for r in self.replicas.values() if r.state == "ready")

    def _start_rollout(self) -> None:
        replica = _Replica(self._next_replica, self._rollout_cls.remote(self.config, self._next_replica))
        self._next_replica += 1
        self.replicas[replica.id] = replica
        self._submit("ready", [replica.handle.ready.remote()], replica.id)

    def _connect(self, replica: _Replica) -> None:
        replica.state = "connecting"
        channel = f"{replica.id}.{self.timeline}"
        host, port = self.store_address
        self._submit(
            "channel",
            [self.policy[0].open_channel.remote(replica.id, channel)]
            + [w.publish.remote([replica.id]) for w in self.policy],
            replica.id,
        )
        self._submit("connect", [replica.handle.connect.remote(host, port, channel, self.buckets)], replica.id)

    def _sync(self, replicas: list[int]) -> None:
        """Publish the policy's current weights to these ready replicas."""
        if not replicas:
            return
        self._submit("publish", [w.publish.remote(replicas) for w in self.policy])
        for replica in replicas:
            self._submit("receive", [self.replicas[replica].handle.receive_weights.remote()], replica)

    def _lose_rollout(self, replica_id: int, reason: str) -> None:
        replica = self.replicas.pop(replica_id, None)
        if replica is None:
            return
        self._event(f"rollout replica {replica_id} lost ({reason})")
        if replica.generating is not None and replica.generating.timeline == self.timeline:
            self._hand_back(replica_id, replica.generating.payload)
        self.ops = [op for op in self.ops if op.replica != replica_id or op.kind == "channel"]
        self.ray.kill(replica.handle, no_restart=True)
        self.policy[0].close_channel.remote(replica_id)
        if not replica.produced:
            self._failed_starts += 1
            if self._failed_starts >= MAX_FAILED_STARTS:
                raise PhysReasonError(
                    f"{self._failed_starts} rollout replicas in a row were lost before producing a batch; last: {reason}"
                )

    def _hand_back(self, replica_id: int, draws: list[tuple[int, MCQPrompt]]) -> None:
        """Put the draws of a generate call that will not return first in line for the next free replica."""
        lost = sorted(draw for draw, _ in draws)
        self.retry.extendleft(reversed(lost))
        self.result.redrawn += [(len(self.result.dispatched), draw) for draw in lost]
        self._event(f"{len(lost)} prompt(s) of rollout replica {replica_id} go to the next free replica")

    def _expire_hung_replicas(self) -> None:
        """Handle as lost every replica with a call running past rollout.replica_timeout_s (a hung engine or channel).

        Killing it also ends a policy-side transfer blocked on it (its sockets close), so the policy goes on.
        """
        limit = self.config.rollout.replica_timeout_s
        now = time.monotonic()
        for op in list(self.ops):
            if op.replica is not None and op.kind in TIMED_REPLICA_CALLS and now - op.started > limit:
                self._lose_rollout(
                    op.replica, f"{op.kind} gave no answer within rollout.replica_timeout_s = {limit:g} s"
                )

    def _top_up_rollouts(self) -> None:
        for _ in range(self.target_rollouts - len(self.replicas)):
            self._start_rollout()
        for replica in list(self.replicas.values()):
            if replica.state == "loaded":
                self._connect(replica)

    def _draws(self, count: int) -> list[tuple[int, MCQPrompt]]:
        """Prompts to hand out: first those lost with a replica, then fresh draws; (draw index, prompt) each."""
        draws = []
        while self.retry and len(draws) < count:
            self._replay.cursor = self.retry.popleft()
            draws.append((self._replay.cursor, self._replay.draw(1)[0]))
        start = self.stream.cursor
        fresh = self.stream.draw(count - len(draws))
        return draws + list(zip(range(start, start + len(fresh)), fresh, strict=True))

    def _dispatch(self) -> None:
        """Give each idle ready replica a batch of prompts if the updates its weights may still feed need more groups."""
        self._window.stale += len(self.queue.drop_stale(self.step))
        in_flight = sum(len(r.generating.payload) for r in self.replicas.values() if r.generating is not None)
        # The update in progress took its batch already: new groups feed the ones after it.
        next_step = self.step + (self._train_op is not None)
        for replica in sorted(self.replicas.values(), key=lambda r: r.id):
            if replica.state != "ready" or replica.generating is not None:
                continue
            room = generation_room(
                replica.version, next_step, self.groups_per_step, self.allowed, len(self.queue) + in_flight
            )
            if room <= 0:
                continue
            draws = self._draws(min(self.config.rollout.batch_size, room))
            replica.generating = self._submit(
                "generate", [replica.handle.generate.remote(draws, self._dispatches)], replica.id, draws
            )
            self._dispatches += 1
            self.result.dispatched.append([draw for draw, _ in draws])
            in_flight += len(draws)

    # ---- training -----------------------------------------------------------------------------

    def _maybe_train(self) -> None:
        if self._train_op is not None or self.step >= self.total_steps:
            return
        self._window.stale += len(self.queue.drop_stale(self.step))
        groups = self.queue.take(self.step, self.groups_per_step)
        if groups is None:
            return
        shares = policy_shares(groups, len(self.policy), self.dp_size)
        refs = {id(share): self.ray.put(share) for share in shares}  # one object per data-parallel share
        self._train_op = self._submit(
            "train", [w.train.remote(refs[id(share)]) for w, share in zip(self.policy, shares, strict=True)]
        )
        self._train_op.payload = groups
        self._window.policy_waiting_s += time.perf_counter() - self._window.policy_free_at

    def _pending_draws(self) -> list[int]:
        in_flight = [d for r in self.replicas.values() if r.generating is not None for d, _ in r.generating.payload]
        return sorted(set(self.queue.draws()) | set(in_flight) | set(self.retry))

    def _on_train(self, op: _Op, replica: _Replica | None) -> None:
        self._train_op = None
        if self._policy_failed(op):
            return
        self._window.policy_free_at = time.perf_counter()
        groups: list[ScoredGroup] = op.payload
        self.step += 1
        self.result.group_versions += [(self.step, g.version, g.replica) for g in groups]
        metrics = op.results[0]
        if "loss" in metrics:  # reduced over the policy ranks; stops before the weights reach a replica or a checkpoint
            self.divergence.check(self.step, metrics["loss"], metrics["policy/grad_norm"])
        self._sync(self.ready_replicas())
        if checkpoint_due(self.config, self.step, self.total_steps):
            state = {"prompt_cursor": self.stream.cursor, "pending_draws": self._pending_draws()}
            self._submit("save", [w.save.remote(state) for w in self.policy])
        self._log_step(op.results[0], groups)

    def _log_step(self, policy_metrics: dict[str, float], groups: list[ScoredGroup]) -> None:
        window = self._window
        samples = [s for g in groups for s in g.samples]
        batch = RolloutBatch(samples=samples, scored=window.scored, counts=window.counts)
        metrics = rollout_metrics(
            batch, _Stats(Runtime(0, 1, torch.device("cpu"))), self.reward_names, self.vision_tokens
        )
        metrics.update(policy_metrics)
        now = time.perf_counter()
        step_s = now - window.started
        lags = [self.step - 1 - g.version for g in groups]
        alive = max(len(self.ready_replicas()), 1)
        policy_busy_s = window.policy_busy_s + policy_metrics.get("time/train_s", 0.0)
        metrics.update(
            {
                "rollout/staleness_mean": sum(lags) / len(lags),
                "rollout/staleness_max": float(max(lags)),
                "rollout/stale_dropped": float(window.stale),
                "rollout/replicas": float(len(self.ready_replicas())),
                "rollout/queue": float(len(self.queue)),
                "time/step_s": step_s,
                "time/sync_s": window.sync_s,
                "time/publish_s": window.publish_s,
                "sync/gbytes_per_s": window.publish_bytes / window.publish_s / 1e9 if window.publish_s > 0 else 0.0,
                "time/policy_wait_s": window.policy_waiting_s,
                "time/policy_idle_frac": max(0.0, 1.0 - policy_busy_s / step_s),
                "time/rollout_busy_s": window.rollout_busy_s,
                "time/rollout_idle_frac": max(0.0, 1.0 - window.rollout_busy_s / (alive * step_s)),
                "perf/samples_per_s": len(samples) / step_s,
            }
        )
        self.result.rewards.append(metrics["reward/total_mean"])
        self.result.metrics.append(metrics)
        self.step_log.step(
            self.step,
            metrics,
            {
                "reward": f"{metrics['reward/total_mean']:.3f}",
                "stale": f"{metrics['rollout/staleness_mean']:.2f}",
                "replicas": str(len(self.ready_replicas())),
            },
        )
        self._window = _StepWindow(policy_free_at=window.policy_free_at)
        if self.on_step is not None:
            self.on_step(self, self.step)

    # ---- completions --------------------------------------------------------------------------

    def _submit(self, kind: str, refs: list[Any], replica: int | None = None, payload: Any = None) -> _Op:
        op = _Op(kind, refs, self.timeline, replica, payload)
        self.ops.append(op)
        return op

    def _poll(self) -> None:
        """Wait for one remote call to finish (or POLL_S) and hand every finished operation to its handler."""
        owner = {ref: (op, i) for op in self.ops for i, ref in enumerate(op.refs) if i not in op.results}
        if not owner:
            raise PhysReasonError("nothing is running and the step cannot finish: no rollout replica could be started")
        done, _ = self.ray.wait(list(owner), num_returns=1, timeout=POLL_S)
        now = time.monotonic()
        if done:
            self._last_progress = now
        elif now - self._last_progress >= WAITING_LOG_S:
            self._last_progress = now
            waits = ", ".join(
                f"{op.kind}" + (f" on replica {op.replica}" if op.replica is not None else "") + f" ({now - op.started:.0f} s)"
                for op in self.ops
            )
            self._event(f"nothing finished for {WAITING_LOG_S:.0f} s; waiting on: {waits}")
        for ref in done:
            op, i = owner[ref]
            try:
                op.results[i] = self.ray.get(ref)
            except self.ray.exceptions.RayError as exc:  # every remote failure goes to the operation's handler
                op.error = exc
                op.results[i] = None
        for op in [op for op in self.ops if op.error is not None or not op.pending]:
            if op in self.ops:
                self.ops.remove(op)
                self._complete(op)

    def _complete(self, op: _Op) -> None:
        replica = self.replicas.get(op.replica) if op.replica is not None else None
        if op.kind == "generate" and replica is not None and replica.generating is op:
            replica.generating = None
        if op.timeline != self.timeline:
            return
        getattr(self, f"_on_{op.kind}")(op, replica)

    def _on_ready(self, op: _Op, replica: _Replica | None) -> None:
        if replica is None:
            return
        if op.error is not None:
            self._lose_rollout(replica.id, f"failed to start: {op.error}")
            return
        replica.state = "loaded"
        self._event(f"rollout replica {replica.id} loaded its engine on GPUs {op.results[0]['gpus']}")

    def _on_channel(self, op: _Op, replica: _Replica | None) -> None:
        if self._policy_failed(op):
            return
        opened, published = op.results[0], op.results[1]
        if replica is not None and (opened is not None or op.replica in published["failed"]):
            self._lose_rollout(replica.id, f"weight channel: {opened or published['failed'][op.replica]}")

    def _on_connect(self, op: _Op, replica: _Replica | None) -> None:
        if replica is None:
            return
        if op.error is not None:
            self._lose_rollout(replica.id, f"connect: {op.error}")
            return
        replica.version = int(op.results[0]["version"])
        replica.state = "ready"
        self._window.sync_s += op.results[0]["seconds"]
        self._event(f"rollout replica {replica.id} ready with weights of step {replica.version}")
        if replica.version < self.step and self._train_op is None:
            # A publish after an update that finished while this replica was connecting left it out.
            self._sync([replica.id])

    def _on_publish(self, op: _Op, replica: _Replica | None) -> None:
        if self._policy_failed(op):
            return
        self._window.sync_s += op.results[0]["seconds"]
        self._window.publish_s += op.results[0]["seconds"]
        self._window.publish_bytes += op.results[0]["bytes"]
        self._window.policy_busy_s += op.results[0]["seconds"]
        for lost, reason in op.results[0]["failed"].items():
            self._lose_rollout(lost, f"weight transfer: {reason}")

    def _on_receive(self, op: _Op, replica: _Replica | None) -> None:
        if replica is None:
            return
        if op.error is not None:
            self._lose_rollout(replica.id, f"receive: {op.error}")
            return
        replica.version = int(op.results[0]["version"])

    def _on_generate(self, op: _Op, replica: _Replica | None) -> None:
        if replica is None:
            return
        if op.error is not None:
            # _complete already took the call off the replica, so _lose_rollout would not see its draws.
            self._hand_back(replica.id, op.payload)
            self._lose_rollout(replica.id, f"generate: {type(op.error).__name__}")
            return
        output: RolloutOutput = op.results[0]
        replica.produced = True
        self._failed_starts = 0
        self._check_failed_requests(output)
        for group in output.groups:
            if is_fresh(group.version, self.step, self.allowed):
                self.queue.put(group)
            else:
                self._window.stale += 1
        self._window.scored += output.scored
        self._window.counts.update(output.counts)
        self._window.rollout_busy_s += output.busy_s

    def _check_failed_requests(self, output: RolloutOutput) -> None:
        """Stop once every request failed in FAILING_STEPS_LIMIT generate calls a replica in a row (run_grpo's rule):
        no group would ever reach the policy, and the run would draw prompts for ever."""
        drawn, failed = output.counts["prompts_drawn"], output.counts["requests_failed"]
        self._failed_generates = self._failed_generates + 1 if every_request_failed(drawn, failed) else 0
        limit = FAILING_STEPS_LIMIT * max(1, self.target_rollouts)
        if self._failed_generates >= limit:
            raise PhysReasonError(
                f"GRPO stopped at step {self.step + 1}: every rollout request failed in the last {limit} generate calls "
                f"(rollout replica {output.replica}'s last: {failed} of {drawn}). First error of that call: "
                f"{output.first_error or 'not given'}. The checkpoints and metrics written so far are kept; fix the "
                "cause and resume with train.resume=true"
            )

    def _on_save(self, op: _Op, replica: _Replica | None) -> None:
        if self._policy_failed(op):
            return
        self._window.policy_busy_s += op.results[0]["seconds"]
        self.result.last_checkpoint = Path(op.results[0]["checkpoint"])
        if op.results[0]["export"]:
            self.result.export_dir = Path(op.results[0]["export"])

    def _event(self, text: str) -> None:
        line = f"step {self.step}: {text}"
        log.info(line)
        self.result.events.append(line)

    # ---- run ----------------------------------------------------------------------------------

    @releases_output_lock
    def run(self) -> DisaggregatedResult:
        """Train until `total_steps` and the last checkpoint are done; returns the run's record."""
        prepare_output(self.config)
        self._layout()
        print_grpo_startup(
            self.config, len(self.prompts), self.total_steps, "cuda" if self.use_gpu else "cpu", self.policy_world
        )
        self.step_log: StepLog | None = None
        try:
            # Rollout engines start loading first, so their start-up overlaps the policy's.
            self._top_up_rollouts()
            self._start_policy(self.config.train.resume)
            self.step_log = StepLog(self.config, self.total_steps, self.step, "grpo (disaggregated)")
            self._window = _StepWindow()
            policy_kinds = ("train", "publish", "channel", "save")
            while self.step < self.total_steps or any(op.kind in policy_kinds for op in self.ops):
                self._expire_hung_replicas()
                if self.step < self.total_steps:
                    self._top_up_rollouts()
                    self._dispatch()
                    self._maybe_train()
                self._poll()
            # Before the policy ranks are killed: rank 0 holds the upload queue ([train.ckpt] upload_s3, upload_hf).
            self.ray.get([worker.finish_uploads.remote() for worker in self.policy])
        finally:
            if self.step_log is not None:
                self.step_log.close()
            self._stop_policy()
            for replica in self.replicas.values():
                self.ray.kill(replica.handle, no_restart=True)
        return self.result


@dataclass
class _StepWindow:
    """What happened since the last step: scored rewards, rollout counters, time spent."""

    started: float = field(default_factory=time.perf_counter)
    policy_free_at: float = field(default_factory=time.perf_counter)
    policy_waiting_s: float = 0.0
    scored: list[dict[str, float]] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)
    stale: int = 0
    sync_s: float = 0.0  # policy pushes to ready replicas plus the first transfer to each joining replica
    publish_s: float = 0.0  # policy pushes to ready replicas (gather, pack, transfer), their bytes below
    publish_bytes: int = 0
    policy_busy_s: float = 0.0  # pushes and saves (the update's own time comes with its metrics)
    rollout_busy_s: float = 0.0


def run_disaggregated(config: Config, on_step: Callable[[Controller, int], None] | None = None) -> DisaggregatedResult:
    """Train config.model with disaggregated asynchronous GRPO on Ray (joins the running cluster or starts a local one)."""
    check_reward_options(config.grpo.reward_function, config.grpo.reward_options)  # before any replica starts
    ray = _import_ray()
    started_here = not ray.is_initialized()
    if started_here:
        ray.init()
    try:
        return Controller(config, on_step).run()
    finally:
        if started_here:
            ray.shutdown()
