"""bench/harness.py: the device line, rows printed as they finish with the JSON rewritten after each, timers, clips."""

from __future__ import annotations

import json

import pytest
from setups import load_bench


@pytest.fixture(scope="module")
def harness():
    return load_bench("harness")


def test_device_line_names_the_device_versions_commit_and_date(harness, capsys, monkeypatch):
    monkeypatch.setenv("PHYSREASON_COMMIT", "abc1234")
    info = harness.device_line(shape="tiny")
    printed = capsys.readouterr().out
    assert printed.startswith("device: ") and printed.count("\n") == 1
    assert {"device", "gpus", "torch", "cuda", "commit", "date", "shape"} <= set(info)
    assert info["commit"] == "abc1234" and "commit abc1234" in printed and "shape tiny" in printed


def test_each_row_prints_as_it_finishes_and_the_json_holds_every_row_so_far(harness, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    report = harness.Report("rows.json", device="cpu")
    report.row({"n": 1})
    assert json.loads(capsys.readouterr().out) == {"n": 1}  # a JSON line by default
    assert json.loads((tmp_path / "out" / "rows.json").read_text()) == {"device": "cpu", "rows": [{"n": 1}]}
    report.row({"n": 2}, line="| 2 |")
    report.update(summary={"best": 2})
    assert capsys.readouterr().out == "| 2 |\n"
    written = json.loads((tmp_path / "out" / "rows.json").read_text())
    assert written["rows"] == [{"n": 1}, {"n": 2}] and written["summary"] == {"best": 2}


def test_json_goes_to_the_given_path_before_out_and_nowhere_without_either(harness, tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    assert harness.write_json("a.json", {"x": 1}, tmp_path / "mine" / "a.json") == tmp_path / "mine" / "a.json"
    assert json.loads((tmp_path / "mine" / "a.json").read_text()) == {"x": 1}
    assert not (tmp_path / "out").exists()
    monkeypatch.delenv("OUT")
    assert harness.write_json("a.json", {"x": 1}) is None


def test_timed_steps_runs_the_warmup_untimed_then_the_timed_steps(harness):
    calls = []
    seconds = harness.timed_steps(lambda: calls.append(1), warmup=2, steps=3)
    assert len(calls) == 5 and seconds >= 0
    assert harness.peak_gib(None) is None or harness.peak_gib() >= 0


def test_shared_options_parse_as_each_script_names_them(harness, tmp_path):
    import argparse

    parser = argparse.ArgumentParser()
    harness.add_steps(parser, 5, 2)
    harness.add_shape(parser, "qwen2.5-vl-3b")
    harness.add_json(parser)
    args = parser.parse_args(["--steps", "1", "--json", str(tmp_path / "r.json")])
    assert (args.steps, args.warmup, args.shape, args.json) == (1, 2, "qwen2.5-vl-3b", tmp_path / "r.json")
    with pytest.raises(SystemExit):
        parser.parse_args(["--shape", "no-such-shape"])


def test_panning_clip_has_every_frame_and_moves_by_its_step(harness, tmp_path):
    import av
    import numpy as np

    clip = harness.write_panning_clip(tmp_path / "c.mp4", frames=6, size=(64, 96), fps=4, step=(0, 8), seed=3)
    with av.open(str(clip)) as container:
        frames = [f.to_ndarray(format="rgb24").astype(int) for f in container.decode(video=0)]
    assert len(frames) == 6 and frames[0].shape == (64, 96, 3)
    # panning right by 8 px a frame: frame 1 is frame 0 moved left by 8 columns (up to the codec's error)
    assert np.abs(frames[1][:, :-8] - frames[0][:, 8:]).mean() < 8 < np.abs(frames[1] - frames[0]).mean()


def test_mcq_prompts_carry_the_filler_before_each_question(harness, tmp_path):
    plain = harness.write_mcq_prompts(tmp_path / "a.jsonl", 2)
    rows = [json.loads(line) for line in plain.read_text().splitlines()]
    assert [r["question"] for r in rows] == ["Which way does ball 0 move next?", "Which way does ball 1 move next?"]
    padded = json.loads(harness.write_mcq_prompts(tmp_path / "b.jsonl", 1, filler=2).read_text())
    sentence = "the ball rolls down the slope and hits the box"
    assert padded["question"] == f"{sentence} {sentence} Which way does ball 0 move next?"
    assert padded["options"] == ["left", "right", "up", "down"] and padded["answer"] == "A"


def test_a_logged_child_gives_its_exit_code_or_none_past_its_timeout_and_its_leftovers_are_killed(harness, tmp_path):
    import sys

    log = tmp_path / "child.log"
    code = harness.run_logged([sys.executable, "-c", "print('hello'); raise SystemExit(3)"], log, 60)
    assert code == 3 and log.read_text() == "hello\n"
    # The child starts a grandchild that outlives it (as vLLM's and Ray's helpers do); that one is killed too.
    marker = tmp_path / "alive"
    leftover = f"import time; time.sleep(3); open({str(marker)!r}, 'w').close()"
    script = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {leftover!r}])"
    assert harness.run_logged([sys.executable, "-c", script], tmp_path / "parent.log", 60) == 0
    assert not marker.exists()  # run_logged gave it 5 s after SIGTERM: it would have written the marker at 3 s
    assert harness.run_logged([sys.executable, "-c", "import time; time.sleep(30)"], log, 0.5) is None


def test_children_import_this_checkout_and_versions_name_missing_packages(harness, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = harness.child_env(EXTRA="1")
    assert env["PYTHONPATH"].split(":") == [str(harness.REPO), "/elsewhere"] and env["EXTRA"] == "1"
    monkeypatch.setenv("PHYSREASON_COMMIT", "abc1234")
    found = harness.versions("torch", "no-such-package-here")
    assert found["no-such-package-here"] == "not installed" and found["physreason_commit"] == "abc1234"


def test_a_guarded_row_gives_oom_or_the_named_errors_first_line_and_lets_other_failures_through(harness):
    import torch

    def fail(error):
        raise error

    assert harness.guarded(lambda a, b: {"sum": a + b}, 1, 2) == {"sum": 3}
    assert harness.guarded(fail, torch.cuda.OutOfMemoryError("CUDA out of memory")) == {"error": "OOM"}
    no_kernel = RuntimeError("No available kernel.\nAborting.")
    assert harness.guarded(fail, no_kernel, errors=(RuntimeError,)) == {"error": "error: No available kernel."}
    with pytest.raises(RuntimeError):
        harness.guarded(fail, no_kernel)


def test_a_comma_list_keeps_known_items_and_refuses_others_as_a_usage_error(harness, capsys):
    import argparse

    parser = argparse.ArgumentParser()
    assert harness.comma_list(parser, "--modes", " sync, async,", ("sync", "async")) == ["sync", "async"]
    for bad in ("sync,later", ","):
        with pytest.raises(SystemExit) as exit_info:
            harness.comma_list(parser, "--modes", bad, ("sync", "async"))
        assert exit_info.value.code == 2 and "give a comma-separated list of sync, async" in capsys.readouterr().err
