"""A rollout replica: one generation engine that turns prompt draws into scored GRPO groups, tagged with a weight version.

Run as a Ray actor with two threads: one generates, the other receives weights from the policy
while generation goes on, so the policy never waits for a generation batch to finish. Received
weights are staged (weight_transfer.StagingArea: on the replica's GPU when the engine runs in this
process and the model fits beside it, else in pinned host memory) and loaded into the engine at the
start of the next `generate` call; every group it returns carries the version of the weights that
produced it. A replica never
generates before it has received weights once, so one that joins mid-run starts from the
policy's current weights, not from the checkpoint on disk.

Generation and scoring are the colocated loop's `collect_rollouts`, given exactly the prompts the
controller assigned.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from physreason.config import Config
from physreason.data.mcq import MCQPrompt
from physreason.distributed.rollout_queue import ScoredGroup
from physreason.distributed.weight_transfer import Bucket, StagingArea, WeightChannel, staging_device
from physreason.engines import Engine, create_engine
from physreason.errors import PhysReasonError
from physreason.models import loading
from physreason.models.family import model_family
from physreason.train.rollout import collect_rollouts, rollout_engine_config, rollout_settings

log = logging.getLogger(__name__)

# How long a generate call waits for a weight transfer that is landing to finish before it goes on without it.
LOAD_WAIT_S = 60.0


@dataclass
class RolloutOutput:
    """What one generate call produced."""

    replica: int
    version: int  # weights the engine generated with
    groups: list[ScoredGroup] = field(default_factory=list)
    scored: list[dict[str, float]] = field(default_factory=list)  # rewards of every completion, dropped groups too
    counts: Counter = field(default_factory=Counter)  # prompts_drawn, groups_dropped, requests_failed, rounds
    busy_s: float = 0.0  # loading weights, generating and scoring
    first_error: str | None = None  # the first failed request's error


class _AssignedPrompts:
    """Stands in for the PromptStream in collect_rollouts: hands out exactly the controller's prompts, in order."""

    def __init__(self, prompts: list[MCQPrompt]) -> None:
        self._prompts = prompts
        self._next = 0

    def draw(self, count: int) -> list[MCQPrompt]:
        drawn = self._prompts[self._next : self._next + count]
        self._next += count
        return drawn


def build_engine(config: Config) -> Engine:
    """The replica's engine on the GPUs Ray gave this actor: `[engine]` with `[rollout.parallelism] tp_size`.

    vLLM is told its executor: in-process for one GPU (so weights load into the live model without a copy
    to another process), local worker processes for several. Left to choose, vLLM inside a Ray actor could
    pick its Ray executor and ask the cluster for GPUs this actor already holds.
    """
    engine_config = rollout_engine_config(config)
    executor = "uni" if engine_config.tensor_parallel_size == 1 else "mp"
    return create_engine(config.model, engine_config, vllm_executor=executor)


