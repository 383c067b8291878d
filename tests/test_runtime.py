"""init_runtime: which device each process takes, and a clear error when a node has fewer GPUs than processes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from physreason.errors import ConfigError
from physreason.train.runtime import init_runtime


@pytest.fixture
def one_gpu(monkeypatch):
    """A machine that looks like it has one CUDA device; records set_device and process-group calls."""
    calls: list[tuple] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.append(("set_device", index)))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend: calls.append(("init", backend)))
    return calls


def test_second_process_on_a_one_gpu_node_is_refused_before_joining_the_group(one_gpu, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ConfigError) as caught:
        init_runtime()
    message = str(caught.value)
    assert "LOCAL_RANK 1" in message and "2 processes" in message and "only 1 GPU(s)" in message
    assert "--nproc-per-node 1" in message and "CUDA_VISIBLE_DEVICES=" in message
    assert one_gpu == []  # neither a device nor the NCCL group was touched


def test_a_process_takes_its_local_gpu_before_the_nccl_group_starts(one_gpu, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 1)
    monkeypatch.setattr(dist, "is_initialized", lambda: bool([c for c in one_gpu if c[0] == "init"]))
    runtime = init_runtime()
    # gloo beside NCCL: offloaded (host) gradients are reduced over ranks when the gradient norm is clipped
    assert one_gpu == [("set_device", 0), ("init", "cpu:gloo,cuda:nccl")]
    assert runtime.device == torch.device("cuda", 0) and runtime.distributed and runtime.world_size == 1


def test_without_torchrun_on_cpu_there_is_no_process_group(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    runtime = init_runtime()
    assert runtime.device == torch.device("cpu") and runtime.world_size == 1 and not runtime.distributed
