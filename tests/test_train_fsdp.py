"""Two processes with gloo and FSDP2 train to the same losses as one process, and export the same weights."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from setups import fsdp_overrides, torchrun_sft, write_chat_records

from physreason.config import load_config
from physreason.models.tiny import save_tiny_model
from physreason.train.sft import run_sft

pytestmark = pytest.mark.cpu_only  # gloo children compared with an in-process run

@pytest.mark.slow
def test_two_gloo_processes_with_fsdp2_match_one_process(tmp_path, vl_kind):
    model = save_tiny_model(vl_kind, tmp_path / "model")
    data = write_chat_records(tmp_path, 8, "Does it roll {i}?")
    single = run_sft(load_config(None, fsdp_overrides(model, data, tmp_path / "one", lr="2e-3")))
    two = torchrun_sft(tmp_path, 2, 29517, fsdp_overrides(model, data, tmp_path / "two", lr="2e-3"))
    assert len(two) == 3
    assert torch.allclose(torch.tensor(two), torch.tensor(single.losses), rtol=1e-4, atol=1e-5)
    one_weights = load_file(tmp_path / "one" / "safetensors" / "step_3" / "model.safetensors")
    two_weights = load_file(tmp_path / "two" / "safetensors" / "step_3" / "model.safetensors")
    assert one_weights.keys() == two_weights.keys()
    for name, tensor in one_weights.items():
        assert torch.allclose(tensor, two_weights[name], atol=1e-4), name


@pytest.mark.slow
def test_async_checkpoints_of_two_gloo_processes_complete_and_resume_in_one_process(tmp_path):
    """Each rank's background write runs its collectives on its own gloo group while training's go on."""
    model = save_tiny_model("qwen2_5_vl", tmp_path / "model")
    data = write_chat_records(tmp_path, 8, "Does it roll {i}?")
    single = run_sft(load_config(None, fsdp_overrides(model, data, tmp_path / "one", lr="2e-3")))
    saves = ["train.ckpt.save_freq=1", "train.ckpt.max_keep=2", "train.ckpt.save_mode='async'"]
    torchrun_sft(tmp_path, 2, 29551, fsdp_overrides(model, data, tmp_path / "two", lr="2e-3") + saves)
    checkpoints = tmp_path / "two" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_2", "step_3", "written.json"]
    assert {f"trainer_rank{r}.pt" for r in (0, 1)} <= {p.name for p in (checkpoints / "step_2").iterdir()}
    resumed = run_sft(load_config(None, [*fsdp_overrides(model, data, tmp_path / "resumed", lr="2e-3"),
                                         f"train.resume='{checkpoints / 'step_2'}'", "train.trust_checkpoint=true"]))
    assert torch.allclose(torch.tensor(resumed.losses), torch.tensor(single.losses[2:]), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_one_torchrun_process_trains_a_bf16_vl_model_on_text_only_records(tmp_path, vl_kind):
    """The vision blocks sit out every forward; with bf16 compute and fp32 reduction over several micro-batches
    FSDP2's sync-off accumulation path used to raise AttributeError ('_unsharded_param')."""
    model = save_tiny_model(vl_kind, tmp_path / "model")
    data = write_chat_records(tmp_path, 8, "Does it roll {i}?")
    overrides = [o for o in fsdp_overrides(model, data, tmp_path / "bf16", lr="2e-3") if not o.startswith("train.param_dtype")]
    overrides += ["train.param_dtype='bfloat16'", "train.fsdp_reduce_dtype='float32'", "train.ckpt.export_safetensors=false"]
    losses = torchrun_sft(tmp_path, 1, 29521, overrides)
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
