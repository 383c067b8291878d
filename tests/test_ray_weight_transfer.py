"""Weight transfer plan, packing and the two-member gloo channel (no Ray needed)."""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from physreason.distributed.weight_transfer import (
    TensorSpec,
    WeightChannel,
    pack_bucket,
    plan_buckets,
    unpack_bucket,
    weight_manifest,
)


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
