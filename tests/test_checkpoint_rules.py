"""Checkpoint folders: a fresh run never reuses a run's folder, foreign checkpoints need trust, rotation keeps the new one."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from physreason.errors import ConfigError
from physreason.train.checkpoint import (
    checkpoint_dirs,
    read_record,
    reapply_retention,
    record_export,
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


def test_a_run_from_step_0_never_replaces_an_earlier_runs_exports(tmp_path):
    for step in (900, 1000):  # a finished run's exports; its checkpoints deleted to free the disk
        (tmp_path / "safetensors" / f"step_{step}").mkdir(parents=True)
    (tmp_path / "safetensors" / "step_5.tmp").mkdir()  # a cut-short export is no export
    for resume in (False, True):  # true finds no checkpoint: the run would start from step 0 too
        with pytest.raises(ConfigError, match=r"safetensors exports of an earlier run \(step_900, step_1000\) and no "
                           r"checkpoint.*new or empty folder"):  # fmt: skip
            refuse_stale_checkpoints(tmp_path, resume)
    fake_checkpoint(tmp_path, 1000)
    refuse_stale_checkpoints(tmp_path, True)  # resumes the run that wrote them
    refuse_stale_checkpoints(tmp_path, str(tmp_path / "checkpoints" / "step_1000"))
    shutil.rmtree(tmp_path / "safetensors" / "step_900")
    shutil.rmtree(tmp_path / "safetensors" / "step_1000")
    shutil.rmtree(tmp_path / "checkpoints")
    refuse_stale_checkpoints(tmp_path, False)  # a run killed before its first save: the rerun goes ahead


def saved_checkpoint(output: Path, step: int, max_keep: int = 5) -> Path:
    """A real checkpoint written by save_checkpoint, so it is in output's record of checkpoints it wrote."""
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return save_checkpoint(output, step, model, optimizer, scheduler, {"step": step}, max_keep=max_keep)


def test_resume_from_a_folder_outside_output_dir_needs_trust(tmp_path):
    other = saved_checkpoint(tmp_path / "someone-elses-run", 2)
    with pytest.raises(ConfigError, match="outside train.output_dir.*unpickles its .metadata.*trust_checkpoint = true"):
        resolve_resume(str(other), tmp_path / "mine")
    assert resolve_resume(str(other), tmp_path / "mine", trust=True) == other
    own = saved_checkpoint(tmp_path / "mine", 3)
    assert resolve_resume(str(own), tmp_path / "mine") == own
    assert resolve_resume(True, tmp_path / "mine") == own
    (tmp_path / "mine" / "link").symlink_to(other)  # a link inside output_dir to a folder outside it
    with pytest.raises(ConfigError, match="is a link to"):
        resolve_resume(str(tmp_path / "mine" / "link"), tmp_path / "mine")


def test_a_checkpoint_linked_into_the_run_is_not_trusted_on_resume(tmp_path):
    other = saved_checkpoint(tmp_path / "elsewhere", 5)
    saved_checkpoint(tmp_path / "mine", 3)
    (tmp_path / "mine" / "checkpoints" / "step_5").symlink_to(other)  # now the latest step of the run
    with pytest.raises(ConfigError, match=r"step_5 is a link to .*elsewhere.*--trust-checkpoint.*safetensors export"):
        resolve_resume(True, tmp_path / "mine")
    assert resolve_resume(True, tmp_path / "mine", trust=True).name == "step_5"
    # The refused link never deletes its target when rotation or a later save replaces it.
    saved_checkpoint(tmp_path / "mine", 5)
    assert (other / ".metadata").is_file() and resolve_resume(True, tmp_path / "mine").name == "step_5"


def test_a_checkpoint_copied_into_the_run_is_not_trusted_as_advised_before(tmp_path):
    other = saved_checkpoint(tmp_path / "elsewhere", 5)
    own = saved_checkpoint(tmp_path / "mine", 3)
    shutil.copytree(other, tmp_path / "mine" / "checkpoints" / "step_5")  # the old message's "copy the run in"
    with pytest.raises(ConfigError, match="was not written by the run"):
        resolve_resume(True, tmp_path / "mine")
    shutil.rmtree(tmp_path / "mine" / "checkpoints" / "step_5")
    shutil.copytree(own, tmp_path / "mine" / "checkpoints" / "step_7", copy_function=shutil.copy2)  # even its own, copied
    with pytest.raises(ConfigError, match="step_7 was not written by the run"):
        resolve_resume(True, tmp_path / "mine")
    shutil.rmtree(tmp_path / "mine" / "checkpoints" / "step_7")
    assert resolve_resume(True, tmp_path / "mine") == own
    (own / ".metadata").write_bytes((own / ".metadata").read_bytes() + b"x")  # changed after the run wrote it
    with pytest.raises(ConfigError, match="changed since"):
        resolve_resume(str(own), tmp_path / "mine")


