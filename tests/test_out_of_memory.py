"""The message a training step that runs out of GPU memory ends with (physreason.train.out_of_memory)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from physreason.config import load_config
from physreason.train.allocator import ALLOC_CONF_VARS
from physreason.train.out_of_memory import OutOfGPUMemory, explains_out_of_memory, out_of_memory_message

GIB = 1024**3
H200 = int(139.8 * GIB)


@pytest.fixture
def no_alloc_conf(monkeypatch):
    for name in ALLOC_CONF_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _config(*sets: str):
    return load_config(None, ["model.model_name_or_path='m'", *sets])


def test_fragmentation_is_named_with_the_users_allocator_setting(no_alloc_conf):
    no_alloc_conf.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    held = (int(118.2 * GIB), int(138.1 * GIB), H200)
    message = out_of_memory_message(
        _config("train.gradient_checkpointing=false"), "grpo", 5, held, int(129.8 * GIB), None, []
    )
    assert message.startswith("step 5 ran out of GPU memory: tensors held 118.2 GiB and the allocator 19.9 GiB more")
    assert "the memory plan was 129.8 GiB" in message
    assert "PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:512 leaves expandable segments off" in message
    assert "--set train.gradient_checkpointing=true" in message and "a smaller grpo.mini_batch" in message
    assert "train.cpu_offload" not in message  # GRPO refuses offload: not offered
    assert message.endswith("No checkpoint was saved before it, so a rerun starts from step 0")


def test_no_fragmentation_advice_with_expandable_segments_and_recomputation_offered_by_block(no_alloc_conf):
    held = (int(118.2 * GIB), int(138.1 * GIB), H200)
    config = _config("train.gradient_checkpointing=true", "train.checkpoint_every=4")
    message = out_of_memory_message(config, "sft", 2, held, None, Path("/r/checkpoints/step_1"), ["sft", "--config", "c"])
    assert "fragmentation" not in message and "memory plan" not in message
    assert "--set train.checkpoint_every=1 (recompute every block)" in message
    assert "--set train.cpu_offload=true" in message
    assert message.endswith(
        "The last checkpoint is /r/checkpoints/step_1; with the change, this continues from it:\n"
        "  physreason sft --config c --set train.resume=true"
    )


def test_only_out_of_memory_is_turned_into_the_explained_error(tmp_path, no_alloc_conf):
    config = _config(f"train.output_dir='{tmp_path / 'run'}'")
    (tmp_path / "run" / "checkpoints" / "step_4").mkdir(parents=True)
    with pytest.raises(OutOfGPUMemory, match=r"^step 7 ran out of GPU memory.*step_4"):
        with explains_out_of_memory(config, "sft", torch.device("cpu"), 10 * GIB, lambda: 7):
            raise torch.OutOfMemoryError("CUDA out of memory")
    with pytest.raises(RuntimeError, match="other"):
        with explains_out_of_memory(config, "sft", torch.device("cpu"), 10 * GIB, lambda: 7):
            raise RuntimeError("other")
