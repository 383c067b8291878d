"""Result, metrics and generated-record files read back on a resume: a line no JSON reader takes, or bytes that are
not UTF-8, are skipped (or kept as they are), never a traceback that stops the resume."""

from __future__ import annotations

import pytest

from physreason.data.synth.generate import _check_meta, _existing_record
from physreason.errors import InputError
from physreason.eval.results import read_jsonl_records
from physreason.infer.results import drop_results, finished_ids
from physreason.plots import read_metrics

# 4,301 digits: over Python's limit for int() of a string, so json.loads raises ValueError (not JSONDecodeError)
HUGE = '{"id": "big", "n": ' + "9" * 4301 + "}\n"
DEEP = '{"id": "deep", "x": ' + "[" * 100_000 + "]" * 100_000 + "}\n"  # RecursionError in json.loads


def test_a_results_line_no_json_reader_takes_is_redone_not_fatal(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "a", "answer": "A"}\n' + HUGE + DEEP + '{"id": "b", "answer": "B"}\n')
    assert finished_ids(out) == {"a", "b"}
    assert [r["id"] for r in read_jsonl_records(out)] == ["a", "b"]


def test_dropping_results_keeps_every_other_line_byte_for_byte(tmp_path):
    out = tmp_path / "out.jsonl"
    garbled = b'{"id": "g", "answer": "\xff\xfe"}\n'  # not UTF-8: kept exactly as it was
    out.write_bytes(b'{"id": "a", "error": "boom"}\n' + garbled + HUGE.encode() + b'{"id": "b", "answer": "B"}\n')
    drop_results(out, {"a"})
    assert out.read_bytes() == garbled + HUGE.encode() + b'{"id": "b", "answer": "B"}\n'


def test_metrics_with_bytes_that_are_not_utf8_plot_the_lines_that_parse(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5, "note": "\xff"}\n' + HUGE.encode()
                     + b'{"step": 3, "loss": 1.0}\n{"step": 4, "lo')  # fmt: skip
    assert read_metrics(path)["loss"] == [(1, 2.0), (2, 1.5), (3, 1.0)]


def test_a_generated_folder_with_a_damaged_meta_or_record_is_named_or_regenerated(tmp_path):
    (tmp_path / "meta.json").write_text("")
    with pytest.raises(InputError, match=r"meta.json is not a JSON object .*delete it"):
        _check_meta(tmp_path, "train", 0, "fixed")
    (tmp_path / "meta.json").write_text("[1]")
    with pytest.raises(InputError, match=r"meta.json is not a JSON object"):
        _check_meta(tmp_path, "train", 0, "fixed")
    (tmp_path / "records").mkdir()
    (tmp_path / "clips").mkdir()
    sid = "train_000000"
    (tmp_path / "clips" / f"{sid}.mp4").write_bytes(b"clip")
    for text in ("[1]", HUGE, ""):
        (tmp_path / "records" / f"{sid}.json").write_text(text)
        assert _existing_record(tmp_path, "train", 0, "arrow_of_time", 0, "fixed") is None  # generated again


def test_a_resume_keeps_the_metrics_it_can_read_past_a_line_no_json_reader_takes(tmp_path):
    from physreason.train.metrics import keep_records_up_to, read_records

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n' + HUGE.replace('"id": "big"', '"step": 2') + '{"step": 3, "loss": 1.0}\n')
    keep_records_up_to(path, 2)
    assert [r["step"] for r in read_records(path)] == [1]
    path.write_text('{"step": 1}\n' + HUGE + '{"step": 2}\n')
    with pytest.raises(InputError, match=r"metrics.jsonl:2 is not valid JSON"):
        read_records(path)  # in the middle of the log: no kill's doing, named


def test_setting_steps_aside_goes_on_past_a_damaged_upload_record(tmp_path, caplog):
    from physreason.train.loop import set_aside_abandoned_steps

    for step in (2, 3):
        (tmp_path / "checkpoints" / f"step_{step}").mkdir(parents=True)
    (tmp_path / "uploads.json").write_text("{not json")
    with caplog.at_level("WARNING", logger="physreason.train.loop"):
        set_aside_abandoned_steps(tmp_path, tmp_path / "checkpoints" / "step_2")
    assert (tmp_path / "superseded" / "after-step_2" / "checkpoints" / "step_3").is_dir()
    assert "could not drop the set-aside steps' uploads" in caplog.text and "uploads.json" in caplog.text
