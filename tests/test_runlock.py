"""One training run at a time in a train.output_dir (physreason.train.runlock): a second run is refused while the
first holds the folder, a killed run never locks it, and a run's entry point lets go of it when it ends."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from setups import lock_holder

from physreason.errors import ConfigError
from physreason.train import runlock

pytestmark = pytest.mark.timeout(120)


def _recipe(out: Path, tmp_path: Path):
    from physreason.config import load_config

    data = tmp_path / "train.jsonl"
    data.write_text("{}\n")
    return load_config(None, [f"model.model_name_or_path='{tmp_path}'", f"data.dataset.name='{data}'",
                              f"train.output_dir='{out}'"])  # fmt: skip


def test_a_second_run_is_refused_while_another_holds_the_folder_and_a_killed_one_never_locks_it(tmp_path):
    from physreason.train.loop import prepare_output

    out = tmp_path / "run"
    out.mkdir()
    holder = lock_holder(out)
    try:
        with pytest.raises(ConfigError, match=rf"train.output_dir {out} is in use by another run \(pid {holder.pid} on "):
            prepare_output(_recipe(out, tmp_path))
        assert not (out / "config.toml").exists()  # refused before anything was written
    finally:
        holder.kill()  # as kill -9: the process ends without a word
        holder.wait()
    assert prepare_output(_recipe(out, tmp_path)) == out  # the kernel let go with the process
    assert (out / "config.toml").is_file()
    assert f"pid {os.getpid()} on " in (out / runlock.LOCK_NAME).read_text()


def test_a_run_lets_go_of_its_folder_when_it_ends_even_by_an_error(tmp_path):
    from physreason.train.loop import prepare_output

    out = tmp_path / "run"

    @runlock.releases_output_lock
    def failing_run():
        prepare_output(_recipe(out, tmp_path))
        prepare_output(_recipe(out, tmp_path))  # again in the same process (a resume in-process): still its own
        assert (out / runlock.LOCK_NAME).resolve() in runlock._HELD
        raise RuntimeError("the run failed")

    with pytest.raises(RuntimeError, match="the run failed"):
        failing_run()
    assert (out / runlock.LOCK_NAME).resolve() not in runlock._HELD
    holder = lock_holder(out)  # another process may take the folder now
    holder.kill()
    holder.wait()


def test_a_folder_that_cannot_be_locked_runs_unprotected_with_a_warning(tmp_path, monkeypatch, caplog):
    import fcntl

    def no_locks(*args):
        raise OSError(38, "Function not implemented")  # ENOLCK/ENOSYS on a mount without locks

    monkeypatch.setattr(fcntl, "lockf", no_locks)
    assert runlock.lock_output(tmp_path) is False
    assert "nothing stops a second run" in caplog.text
    assert (tmp_path / runlock.LOCK_NAME).resolve() not in runlock._HELD


def test_a_second_infer_into_the_same_out_is_refused_before_it_reads_or_writes(tmp_path):
    from physreason.config import SamplingConfig, VisionConfig
    from physreason.infer import run_batch

    (tmp_path / "requests.jsonl").write_text('{"id": "a", "question": "Is it falling?"}\n')
    out = tmp_path / "answers" / "out.jsonl"
    out.parent.mkdir()

    def no_engine():
        raise AssertionError("the refused run built an engine")

    holder = lock_holder(out.parent / ".out.jsonl.lock")
    try:
        with pytest.raises(ConfigError, match=rf"--out {out} is in use by another run \(pid {holder.pid} on "):
            run_batch(no_engine, tmp_path / "requests.jsonl", out, sampling=SamplingConfig(), vision=VisionConfig(),
                      show_progress=False)  # fmt: skip
        assert not out.exists()
    finally:
        holder.kill()
        holder.wait()
    assert not runlock._HELD  # nothing left held by the refused run


def test_a_lock_file_that_is_a_link_is_refused_and_its_target_left_as_it_was(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / runlock.LOCK_NAME).symlink_to(victim)
    with pytest.raises(ConfigError, match=r"\.physreason\.lock is a symbolic link, and a run lock is written: delete"):
        runlock.lock_output(run)
    assert victim.read_text() == "precious\n"
    (run / runlock.LOCK_NAME).unlink()
    assert runlock.lock_output(run)  # a plain file in its place: held
    try:
        assert (run / runlock.LOCK_NAME).read_text().startswith(f"pid {os.getpid()} on ")
    finally:
        runlock.release_output(run)


_TRY_LOCK = """
import sys
from pathlib import Path
from physreason.errors import ConfigError
from physreason.train.runlock import lock_file
try:
    lock_file(Path(sys.argv[1]), "the folder", "by the test")
    print("held")
except ConfigError as exc:
    print(f"refused: {exc}")
"""


def _lock_in_another_process(path: Path) -> str:
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _TRY_LOCK, str(path)], capture_output=True, text=True, env=env,
                          timeout=60, check=True)  # fmt: skip
    return done.stdout.strip()


def test_a_lock_file_deleted_between_its_open_and_its_lock_is_not_the_one_held(tmp_path, monkeypatch):
    import fcntl

    lock = tmp_path / ".out.lock"
    real, calls = fcntl.lockf, []

    def lockf(handle, *args):
        if not calls:  # the last holder deletes the file after this process opened it, before it locks it
            lock.unlink()
        calls.append(handle)
        return real(handle, *args)

    monkeypatch.setattr(fcntl, "lockf", lockf)
    assert runlock.lock_file(lock, "the folder", "by the test")
    monkeypatch.undo()
    try:
        assert len(calls) == 2  # the deleted file was let go of and the file now at the path locked
        held = os.fstat(runlock._HELD[runlock._key(lock)].fileno())
        assert held.st_nlink == 1 and held.st_ino == os.stat(lock).st_ino
        assert _lock_in_another_process(lock).startswith("refused: the folder is in use by another run (pid ")
    finally:
        runlock.release_file(lock)
    assert _lock_in_another_process(lock) == "held"


def test_a_lock_file_deleted_every_time_it_is_locked_is_a_clear_error_after_a_few_tries(tmp_path, monkeypatch):
    import fcntl

    lock = tmp_path / ".out.lock"
    real, calls = fcntl.lockf, []

    def lockf(handle, *args):
        calls.append(handle)
        lock.unlink()
        return real(handle, *args)

    monkeypatch.setattr(fcntl, "lockf", lockf)
    with pytest.raises(ConfigError, match=r"the folder cannot be locked: its lock file .*\.out\.lock was deleted or "
                                          r"replaced each of 10 times it was locked"):  # fmt: skip
        runlock.lock_file(lock, "the folder", "by the test")
    assert len(calls) == 10 and all(handle.closed for handle in calls)
    assert not runlock._HELD


def test_a_lock_held_for_a_moment_is_waited_for_up_to_wait_s(tmp_path):
    import threading
    import time

    lock = tmp_path / ".choice.lock"
    holder = lock_holder(lock)
    try:
        started = time.monotonic()
        with pytest.raises(runlock.LockHeld, match=rf"the choice is in use by another run \(pid {holder.pid} "):
            runlock.lock_file(lock, "the choice", "by the test", wait_s=0.3)
        assert time.monotonic() - started >= 0.3  # tried again until wait_s had passed
        assert not runlock._HELD
        threading.Timer(0.5, holder.kill).start()  # the holder lets go while this one waits
        with runlock.holding(lock, "the choice", "by the test", wait_s=30):
            assert runlock._key(lock) in runlock._HELD
    finally:
        holder.kill()
        holder.wait()
    assert not runlock._HELD
