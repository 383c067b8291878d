"""tools/device_job.sh: a job that outlives one device call, and the calls that wait for it and collect its results."""

from __future__ import annotations

import os
import subprocess
import tarfile
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "device_job.sh"

pytestmark = pytest.mark.timeout(60)


def job(tree: Path, jobs: Path, *args: str, out: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "DEVICE_JOBS": str(jobs)}
    if out is not None:
        env["OUT"] = str(out)
    return subprocess.run(["bash", str(TOOL), *args], cwd=tree, env=env, capture_output=True, text=True, timeout=50)


@pytest.fixture()
def tree(tmp_path: Path) -> Path:
    tree = tmp_path / "tree"
    (tree / "scripts").mkdir(parents=True)
    (tree / "scripts" / "ok.sh").write_text(
        'echo "args: $*"; echo "cwd: $PWD"; echo partial > "$RESULTS/a.txt"; sleep "${1:-0}"; echo done > "$RESULTS/b.txt"\n'
    )
    (tree / "scripts" / "fail.sh").write_text("echo about to fail; exit 7\n")
    return tree


def test_start_wait_collect(tree: Path, tmp_path: Path) -> None:
    jobs, out = tmp_path / "jobs", tmp_path / "out"
    out.mkdir()
    started = job(tree, jobs, "start", "t1", "scripts/ok.sh", "2")
    assert started.returncode == 0, started.stderr
    assert "started t1" in started.stdout
    running = job(tree, jobs, "wait", "t1", "0")
    assert running.returncode == 75, running.stdout + running.stderr
    assert "still running" in running.stdout
    done = job(tree, jobs, "wait", "t1", "30")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "args: 2" in done.stdout
    assert f"cwd: {jobs / 't1' / 'repo'}" in done.stdout  # the script runs in the copy, not in the call's tree
    assert "ended with exit status 0" in done.stdout
    collected = job(tree, jobs, "collect", "t1", out=out)
    assert collected.returncode == 0, collected.stderr
    with tarfile.open(out / "t1.tgz") as tar:
        names = set(tar.getnames())
        assert {"results/a.txt", "results/b.txt", "results/job.log"} <= names
        assert tar.extractfile("results/b.txt").read() == b"done\n"


def test_failed_job_passes_its_status(tree: Path, tmp_path: Path) -> None:
    jobs = tmp_path / "jobs"
    assert job(tree, jobs, "start", "f", "scripts/fail.sh").returncode == 0
    waited = job(tree, jobs, "wait", "f", "30")
    assert waited.returncode == 7
    assert "about to fail" in waited.stdout
    assert "ended with exit status 7" in waited.stdout


def test_wait_on_a_fresh_machine_fails_at_once(tree: Path, tmp_path: Path) -> None:
    waited = job(tree, tmp_path / "jobs", "wait", "never", "600")
    assert waited.returncode == 3
    assert "never started on this machine" in waited.stderr
    collected = job(tree, tmp_path / "jobs", "collect", "never", out=tmp_path)
    assert collected.returncode == 3


def test_refuses_a_second_start_while_running_and_bad_names(tree: Path, tmp_path: Path) -> None:
    jobs = tmp_path / "jobs"
    assert job(tree, jobs, "start", "r", "scripts/ok.sh", "3").returncode == 0
    again = job(tree, jobs, "start", "r", "scripts/ok.sh")
    assert again.returncode == 2
    assert "already running" in again.stderr
    assert job(tree, jobs, "wait", "r", "30").returncode == 0
    assert job(tree, jobs, "start", "r", "scripts/ok.sh").returncode == 0  # ended: may start again
    assert job(tree, jobs, "wait", "r", "30").returncode == 0
    for bad in ("../x", ".hidden", "a/b"):
        refused = job(tree, jobs, "start", bad, "scripts/ok.sh")
        assert refused.returncode == 2
        assert "plain name" in refused.stderr
    missing = job(tree, jobs, "start", "m", "scripts/nope.sh")
    assert missing.returncode == 2
    assert "no script" in missing.stderr
    assert job(tree, jobs, "wait", "r", "soon").returncode == 2
