"""physreason.files: write_atomic (the new text or the old, flushed to disk, never written through a link) and
replace_folder (a folder put in place of another without a moment where it is half deleted)."""

from __future__ import annotations

import os

import pytest

from physreason.files import write_atomic


def test_write_atomic_replaces_the_file_and_leaves_no_temporary(tmp_path, fsynced):
    path = tmp_path / "record.json"
    path.write_text("old", encoding="utf-8")
    write_atomic(path, "new")
    assert path.read_text(encoding="utf-8") == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["record.json"]
    assert fsynced == [str(tmp_path / "record.json.tmp")]  # the temporary, flushed before the rename


def test_a_link_at_the_temporarys_name_or_at_the_path_is_replaced_and_its_target_left_alone(tmp_path):
    victim = tmp_path / "elsewhere.txt"
    victim.write_text("keep me", encoding="utf-8")
    path = tmp_path / "report.md"
    os.symlink(victim, tmp_path / "report.md.tmp")  # a link where the temporary goes
    write_atomic(path, "report")
    assert victim.read_text(encoding="utf-8") == "keep me"
    assert not path.is_symlink() and path.read_text(encoding="utf-8") == "report"
    path.unlink()
    os.symlink(victim, path)  # a link in place of the file itself
    write_atomic(path, "again")
    assert victim.read_text(encoding="utf-8") == "keep me"
    assert not path.is_symlink() and path.read_text(encoding="utf-8") == "again"


def test_a_stale_temporary_from_a_killed_write_is_replaced(tmp_path):
    path = tmp_path / "metrics.jsonl"
    (tmp_path / "metrics.jsonl.tmp").write_text("half a line", encoding="utf-8")
    write_atomic(path, "whole\n")
    assert path.read_text(encoding="utf-8") == "whole\n" and not (tmp_path / "metrics.jsonl.tmp").exists()


def _folder(path, text):
    path.mkdir(parents=True)
    (path / "model.safetensors").write_text(text)
    return path


def test_replace_folder_renames_the_old_aside_before_deleting_it(tmp_path, monkeypatch):
    from physreason import files

    final, staging = _folder(tmp_path / "step_4", "old"), _folder(tmp_path / "step_4.tmp", "new")

    def killed(path, ignore_errors=False):  # the kill arrives while the old folder is being deleted
        if path.name.startswith(".step_4.old-") and not (tmp_path / "step_4.tmp").exists():  # after the rename
            raise KeyboardInterrupt
        real(path, ignore_errors=ignore_errors)

    real = files.shutil.rmtree
    monkeypatch.setattr(files.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        files.replace_folder(staging, final)
    assert (final / "model.safetensors").read_text() == "new" and not staging.exists()  # complete, never half
    (aside,) = tmp_path.glob(".step_4.old-*")  # left for the user: a later call deletes only what it set aside
    assert (aside / "step_4" / "model.safetensors").read_text() == "old"


def test_replace_folder_never_deletes_a_folder_it_did_not_set_aside(tmp_path):
    from physreason.files import replace_folder

    final = _folder(tmp_path / "out", "old")
    for name in (".out.old", ".out.old-1"):  # the user's, under names like the one the old folder is set aside under
        _folder(tmp_path / name, "mine")
    replace_folder(_folder(tmp_path / "out.tmp", "new"), final)
    replace_folder(_folder(tmp_path / "out.tmp", "newer"), final)
    assert (final / "model.safetensors").read_text() == "newer"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.old", ".out.old-1", "out"]
    assert all((tmp_path / name / "model.safetensors").read_text() == "mine" for name in (".out.old", ".out.old-1"))


def test_replace_folder_replaces_a_link_and_keeps_its_target(tmp_path):
    from physreason.files import replace_folder

    theirs = _folder(tmp_path / "theirs", "theirs")
    (tmp_path / "out").symlink_to(theirs, target_is_directory=True)
    replace_folder(_folder(tmp_path / "out.tmp", "ours"), tmp_path / "out")
    assert not (tmp_path / "out").is_symlink() and (tmp_path / "out" / "model.safetensors").read_text() == "ours"
    assert (theirs / "model.safetensors").read_text() == "theirs"
