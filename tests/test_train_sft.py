"""SFT trainer on the tiny Qwen2.5-VL and Qwen3-VL models: it learns, logs, validates and resumes exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from setups import sft_overrides, write_chat_records

from physreason.config import load_config
from physreason.models.tiny import save_tiny_model
from physreason.train.checkpoint import checkpoint_dirs
from physreason.train.sft import run_sft


@pytest.fixture(scope="session")
def tiny_vl(tmp_path_factory, vl_kind) -> Path:
    return save_tiny_model(vl_kind, tmp_path_factory.mktemp(f"tiny_{vl_kind}"))


def tiny_config(model: Path, data: Path, out: Path, *extra: str):
    return load_config(None, [
        *sft_overrides(model, data, out, lr="2e-3", logger="['jsonl', 'tensorboard']"),
        "train.ckpt.export_safetensors=false",
        *extra,
    ])


@pytest.mark.slow
def test_loss_falls_when_overfitting_a_few_samples(tiny_vl, tmp_path):
    data = write_chat_records(tmp_path, 4)
    result = run_sft(tiny_config(tiny_vl, data, tmp_path / "out", "train.max_steps=12", "train.ckpt.enable_checkpoint=false"))
    assert result.losses[-1] < 0.5 * result.losses[0]
    lines = (tmp_path / "out" / "logs" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["step"] == 12
    assert any((tmp_path / "out" / "logs" / "tensorboard").rglob("events.*"))


def test_validation_loss_is_reported_on_the_held_out_split(tiny_vl, tmp_path):
    data = write_chat_records(tmp_path, 10)
    config = tiny_config(tiny_vl, data, tmp_path / "out", "train.max_steps=2", "data.val_fraction=0.2",
                         "train.validation_freq=1", "train.ckpt.enable_checkpoint=false")
    result = run_sft(config)
    assert sorted(result.val_losses) == [1, 2]
    assert result.val_losses[2] < result.val_losses[1]


@pytest.mark.slow
def test_resume_continues_the_loss_curve_exactly(tiny_vl, tmp_path):
    data = write_chat_records(tmp_path, 8)
    straight = run_sft(tiny_config(tiny_vl, data, tmp_path / "a", "train.max_steps=6", "train.ckpt.save_freq=100"))
    first = run_sft(tiny_config(tiny_vl, data, tmp_path / "b", "train.max_steps=6", "train.ckpt.save_freq=3"))
    assert [p.name for p in checkpoint_dirs(tmp_path / "b")] == ["step_3", "step_6"]
    # Throw away the end of the run, then resume from step 3 in a fresh run.
    resumed = run_sft(tiny_config(tiny_vl, data, tmp_path / "c", "train.max_steps=6",
                                  f"train.resume='{tmp_path / 'b' / 'checkpoints' / 'step_3'}'",
                                  "train.trust_checkpoint=true"))
    assert first.losses == straight.losses
    assert resumed.losses == straight.losses[3:]


@pytest.mark.slow
def test_checkpoints_are_rotated_and_never_left_half_written(tiny_vl, tmp_path):
    data = write_chat_records(tmp_path, 8)
    run_sft(tiny_config(tiny_vl, data, tmp_path / "out", "train.max_steps=4", "train.ckpt.save_freq=1", "train.ckpt.max_keep=2"))
    names = sorted(p.name for p in (tmp_path / "out" / "checkpoints").iterdir())
    assert names == ["step_3", "step_4", "written.json"]  # the record of what the run wrote keeps pace with rotation
    assert sorted(json.loads((tmp_path / "out" / "checkpoints" / "written.json").read_text())) == ["step_3", "step_4"]
    assert (tmp_path / "out" / "checkpoints" / "step_4" / ".metadata").is_file()
    again = run_sft(tiny_config(tiny_vl, data, tmp_path / "out", "train.max_steps=5", "train.resume=true"))
    assert len(again.losses) == 1


@pytest.mark.slow
def test_a_resume_finishes_every_export_a_kill_left_undone_and_says_so(tiny_vl, tmp_path, monkeypatch, capsys):
    from killed_export import killed_during_export
    from safetensors.torch import load_file

    data = write_chat_records(tmp_path, 8)

    def config(out: str, *extra: str):
        return tiny_config(tiny_vl, data, tmp_path / out, "train.max_steps=4", "train.ckpt.save_freq=2",
                           "train.ckpt.export_safetensors=true", "train.ckpt.max_keep=2", *extra)

    run_sft(config("straight"))
    exports = tmp_path / "run" / "safetensors"
    with killed_during_export(monkeypatch, 2):  # mid-run: step 2 checkpointed, its export cut short
        run_sft(config("run"))
    with killed_during_export(monkeypatch, 4):  # the last step: only the export was left to do
        run_sft(config("run", "train.resume=true"))
    assert sorted(p.name for p in exports.iterdir()) == ["step_2", "step_4.tmp"]
    capsys.readouterr()
    resumed = run_sft(config("run", "train.resume=true"))
    assert resumed.losses == [] and resumed.export_dir is None
    assert sorted(p.name for p in exports.iterdir()) == ["step_2", "step_4"]
    assert f"finished the safetensors export {exports / 'step_4'}" in capsys.readouterr().out
    # An older checkpoint's missing export is written from that checkpoint, not from the latest weights.
    import shutil

    shutil.rmtree(exports / "step_2")
    run_sft(config("run", "train.resume=true"))
    for step in (2, 4):
        got = load_file(exports / f"step_{step}" / "model.safetensors")
        want = load_file(tmp_path / "straight" / "safetensors" / f"step_{step}" / "model.safetensors")
        assert got.keys() == want.keys() and all(got[k].equal(want[k]) for k in want)


def test_a_nan_loss_stops_the_run_naming_the_step_and_the_last_good_checkpoint(tiny_vl, tmp_path, monkeypatch):
    from physreason.errors import TrainingDiverged
    from physreason.train import sft

    real, calls = sft.train_step, []

    def diverging(*args, **kwargs):
        calls.append(1)
        loss, norm = real(*args, **kwargs)
        return (float("nan"), float("inf")) if len(calls) == 3 else (loss, norm)

    monkeypatch.setattr(sft, "train_step", diverging)
    data = write_chat_records(tmp_path, 8)
    out = tmp_path / "out"
    with pytest.raises(TrainingDiverged, match=rf"step 3: the loss is nan.*last good checkpoint is {out / 'checkpoints' / 'step_2'}"):
        run_sft(tiny_config(tiny_vl, data, out, "train.max_steps=4", "train.ckpt.save_freq=1", "train.ckpt.max_keep=5"))
    assert [p.name for p in checkpoint_dirs(out)] == ["step_1", "step_2"]  # the diverged step is never saved
