"""Shared fixtures: tiny models built once per test session, synthetic media."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True)
def _release_run_locks():
    """A test that calls prepare_output directly (no run entry point around it) lets go of its folders' run locks."""
    yield
    from physreason.train.runlock import release_all

    release_all()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Qwen2.5-VL model saved as a Hugging Face folder (built once per session)."""
    from physreason.models.tiny import save_tiny_model

    return save_tiny_model("qwen2_5_vl", tmp_path_factory.mktemp("tiny-qwen2_5_vl"))


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory, tiny_model_dir) -> dict[str, Path]:
    """Every tiny architecture, each saved once per session."""
    from physreason.models.tiny import TINY_KINDS, save_tiny_model

    dirs = {"qwen2_5_vl": tiny_model_dir}
    for kind in TINY_KINDS:
        if kind not in dirs:
            dirs[kind] = save_tiny_model(kind, tmp_path_factory.mktemp(f"tiny-{kind}"))
    return dirs


@pytest.fixture(scope="session")
def tiny_text(tmp_path_factory) -> Path:
    """The GRPO tests' tiny Qwen2 text model (a folder of their own)."""
    from physreason.models.tiny import save_tiny_model

    return save_tiny_model("qwen2", tmp_path_factory.mktemp("tiny_qwen2"))


@pytest.fixture(scope="session")
def mcq_file(tmp_path_factory) -> Path:
    """The GRPO tests' eight multiple-choice prompts, all answered B (setups.write_mcq_file)."""
    from setups import write_mcq_file

    return write_mcq_file(tmp_path_factory.mktemp("mcq"))


@pytest.fixture(scope="session", params=["qwen2_5_vl", "qwen3_vl"])
def vl_kind(request) -> str:
    """Each vision-language family the suite runs for: Qwen2.5-VL (Cosmos-Reason1) and Qwen3-VL (Cosmos-Reason2)."""
    return request.param


@pytest.fixture(scope="session")
def vl_model_dir(tiny_model_dirs, vl_kind) -> Path:
    """The tiny model folder of the `vl_kind` family (tests that use it run once per family)."""
    return tiny_model_dirs[vl_kind]


def pytest_collection_modifyitems(config, items) -> None:
    """`gpu` tests skip, with the reason, on a machine without CUDA; `cpu_only` tests skip on one with CUDA.

    addopts deselects the gpu tests, but any `-m` given on the command line (such as `-m "not vllm"`) replaces
    that filter. A cpu_only test runs torchrun children with gloo on CPU and compares them with a run in the
    test process, which would use the GPU.
    """
    import torch

    cuda = torch.cuda.is_available()
    needs_gpu = pytest.mark.skip(reason="needs a CUDA GPU (gpu marker): run `pytest -m gpu` on a GPU machine")
    needs_cpu = pytest.mark.skip(
        reason="gloo CPU test (cpu_only marker): run with CUDA_VISIBLE_DEVICES= on a GPU machine"
    )
    for item in items:
        if "gpu" in item.keywords and not cuda:
            item.add_marker(needs_gpu)
        if "cpu_only" in item.keywords and cuda:
            item.add_marker(needs_cpu)


@pytest.fixture
def fsynced(monkeypatch) -> list[str]:
    """The paths os.fsync is called on during the test, in order (Linux: read from /proc/self/fd); fsync still runs."""
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return synced


@pytest.fixture
def world_of_one(tmp_path):
    """A gloo process group of one rank in this process, and its CPU device mesh (FSDP2 and DTensor on one rank)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()
