"""bench/checkpoint_stall.py on CPU with the tiny shape, run as a person runs it: progress, rows, summary, JSON."""

from __future__ import annotations

import json

import pytest
from setups import load_bench


@pytest.fixture(scope="module")
def stall():
    return load_bench("checkpoint_stall")


def test_tiny_run_prints_progress_and_a_stall_per_save_for_both_modes(stall, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    work = tmp_path / "work"
    argv = ["--tiny", "--seq-len", "16", "--warmup", "0", "--steps", "1", "--after", "1", "--saves", "2",
            "--work", str(work)]  # fmt: skip
    result = stall.main(argv)
    printed = capsys.readouterr().out
    # progress comes first, one flushed line per phase, before the table
    for line in ("building the tiny shape", "sync save 1 of 2", "async save 2 of 2", "deleting it"):
        assert line in printed, line
    assert printed.index("sync save 1 of 2") < printed.index("async save 1 of 2") < printed.index("mode   save")
    rows = result["rows"]
    assert [(r["mode"], r["save"]) for r in rows] == [("sync", 1), ("sync", 2), ("async", 1), ("async", 2)]
    for row in rows:
        assert row["save_s"] > 0 and row["baseline_step_s"] > 0 and len(row["after_steps_s"]) == 1
        assert row["write_s"] > 0  # the folder watch saw the complete checkpoint appear (NaN if it never did)
        # the free-space check's estimate bounds what was written: more than the weights alone, at most all three
        # copies (the vision tower of text rows gets no AdamW moments)
        assert result["checkpoint_estimate_gb"] / 3 < row["checkpoint_gb"] <= 1.05 * result["checkpoint_estimate_gb"]
    assert rows[0]["checkpoint_gb"] == pytest.approx(rows[2]["checkpoint_gb"], rel=0.01)  # same state either way
    for row in rows[2:]:
        assert row["stall_vs_sync"] == pytest.approx(row["save_s"] / rows[row["save"] - 1]["save_s"])
    summary = result["summary"]
    assert summary["sync"]["stall_s"] == [rows[0]["save_s"], rows[1]["save_s"]]
    assert summary["async"]["stall_vs_sync"] == [rows[2]["stall_vs_sync"], rows[3]["stall_vs_sync"]]
    assert "sync: steady step" in printed and "async: steady step" in printed and "stall / sync" in printed
    written = json.loads((tmp_path / "checkpoint_stall.json").read_text())
    assert [(r["mode"], r["save"]) for r in written["rows"]] == [(r["mode"], r["save"]) for r in rows]
    assert not [p for p in work.rglob("*") if p.is_file()]  # every checkpoint deleted once measured


def test_a_work_folder_without_room_for_one_checkpoint_is_refused_before_any_step(stall, tmp_path):
    with pytest.raises(SystemExit, match=r"--work .*GB free, one checkpoint needs up to .*GB"):
        stall.check_room(tmp_path, 10**18)
    stall.check_room(tmp_path, 1)  # room for a tiny one


def test_checkpoint_estimate_is_three_fp32_copies_of_the_trainable_weights(stall):
    import torch

    layer = torch.nn.Linear(10, 10)  # 110 parameters
    layer.bias.requires_grad_(False)
    assert stall.checkpoint_bytes(layer) == 3 * 100 * 4


def test_bad_modes_and_counts_are_refused_with_the_option_named(stall, capsys):
    for argv, message in ((["--modes", "sync,fast"], "--modes"), (["--saves", "0"], "--saves must be")):
        with pytest.raises(SystemExit):
            stall.main(argv)
        assert message in capsys.readouterr().err
