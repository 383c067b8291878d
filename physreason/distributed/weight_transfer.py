"""Policy -> rollout weight transfer: versioned, bucketed byte buffers over a two-member process group.

Each rollout replica has its own channel to policy rank 0: a process group of two (NCCL on GPUs,
gloo on CPU) built from a TCPStore that policy rank 0 hosts, outside torch.distributed's default
group (which the policy replica keeps for FSDP). One channel per replica isolates failures: a dead
replica breaks only its own channel, and a replica that joins opens a new one without rebuilding
the others' communicators. A transfer goes to every replica at once (`send_transfer` issues each
bucket's broadcasts on all channels before waiting on any).

A transfer is a header `[version, number of buckets]` followed by the buckets: the tensors of the
manifest, in order, cast to the engine dtype and packed as raw bytes into buffers of at most
`bucket_bytes` (a tensor larger than that travels alone), so a 3B model moves in a handful of
collective calls instead of one per tensor. The sender packs bucket i + 1 while bucket i is on the
wire (two buffers in turn). The receiver keeps what arrives where the engine loads it from
(`StagingArea`): on the GPU when the engine runs in the process and the model fits beside it, so
a transfer never passes through host memory; otherwise in pinned host memory.
"""

from __future__ import annotations

import contextlib
import datetime
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from physreason.errors import PhysReasonError

DEFAULT_BUCKET_BYTES = 1024 * 1024 * 1024
# Buckets in flight on the sender: one on the wire while the next is packed.
SEND_DEPTH = 2
# GPU memory a received version must leave free beside the engine to be staged on the GPU.
STAGING_MARGIN_BYTES = 1024 * 1024 * 1024
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


