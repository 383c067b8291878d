"""Reading a run's logs/metrics.jsonl back (the experiments' `logged`): a run killed mid-write is no error."""

from __future__ import annotations

import json

import pytest

from physreason.errors import InputError
from physreason.experiments.common import logged


def write_log(run, tail: bytes = b"", middle: bytes = b"") -> None:
    lines = [json.dumps({"step": step, "train/loss": 1.0 / step}).encode() + b"\n" for step in (1, 2, 3)]
    path = run / "logs" / "metrics.jsonl"
    path.parent.mkdir(parents=True)
    path.write_bytes(lines[0] + middle + b"".join(lines[1:]) + tail)


@pytest.mark.parametrize(
    "tail",
    [b'{"step": 4, "train/lo', b"\x00" * 512, b"\x00" * 64 + b"\n", b"\n\n", b'{"step": 4, "train/loss": 0.2\n\x00\x00',
     b'{"step": 4, "note": "\xc3'],
)  # fmt: skip
def test_a_torn_or_nul_filled_last_line_is_skipped(tmp_path, tail):
    write_log(tmp_path, tail=tail)
    assert logged(tmp_path, "train/loss") == [1.0, 0.5, 1 / 3]


def test_blank_and_nul_only_lines_in_the_middle_are_skipped(tmp_path):
    write_log(tmp_path, middle=b"\n\x00\x00\x00\n   \n")
    assert logged(tmp_path, "train/loss") == [1.0, 0.5, 1 / 3]


@pytest.mark.parametrize(
    ("middle", "problem"), [(b'{"step": 9, "tra\n', "not valid JSON"), (b"[1, 2]\n", "not a JSON object")]
)
def test_a_corrupt_line_in_the_middle_is_one_error_naming_the_file_and_line(tmp_path, middle, problem):
    write_log(tmp_path, middle=b"\n" + middle)
    path = tmp_path / "logs" / "metrics.jsonl"
    with pytest.raises(InputError, match=rf"^{path}:3 is {problem}.*delete or fix that line and run again$"):
        logged(tmp_path, "train/loss")


def test_no_log_is_no_values(tmp_path):
    assert logged(tmp_path, "train/loss") == []


def test_a_resume_rewrites_the_log_flushed_to_disk_before_it_replaces_the_old(tmp_path, fsynced):
    from physreason.train.metrics import keep_records_up_to

    write_log(tmp_path)
    path = tmp_path / "logs" / "metrics.jsonl"
    keep_records_up_to(path, 2)
    assert str(path) + ".tmp" in fsynced  # a power cut after the rename never leaves an empty log
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
