"""bench/memory_plan.py on CPU with the tiny Qwen3-VL, run as a person runs it: the throughput of each memory mode."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from setups import load_bench, run_torchrun

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def memory_bench():
    return load_bench("memory_plan")


@pytest.mark.slow
def test_modes_run_in_one_torchrun_and_print_tokens_per_second_against_none(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OUT": str(tmp_path), "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
               str(ROOT / "bench" / "memory_plan.py"), "--tiny", "--seq-len", "64", "--modes",
               "none,offload,bf16-state,offload-overlap",
               "--steps", "1", "--warmup", "1"]  # fmt: skip
    done = run_torchrun(command, env)
    assert done.returncode == 0, done.stderr[-3000:]
    modes = ["none", "offload", "bf16-state", "offload-overlap"]
    table = [line.split() for line in done.stdout.splitlines() if line.split()[:1] in ([mode] for mode in modes)]
    assert [row[0] for row in table] == modes
    rows = json.loads((tmp_path / "memory_plan_modes.json").read_text())["rows"]
    assert [r["mode"] for r in rows] == modes
    none = rows[0]
    for row in rows:
        assert row["seconds_per_step"] > 0
        assert row["tokens_per_s"] == pytest.approx(64 / row["seconds_per_step"])
        assert row["vs_none"] == pytest.approx(row["tokens_per_s"] / none["tokens_per_s"])
    # bf16 state on the host: the eager update of each parameter (on CUDA the grouped kernel, one launch a group)
    launches = rows[2]["adamw_launches_per_step"]
    assert launches["grouped"] == 0 and launches["per_parameter"] > 0 and "adamw_launches_per_step" not in none
    assert "AdamW of bf16-state: 0 grouped kernels and" in done.stdout
    # offload: the host's share of its step, taken by torch's fused AdamW (not the single-tensor loop), and the
    # process's CPU threads; the other modes time no host step
    offload = rows[1]
    assert offload["host_adamw"] == "fused" and 0 < offload["host_step_seconds"] < offload["seconds_per_step"]
    assert "host_step_seconds" not in none and "host_step_seconds" not in rows[2]
    assert "offload: clipping and AdamW (fused) on the host" in done.stdout
    assert json.loads((tmp_path / "memory_plan_modes.json").read_text())["cpu_threads"] >= 1
    # offload-overlap: AdamW in the background thread, timed there; the main thread's waits for it are its host share
    overlap = rows[3]
    assert overlap["host_adamw"] == "fused" and overlap["host_adamw_seconds"] > 0
    assert 0 <= overlap["host_wait_seconds"] < overlap["seconds_per_step"]
    assert overlap["host_step_seconds"] == pytest.approx(overlap["host_norm_seconds"] + overlap["host_wait_seconds"])
    assert "offload-overlap: AdamW (fused) in the background" in done.stdout
    assert "host_wait_seconds" not in offload
    # the plan of each mode, beside its figure: offload moves the state to the host, bf16 state halves the moments
    assert rows[1]["planned_gib"] < none["planned_gib"] and rows[2]["planned_gib"] < none["planned_gib"]


def test_offload_without_torchrun_is_refused_instead_of_measured_without_offload(memory_bench, tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit, match="torchrun --standalone --nproc-per-node 1"):
        memory_bench.main(["--tiny", "--offload"])


@pytest.mark.parametrize(
    "argv, message",
    [(["--modes", "none,fast"], "--modes 'none,fast'"), (["--modes", "none,offload", "--offload"], "leave out"),
     (["--modes", "none", "--steps", "0"], "--steps must be"), (["--profile", "/tmp/p"], "--profile needs --modes"),
     (["--modes", "none", "--profile", "/tmp/p", "--profile-steps", "0"], "--profile needs --modes")],
)  # fmt: skip
def test_mode_options_that_cannot_run_are_refused_with_the_option_named(memory_bench, capsys, argv, message):
    with pytest.raises(SystemExit):
        memory_bench.main(["--tiny", *argv])
    assert message in capsys.readouterr().err


def test_profile_prints_a_line_a_mode_and_keeps_one_text_and_a_small_trace(memory_bench, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    memory_bench.main(["--tiny", "--seq-len", "32", "--modes", "bf16-state", "--steps", "1", "--warmup", "1",
                       "--profile", str(tmp_path / "prof"), "--profile-steps", "2"])  # fmt: skip
    out = capsys.readouterr().out
    line = next(text for text in out.splitlines() if text.startswith("  profile of bf16-state (2 steps"))
    for part in ("GPU kernel" if torch.cuda.is_available() else "CPU op", "optimizer ", "GEMMs ", "wall ms clip ",
                 "optimizer.step ", "zero_grad ", "a step: clip "):  # fmt: skip
        assert part in line
    assert "pointer tables built" in out
    assert sorted(p.name for p in (tmp_path / "prof" / "bf16-state").iterdir()) == ["profile.txt", "trace.json.gz"]
    text = (tmp_path / "prof" / "bf16-state" / "profile.txt").read_text()
    assert text.startswith("profile of bf16-state") and "key_averages, top 25" in text and "category" in text
    row = json.loads((tmp_path / "memory_plan_modes.json").read_text())["rows"][0]["profile"]
    assert row["steps"] == 2 and set(row["host_ms"]) == {"clip", "step", "step_returned", "zero_grad"}
    # the eager bf16 update on the host: its ops are counted under optimizer.step, and AdamW is in the optimizer phase
    assert row["optimizer_launches_per_step"]["optimizer_step"] > row["optimizer_launches_per_step"]["zero_grad"]
    assert row["by_category_ms_per_step"]["optimizer"] > 0
    assert row["host_ms"]["step"] >= row["host_ms"]["step_returned"] > 0