def test_a_refused_checkpoint_is_never_unpickled(tmp_path):
    import pickle

    marker = tmp_path / "pickle-ran"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    saved_checkpoint(tmp_path / "mine", 3)
    planted = tmp_path / "mine" / "checkpoints" / "step_9"
    planted.mkdir()
    (planted / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(ConfigError, match="step_9 was not written"):
        resolve_resume(True, tmp_path / "mine")
    assert not marker.exists()


def fake_export(output: Path, step: int) -> Path:
    """A safetensors export folder the run wrote: on disk and in its record of exports."""
    folder = output / "safetensors" / f"step_{step}"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"weights")
    record_export(output, folder)
    return folder


def test_rotation_never_deletes_the_folder_just_written(tmp_path):
    for step in (10, 20):
        fake_export(tmp_path, step)
    just_written = fake_export(tmp_path, 5)  # a restarted run's first save, below the old steps
    reapply_retention(tmp_path, 1, keep=just_written, under="safetensors")
    assert [p.name for p in checkpoint_dirs(tmp_path, "safetensors")] == ["step_5", "step_20"]


def test_export_rotation_deletes_only_exports_the_run_wrote_and_never_follows_a_link(tmp_path):
    elsewhere = tmp_path / "elsewhere" / "model"  # a model of the user's, linked in as an export
    elsewhere.mkdir(parents=True)
    (elsewhere / "model.safetensors").write_bytes(b"theirs")
    run = tmp_path / "run"
    (run / "safetensors").mkdir(parents=True)
    (run / "safetensors" / "step_1").symlink_to(elsewhere, target_is_directory=True)
    shutil.copytree(elsewhere, run / "safetensors" / "step_2")  # copied in
    changed = fake_export(run, 3)
    (changed / "notes.txt").write_text("added after the export")  # no longer the folder the run wrote
    for step in (4, 5, 6):
        reapply_retention(run, 2, keep=fake_export(run, step), under="safetensors")
    names = [p.name for p in checkpoint_dirs(run, "safetensors")]
    assert names == ["step_1", "step_2", "step_3", "step_5", "step_6"]
    assert (elsewhere / "model.safetensors").read_bytes() == b"theirs" and (run / "safetensors" / "step_1").is_symlink()
    assert sorted(read_record(run, "safetensors")) == ["step_3", "step_5", "step_6"]


def test_rotation_deletes_only_checkpoints_the_run_wrote(tmp_path):
    other = saved_checkpoint(tmp_path / "elsewhere", 1)
    mine = tmp_path / "mine"
    copied = mine / "checkpoints" / "step_1"
    shutil.copytree(other, copied)  # another run's checkpoint, resumed from with train.trust_checkpoint
    assert resolve_resume(str(copied), mine, trust=True) == copied
    planted = fake_checkpoint(mine, 2)  # a folder of another tool or run in the same output_dir
    for step in (3, 4, 5):
        saved_checkpoint(mine, step, max_keep=2)
    assert [p.name for p in checkpoint_dirs(mine)] == ["step_1", "step_2", "step_4", "step_5"]
    assert (copied / ".metadata").is_file() and (planted / ".metadata").is_file()


def test_the_record_of_checkpoints_is_flushed_to_disk_before_it_replaces_the_old(tmp_path, fsynced):
    saved_checkpoint(tmp_path, 1)
    record = tmp_path / "checkpoints" / "written.json"
    assert str(record) + ".tmp" in fsynced  # a power cut after the rename never leaves an empty record
    assert list(json.loads(record.read_text())) == ["step_1"]


def test_a_run_never_trains_from_a_folder_its_own_saves_rotate(tmp_path):
    from physreason.config import load_config
    from physreason.models.tiny import save_tiny_model
    from physreason.train.loop import prepare_output

    out = tmp_path / "run"
    export = save_tiny_model("qwen2_5_vl", out / "safetensors" / "step_100")  # the first stage's export, checkpoints gone
    data = tmp_path / "train.jsonl"
    data.write_text("{}\n")

    def recipe(model: Path, data: Path, *extra: str):
        return load_config(None, [f"model.model_name_or_path='{model}'", f"data.dataset.name='{data}'",
                                  f"train.output_dir='{out}'", *extra])  # fmt: skip

    with pytest.raises(ConfigError, match=r"model.model_name_or_path = .*step_100' lies in .*safetensors.*max_keep"):
        prepare_output(recipe(export, data))
    with pytest.raises(ConfigError, match=r"grpo.reference_model_path = .*lies in .*safetensors"):
        prepare_output(recipe(tmp_path, data, f"grpo.reference_model_path='{export}'"))
    (out / "checkpoints").mkdir()
    moved = out / "checkpoints" / "train.jsonl"
    data.rename(moved)
    with pytest.raises(ConfigError, match=r"data.dataset.name = .*lies in .*checkpoints"):
        prepare_output(recipe(tmp_path, moved))
    assert not (out / "config.toml").exists()  # refused before anything was written
    moved.rename(data)
    assert prepare_output(recipe(export, data, f"train.output_dir='{tmp_path / 'stage2'}'")) == tmp_path / "stage2"
    # The model folder itself as train.output_dir: the run writes beside its files, never over them.
    assert prepare_output(recipe(export, data, f"train.output_dir='{export}'")) == export
    assert (export / "model.safetensors").is_file()


