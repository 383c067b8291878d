"""`physreason sft` as a person types it: bad data refused up front, reruns refused until resumed, trusted resumes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from physreason.models.tiny import save_tiny_model

ANSWER = "<think>\nthe ball falls\n</think>\n\n<answer>\nyes\n</answer>"
RECIPE = Path(__file__).resolve().parent.parent / "configs" / "sft_tiny.toml"


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory) -> Path:
    return save_tiny_model("qwen2_5_vl", tmp_path_factory.mktemp("tiny_vl"))


def conversation(i: int) -> dict:
    return {"conversations": [{"role": "user", "content": f"Does the box slide {i}?"},
                              {"role": "assistant", "content": ANSWER}]}


def run_sft_cli(model: Path, data: Path, out: Path, *overrides: str) -> subprocess.CompletedProcess:
    sets = [f"model.model_name_or_path={model}", f"data.dataset.name={data}", f"train.output_dir={out}",
            "data.val_fraction=0", *overrides]
    command = [sys.executable, "-m", "physreason", "sft", "--config", str(RECIPE)]
    for item in sets:
        command += [item] if item.startswith("--") else ["--set", item]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("bad_line", ['["a", "list"]', '"a string"', "3", "null"])
def test_jsonl_line_that_is_not_an_object_is_named_by_file_and_line(tiny_vl, tmp_path, bad_line):
    data = tmp_path / "train.jsonl"
    lines = [json.dumps(conversation(i)) for i in range(8)]
    lines.insert(3, bad_line)  # line 4 of the file
    data.write_text("\n".join(lines) + "\n")
    result = run_sft_cli(tiny_vl, data, tmp_path / "out", "train.max_steps=1")
    assert result.returncode == 2, result.stderr
    assert f"{data}:4 is a JSON" in result.stderr and "not an object" in result.stderr
    assert "Traceback" not in result.stderr and "do not fill one batch" not in result.stderr


def test_parquet_data_file_trains(tiny_vl, tmp_path):
    datasets = pytest.importorskip("datasets")
    data = tmp_path / "train.parquet"
    datasets.Dataset.from_list([conversation(i) for i in range(8)]).to_parquet(str(data))
    result = run_sft_cli(tiny_vl, data, tmp_path / "out", "train.max_steps=1", "train.ckpt.enable_checkpoint=false",
                         "train.ckpt.export_safetensors=false")
    assert result.returncode == 0, result.stderr
    assert "finished 1 steps" in result.stdout


def test_file_that_is_not_parquet_is_refused_with_its_name(tiny_vl, tmp_path):
    data = tmp_path / "train.parquet"
    data.write_text("not parquet\n")
    result = run_sft_cli(tiny_vl, data, tmp_path / "out", "train.max_steps=1")
    assert result.returncode == 2, result.stderr
    assert f"{data} cannot be read as parquet" in result.stderr and "Traceback" not in result.stderr


def metric_steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_rerun_into_a_run_folder_is_refused_until_resumed_and_exports_are_rotated(tiny_vl, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(conversation(i)) + "\n" for i in range(8)))
    out = tmp_path / "run"
    keep = ("train.ckpt.save_freq=1", "train.ckpt.max_keep=2", "train.log_freq=1", "train.validation_freq=100")
    first = run_sft_cli(tiny_vl, data, out, "train.max_steps=3", *keep)
    assert first.returncode == 0, first.stderr
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_2", "step_3", "written.json"]
    exports = sorted(p.name for p in (out / "safetensors").iterdir())
    assert exports == ["step_2", "step_3", "written.json"]  # max_keep rotates exports; the record lists the run's own
    assert "torch.distributed is disabled" not in first.stderr  # DCP's single-process warning
    assert metric_steps(out) == [1, 2, 3]

    again = run_sft_cli(tiny_vl, data, out, "train.max_steps=3", *keep)
    assert again.returncode == 2, again.stderr
    assert "already holds checkpoints of an earlier run (step_2, step_3)" in again.stderr
    assert "train.resume=true" in again.stderr and "new or empty folder" in again.stderr
    assert "Traceback" not in again.stderr
    assert metric_steps(out) == [1, 2, 3]  # nothing appended

    shutil.copytree(out / "safetensors" / "step_2", out / "safetensors" / "step_1")  # a copy of the user's
    resumed = run_sft_cli(tiny_vl, data, out, "train.max_steps=4", "train.resume=true", *keep)
    assert resumed.returncode == 0, resumed.stderr
    assert metric_steps(out) == [1, 2, 3, 4]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_3", "step_4", "written.json"]
    assert sorted(json.loads((out / "checkpoints" / "written.json").read_text())) == ["step_3", "step_4"]
    # rotation deleted the run's own step_2 export, never the step_1 copied in
    assert sorted(p.name for p in (out / "safetensors").iterdir()) == ["step_1", "step_3", "step_4", "written.json"]

    elsewhere = f"train.resume={out / 'checkpoints' / 'step_4'}"
    refused = run_sft_cli(tiny_vl, data, tmp_path / "other", "train.max_steps=5", elsewhere)
    assert refused.returncode == 2, refused.stderr
    assert "outside train.output_dir" in refused.stderr and "--trust-checkpoint" in refused.stderr
    assert not (tmp_path / "other" / "logs").exists()
    trusted = run_sft_cli(tiny_vl, data, tmp_path / "other", "train.max_steps=5", elsewhere, "--trust-checkpoint")
    assert trusted.returncode == 0, trusted.stderr
    assert "finished 1 steps" in trusted.stdout


def test_help_says_resuming_loads_pickle_and_names_the_trust_flag():
    for command in ("sft", "grpo"):
        result = subprocess.run([sys.executable, "-m", "physreason", command, "--help"], capture_output=True, text=True,
                                timeout=300)
        assert result.returncode == 0
        assert "pickle" in result.stdout and "--trust-checkpoint" in result.stdout


def test_bad_media_paths_are_all_reported_by_file_line_before_training(tiny_vl, tmp_path):
    from media import write_clip

    write_clip(tmp_path / "clips" / "ok.mp4")
    records = [{**conversation(i), "video": "clips/ok.mp4"} for i in range(10)]
    records[6]["video"] = "clips/missing.mp4"  # line 7
    records[8]["video"] = "../outside.mp4"  # line 9
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    result = run_sft_cli(tiny_vl, data, tmp_path / "out", "train.max_steps=1", "data.val_fraction=0.2")
    assert result.returncode == 2, result.stderr
    assert "2 of 10 SFT records cannot be used" in result.stderr  # one check over the train and held-out splits
    assert f"{data}:7: media file" in result.stderr and "missing.mp4 does not exist" in result.stderr
    assert f"{data}:9: media path '../outside.mp4' leads outside the data folder" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out" / "logs").exists()  # refused before the model was built or a step ran


def test_a_log_shows_one_metrics_line_per_log_freq_and_progress_lines_not_a_bar(tiny_vl, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(conversation(i)) + "\n" for i in range(8)))
    result = run_sft_cli(tiny_vl, data, tmp_path / "out", "train.max_steps=3", "train.ckpt.enable_checkpoint=false",
                         "train.ckpt.export_safetensors=false", "train.validation_freq=100")
    assert result.returncode == 0, result.stderr
    output = result.stdout + result.stderr
    metric_lines = [line for line in output.splitlines() if "physreason.train.metrics: step" in line]
    assert [line.split(": step ")[1].split()[0] for line in metric_lines] == ["3"]  # log_freq 10: the last step only
    assert "sft: 3/3 (100%)" in output and "\r" not in output  # the bar became a plain line
    assert metric_steps(tmp_path / "out") == [3]


def _wait_for_metrics(out: Path, steps: int, process: subprocess.Popen) -> None:
    import time

    # Generous bound: start-up on a loaded machine can take a minute; it only costs time when the test fails.
    deadline = time.monotonic() + 240
    metrics = out / "logs" / "metrics.jsonl"
    while time.monotonic() < deadline and process.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= steps:
            return
        time.sleep(0.2)


def _stop(command: list[str], out: Path, steps: int, signum: int) -> tuple[int, str, str]:
    import os

    env = {**os.environ, "PYTHONPATH": str(RECIPE.parent.parent)}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        _wait_for_metrics(out, steps, process)
        process.send_signal(signum)
        stdout, stderr = process.communicate(timeout=240)
    finally:
        if process.poll() is None:  # never leave a 5,000-step run behind after a failure
            process.kill()
            process.wait()
    return process.returncode, stdout, stderr


def _resume_command(stderr: str) -> list[str]:
    import shlex

    line = stderr.split("Resume with:")[1].strip().splitlines()[0]
    words = shlex.split(line)
    assert words[0] == "physreason"
    return [sys.executable, "-m", "physreason", *words[1:]]


def _long_run(tiny_vl, tmp_path, *settings: str) -> tuple[list[str], Path]:
    """(`physreason sft` command, its output folder): 5,000 steps on 8 records, a metric line a step, for a signal to
    stop; `settings` are more --set key=value."""
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(conversation(i)) + "\n" for i in range(8)))
    out = tmp_path / "run"
    command = [sys.executable, "-m", "physreason", "sft", "--config", str(RECIPE), "-m", str(tiny_vl),
               "--output-dir", str(out), "--set", f"data.dataset.name={data}", "--set", "data.val_fraction=0",
               "--set", "train.max_steps=5000", "--set", "train.log_freq=1"]  # fmt: skip
    for setting in settings:
        command += ["--set", setting]
    return command, out


@pytest.mark.slow
def test_ctrl_c_saves_a_checkpoint_and_prints_a_resume_command_that_works_and_sigterm_does_too(tiny_vl, tmp_path):
    import signal

    # save_freq far beyond the stop: without the save on a signal, no checkpoint would exist.
    command, out = _long_run(tiny_vl, tmp_path, "train.ckpt.save_freq=4000")
    code, _, stderr = _stop(command, out, 2, signal.SIGINT)
    assert code == 130, stderr
    (checkpoint,) = (p for p in (out / "checkpoints").iterdir() if p.is_dir())  # beside the written.json record
    stopped = int(checkpoint.name.removeprefix("step_"))
    assert f"SIGINT: stopped after step {stopped}, checkpoint saved to {checkpoint}" in stderr
    assert "Traceback" not in stderr and metric_steps(out) == list(range(1, stopped + 1))

    resume = _resume_command(stderr)
    assert resume[-2:] == ["--set", "train.resume=true"]
    code, _, stderr = _stop(resume, out, stopped + 2, signal.SIGTERM)
    assert code == 130, stderr
    assert "already holds checkpoints" not in stderr and f"resumed from {checkpoint} at step {stopped}" in stderr
    last = max(int(p.name.removeprefix("step_")) for p in (out / "checkpoints").glob("step_*"))
    assert last > stopped and f"SIGTERM: stopped after step {last}" in stderr
    assert metric_steps(out) == list(range(1, last + 1))  # one record per step: the resumed run continued the file
    assert _resume_command(stderr) == resume  # the same command continues again (no second resume key added)


@pytest.mark.slow
def test_sigterm_to_the_process_group_with_loader_workers_finishes_the_step_and_exits_130(tiny_vl, tmp_path):
    # As GNU timeout stops a command: SIGTERM to the trainer, then to its whole process group (loader workers too).
    import os
    import signal
    import time

    command, out = _long_run(tiny_vl, tmp_path, "data.num_workers=2", "train.ckpt.enable_checkpoint=false")
    # three threads: two of them loader workers (physreason.cpu keeps one for the trainer)
    env = {**os.environ, "PYTHONPATH": str(RECIPE.parent.parent), "PHYSREASON_CPU_THREADS": "3"}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                               start_new_session=True)  # fmt: skip
    try:
        _wait_for_metrics(out, 2, process)
        assert process.poll() is None, process.communicate()[1]
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        os.killpg(process.pid, signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 130, stderr
    assert took < 30, f"{took:.0f} s from SIGTERM to exit"
    assert stderr.count("SIGTERM: stopping after this step (checkpoints are off) (SIGTERM again stops at once") == 1
    assert "SIGTERM: stopped after step" in stderr and "Traceback" not in stderr and "killed by signal" not in stderr
    deadline = time.monotonic() + 10  # no worker outlives the trainer (the resource tracker leaves when it sees it go)
    while time.monotonic() < deadline:
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        pytest.fail("a process of the run's group is still there 10 s after the trainer exited")


def test_resuming_a_finished_run_says_nothing_to_do(tiny_vl, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(conversation(i)) + "\n" for i in range(8)))
    out = tmp_path / "run"
    sets = ("train.max_steps=1", "train.ckpt.export_safetensors=false")
    assert run_sft_cli(tiny_vl, data, out, *sets).returncode == 0
    again = run_sft_cli(tiny_vl, data, out, *sets, "train.resume=true")
    assert again.returncode == 0, again.stderr
    assert "nothing to do: the run already finished at" in again.stdout and "step_1" in again.stdout
    assert "1/1" not in again.stderr and "? left" not in again.stderr + again.stdout


def test_start_up_summary_names_samples_steps_batch_and_trainable_parameters(tiny_vl, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(conversation(i)) + "\n" for i in range(8)))
    result = run_sft_cli(tiny_vl, data, tmp_path / "out", "train.max_steps=2", "train.ckpt.enable_checkpoint=false",
                         "train.ckpt.export_safetensors=false")
    assert result.returncode == 0, result.stderr
    summary = result.stderr.split("***** Running SFT *****")[1]
    for line in ("Num examples                                 = 8", "Total optimization steps                     = 2",
                 "Effective batch (samples per optimizer step) = 4", "Gradient accumulation steps                  = 2"):
        assert line in summary
    assert "Trainable parameters" in summary and "(100.00%)" in summary


def test_a_resume_with_other_data_or_learning_rate_is_refused_unless_allowed_and_keeps_the_old_config(tiny_vl, tmp_path):
    import tomllib

    data, other = tmp_path / "train.jsonl", tmp_path / "other.jsonl"
    data.write_text("".join(json.dumps(conversation(i)) + "\n" for i in range(8)))
    other.write_text(data.read_text())
    out = tmp_path / "run"
    sets = ("train.max_steps=1", "train.ckpt.export_safetensors=false")
    assert run_sft_cli(tiny_vl, data, out, *sets).returncode == 0
    first = (out / "config.toml").read_text()
    changed = run_sft_cli(tiny_vl, other, out, *sets, "train.resume=true", "train.optm_lr=5e-4")
    assert changed.returncode == 2, changed.stderr
    assert "has other data.dataset.name, train.optm_lr; resuming would" in changed.stderr
    assert "--set train.resume_allow_changes=true" in changed.stderr and "Traceback" not in changed.stderr
    assert (out / "config.toml").read_text() == first
    allowed = run_sft_cli(tiny_vl, other, out, *sets, "train.resume=true", "train.optm_lr=5e-4",
                          "train.resume_allow_changes=true")
    assert allowed.returncode == 0, allowed.stderr
    assert "resuming with changed data.dataset.name, train.optm_lr" in allowed.stderr
    assert (out / "config.before-resume-1.toml").read_text() == first
    assert tomllib.loads((out / "config.toml").read_text())["train"]["optm_lr"] == 5e-4
