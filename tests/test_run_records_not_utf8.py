"""A run's own records (uploads.json, checkpoints/written.json, an eval run's run.json) that are not UTF-8 (a disk
fault, a hand edit) are one clear error naming the file, never a UnicodeDecodeError traceback."""

from __future__ import annotations

import pytest

from physreason.errors import ConfigError, InputError


@pytest.mark.parametrize("content", [b"\xff\xfe", b"[" * 5000 + b"]" * 5000])
def test_a_run_record_that_is_not_utf8_json_is_one_error_naming_it(tmp_path, content):
    from physreason.eval.results import read_run_info
    from physreason.train.checkpoint import read_record as written_record
    from physreason.train.upload import read_record as upload_record

    (tmp_path / "uploads.json").write_bytes(content)
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "written.json").write_bytes(content)
    (tmp_path / "run.json").write_bytes(content)
    with pytest.raises(ConfigError, match=rf"^{tmp_path}/uploads.json is not valid JSON"):
        upload_record(tmp_path)
    with pytest.raises(ConfigError, match=rf"^{tmp_path}/checkpoints/written.json is not valid JSON"):
        written_record(tmp_path)
    with pytest.raises(InputError, match=rf"^{tmp_path}/run.json is not valid JSON"):
        read_run_info(tmp_path)
