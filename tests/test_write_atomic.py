"""physreason.files.write_atomic: the new text or the old, flushed to disk, and never written through a link."""

from __future__ import annotations

import os

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
