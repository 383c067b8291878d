"""A policy rank: one process of the policy replica (FSDP2 over `[policy.parallelism]`) that trains and publishes weights.

Run as a Ray actor per GPU. The ranks form torch.distributed's default group among themselves,
exactly as under torchrun, so the model setup, the GRPO update (`update_policy` of the colocated
loop) and DCP checkpoints are the same code. Rank 0 also hosts the TCPStore of the weight
channels and sends each published version to the rollout replicas; every rank takes part in
gathering the full tensors.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from physreason.config import Config
from physreason.distributed.weight_transfer import (
    CHANNEL_TIMEOUT,
    DEFAULT_BUCKET_BYTES,
    WeightChannel,
    plan_buckets,
    send_transfer,
    weight_manifest,
)
from physreason.models import loading
from physreason.models.family import read_vision_tokens
from physreason.net import free_port
from physreason.train.grpo import UpdateSettings, build_policy, update_policy
from physreason.train.loop import Checkpointer
from physreason.train.memory_report import resolve_runtime_checkpoint_every
from physreason.train.rollout import RolloutSample
from physreason.train.runtime import init_runtime, seed_everything
from physreason.train.weight_sync import full_named_parameters

log = logging.getLogger(__name__)


def node_address() -> str:
    """This node's address as the Ray cluster knows it."""
    import ray

    return ray.util.get_node_ip_address()


