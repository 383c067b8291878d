"""Weight transfer plan, packing and the two-member gloo channel (no Ray needed)."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from physreason.distributed.weight_transfer import (
    StagingArea,
    TensorSpec,
    WeightChannel,
    pack_bucket,
    plan_buckets,
    send_transfer,
    unpack_bucket,
    weight_manifest,
)
from physreason.errors import PhysReasonError


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 50))


def test_buckets_keep_manifest_order_respect_the_size_limit_and_align_offsets():
    manifest = [TensorSpec(f"t{i}", (n,), torch.float32) for i, n in enumerate([10, 3, 30, 1, 7, 64])]
    buckets = plan_buckets(manifest, bucket_bytes=128)

    assert [s.name for b in buckets for s in b.specs] == [s.name for s in manifest]
    for bucket in buckets:
        assert all(offset % 16 == 0 for offset in bucket.offsets)
        assert bucket.nbytes == bucket.offsets[-1] + bucket.specs[-1].nbytes
        assert bucket.nbytes <= 128 or len(bucket.specs) == 1  # only a tensor larger than a bucket travels alone
    assert len(buckets) < len(manifest)


def test_pack_then_unpack_returns_every_tensor_in_the_transfer_dtype():
    model = _model()
    manifest = weight_manifest(model, torch.bfloat16)
    buckets = plan_buckets(manifest, bucket_bytes=512)
    tensors = iter([(n, p.detach()) for n, p in model.named_parameters()])
    received = {}
    for bucket in buckets:
        received.update(unpack_bucket(bucket, pack_bucket(bucket, tensors, torch.device("cpu"))))

    assert list(received) == [n for n, _ in model.named_parameters()]
    for name, parameter in model.named_parameters():
        assert received[name].dtype == torch.bfloat16
        assert torch.equal(received[name], parameter.detach().to(torch.bfloat16))


def test_gloo_channel_delivers_a_versioned_transfer():
    model = _model()
    buckets = plan_buckets(weight_manifest(model), bucket_bytes=256)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    got = {}

    def receiver() -> None:
        channel = WeightChannel("127.0.0.1", store.port, "test", rank=1, device=torch.device("cpu"))
        got["version"], got["tensors"] = channel.receive(buckets)

    thread = threading.Thread(target=receiver)
    thread.start()
    sender = WeightChannel("", 0, "test", rank=0, device=torch.device("cpu"), store=store)
    sender.send_header(7, len(buckets))
    tensors = iter([(n, p.detach()) for n, p in model.named_parameters()])
    for bucket in buckets:
        sender.send(pack_bucket(bucket, tensors, torch.device("cpu")))
    thread.join(timeout=300)
    assert not thread.is_alive(), "the receiver never got every bucket"

    assert got["version"] == 7
    assert [n for n, _ in got["tensors"]] == [n for n, _ in model.named_parameters()]
    for (_, tensor), (_, parameter) in zip(got["tensors"], model.named_parameters(), strict=True):
        assert torch.equal(tensor, parameter.detach())


def _mixed() -> list[tuple[str, torch.Tensor]]:
    """Tensors of several dtypes and sizes, one (`big`) larger than the 256-byte buckets of the tests below."""
    torch.manual_seed(1)
    return [
        ("a", torch.randn(3, 5)),
        ("b", torch.randn(7).to(torch.bfloat16)),
        ("big", torch.randn(40, 3)),  # 480 bytes: a bucket of its own
        ("d", torch.randn(16)),  # 64 bytes
        ("e", torch.randn(48)),  # 192 bytes: with "d", a bucket of exactly 256
        ("c", torch.arange(6, dtype=torch.int64).view(2, 3)),
        ("empty", torch.zeros(0, 4)),
        ("f", torch.randn(1)),
    ]


def _specs(named: list[tuple[str, torch.Tensor]]) -> list[TensorSpec]:
    return [TensorSpec(name, tuple(t.shape), t.dtype) for name, t in named]


def test_bucket_boundaries_a_full_bucket_and_a_tensor_larger_than_a_bucket():
    buckets = plan_buckets(_specs(_mixed()), bucket_bytes=256)

    layout = [[s.name for s in b.specs] for b in buckets]
    # "big" (480 bytes) goes alone, in order; "d" + "e" fill a bucket to exactly its 256 bytes; "empty" costs nothing.
    assert layout == [["a", "b"], ["big"], ["d", "e"], ["c", "empty", "f"]]
    assert [b.nbytes for b in buckets] == [64 + 14, 480, 256, 48 + 4]
    assert buckets[0].offsets == (0, 64)  # "b" starts on the next 16-byte boundary after "a"'s 60 bytes


def test_pack_unpack_round_trip_is_bit_exact_for_every_dtype_and_reuses_one_buffer():
    named = _mixed()
    buckets = plan_buckets(_specs(named), bucket_bytes=256)
    ring = torch.full((max(b.nbytes for b in buckets) + 32,), 255, dtype=torch.uint8)  # larger than any bucket
    tensors = iter(named)
    received = []
    for bucket in buckets:
        packed = pack_bucket(bucket, tensors, torch.device("cpu"), out=ring)
        assert packed.numel() == bucket.nbytes and packed.data_ptr() == ring.data_ptr()
        received += [(name, t.clone()) for name, t in unpack_bucket(bucket, packed)]  # the buffer is packed again next

    assert [n for n, _ in received] == [n for n, _ in named]
    for (_, got), (_, sent) in zip(received, named, strict=True):
        assert got.dtype == sent.dtype and got.shape == sent.shape
        assert torch.equal(got.view(-1).view(torch.uint8), sent.reshape(-1).view(torch.uint8))  # bit-exact


def test_pack_names_a_tensor_that_does_not_match_the_plan():
    buckets = plan_buckets(_specs(_mixed()), bucket_bytes=256)
    wrong = iter([("a", torch.randn(5, 3))])
    with pytest.raises(PhysReasonError, match=r"expected a \(3, 5\), got a \(5, 3\)"):
        pack_bucket(buckets[0], wrong, torch.device("cpu"))


class _BrokenChannel:
    """A channel whose second broadcast fails (a replica that dies after the header)."""

    def __init__(self) -> None:
        self.calls = 0

    def broadcast_async(self, tensor: torch.Tensor):
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("connection reset by peer")
        return _Done()


class _Done:
    def wait(self) -> bool:
        return True


def test_send_transfer_reaches_every_receiver_into_reused_staging_and_survives_a_broken_channel():
    named = _mixed()
    buckets = plan_buckets(_specs(named), bucket_bytes=256)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    got: dict[int, list] = {1: [], 2: []}
    views: dict[int, bool] = {}

    def receiver(key: int) -> None:
        channel = WeightChannel("127.0.0.1", store.port, f"r{key}", rank=1, device=torch.device("cpu"))
        staging = StagingArea(buckets, torch.device("cpu"))
        for _ in range(2):  # two versions into the same staging buffers
            version, tensors = channel.receive(buckets, staging)
            got[key].append((version, [(n, t.clone()) for n, t in tensors]))
            views[key] = all(  # views into the staging buffers, no copies (an empty tensor has no address)
                any(b.data_ptr() <= t.data_ptr() < b.data_ptr() + b.numel() for b in staging.buffers)
                for _, t in tensors
                if t.numel()
            )

    threads = [threading.Thread(target=receiver, args=(key,)) for key in got]
    for thread in threads:
        thread.start()
    senders = {key: WeightChannel("", 0, f"r{key}", rank=0, device=torch.device("cpu"), store=store) for key in got}
    broken = _BrokenChannel()
    failed = send_transfer({**senders, 3: broken}, 4, buckets, iter(named), torch.device("cpu"))
    second = [(n, t * 2 if t.is_floating_point() else t + 1) for n, t in named]
    assert send_transfer(senders, 5, buckets, iter(second), torch.device("cpu")) == {}
    for thread in threads:
        thread.join(timeout=300)
    assert not any(thread.is_alive() for thread in threads), "a receiver never got every bucket"

    assert failed == {3: "RuntimeError: connection reset by peer"} and broken.calls == 2  # left out after it failed
    assert views == {1: True, 2: True}
    for key in got:
        assert [version for version, _ in got[key]] == [4, 5]
        for (_, tensors), sent in zip(got[key], (named, second), strict=True):
            assert [n for n, _ in tensors] == [n for n, _ in sent]
            assert all(torch.equal(a, b) for (_, a), (_, b) in zip(tensors, sent, strict=True))


def _receive_in_child(port: int, buckets, results) -> None:
    channel = WeightChannel("127.0.0.1", port, "child", rank=1, device=torch.device("cpu"))
    version, tensors = channel.receive(buckets, StagingArea(buckets, torch.device("cpu")))
    # Raw bytes, not tensors: a tensor in a queue is shared memory, gone when this process exits.
    results.put((version, [(n, t.reshape(-1).view(torch.uint8).numpy().tobytes()) for n, t in tensors]))


def test_push_from_the_policy_model_reaches_another_process_over_gloo():
    import multiprocessing

    from physreason.train.weight_sync import full_named_parameters

    model = _model()
    buckets = plan_buckets(weight_manifest(model, torch.bfloat16), bucket_bytes=512)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    child = context.Process(target=_receive_in_child, args=(store.port, buckets, results))
    child.start()
    try:
        sender = WeightChannel("", 0, "child", rank=0, device=torch.device("cpu"), store=store)
        failed = send_transfer({0: sender}, 9, buckets, full_named_parameters(model, torch.bfloat16), torch.device("cpu"))
        version, tensors = results.get(timeout=120)
    finally:
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
    assert failed == {} and version == 9 and child.exitcode == 0
    assert [n for n, _ in tensors] == [n for n, _ in model.named_parameters()]
    for (_, got), (_, parameter) in zip(tensors, model.named_parameters(), strict=True):
        assert got == parameter.detach().to(torch.bfloat16).reshape(-1).view(torch.uint8).numpy().tobytes()


def test_fsdp2_parameters_are_cast_on_the_shard_then_gathered_whole(tmp_path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from physreason.train.weight_sync import full_named_parameters

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        model = _model()
        expected = {n: p.detach().clone().to(torch.bfloat16) for n, p in model.named_parameters()}
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        assert all(isinstance(p, DTensor) for p in model.parameters())
        pushed = list(full_named_parameters(model, torch.bfloat16))
    finally:
        dist.destroy_process_group()
    assert [n for n, _ in pushed] == list(expected)
    for name, tensor in pushed:
        assert not isinstance(tensor, DTensor) and tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, expected[name])