def test_single_process_save_and_load_raise_no_distributed_warning(tmp_path):
    from physreason.train.checkpoint import load_checkpoint

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        path = save_checkpoint(tmp_path, 1, model, optimizer, scheduler, {"step": 1}, max_keep=1)
        assert load_checkpoint(path, model, optimizer, scheduler)["step"] == 1


def test_a_runs_export_never_replaces_a_step_folder_it_did_not_write(tiny_model_dir, tmp_path):
    from transformers import AutoModelForImageTextToText

    from physreason.config import load_config
    from physreason.train.build import TrainingModel
    from physreason.train.loop import Checkpointer

    run = tmp_path / "run"
    config = load_config(None, [f"model.model_name_or_path='{tiny_model_dir}'", f"train.output_dir='{run}'"])
    model = AutoModelForImageTextToText.from_pretrained(tiny_model_dir, dtype=torch.float32)
    checkpointer = Checkpointer(config, TrainingModel(model, model, None, None, None))
    own = checkpointer.export(2)
    checkpointer.export(2)  # the run's own export of that step (a resume replays it) is replaced
    assert sorted(read_record(run, "safetensors")) == ["step_2"]
    copied = run / "safetensors" / "step_4"
    shutil.copytree(own, copied)  # put there by hand
    (copied / "notes.txt").write_text("mine")
    before = sorted(p.name for p in copied.iterdir())
    with pytest.raises(ConfigError, match=f"{copied} was not written by this run .* move that folder out of the run"):
        checkpointer.export(4)
    assert sorted(p.name for p in copied.iterdir()) == before and (copied / "notes.txt").read_text() == "mine"
    assert not (run / "safetensors" / "step_4.tmp").exists() and sorted(read_record(run, "safetensors")) == ["step_2"]


def test_an_export_the_run_began_but_never_recorded_or_one_from_before_the_record_is_the_runs_to_replace(
    tiny_model_dir, tmp_path
):
    from transformers import AutoModelForImageTextToText

    from physreason.config import load_config
    from physreason.models.export import export_trained
    from physreason.train.build import TrainingModel
    from physreason.train.checkpoint import begin_export
    from physreason.train.loop import Checkpointer

    run = tmp_path / "run"
    config = load_config(None, [f"model.model_name_or_path='{tiny_model_dir}'", f"train.output_dir='{run}'"])
    model = AutoModelForImageTextToText.from_pretrained(tiny_model_dir, dtype=torch.float32)
    checkpointer = Checkpointer(config, TrainingModel(model, model, None, None, None))
    # a run from before physreason kept an export record: its step folders are its own, replaced as they always were
    old = run / "safetensors" / "step_2"
    export_trained(model, None, str(tiny_model_dir), old, "float32")
    assert not (run / "safetensors" / "written.json").exists()
    assert checkpointer.export(2) == old and sorted(read_record(run, "safetensors")) == ["step_2"]
    # killed between the rename of step_4 and its record: the resume that redoes step 4 replaces it
    begin_export(run, "step_4")
    export_trained(model, None, str(tiny_model_dir), run / "safetensors" / "step_4", "float32")
    assert read_record(run, "safetensors")["step_4"] == {"pending": True}
    checkpointer.export(4)
    assert "files" in read_record(run, "safetensors")["step_4"]


def test_a_save_never_replaces_a_checkpoint_folder_the_run_did_not_write(tmp_path):
    own = saved_checkpoint(tmp_path, 2)
    assert saved_checkpoint(tmp_path, 2) == own  # the run's own step (a resume replays it) is replaced
    copied = tmp_path / "checkpoints" / "step_4"
    shutil.copytree(own, copied)  # put there by hand: not in the run's record
    (copied / "notes.txt").write_text("mine")
    before = sorted(p.name for p in copied.iterdir())
    with pytest.raises(ConfigError, match=f"{copied} was not written by this run .* move that folder out of the run"):
        saved_checkpoint(tmp_path, 4)
    assert sorted(p.name for p in copied.iterdir()) == before and (copied / "notes.txt").read_text() == "mine"
    assert not (tmp_path / "checkpoints" / "step_4.tmp").exists() and sorted(read_record(tmp_path)) == ["step_2"]
    victim = tmp_path / "elsewhere"
    shutil.copytree(own, victim)
    shutil.rmtree(copied)
    copied.symlink_to(victim)  # a link in the step's place: replaced, its target left alone
    assert saved_checkpoint(tmp_path, 4) == copied and not copied.is_symlink()
    assert sorted(p.name for p in victim.iterdir()) == sorted(p.name for p in own.iterdir())


def test_a_run_from_before_the_record_of_checkpoints_replaces_its_step_folders_as_before(tmp_path):
    old = fake_checkpoint(tmp_path, 2)  # no checkpoints/written.json: written before physreason kept one
    assert saved_checkpoint(tmp_path, 2) == old and (old / "trainer_rank0.pt").is_file()
