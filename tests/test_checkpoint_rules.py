"""Checkpoint folders: a fresh run never reuses a run's folder, foreign checkpoints need trust, rotation keeps the new one."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from physreason.errors import ConfigError
from physreason.train.checkpoint import (
    checkpoint_dirs,
    prune_step_dirs,
    refuse_stale_checkpoints,
    resolve_resume,
    save_checkpoint,
)


def fake_checkpoint(output: Path, step: int) -> Path:
    folder = output / "checkpoints" / f"step_{step}"
    folder.mkdir(parents=True)
    (folder / ".metadata").write_bytes(b"")
    return folder


def test_fresh_run_into_a_folder_with_checkpoints_is_refused_naming_both_ways_out(tmp_path):
    refuse_stale_checkpoints(tmp_path, False)  # an empty folder is fine
    fake_checkpoint(tmp_path, 4)
    with pytest.raises(ConfigError, match=r"\(step_4\).*train.resume=true.*new or empty folder"):
        refuse_stale_checkpoints(tmp_path, False)
    refuse_stale_checkpoints(tmp_path, True)
    refuse_stale_checkpoints(tmp_path, str(tmp_path / "checkpoints" / "step_4"))


def test_resume_from_a_folder_outside_output_dir_needs_trust(tmp_path):
    other = fake_checkpoint(tmp_path / "someone-elses-run", 2)
    with pytest.raises(ConfigError, match="unpickles its .metadata.*train.trust_checkpoint = true"):
        resolve_resume(str(other), tmp_path / "mine")
    assert resolve_resume(str(other), tmp_path / "mine", trust=True) == other
    own = fake_checkpoint(tmp_path / "mine", 3)
    assert resolve_resume(str(own), tmp_path / "mine") == own
    (tmp_path / "mine" / "link").symlink_to(other)  # a link inside output_dir to a folder outside it
    with pytest.raises(ConfigError, match="outside train.output_dir"):
        resolve_resume(str(tmp_path / "mine" / "link"), tmp_path / "mine")


def test_rotation_never_deletes_the_folder_just_written(tmp_path):
    for step in (10, 20):
        fake_checkpoint(tmp_path, step)
    just_written = fake_checkpoint(tmp_path, 5)  # a restarted run's first save, below the old steps
    prune_step_dirs(tmp_path / "checkpoints", 1, keep=just_written)
    assert [p.name for p in checkpoint_dirs(tmp_path)] == ["step_5", "step_20"]


def test_single_process_save_and_load_raise_no_distributed_warning(tmp_path):
    from physreason.train.checkpoint import load_checkpoint

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        path = save_checkpoint(tmp_path, 1, model, optimizer, scheduler, {"step": 1}, max_keep=1)
        assert load_checkpoint(path, model, optimizer, scheduler)["step"] == 1
