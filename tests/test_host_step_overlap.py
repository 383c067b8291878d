"""train.cpu_offload_overlap: the host's AdamW a unit at a time in a background thread, beside the next forward.

Every run here is FSDP2 with CPU offload on a one-rank gloo world in this process: the overlapped step must give the
serial step's losses, weights and optimizer state bit for bit, checkpoints must hold the stepped weights, a resume
may cross the option either way, and an error in the thread must reach the main thread.
"""

from __future__ import annotations

import time
import traceback
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from setups import write_chat_records

from physreason.config import load_config
from physreason.errors import ConfigError
from physreason.models.tiny import save_tiny_model
from physreason.train.host_step import OverlappedHostStep
from physreason.train.sft import run_sft


def _overrides(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return [f"model.model_name_or_path='{model}'", f"data.dataset.name='{data}'", f"train.output_dir='{out}'",
            "train.train_batch_per_replica=4", "train.mini_batch=2", "train.optm_lr=2e-3", "train.param_dtype='float32'",
            "model.dtype='float32'", "data.num_workers=0", "logging.logger=['jsonl']", "train.ckpt.save_freq=2",
            "train.cpu_offload=true", "train.optm_warmup_steps=1", *extra]


@pytest.fixture
def torchrun_of_one(world_of_one, monkeypatch):
    """conftest's group of one, seen as torchrun's: run_sft's runtime then trains in the group made there."""
    monkeypatch.setenv("WORLD_SIZE", "1")


@pytest.fixture
def tiny(tmp_path):
    return save_tiny_model("qwen2_5_vl", tmp_path / "model"), write_chat_records(tmp_path)


def _full(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in module.named_parameters()}  # fmt: skip


def _state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    from torch.distributed.tensor import DTensor

    values = []
    state = optimizer.state_dict()["state"]
    for index in sorted(state):  # the order of first steps differs (units in forward order); the indices do not
        entry = state[index]
        for key in sorted(entry):
            value = entry[key]
            values.append(value.full_tensor() if isinstance(value, DTensor) else value)
    return values


def _steps(trained, config, clip: float, steps: list[int]) -> tuple[list[float], list[float]]:
    from physreason.models import loading
    from physreason.train.runtime import Runtime
    from physreason.train.sft import _collate_fn, build_datasets, train_step

    runtime = Runtime(rank=0, world_size=1, device=torch.device("cpu"), distributed=True)
    tokenizer = loading.load_tokenizer(config.model)
    train_set, _ = build_datasets(config, tokenizer, loading.load_model_config(config.model))
    collate = _collate_fn(config, tokenizer.pad_token_id, mrope=True)
    losses, norms = [], []
    for index, count in enumerate(steps):  # micro-batches a step: 2 adds gradients on the host
        micro = [collate([train_set[(2 * (index + k)) % len(train_set)], train_set[(2 * (index + k) + 1) % len(train_set)]])
                 for k in range(count)]  # fmt: skip
        loss, norm = train_step(trained.module, micro, trained.optimizer, trained.scheduler, runtime, 1, clip,
                                trained.autocast, reduced_norm=trained.reduced_norm, overlap=trained.overlap)  # fmt: skip
        losses.append(loss)
        norms.append(norm)
    return losses, norms


@pytest.mark.parametrize("clip", [1e-3, 1e3])
def test_overlapped_steps_equal_the_serial_offload_steps_bit_for_bit(torchrun_of_one, tiny, tmp_path, clip):
    """Four steps (one and two micro-batches; the text rows leave the vision tower's units without gradients) with
    clipping active (1e-3: the coefficient rides in the fused kernel as grad_scale) and not: the losses, norms,
    weights and AdamW moments of the overlapped run are the serial run's, bitwise. The step is still in flight when
    train_step returns, and each unit's forward hook runs ahead of FSDP2's own (which copies the shards in)."""
    from physreason.train.build import build_training_model
    from physreason.train.model import CausalLMLoss
    from physreason.train.runtime import Runtime

    model, data = tiny
    runtime = Runtime(rank=0, world_size=1, device=torch.device("cpu"), distributed=True)
    runs = {}
    for overlap in (False, True):
        config = load_config(None, _overrides(model, data, tmp_path / str(overlap),
                                              f"train.cpu_offload_overlap={str(overlap).lower()}"))  # fmt: skip
        torch.manual_seed(0)
        trained = build_training_model(config, runtime, CausalLMLoss, 6, overlaps_step=True)
        assert (trained.overlap is not None) == overlap
        if overlap:
            from torch.distributed.fsdp import FSDPModule

            units = [m for m in trained.module.modules() if isinstance(m, FSDPModule)]
            assert len(units) > 2 and len(trained.overlap.handles) == len(units)
            for unit, handle in zip(units, trained.overlap.handles, strict=True):
                assert next(iter(unit._forward_pre_hooks)) == handle.id  # ahead of FSDP2's pre-forward
        losses, norms = _steps(trained, config, clip, [1, 1, 2, 1])
        if overlap:
            assert trained.overlap.pending  # the last step is still (or was) running in the background
            trained.wait_for_step()
            assert not trained.overlap.pending
        assert all(p.grad is None for p in trained.module.parameters())  # released, as zero_grad(set_to_none)
        runs[overlap] = losses, norms, _full(trained.module), _state(trained.optimizer)
        assert all((norm > clip) == (clip < 1) for norm in norms)
    (serial, serial_norms, serial_weights, serial_state) = runs[False]
    (overlapped, overlapped_norms, overlapped_weights, overlapped_state) = runs[True]
    assert overlapped == serial and overlapped_norms == serial_norms
    assert serial[-1] < serial[0]
    assert overlapped_weights.keys() == serial_weights.keys()
    assert all(torch.equal(overlapped_weights[name], serial_weights[name]) for name in serial_weights)
    assert len(overlapped_state) == len(serial_state) > 0
    assert all(torch.equal(a, b) for a, b in zip(overlapped_state, serial_state, strict=True))


def test_an_error_in_the_background_step_is_raised_in_the_main_thread(torchrun_of_one, tiny, tmp_path):
    from physreason.train.build import build_training_model
    from physreason.train.model import CausalLMLoss
    from physreason.train.runtime import Runtime

    model, data = tiny
    config = load_config(None, _overrides(model, data, tmp_path / "out", "train.cpu_offload_overlap=true"))
    runtime = Runtime(rank=0, world_size=1, device=torch.device("cpu"), distributed=True)
    trained = build_training_model(config, runtime, CausalLMLoss, 4, overlaps_step=True)
    _steps(trained, config, 1.0, [1])
    trained.wait_for_step()

    def broken_step(*_args, **_kwargs):
        raise RuntimeError("host AdamW failed")

    root_stepper = trained.overlap._steppers[0]
    root_stepper.step = broken_step
    with pytest.raises(RuntimeError, match="host AdamW failed") as raised:
        _steps(trained, config, 1.0, [1, 1])  # the second step's forward (the root unit's hook) meets it
    assert "broken_step" in "".join(traceback.format_tb(raised.value.__traceback__))  # the thread's own frames
    assert not trained.overlap.pending
    trained.wait_for_step()  # raised once: nothing left to raise
    # and at an explicit wait, when no forward comes first
    _steps(trained, config, 1.0, [1])
    with pytest.raises(RuntimeError, match="host AdamW failed"):
        trained.wait_for_step()


def _run(model: Path, data: Path, out: Path, *extra: str):
    return run_sft(load_config(None, _overrides(model, data, out, "train.max_steps=4", *extra)))


def _export(out: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(out / "safetensors" / f"step_{step}" / "model.safetensors")


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def test_runs_and_resumes_across_the_option_equal_the_serial_run(torchrun_of_one, tiny, tmp_path, monkeypatch):
    """run_sft with the option on equals it off (losses, checkpoints' exports at steps 2 and 4); a checkpoint written
    with it off resumes with it on and the reverse, equal to the run straight through. The background step is slowed
    down so that a save which did not wait for it would write the weights before the step."""
    model, data = tiny
    run = OverlappedHostStep._run

    def slow_run(self, *args):
        time.sleep(0.3)
        run(self, *args)

    monkeypatch.setattr(OverlappedHostStep, "_run", slow_run)
    serial = _run(model, data, tmp_path / "off")
    overlapped = _run(model, data, tmp_path / "on", "train.cpu_offload_overlap=true")
    assert overlapped.losses == serial.losses and serial.losses[-1] < serial.losses[0]
    for step in (2, 4):
        assert _same(_export(tmp_path / "on", step), _export(tmp_path / "off", step))
    for written, resumed_with in (("off", "true"), ("on", "false")):
        out = tmp_path / f"from-{written}"
        resumed = _run(model, data, out, f"train.cpu_offload_overlap={resumed_with}", "train.trust_checkpoint=true",
                       f"train.resume='{tmp_path / written / 'checkpoints' / 'step_2'}'")  # fmt: skip
        assert resumed.losses == serial.losses[2:]
        assert _same(_export(out, 4), _export(tmp_path / "off", 4))


@pytest.mark.parametrize(
    "extra, names",
    [((), "train.cpu_offload = false"),
     (("train.cpu_offload=true", "train.optimizer_state_dtype='bfloat16'"), "train.optimizer_state_dtype"),
     (("train.cpu_offload=true", "train.fp8.enable_fp8=true"), "train.fp8.enable_fp8")],
)  # fmt: skip
def test_overlap_without_offload_or_with_what_it_cannot_step_is_refused_naming_the_keys(extra, names):
    with pytest.raises(ConfigError, match="train.cpu_offload_overlap") as raised:
        load_config(None, ["train.cpu_offload_overlap=true", *extra])
    assert names in str(raised.value)


def test_grpo_refuses_the_overlap_it_does_not_run(torchrun_of_one, tiny, tmp_path):
    from physreason.train.build import build_training_model
    from physreason.train.runtime import Runtime

    model, data = tiny
    config = load_config(None, _overrides(model, data, tmp_path / "out", "train.cpu_offload_overlap=true"))
    runtime = Runtime(rank=0, world_size=1, device=torch.device("cpu"), distributed=True)
    with pytest.raises(ConfigError, match="train.cpu_offload_overlap = true is implemented for SFT only"):
        build_training_model(config, runtime, lambda m: m, 4)
