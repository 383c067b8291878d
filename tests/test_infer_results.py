"""Batch result files and planning without an engine: Parquet parts, resume status, --retry-failed, replica layouts."""

from __future__ import annotations

import json

import pytest

from physreason.errors import ConfigError, InputError
from physreason.infer.batch import BatchSummary, plan_batch, prepare_single_out, read_requests
from physreason.infer.ray_pipeline import check_cpus, replica_layout
from physreason.infer.results import ParquetSink, drop_broken_lines, drop_results, open_sink, result_status


def answered(rid: str) -> dict:
    output = {
        "text": "<answer>A</answer>", "reasoning": None, "answer": "A", "format_problems": [],
        "finish_reason": "stop", "completion_tokens": 3,
    }
    return {"id": rid, "prompt_tokens": 7, "outputs": [output]}


def test_parquet_sink_writes_whole_part_files_and_reads_back_status(tmp_path):
    out = tmp_path / "out.parquet"
    sink = ParquetSink(out, rows_per_file=2, flush_s=3600)
    for rid in "abc":
        sink.write(answered(rid))
    assert [p.name for p in sorted(out.iterdir())] == ["part-00000.parquet"]  # "c" still buffered
    assert result_status(out) == {"a": True, "b": True}
    sink.write({"id": "d", "error": "media file missing"})
    sink.close()
    assert result_status(out) == {"a": True, "b": True, "c": True, "d": False}
    # a second run numbers its parts after the existing ones and clears a part a killed run left unfinished
    (out / ".part-00002.parquet.tmp").write_bytes(b"half a file")
    resumed = open_sink(out, rows_per_file=5, flush_s=3600)
    resumed.write(answered("e"))
    resumed.close()
    assert sorted(p.name for p in out.iterdir()) == ["part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    import pyarrow.parquet as pq

    rows = pq.read_table(out).to_pylist()
    assert sorted(r["id"] for r in rows) == ["a", "b", "c", "d", "e"]
    assert next(r for r in rows if r["id"] == "a")["outputs"][0]["answer"] == "A"


def test_parquet_sink_writes_a_part_when_results_wait_too_long(tmp_path):
    out = tmp_path / "o.parquet"
    sink = ParquetSink(out, rows_per_file=1000, flush_s=0.0)
    sink.write(answered("a"))
    assert result_status(out) == {"a": True}


def test_unreadable_parquet_part_is_named(tmp_path):
    out = tmp_path / "o.parquet"
    out.mkdir()
    (out / "part-00000.parquet").write_bytes(b"not parquet")
    with pytest.raises(InputError, match="part-00000.parquet cannot be read"):
        result_status(out)


@pytest.mark.parametrize("name", ["out.jsonl", "out.parquet"])
def test_retry_failed_plans_failures_again_and_drops_their_records(tmp_path, name):
    requests = tmp_path / "r.jsonl"
    requests.write_text("".join(json.dumps({"id": i, "question": "q"}) + "\n" for i in "abcd"))
    out = tmp_path / name
    sink = open_sink(out, rows_per_file=2, flush_s=3600)
    for record in [answered("a"), {"id": "b", "error": "broken"}, answered("c")]:
        sink.write(record)
    sink.close()
    plain = plan_batch(requests, out)
    assert [rid for rid, _ in plain.pending] == ["d"] and plain.skipped == 3
    retry = plan_batch(requests, out, retry_failed=True)
    assert [rid for rid, _ in retry.pending] == ["b", "d"] and retry.skipped == 2
    assert result_status(out) == {"a": True, "c": True}  # the failed record is gone, the others kept


def test_drop_results_keeps_other_lines_and_cuts_a_torn_tail(tmp_path):
    out = tmp_path / "o.jsonl"
    out.write_text('{"id": "a"}\n{"id": "b", "error": "x"}\n{"id": "c"}\n{"id": "d", "err')
    drop_results(out, {"b"})
    assert out.read_text() == '{"id": "a"}\n{"id": "c"}\n'


@pytest.mark.parametrize("name", ["out.jsonl", "out.parquet"])
def test_a_rewrite_that_drops_records_is_flushed_to_disk_before_it_replaces_the_old(tmp_path, fsynced, name):
    out = tmp_path / name
    sink = open_sink(out, rows_per_file=2, flush_s=3600)
    for record in [answered("a"), {"id": "b", "error": "broken"}, answered("c")]:
        sink.write(record)
    sink.close()
    fsynced.clear()
    drop_results(out, {"b"})
    part = out / "part-00000.parquet"
    assert str(part.with_name(f".{part.name}.tmp") if out.is_dir() else out.with_name(f".{name}.tmp")) in fsynced
    assert result_status(out) == {"a": True, "c": True}


def test_dropping_broken_lines_is_flushed_to_disk_before_it_replaces_the_old(tmp_path, fsynced):
    out = tmp_path / "o.jsonl"
    out.write_text('{"id": "a"}\n{"id": "b", "tor\n{"id": "c"}\n')
    assert drop_broken_lines(out) == [2]
    assert str(tmp_path / ".o.jsonl.tmp") in fsynced  # a power cut after the rename never leaves an empty file
    assert out.read_text() == '{"id": "a"}\n{"id": "c"}\n'


@pytest.mark.parametrize("name", ["out.jsonl", "out.parquet"])
def test_a_rewrite_that_drops_records_replaces_a_link_at_its_temporary_and_never_writes_through_it(tmp_path, name):
    out = tmp_path / name
    sink = open_sink(out, rows_per_file=2, flush_s=3600)
    for record in [answered("a"), {"id": "b", "error": "broken"}, answered("c")]:
        sink.write(record)
    sink.close()
    mine = tmp_path / "mine.txt"
    mine.write_text("my own file")
    rewritten = out / "part-00000.parquet" if out.is_dir() else out  # the file holding "b"
    rewritten.with_name(f".{rewritten.name}.tmp").symlink_to(mine)
    drop_results(out, {"b"})
    assert mine.read_text() == "my own file" and not rewritten.is_symlink()
    assert not rewritten.with_name(f".{rewritten.name}.tmp").is_symlink()
    assert result_status(out) == {"a": True, "c": True}


def test_dropping_broken_lines_replaces_a_link_at_its_temporary_and_never_writes_through_it(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "a"}\n{"id": "b", "tor\n{"id": "c"}\n')
    mine = tmp_path / "mine.txt"
    mine.write_text("my own file")
    (tmp_path / ".out.jsonl.tmp").symlink_to(mine)
    assert drop_broken_lines(out) == [2]
    assert mine.read_text() == "my own file" and not out.is_symlink()
    assert out.read_text() == '{"id": "a"}\n{"id": "c"}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.txt", "out.jsonl"]


def test_parquet_requests_are_read_with_their_folder_as_media_root(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"id": "x", "question": "q", "video": "a.mp4"}]), tmp_path / "r.parquet")
    records, root = read_requests(tmp_path / "r.parquet")
    assert records == [{"id": "x", "question": "q", "video": "a.mp4"}] and root == tmp_path.resolve()