def pack_bucket(
    bucket: Bucket,
    tensors: Iterator[tuple[str, torch.Tensor]],
    device: torch.device,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Draw the bucket's tensors from `tensors` (in manifest order) and copy their bytes into one uint8 buffer.

    Each tensor is cast and copied straight into its slice of the buffer (one copy, no temporary). `out`: a
    uint8 buffer of at least bucket.nbytes to pack into (its first bucket.nbytes bytes are returned).
    """
    if out is None:
        out = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)  # [nbytes]
    buffer = out[: bucket.nbytes]
    for spec, offset in zip(bucket.specs, bucket.offsets, strict=True):
        name, tensor = next(tensors)
        if name != spec.name or tuple(tensor.shape) != spec.shape:
            raise PhysReasonError(
                f"weight transfer: expected {spec.name} {spec.shape}, got {name} {tuple(tensor.shape)}; "
                "the policy's parameters changed after the transfer plan was made"
            )
        _typed(buffer, spec, offset).copy_(tensor.detach())
    return buffer


def _typed(buffer: torch.Tensor, spec: TensorSpec, offset: int) -> torch.Tensor:
    """The view of `spec` at `offset` of a uint8 buffer, in its dtype and shape."""
    return buffer[offset : offset + spec.nbytes].view(spec.dtype).view(spec.shape)


def unpack_bucket(bucket: Bucket, buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Views of each tensor of a received bucket buffer, under their names and shapes."""
    return [(spec.name, _typed(buffer, spec, offset)) for spec, offset in zip(bucket.specs, bucket.offsets, strict=True)]


def _process_group(store: dist.Store, rank: int, device: torch.device, timeout: datetime.timedelta):
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    return dist.ProcessGroupGloo(store, rank, 2, timeout)


class StagingArea:
    """One buffer per bucket where a received version waits until the engine loads it, reused by every transfer.

    On the channel's GPU the buckets are received in place; in host memory (pinned when CUDA is there) each
    bucket is received into a GPU buffer first and copied out while the next one arrives.
    """

    def __init__(self, buckets: list[Bucket], device: torch.device) -> None:
        self.buckets = buckets
        self.device = device
        pin = device.type == "cpu" and torch.cuda.is_available()
        self.buffers = [
            torch.empty(b.nbytes, dtype=torch.uint8, device=device, pin_memory=pin)  # [nbytes]
            for b in buckets
        ]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """(name, view) of every tensor of the staged version, in manifest order (views: no copy)."""
        return [pair for bucket, buffer in zip(self.buckets, self.buffers, strict=True) for pair in unpack_bucket(bucket, buffer)]


def staging_device(device: torch.device, nbytes: int, in_process_engine: bool) -> torch.device:
    """Where a replica stages received weights: its GPU when the engine takes tensors in this process and `nbytes`
    fit in the GPU memory left free (with STAGING_MARGIN_BYTES to spare), else host memory."""
    if device.type != "cuda" or not in_process_engine:
        return torch.device("cpu")
    free, _ = torch.cuda.mem_get_info(device)
    return device if free >= nbytes + STAGING_MARGIN_BYTES else torch.device("cpu")


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
        # The receiver works on a stream of its own: a replica generates on the default stream meanwhile, and
        # its kernels need not queue behind the transfer (nor the transfer behind them).
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" and rank != 0 else None

    def broadcast_async(self, tensor: torch.Tensor) -> dist.Work:
        """Start a broadcast from rank 0 of `tensor` (contiguous, on the channel's device); wait() on the result.

        With NCCL, wait() orders the caller's CUDA stream after the transfer and returns at once.
        """
        options = dist.BroadcastOptions()
        options.rootRank = 0
        return self.group.broadcast([tensor], options)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        self.broadcast_async(tensor).wait()

    def send_header(self, version: int, num_buckets: int) -> None:
        """Announce a transfer of weight version `version` in `num_buckets` buckets."""
        self._broadcast(torch.tensor([version, num_buckets], dtype=torch.int64, device=self.device))

    def send(self, buffer: torch.Tensor) -> None:
        """Send one packed bucket."""
        self._broadcast(buffer)

    def receive(
        self, buckets: list[Bucket], staging: StagingArea | None = None
    ) -> tuple[int, list[tuple[str, torch.Tensor]]]:
        """Receive one whole transfer into `staging` (new buffers on the channel's device when None).

        Returns its version and (name, view into the staging buffers) per parameter, complete on return. Whoever
        read the staging buffers last (an engine loading them) must have finished on the device before this call.
        """
        stream = torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()
        with stream:
            return self._receive(buckets, staging if staging is not None else StagingArea(buckets, self.device))

    def _receive(self, buckets: list[Bucket], staging: StagingArea) -> tuple[int, list[tuple[str, torch.Tensor]]]:
        header = torch.zeros(2, dtype=torch.int64, device=self.device)  # [version, num_buckets]
        self._broadcast(header)
        version, count = header.tolist()
        if count != len(buckets) or len(staging.buckets) != len(buckets):
            raise PhysReasonError(
                f"weight transfer: the policy sent {count} buckets, this replica planned {len(buckets)}; "
                "both sides must use the same transfer plan"
            )
        if staging.device == self.device:
            for buffer in staging.buffers:
                self._broadcast(buffer)
        else:
            # Two landing buffers in turn: bucket i is copied out (on the caller's stream, after its broadcast)
            # while bucket i + 1 arrives; a landing buffer is broadcast into again only after its copy was queued.
            largest = max((b.nbytes for b in buckets), default=0)
            landing = [torch.empty(largest, dtype=torch.uint8, device=self.device) for _ in range(SEND_DEPTH)]
            for i, buffer in enumerate(staging.buffers):
                slot = landing[i % SEND_DEPTH][: buffer.numel()]
                self._broadcast(slot)
                buffer.copy_(slot, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return version, staging.tensors()


def send_transfer(
    channels: dict[int, WeightChannel],
    version: int,
    buckets: list[Bucket],
    tensors: Iterator[tuple[str, torch.Tensor]],
    device: torch.device,
) -> dict[int, str]:
    """Send weight version `version` to every channel: header, then each bucket packed from `tensors` (manifest order).

    Each bucket's broadcasts start on all channels before any is waited on, and bucket i + 1 is packed while
    bucket i travels (SEND_DEPTH buffers in turn). A channel whose broadcast fails is left out of the rest of
    the transfer; the others still get all of it. Returns {channel key: error} of the failed channels. Every
    tensor is drawn from `tensors` even when every channel failed (other policy ranks gather in step).
    Complete on return (the device is synchronized), so the time around it is the transfer's.
    """
    targets = dict(channels)
    failed: dict[int, str] = {}

    def fail(key: int, exc: BaseException) -> None:
        failed[key] = f"{type(exc).__name__}: {exc}"
        targets.pop(key, None)

    def start(buffer: torch.Tensor) -> list[tuple[int, dist.Work]]:
        works = []
        for key, channel in list(targets.items()):
            try:
                works.append((key, channel.broadcast_async(buffer)))
            except (RuntimeError, dist.DistError) as exc:
                fail(key, exc)
        return works

    def finish(works: list[tuple[int, dist.Work]]) -> None:
        for key, work in works:
            if key in targets:
                try:
                    work.wait()
                except (RuntimeError, dist.DistError) as exc:
                    fail(key, exc)

    finish(start(torch.tensor([version, len(buckets)], dtype=torch.int64, device=device)))
    largest = max((b.nbytes for b in buckets), default=0)
    ring = [torch.empty(largest, dtype=torch.uint8, device=device) for _ in range(min(SEND_DEPTH, len(buckets)))]
    in_flight: deque[list[tuple[int, dist.Work]]] = deque()
    for i, bucket in enumerate(buckets):
        if len(in_flight) == len(ring):
            finish(in_flight.popleft())  # its buffer is packed again next
        in_flight.append(start(pack_bucket(bucket, tensors, device, out=ring[i % len(ring)])))
    while in_flight:
        finish(in_flight.popleft())
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return failed
