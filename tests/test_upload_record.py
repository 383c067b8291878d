"""The upload record (<run>/uploads.json): written to disk before it replaces the old one, and read back only when it
has the shape a run writes."""

from __future__ import annotations

import json
import re

import pytest

from physreason.errors import ConfigError
from physreason.train.upload import RECORD, Uploads, read_record


def test_the_record_is_flushed_to_disk_before_it_replaces_the_old(tmp_path, fsynced):
    folder = tmp_path / "checkpoints" / "step_2"
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(b"shard")
    Uploads(tmp_path).submit(folder, "s3")  # not started: the job is only pinned and recorded
    record = tmp_path / RECORD
    assert str(record) + ".tmp" in fsynced  # a power cut after the rename never leaves an empty record
    assert json.loads(record.read_text())["pending"] == [["s3", "checkpoints/step_2"]]


@pytest.mark.parametrize(
    "text",
    ['["s3", "checkpoints/step_2"]', "3", "null", '{"pending": {}}', '{"s3": []}', '{"hf": "x"}',
     '{"pending": [["s3"]]}', '{"pending": ["checkpoints/step_2"]}',
     '{"pending": [["ftp", "checkpoints/step_2"]]}', '{"pending": [["s3", 2]]}'],
)  # fmt: skip
def test_a_record_of_the_wrong_shape_is_one_clear_error(tmp_path, text):
    (tmp_path / RECORD).write_text(text)
    with pytest.raises(ConfigError, match=rf"^{tmp_path / RECORD} is not an upload record as a run writes it \(.*\): "
                       "it lists this run's uploads; delete it to upload everything again$"):  # fmt: skip
        read_record(tmp_path)
    with pytest.raises(ConfigError, match=rf"^{tmp_path / RECORD} is not"):
        Uploads(tmp_path)


def test_a_record_missing_a_part_reads_as_empty_there(tmp_path):
    (tmp_path / RECORD).write_text('{"s3": {"s3://b/k": {"etag": "e"}}}')
    assert read_record(tmp_path) == {"pending": [], "s3": {"s3://b/k": {"etag": "e"}}, "hf": {}}


@pytest.mark.parametrize("folder", ["../../precious", ".", "", "checkpoints", "checkpoints/step_2/..", "foo/bar",
                                    "/tmp/precious", "safetensors/step_x"])  # fmt: skip
def test_a_queued_folder_not_a_runs_checkpoint_or_export_is_refused_before_anything_is_deleted(tmp_path, folder):
    outside = tmp_path / "precious"
    outside.mkdir()
    run = tmp_path / "run"
    (run / ".uploads" / "checkpoints" / "step_3").mkdir(parents=True)  # another job's pin: '.' would delete it
    (run / RECORD).write_text(json.dumps({"pending": [["s3", folder]]}))
    with pytest.raises(ConfigError, match=rf"'pending' names the folder '{re.escape(folder)}', not a run's "
                       r"checkpoints/step_N or safetensors/step_N"):  # fmt: skip
        Uploads(run)
    assert outside.is_dir() and (run / ".uploads" / "checkpoints" / "step_3").is_dir()


def test_a_link_in_the_pin_folder_is_refused_and_what_it_names_is_kept(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "step_2").mkdir(parents=True)
    (elsewhere / "step_2" / "shard").write_bytes(b"someone else's")
    run = tmp_path / "run"
    (run / ".uploads").mkdir(parents=True)
    (run / ".uploads" / "checkpoints").symlink_to(elsewhere, target_is_directory=True)
    (run / RECORD).write_text(json.dumps({"pending": [["s3", "checkpoints/step_2"]]}))
    uploads = Uploads(run)
    with pytest.raises(ConfigError, match=r"\.uploads/checkpoints is a link, where physreason keeps the pinned copies"):
        uploads.start()
    uploads.close()
    assert (elsewhere / "step_2" / "shard").read_bytes() == b"someone else's"


def test_a_checkpoint_folder_linked_to_another_disk_is_queued_by_its_name_in_the_run(tmp_path):
    disk = tmp_path / "big-disk"
    (disk / "step_2").mkdir(parents=True)
    (disk / "step_2" / "__0_0.distcp").write_bytes(b"shard")
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").symlink_to(disk, target_is_directory=True)  # raised ValueError after the save before
    Uploads(run).submit(run / "checkpoints" / "step_2", "s3")
    assert json.loads((run / RECORD).read_text())["pending"] == [["s3", "checkpoints/step_2"]]
    assert (run / ".uploads" / "checkpoints" / "step_2" / "__0_0.distcp").read_bytes() == b"shard"
    with pytest.raises(ValueError, match="is not a checkpoints/step_N or safetensors/step_N folder of"):
        Uploads(run).submit(tmp_path / "big-disk" / "step_2", "s3")
