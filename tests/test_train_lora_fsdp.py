"""LoRA under FSDP2: two gloo processes train the adapters to the same losses and exports as one process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from setups import fsdp_overrides, torchrun_sft, write_chat_records

from physreason.config import load_config
from physreason.models.tiny import save_tiny_model
from physreason.train.sft import run_sft

pytest.importorskip("peft")
pytestmark = pytest.mark.cpu_only  # gloo children compared with an in-process run


def _overrides(model: Path, data: Path, out: Path) -> list[str]:
    return [
        *fsdp_overrides(model, data, out, lr="1e-2"),
        "train.lora.enable=true", "train.lora.rank=4", "train.lora.vision=true",
    ]


@pytest.mark.slow
def test_two_gloo_processes_train_lora_like_one_process(tmp_path):
    model = save_tiny_model("qwen2_5_vl", tmp_path / "model")
    data = write_chat_records(tmp_path, 8, "Does it roll {i}?")
    single = run_sft(load_config(None, _overrides(model, data, tmp_path / "one")))
    two = torchrun_sft(tmp_path, 2, 29533, _overrides(model, data, tmp_path / "two"))
    assert len(two) == 3 and two[-1] < two[0]
    assert torch.allclose(torch.tensor(two), torch.tensor(single.losses), rtol=1e-4, atol=1e-5)
    for part in ("model.safetensors", "adapter/adapter_model.safetensors"):
        one_weights = load_file(tmp_path / "one" / "safetensors" / "step_3" / part)
        two_weights = load_file(tmp_path / "two" / "safetensors" / "step_3" / part)
        assert one_weights.keys() == two_weights.keys()
        for name, tensor in one_weights.items():
            assert torch.allclose(tensor, two_weights[name], atol=1e-4), (part, name)