class RolloutReplica:
    """One engine (`[engine]`, `[rollout.parallelism] tp_size` GPUs) producing scored groups on request."""

    def __init__(self, config: Config, replica_id: int) -> None:
        self.config = config
        self.replica_id = replica_id
        self.engine = build_engine(config)
        self.processor_params = None
        if model_family(loading.load_model_config(config.model)).is_vision_language:
            from physreason.models.inputs import load_processor_params

            self.processor_params = load_processor_params(config.model.model_name_or_path, config.model.revision)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.channel: WeightChannel | None = None
        self.buckets: list[Bucket] = []
        self.staging: StagingArea | None = None
        self.version: int | None = None  # weights loaded in the engine
        self._staged: tuple[int, list[tuple[str, torch.Tensor]]] | None = None
        # Held while a transfer lands in the staging buffers and while the engine loads from them: a
        # generate call that starts during a transfer waits for it and loads the newer weights.
        self._staged_lock = threading.Lock()

    def ready(self) -> dict[str, Any]:
        """Once the engine is built (Ray runs __init__ before any method): the replica id and the GPUs Ray gave it."""
        import ray

        return {"replica": self.replica_id, "gpus": [str(g) for g in ray.get_gpu_ids()]}

    def connect(self, host: str, port: int, channel_id: str, buckets: list[Bucket]) -> dict[str, float]:
        """Open a weight channel to policy rank 0 (replacing any old one) and receive the current weights."""
        with self._staged_lock:
            self.channel = WeightChannel(host, port, channel_id, rank=1, device=self.device)
            if self.staging is None or self.buckets != buckets:
                self.staging = None  # the old buffers go before the new ones are made
                in_process = self.config.rollout.parallelism.tp_size == 1  # vLLM's uni executor (build_engine)
                nbytes = sum(b.nbytes for b in buckets)
                self.staging = StagingArea(buckets, staging_device(self.device, nbytes, in_process))
                log.info("rollout replica %d stages received weights (%.2f GB) on %s",
                         self.replica_id, nbytes / 1e9, self.staging.device)
            self.buckets = buckets
        return self.receive_weights()

    def receive_weights(self) -> dict[str, float]:
        """Receive one transfer from the policy and stage it for the next generate call; returns version, bytes, seconds."""
        started = time.perf_counter()
        with self._staged_lock:
            if self.channel is None or self.staging is None:
                raise PhysReasonError(f"rollout replica {self.replica_id}: receive_weights before connect")
            self._staged = None  # the buffers are overwritten now
            self._staged = self.channel.receive(self.buckets, self.staging)
            version = self._staged[0]
        return {
            "version": float(version),
            "bytes": float(self.staging.nbytes),
            "seconds": time.perf_counter() - started,
        }

    def _load_staged(self) -> None:
        """Load the staged version, waiting up to LOAD_WAIT_S for a transfer in progress (then it keeps the loaded one)."""
        if not self._staged_lock.acquire(timeout=LOAD_WAIT_S):
            log.warning("rollout replica %d: a weight transfer has been landing for over %.0f s; generating with "
                        "the weights of step %s", self.replica_id, LOAD_WAIT_S, self.version)
            return
        try:
            staged, self._staged = self._staged, None
            if staged is not None:
                version, tensors = staged
                self.engine.update_weights(tensors)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)  # the copies out of staging end before a transfer lands there
                self.version = version
        finally:
            self._staged_lock.release()

    def generate(self, draws: list[tuple[int, MCQPrompt]], dispatch: int) -> RolloutOutput:
        """Load staged weights, then sample, score and group one completion group per (draw index, prompt)."""
        started = time.perf_counter()
        self._load_staged()
        if self.version is None:
            raise PhysReasonError(f"rollout replica {self.replica_id} was asked to generate before it received weights")
        # Fresh copies give every draw its own identity, so groups map back to draws even when one
        # prompt is drawn twice in a call (small data sets wrap around within a call).
        prompts = [replace(prompt) for _, prompt in draws]
        draw_of = {id(prompt): draw for prompt, (draw, _) in zip(prompts, draws, strict=True)}
        # One round of exactly the given prompts: the controller does the drawing and any retries.
        settings = rollout_settings(
            self.config,
            groups_needed=len(prompts),
            prompts_per_round=len(prompts),
            max_rounds=1,
            processor_params=self.processor_params,
        )
        # Dispatch ids are unique over the run, so they alone make every call's sampling seed distinct.
        batch = collect_rollouts(self.engine, _AssignedPrompts(prompts), settings, step=dispatch)
        out = RolloutOutput(self.replica_id, self.version, scored=batch.scored, counts=batch.counts,
                            first_error=batch.first_error)  # fmt: skip
        by_group: dict[int, list] = {}
        for sample in batch.samples:
            by_group.setdefault(sample.group, []).append(sample)
        for samples in by_group.values():
            out.groups.append(ScoredGroup(samples, self.version, self.replica_id, draw_of[id(samples[0].prompt)]))
        out.busy_s = time.perf_counter() - started
        return out