def test_summary_counts_answered_and_failed_apart():
    line = BatchSummary(total=9, skipped=3, done=6, failed=2).describe("o.jsonl")
    assert line.startswith("4 answered, 2 failed, 3 already in o.jsonl, 9 in all")
    assert "--retry-failed" in line
    assert "--retry-failed" not in BatchSummary(total=1, skipped=0, done=1, failed=0).describe("o.jsonl")


def test_replica_layout():
    assert replica_layout(8, 2, "auto", cluster_gpus=8) == (4, 2)
    assert replica_layout(2, 1, "auto", cluster_gpus=0) == (2, 0)  # no GPU in the cluster: CPU replicas
    assert replica_layout(2, 1, "cpu", cluster_gpus=8) == (2, 0)
    with pytest.raises(ConfigError, match="not a multiple"):
        replica_layout(3, 2, "auto", cluster_gpus=8)
    with pytest.raises(ConfigError, match="has 4 GPUs"):
        replica_layout(8, 1, "auto", cluster_gpus=4)
    with pytest.raises(ConfigError, match="has 0 GPUs"):
        replica_layout(1, 1, "gpu", cluster_gpus=0)


def test_replicas_must_leave_a_cpu_for_decoding():
    check_cpus(2, 1.0, 1.0, cluster_cpus=3)
    with pytest.raises(ConfigError, match="reserve 2 CPUs and a decoding task 1, but the Ray cluster has 2"):
        check_cpus(2, 1.0, 1.0, cluster_cpus=2)


