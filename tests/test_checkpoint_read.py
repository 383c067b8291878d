"""Checkpoints are read without running code put in them, even when the run's record of what it wrote is forged;
a damaged checkpoint is one line naming its folder; a resume re-applies max_keep that a kill left undone."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from physreason.errors import ConfigError
from physreason.train.checkpoint import (
    _fingerprint,
    checkpoint_dirs,
    load_checkpoint,
    load_model_weights,
    reapply_retention,
    resolve_resume,
    save_checkpoint,
)
from physreason.train.checkpoint_read import read_metadata


def _parts():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return model, optimizer, scheduler


def _trained_checkpoint(output: Path, step: int, max_keep: int = 5) -> tuple[Path, torch.nn.Module]:
    model, optimizer, scheduler = _parts()
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    scheduler.step()
    return save_checkpoint(output, step, model, optimizer, scheduler, {"step": step}, max_keep=max_keep), model


def _forge_record(output: Path, folder: Path) -> None:
    """What someone who can write the output folder does: make the record vouch for the folder as it is now."""
    record_path = output / "checkpoints" / "written.json"
    record = json.loads(record_path.read_text()) if record_path.is_file() else {}
    record[folder.name] = {"files": _fingerprint(folder), "export": False}
    record_path.write_text(json.dumps(record))


class _System:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _Touch:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _payloads(marker: Path, real: bytes) -> dict[str, bytes]:
    """Forged .metadata files, each of which creates `marker` when plain pickle loads it."""
    nested = pickle.loads(real)  # a real Metadata with a payload hidden in one entry
    nested.planner_data = {"model.weight": _Touch(marker)}
    return {
        "os.system": pickle.dumps(_System(marker)),
        "builtins.eval": b"cbuiltins\neval\n(Vopen(%r, 'w').close()\ntR." % str(marker).encode(),
        "builtins.exec via STACK_GLOBAL": pickle.dumps(_Exec(marker), protocol=4),
        "inside a real Metadata": pickle.dumps(nested),
    }


class _Exec:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


def test_every_forged_metadata_is_refused_naming_the_folder_and_runs_nothing_even_with_a_forged_record(tmp_path):
    output = tmp_path / "run"
    own, _ = _trained_checkpoint(output, 1)
    marker = tmp_path / "pickle-ran"
    real = (own / ".metadata").read_bytes()
    for what, payload in _payloads(marker, real).items():
        # Sanity: plain pickle (what DCP does) would have run it.
        pickle.loads(payload)
        assert marker.exists(), what
        marker.unlink()
        (own / ".metadata").write_bytes(payload)
        _forge_record(output, own)
        for attempt in (
            lambda: resolve_resume(True, output),
            lambda: resolve_resume(str(own), output, trust=True),
            lambda: load_checkpoint(own, *_parts()),
        ):
            with pytest.raises(ConfigError) as caught:
                attempt()
            message = str(caught.value)
            assert f"checkpoint {own}" in message and "\n" not in message, (what, message)
            assert "never holds" in message and "nothing in it ran" in message, (what, message)
            assert not marker.exists(), what


def test_a_forged_non_tensor_entry_in_the_shards_is_refused_and_runs_nothing(tmp_path):
    output = tmp_path / "run"
    model, optimizer, scheduler = _parts()
    marker = tmp_path / "pickle-ran"
    folder = output / "checkpoints" / "step_1"
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    # DCP itself writes a non-tensor entry with torch.save: the payload sits in a shard, its .metadata is genuine.
    state = {"model": model_state, "optim": optim_state, "scheduler": {**scheduler.state_dict(), "last_epoch": _Touch(marker)}}
    dcp.save(state, checkpoint_id=folder, no_dist=True)
    torch.save({"step": 1, "rng": {}}, folder / "trainer_rank0.pt")
    _forge_record(output, folder)
    assert not marker.exists()
    assert resolve_resume(True, output) == folder  # the metadata itself is genuine
    with pytest.raises(ConfigError, match=rf"checkpoint {folder} is damaged: its shard files cannot be read") as caught:
        load_checkpoint(folder, *_parts())
    assert "\n" not in str(caught.value) and "delete" in str(caught.value)
    assert not marker.exists()


def test_a_metadata_pointing_outside_its_folder_is_refused(tmp_path):
    own, _ = _trained_checkpoint(tmp_path / "run", 1)
    metadata = pickle.loads((own / ".metadata").read_bytes())
    for info in metadata.storage_data.values():
        info.relative_path = "../../secret.distcp"
    (own / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(ConfigError, match=r"points at '\.\./\.\./secret\.distcp', not a shard file inside"):
        read_metadata(own)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "not metadata"])
def test_a_damaged_metadata_in_a_trusted_checkpoint_is_one_line_naming_the_folder(tmp_path, damage):
    output = tmp_path / "run"
    own, _ = _trained_checkpoint(output, 1)
    real = (own / ".metadata").read_bytes()
    damaged = {
        "truncated": real[: len(real) // 2],
        "garbage": bytes(range(256)) * 4,
        "empty": b"",
        "not metadata": pickle.dumps({"a": 1}),
    }[damage]
    (own / ".metadata").write_bytes(damaged)
    _forge_record(output, own)  # trusted: the damage is not what the trust rule is about
    for attempt in (lambda: resolve_resume(True, output), lambda: load_checkpoint(own, *_parts())):
        with pytest.raises(ConfigError) as caught:
            attempt()
        message = str(caught.value)
        assert message.startswith(f"checkpoint {own} is damaged: its .metadata"), message
        assert "earlier step" in message and f"delete {own}" in message and "\n" not in message


def test_damaged_shards_are_one_line_naming_the_folder(tmp_path):
    own, _ = _trained_checkpoint(tmp_path / "run", 1)
    (shard,) = own.glob("*.distcp")
    data = shard.read_bytes()
    for broken in (data[: len(data) // 2], b"\0" * len(data)):
        shard.write_bytes(broken)
        with pytest.raises(ConfigError, match=rf"^checkpoint {own} is damaged: its shard files cannot be read"):
            load_checkpoint(own, *_parts())
    shard.unlink()
    with pytest.raises(ConfigError, match=rf"^checkpoint {own} is damaged"):
        load_model_weights(own, _parts()[0])


def test_a_real_checkpoint_still_loads_exactly_through_the_restricted_reader(tmp_path):
    own, trained = _trained_checkpoint(tmp_path / "run", 1)
    model, optimizer, scheduler = _parts()
    with torch.no_grad():
        model.weight.zero_()
    assert load_checkpoint(own, model, optimizer, scheduler) == {"step": 1}
    assert torch.equal(model.weight, trained.weight) and torch.equal(model.bias, trained.bias)
    assert optimizer.param_groups[0]["betas"] == (0.9, 0.999) and scheduler.last_epoch == 1
    assert type(read_metadata(own)).__name__ == "Metadata"


def test_a_resume_deletes_the_surplus_a_kill_after_a_save_left_and_only_the_runs_own(tmp_path):
    output = tmp_path / "run"
    for step in (1, 2, 3):
        _trained_checkpoint(output, step, max_keep=5)  # as a kill between rename and rotation leaves (max_keep 2)
    foreign = output / "checkpoints" / "step_0"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("not physreason's")
    latest = resolve_resume(True, output)
    assert [p.name for p in reapply_retention(output, 2, keep=latest)] == ["step_1"]
    assert [p.name for p in checkpoint_dirs(output)] == ["step_0", "step_2", "step_3"]
    assert sorted(json.loads((output / "checkpoints" / "written.json").read_text())) == ["step_2", "step_3"]
    assert reapply_retention(output, 2, keep=latest) == []
    # Never the checkpoint resumed from, even when older than the ones kept.
    assert reapply_retention(output, 1, keep=output / "checkpoints" / "step_2") == []


def test_a_resumed_sft_run_reapplies_max_keep_that_a_kill_after_a_save_skipped(tmp_path, monkeypatch):
    from setups import sft_recipe, write_chat_records

    import physreason.train.checkpoint as checkpoint
    from physreason.models.tiny import save_tiny_model
    from physreason.train.sft import run_sft

    model = save_tiny_model("qwen2_5_vl", tmp_path / "tiny")
    data = write_chat_records(tmp_path, 4)

    def config(*extra: str):
        return sft_recipe(model, data, tmp_path / "out", "train.max_steps=3", "train.ckpt.save_freq=1",
                          "train.ckpt.max_keep=2", "train.ckpt.export_safetensors=false", *extra, lr="1e-3",
                          logger="['jsonl']")  # fmt: skip

    with monkeypatch.context() as patch:
        patch.setattr(checkpoint, "reapply_retention", lambda output_dir, max_keep, keep: [])  # killed before each rotation
        run_sft(config())
    assert [p.name for p in checkpoint_dirs(tmp_path / "out")] == ["step_1", "step_2", "step_3"]
    resumed = run_sft(config("train.resume=true"))
    assert resumed.losses == []
    assert [p.name for p in checkpoint_dirs(tmp_path / "out")] == ["step_2", "step_3"]
    assert sorted(json.loads((tmp_path / "out" / "checkpoints" / "written.json").read_text())) == ["step_2", "step_3"]


def test_sft_resume_from_a_forged_checkpoint_exits_2_with_one_line_and_runs_nothing(tmp_path):
    import subprocess
    import sys

    from physreason.models.tiny import save_tiny_model

    model = save_tiny_model("qwen2_5_vl", tmp_path / "tiny")
    answer = "<think>\nthe ball falls\n</think>\n\n<answer>\nyes\n</answer>"
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"conversations": [{"role": "user", "content": f"Does it slide {i}?"},
                                                          {"role": "assistant", "content": answer}]}) + "\n"
                            for i in range(4)))  # fmt: skip
    out, marker = tmp_path / "out", tmp_path / "pickle-ran"
    recipe = Path(__file__).resolve().parent.parent / "configs" / "sft_tiny.toml"

    def sft(*sets: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "physreason", "sft", "--config", str(recipe)]
        for item in (f"model.model_name_or_path={model}", f"data.dataset.name={data}", f"train.output_dir={out}",
                     "data.val_fraction=0", "train.ckpt.export_safetensors=false", *sets):  # fmt: skip
            command += ["--set", item]
        return subprocess.run(command, capture_output=True, text=True, timeout=300)

    assert sft("train.max_steps=1").returncode == 0
    (step,) = checkpoint_dirs(out)
    (step / ".metadata").write_bytes(pickle.dumps(_System(marker)))
    _forge_record(out, step)
    resumed = sft("train.max_steps=2", "train.resume=true")
    assert resumed.returncode == 2, resumed.stderr
    assert f"checkpoint {step}: its .metadata names {os.system.__module__}.system" in resumed.stderr
    assert "Traceback" not in resumed.stderr and not marker.exists()
