"""The upload record (<run>/uploads.json) is written to disk before it replaces the old one."""

from __future__ import annotations

import json
import os

from physreason.train.upload import RECORD, Uploads


def test_the_record_is_flushed_to_disk_before_it_replaces_the_old(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    folder = tmp_path / "checkpoints" / "step_2"
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(b"shard")
    Uploads(tmp_path).submit(folder, "s3")  # not started: the job is only pinned and recorded
    record = tmp_path / RECORD
    assert str(record) + ".tmp" in synced  # a power cut after the rename never leaves an empty record
    assert json.loads(record.read_text())["pending"] == [["s3", "checkpoints/step_2"]]
