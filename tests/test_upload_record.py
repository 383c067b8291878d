"""The upload record (<run>/uploads.json): written to disk before it replaces the old one, and read back only when it
has the shape a run writes."""

from __future__ import annotations

import json

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


def test_a_queued_folder_outside_the_run_is_refused_before_anything_is_deleted(tmp_path):
    outside = tmp_path / "precious"
    outside.mkdir()
    run = tmp_path / "run"
    (run / ".uploads").mkdir(parents=True)
    (run / RECORD).write_text(json.dumps({"pending": [["s3", "../../precious"]]}))
    with pytest.raises(ConfigError, match=r"'pending' names the folder '../../precious', outside the run folder"):
        Uploads(run)
    assert outside.is_dir()