class PolicyWorker:
    """Rank `rank` of `world_size` policy processes."""

    def __init__(self, config: Config, rank: int, world_size: int) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.channels: dict[int, WeightChannel] = {}
        self.store: dist.TCPStore | None = None
        self.step = 0
        self.total_steps = 0

    def address(self) -> tuple[str, int]:
        """(node address, a free port) for the process group's rendezvous."""
        return node_address(), free_port()

    def setup(
        self, master: tuple[str, int] | None, total_steps: int, resume: bool | str, bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> dict[str, Any]:
        """Join the group at `master` (rank 0's address()), build model, optimizer and schedule, resume if asked.

        Returns the weight transfer plan, the channel store's address (rank 0), the resumed trainer state and
        the GPUs Ray gave this rank.
        """
        import ray

        config, train_cfg = self.config, self.config.train
        if self.world_size > 1 and master is not None:
            os.environ.update({
                "RANK": str(self.rank),
                "WORLD_SIZE": str(self.world_size),
                "LOCAL_RANK": "0",  # Ray shows each actor only its own GPUs
                "MASTER_ADDR": master[0],
                "MASTER_PORT": str(master[1]),
            })
        self.runtime = runtime = init_runtime()
        self.config = config = resolve_runtime_checkpoint_every(config, runtime, "grpo")  # "auto" made a number
        self.total_steps = total_steps
        seed_everything(train_cfg.seed)
        tp, self.cp = config.policy.parallelism.tp_size, config.policy.parallelism.cp_size
        self.dp_size = runtime.world_size // (tp * self.cp)
        tokenizer = loading.load_tokenizer(config.model)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.vision_tokens = read_vision_tokens(loading.load_model_config(config.model))

        policy = build_policy(config, runtime, total_steps)
        self.model, self.scorer, self.reference = policy.model, policy.module, policy.reference
        self.optimizer, self.scheduler, self.autocast = policy.optimizer, policy.scheduler, policy.autocast
        self.dp_group = policy.dp_group  # batch totals are summed over data-parallel ranks (TP ranks share a batch)
        self.update = UpdateSettings.from_config(config)
        self.checkpointer = Checkpointer(config, policy)
        self.engine_dtype = loading.DTYPES.get(config.model.dtype)
        self.buckets = plan_buckets(weight_manifest(self.model, self.engine_dtype), bucket_bytes)

        resumed = self.checkpointer.resume(resume)
        if resumed is not None:
            self.step = resumed.step
            log.info("policy rank %d resumed from %s at step %d", self.rank, resumed.path, self.step)
        if self.rank == 0:
            self.store = dist.TCPStore(node_address(), 0, is_master=True, wait_for_workers=False, timeout=CHANNEL_TIMEOUT)
        return {
            "trainer_state": resumed.state if resumed is not None else None,
            "checkpoint": str(resumed.path) if resumed is not None else None,
            "buckets": self.buckets,
            "store": (node_address(), self.store.port) if self.store is not None else None,
            "gpus": [str(g) for g in ray.get_gpu_ids()],
        }

    def open_channel(self, replica: int, channel_id: str) -> str | None:
        """Rank 0: open the weight channel to a rollout replica (which calls connect at the same time); None or the error."""
        try:
            self.channels[replica] = WeightChannel("", 0, channel_id, rank=0, device=self.runtime.device, store=self.store)
        except (RuntimeError, dist.DistError) as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    def close_channel(self, replica: int) -> None:
        """Forget a replica's channel (it died or was removed)."""
        self.channels.pop(replica, None)

    def train(self, samples: list[RolloutSample]) -> dict[str, float]:
        """One GRPO update over this data-parallel rank's share of the step's groups; returns the step's metrics."""
        started = time.perf_counter()
        lr = self.scheduler.get_last_lr()[0]
        batches = self.update.micro_batches(samples, self.pad_id, self.vision_tokens, self.runtime.device)
        metrics = update_policy(
            self.scorer, batches, self.optimizer, self.scheduler, self.update, self.runtime, self.dp_size * self.cp,
            self.autocast, self.reference, dp_group=self.dp_group,
        )
        self.step += 1
        # update_policy's *_sum diagnostics are already divided by the step's token count: token means.
        out = {name.removesuffix("_sum"): value for name, value in metrics.items()}
        out["train/lr"] = lr
        out["time/train_s"] = time.perf_counter() - started
        return out

    @torch.no_grad()
    def publish(self, replicas: list[int]) -> dict[str, Any]:
        """Send the current weights (version = steps trained) to the replicas' channels; every rank must call this.

        Rank 0 sends to all the replicas at once (weight_transfer.send_transfer). A replica whose transfer fails
        is dropped from the channels and reported in "failed"; the others still get the whole transfer.
        "seconds" is the whole push (gathers, packing, the transfer to the last replica).
        """
        started = time.perf_counter()
        targets = {r: self.channels[r] for r in replicas if r in self.channels} if self.rank == 0 else {}
        failed: dict[int, str] = {r: "no channel" for r in replicas if self.rank == 0 and r not in self.channels}
        tensors = full_named_parameters(self.model, self.engine_dtype, fsdp_root=self.scorer)
        if self.rank == 0:
            lost = send_transfer(targets, self.step, self.buckets, tensors, self.runtime.device)
            for replica in lost:
                self.channels.pop(replica, None)
            failed.update(lost)
        else:
            for _ in range(sum(len(bucket.specs) for bucket in self.buckets)):
                next(tensors)  # gathers are collective: every rank walks every parameter
        return {
            "version": self.step,
            "failed": failed,
            "sent": sorted(r for r in targets if r not in failed),
            "bytes": sum(b.nbytes for b in self.buckets),
            "seconds": time.perf_counter() - started,
        }

    def save(self, trainer_state: dict[str, Any]) -> dict[str, Any]:
        """Write a DCP checkpoint of this step (every rank), plus a safetensors export when configured."""
        started = time.perf_counter()
        saved = self.checkpointer.save(self.step, trainer_state)
        if self.step >= self.total_steps:
            # save_mode "async": the controller stops the policy ranks after the last save, which would cut the write.
            self.checkpointer.wait()
        return {
            "checkpoint": str(saved.checkpoint),
            "export": str(saved.export) if saved.export is not None else None,
            "seconds": time.perf_counter() - started,
        }

    def finish_uploads(self) -> None:
        """At the end of a finished run: the final uploads and the wait for them ([train.ckpt] upload_s3, upload_hf)."""
        self.checkpointer.finish()
        self.checkpointer.close()

    def shutdown(self) -> None:
        """Leave the process group."""
        if dist.is_initialized():
            dist.destroy_process_group()

