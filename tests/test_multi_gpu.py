"""Two GPUs over NCCL train like one: the FSDP2 golden test (dp 2) and tensor parallel (tp 2) on CUDA.

The gloo versions (test_train_fsdp.py, test_grpo_tp.py) pin the arithmetic on CPU; these run the same recipe with
NCCL, one process per GPU, against one process on one GPU, in float32 (TF32 stays off: torch's default for matmuls).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from setups import fsdp_overrides, torchrun_sft, write_chat_records

from physreason.models.tiny import save_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]


def _weights(out) -> dict[str, torch.Tensor]:
    return load_file(out / "safetensors" / "step_3" / "model.safetensors")


@pytest.mark.parametrize("layout", ["dp2", "tp2"])
def test_two_nccl_gpus_match_one_gpu(tmp_path, vl_kind, layout):
    model = save_tiny_model(vl_kind, tmp_path / "model")
    data = write_chat_records(tmp_path, 8, "Does it roll {i}?")
    one = torchrun_sft(tmp_path, 1, 29531, fsdp_overrides(model, data, tmp_path / "one", lr="2e-3"))
    extra = ["policy.parallelism.tp_size=2"] if layout == "tp2" else []
    two = torchrun_sft(tmp_path, 2, 29533, fsdp_overrides(model, data, tmp_path / "two", lr="2e-3") + extra)
    assert len(two) == len(one) == 3
    assert torch.allclose(torch.tensor(two), torch.tensor(one), rtol=1e-4, atol=1e-5), (one, two)
    one_weights, two_weights = _weights(tmp_path / "one"), _weights(tmp_path / "two")
    assert one_weights.keys() == two_weights.keys()
    for name, tensor in one_weights.items():
        assert torch.allclose(tensor, two_weights[name], atol=1e-4), name