def test_a_torn_line_in_the_middle_of_a_jsonl_output_is_dropped_on_resume_and_said_once(tmp_path, capsys):
    requests = tmp_path / "r.jsonl"
    requests.write_text("".join(json.dumps({"id": i, "question": "q"}) + "\n" for i in "abcd"))
    out = tmp_path / "out.jsonl"
    good = [json.dumps(answered(i)) for i in "ac"]
    # b's write was torn (kill, full disk) and a later run appended after it; d is torn at the very end.
    out.write_bytes(f'{good[0]}\n{{"id": "b", "outp\n\xff\xfe broken\n{good[1]}\n{{"id": "d"'.encode("latin-1"))
    plan = plan_batch(requests, out)
    assert [rid for rid, _ in plan.pending] == ["b", "d"] and plan.skipped == 2
    assert out.read_text() == f"{good[0]}\n{good[1]}\n"  # every good line kept, in order, and readable JSONL
    assert all(json.loads(line) for line in out.read_text().splitlines())
    err = capsys.readouterr().err
    assert f"{out}: dropped 2 broken line(s)" in err and "line 2, 3" in err and len(err.strip().splitlines()) == 1
    plan_batch(requests, out)
    assert capsys.readouterr().err == ""  # nothing left to repair: nothing said


@pytest.mark.parametrize(
    "content",
    ['[model]\nmodel_name_or_path = "/models/tiny"\n',  # a recipe: no line is JSON
     '{"id": "x", "question": "q", "video": "a.mp4"}\n',  # another requests file: JSON, but no result record
     "notes without a newline at the end"],  # one torn-looking line and no record before it
)  # fmt: skip
def test_an_out_that_is_not_results_is_refused_and_left_as_it_was(tmp_path, content):
    requests = tmp_path / "r.jsonl"
    requests.write_text(json.dumps({"id": "a", "question": "q"}) + "\n")
    out = tmp_path / "precious.jsonl"
    out.write_text(content)
    with pytest.raises(ConfigError, match=r"--out .*precious.jsonl is not an earlier output of this command "
                       r"\(no precious.jsonl.settings.json beside it"):  # fmt: skip
        plan_batch(requests, out)
    with pytest.raises(ConfigError, match="is not an earlier output"):
        prepare_single_out(out, "a", {"style": "reason1"})
    assert out.read_text() == content  # neither repaired, truncated nor appended to


def test_an_empty_out_or_one_of_results_without_settings_is_added_to(tmp_path):
    requests = tmp_path / "r.jsonl"
    requests.write_text("".join(json.dumps({"id": i, "question": "q"}) + "\n" for i in "ab"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert [rid for rid, _ in plan_batch(requests, empty).pending] == ["a", "b"]
    results = tmp_path / "results.jsonl"
    results.write_text(json.dumps(answered("a")) + "\n" + json.dumps({"id": "b", "error": "decode failed"}) + "\n")
    assert plan_batch(requests, results, retry_failed=True).pending[0][0] == "b"


def test_a_line_holding_a_number_past_the_digit_limit_is_dropped_as_broken(tmp_path):
    out = tmp_path / "out.jsonl"
    good = json.dumps(answered("a"))
    out.write_text(f"{good}\n[{'9' * 5000}]\n")  # valid JSON text Python refuses to parse (a ValueError, not a decode error)
    assert drop_broken_lines(out) == [2]
    assert out.read_text() == f"{good}\n"


def test_an_out_that_is_a_link_is_refused_naming_its_target_so_two_names_never_take_two_locks(tmp_path):
    from setups import lock_holder

    from physreason.infer.batch import output_lock

    results = tmp_path / "results.jsonl"
    results.write_text('{"id": "a", "error": "x"}\n')
    latest = tmp_path / "latest.jsonl"
    latest.symlink_to("results.jsonl")
    holder = lock_holder(tmp_path / ".results.jsonl.lock")  # a run writing results.jsonl
    try:
        with pytest.raises(ConfigError, match=rf"--out {latest} is a symbolic link \(to results.jsonl\): results are "
                                              rf"written only to the file or folder itself; give --out {results} "):  # fmt: skip
            with output_lock(latest):
                pass
    finally:
        holder.kill()
        holder.wait()
    assert not (tmp_path / ".latest.jsonl.lock").exists()
    with output_lock(results):  # the file itself, once free
        pass


def test_a_jsonl_result_file_is_never_cut_or_appended_to_through_a_link(tmp_path):
    from physreason.infer.results import JsonlSink

    mine = tmp_path / "mine.txt"
    mine.write_text("line one\nno newline at the end")
    out = tmp_path / "out.jsonl"
    out.symlink_to(mine)
    for use in (JsonlSink, lambda path: drop_results(path, {"a"}), drop_broken_lines):
        with pytest.raises(InputError, match=rf"{out} is a symbolic link \(to {mine}\)"):
            use(out)
    assert mine.read_text() == "line one\nno newline at the end" and out.is_symlink()
