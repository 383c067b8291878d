"""Policy -> rollout weight transfer: versioned, bucketed byte buffers over a two-member process group.

Each rollout replica has its own channel to policy rank 0: a process group of two (NCCL on GPUs,
gloo on CPU) built from a TCPStore that policy rank 0 hosts, outside torch.distributed's default
group (which the policy replica keeps for FSDP). One channel per replica isolates failures: a dead
replica breaks only its own channel, and a replica that joins opens a new one without rebuilding
the others' communicators.

A transfer is a header `[version, number of buckets]` followed by the buckets: the tensors of the
manifest, in order, cast to the engine dtype and packed as raw bytes into buffers of at most
`bucket_bytes` (a tensor larger than that travels alone), so a 7B model moves in a few dozen
collective calls instead of one per tensor.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from physreason.errors import PhysReasonError

DEFAULT_BUCKET_BYTES = 256 * 1024 * 1024
# Long enough for a replica that is still loading its engine; short enough that a dead peer is noticed.
CHANNEL_TIMEOUT = datetime.timedelta(minutes=10)


@dataclass(frozen=True)
class TensorSpec:
    """Name (Hugging Face), full shape and transfer dtype of one parameter."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * self.dtype.itemsize


@dataclass(frozen=True)
class Bucket:
    """Tensors packed back to back into one uint8 buffer of `nbytes`; `offsets[i]` is where `specs[i]` starts."""

    specs: tuple[TensorSpec, ...]
    offsets: tuple[int, ...]
    nbytes: int


def weight_manifest(model: nn.Module, dtype: torch.dtype | None = None) -> list[TensorSpec]:
    """The specs of every parameter of a plain, FSDP2 or TP model, in `named_parameters` order (full shapes).

    A LoRA model is published merged (train/weight_sync.py: full_named_parameters): its specs carry the plain
    Hugging Face names and shapes of the base weights, without the adapters' own tensors.
    """
    from physreason.models.lora import has_lora, hf_name

    lora = has_lora(model)
    specs = []
    for name, parameter in model.named_parameters():
        target = hf_name(name) if lora else name
        if target is not None:
            specs.append(TensorSpec(target, tuple(parameter.shape), dtype if dtype is not None else parameter.dtype))
    return specs


def plan_buckets(manifest: list[TensorSpec], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[Bucket]:
    """Group the manifest, in order, into buckets of at most bucket_bytes (a larger tensor gets its own bucket).

    Offsets are aligned to 16 bytes so every tensor view of a bucket is aligned for its dtype.
    """
    buckets: list[Bucket] = []
    specs: list[TensorSpec] = []
    offsets: list[int] = []
    size = 0
    for spec in manifest:
        start = -(-size // 16) * 16
        if specs and start + spec.nbytes > bucket_bytes:
            buckets.append(Bucket(tuple(specs), tuple(offsets), size))
            specs, offsets, start = [], [], 0
        specs.append(spec)
        offsets.append(start)
        size = start + spec.nbytes
    if specs:
        buckets.append(Bucket(tuple(specs), tuple(offsets), size))
    return buckets


def pack_bucket(bucket: Bucket, tensors: Iterator[tuple[str, torch.Tensor]], device: torch.device) -> torch.Tensor:
    """Draw the bucket's tensors from `tensors` (in manifest order) and copy their bytes into one uint8 buffer."""
    buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)  # [nbytes]
    for spec, offset in zip(bucket.specs, bucket.offsets, strict=True):
        name, tensor = next(tensors)
        if name != spec.name or tuple(tensor.shape) != spec.shape:
            raise PhysReasonError(
                f"weight transfer: expected {spec.name} {spec.shape}, got {name} {tuple(tensor.shape)}; "
                "the policy's parameters changed after the transfer plan was made"
            )
        flat = tensor.to(device=device, dtype=spec.dtype).contiguous().view(-1).view(torch.uint8)  # [spec.nbytes]
        buffer[offset : offset + spec.nbytes].copy_(flat)
    return buffer


def unpack_bucket(bucket: Bucket, buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Views of each tensor of a received bucket buffer, under their names and shapes."""
    return [
        (spec.name, buffer[offset : offset + spec.nbytes].view(spec.dtype).view(spec.shape))
        for spec, offset in zip(bucket.specs, bucket.offsets, strict=True)
    ]


def _process_group(store: dist.Store, rank: int, device: torch.device, timeout: datetime.timedelta):
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    return dist.ProcessGroupGloo(store, rank, 2, timeout)


class WeightChannel:
    """One end of a policy-rank-0 <-> rollout-replica channel; rank 0 sends, rank 1 receives.

    Both ends must construct their channel at the same time (construction is a rendezvous).
    """

    def __init__(
        self,
        host: str,
        port: int,
        channel_id: str,
        rank: int,
        device: torch.device,
        store: dist.Store | None = None,
        timeout: datetime.timedelta = CHANNEL_TIMEOUT,
    ) -> None:
        if store is None:
            store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
        self.device = device
        self.rank = rank
        self.group = _process_group(dist.PrefixStore(f"weights/{channel_id}/", store), rank, device, timeout)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.group.broadcast([tensor], options).wait()

    def send_header(self, version: int, num_buckets: int) -> None:
        """Announce a transfer of weight version `version` in `num_buckets` buckets."""
        self._broadcast(torch.tensor([version, num_buckets], dtype=torch.int64, device=self.device))

    def send(self, buffer: torch.Tensor) -> None:
        """Send one packed bucket."""
        self._broadcast(buffer)

    def receive(self, buckets: list[Bucket]) -> tuple[int, list[tuple[str, torch.Tensor]]]:
        """Receive one whole transfer; returns its version and (name, CPU tensor) per parameter.

        Tensors land on the channel's device one bucket at a time and are copied to host memory, so
        the receiver needs one bucket of free GPU memory, not a second copy of the model.
        """
        header = torch.zeros(2, dtype=torch.int64, device=self.device)  # [version, num_buckets]
        self._broadcast(header)
        version, count = header.tolist()
        if count != len(buckets):
            raise PhysReasonError(
                f"weight transfer: the policy sent {count} buckets, this replica planned {len(buckets)}; "
                "both sides must use the same transfer plan"
            )
        tensors: list[tuple[str, torch.Tensor]] = []
        for bucket in buckets:
            buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device=self.device)  # [nbytes]
            self._broadcast(buffer)
            tensors += [(name, t.to("cpu", copy=self.device.type != "cpu")) for name, t in unpack_bucket(bucket, buffer)]
        return version, tensors
