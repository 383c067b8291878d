"""The CUDA allocator setting of training processes and the headroom the memory plan keeps for it."""

from __future__ import annotations

import pytest

from physreason.train import allocator
from physreason.train.allocator import (
    EXPANDABLE_SEGMENTS,
    allocator_headroom,
    expandable_segments,
    headroom_reason,
    use_expandable_segments,
    user_alloc_conf,
)
from physreason.train.memory import usable_bytes

GPU = 100 * 1024**3


@pytest.fixture
def no_alloc_conf(monkeypatch):
    for name in allocator.ALLOC_CONF_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize(
    ("conf", "expandable"),
    [
        (None, True),  # unset: training processes set it
        ("expandable_segments:True", True),
        (" expandable_segments:True , garbage_collection_threshold:0.6", True),
        ("garbage_collection_threshold:0.6,expandable_segments:True", True),
        ("expandable_segments:False", False),
        ("max_split_size_mb:512", False),
        ("backend:cudaMallocAsync", False),
        ("expandable_segments:True,backend:cudaMallocAsync", False),
        ("expandable_segments", False),  # no value: torch refuses it, and it turns nothing on
    ],
)
def test_expandable_segments_reads_torchs_key_value_syntax(conf, expandable):
    assert expandable_segments(conf) is expandable


def test_the_newer_variable_wins_as_in_torch(no_alloc_conf):
    assert user_alloc_conf() is None
    no_alloc_conf.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert user_alloc_conf() == ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    no_alloc_conf.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:256")
    assert user_alloc_conf() == ("PYTORCH_ALLOC_CONF", "max_split_size_mb:256")
    assert allocator_headroom() == allocator.HEADROOM_FRAGMENTING


def test_a_training_process_gets_expandable_segments_only_when_the_user_set_nothing(no_alloc_conf):
    assert use_expandable_segments() is True
    assert user_alloc_conf() == ("PYTORCH_CUDA_ALLOC_CONF", EXPANDABLE_SEGMENTS)
    no_alloc_conf.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    assert use_expandable_segments() is False
    assert user_alloc_conf() == ("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")  # the user's choice stays


def test_the_plan_keeps_more_of_the_gpu_free_when_the_users_setting_fragments(no_alloc_conf):
    assert usable_bytes(GPU) == int(GPU * 0.95) and headroom_reason() is None
    no_alloc_conf.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert usable_bytes(GPU) == int(GPU * 0.95) and headroom_reason() is None
    no_alloc_conf.setenv("PYTORCH_CUDA_ALLOC_CONF", "garbage_collection_threshold:0.8")
    assert usable_bytes(GPU) == int(GPU * 0.85)
    reason = headroom_reason()
    assert reason is not None and "PYTORCH_CUDA_ALLOC_CONF=garbage_collection_threshold:0.8" in reason
    assert EXPANDABLE_SEGMENTS in reason


def test_the_start_up_check_refuses_a_plan_that_fits_only_with_expandable_segments_and_says_why(tmp_path, no_alloc_conf):
    from physreason.config import load_config
    from physreason.errors import ConfigError
    from physreason.models.tiny import save_tiny_model
    from physreason.train.memory_report import check_memory

    model = save_tiny_model("qwen3_vl", tmp_path / "model")
    config = load_config(None, [f"model.model_name_or_path='{model}'", "model.model_max_length=512"])
    total = check_memory(config, 2, True, "sft", None).total
    gpu = int(total / 0.9)  # 90% full: within 95%, over 85%
    assert check_memory(config, 2, True, "sft", gpu).total == total
    no_alloc_conf.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:512")
    with pytest.raises(ConfigError, match=r"PYTORCH_ALLOC_CONF=max_split_size_mb:512 leaves expandable segments off"):
        check_memory(config, 2, True, "sft", gpu)


def test_init_runtime_sets_the_allocator_before_taking_a_gpu(no_alloc_conf):
    import torch

    from physreason.train import runtime

    order: list[str] = []
    no_alloc_conf.setattr(torch.cuda, "is_available", lambda: True)
    no_alloc_conf.setattr(torch.cuda, "device_count", lambda: 1)
    no_alloc_conf.setattr(torch.cuda, "is_initialized", lambda: False)
    no_alloc_conf.setattr(torch.cuda, "set_device", lambda local: order.append(f"set_device {local} {user_alloc_conf()}"))
    no_alloc_conf.delenv("WORLD_SIZE", raising=False)
    built = runtime.init_runtime()
    assert built.device == torch.device("cuda", 0)
    assert order == [f"set_device 0 {('PYTORCH_CUDA_ALLOC_CONF', EXPANDABLE_SEGMENTS)}"]
