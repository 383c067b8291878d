"""The command line: help, version, and errors without tracebacks."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

import physreason
from physreason.cli import app

runner = CliRunner()


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "physreason", *args], capture_output=True, text=True, timeout=300)


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and physreason.__version__ in result.output


def test_help_lists_commands():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ("config", "models"):
        assert command in result.output


def test_every_command_has_help():
    import typer.main

    group = typer.main.get_command(app)
    for name, command in group.commands.items():
        result = runner.invoke(app, [name, "--help"])
        assert result.exit_code == 0, name
        assert command.help, f"{name} has no help text"


def test_config_error_exits_2_with_one_clear_line(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\noptim_lr = 1\n")
    result = run_cli("config", "check", str(bad))
    assert result.returncode == 2
    assert "train.optim_lr: unknown key" in result.stderr
    assert "Traceback" not in result.stderr


def test_models_tiny_writes_loadable_folder(tmp_path):
    result = run_cli("models", "tiny", str(tmp_path / "m"), "--kind", "qwen3")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "m" / "model.safetensors").is_file()
    assert run_cli("models", "tiny", str(tmp_path / "x"), "--kind", "llama").returncode == 2


def test_models_tiny_refuses_to_overwrite_a_model_folder_unless_asked(tmp_path):
    assert run_cli("models", "tiny", str(tmp_path / "m")).returncode == 0
    before = (tmp_path / "m" / "config.json").read_text()
    refused = run_cli("models", "tiny", "--kind", "qwen3-vl", str(tmp_path / "m"))
    assert refused.returncode == 2 and "already holds a model" in refused.stderr and "--overwrite" in refused.stderr
    assert (tmp_path / "m" / "config.json").read_text() == before
    replaced = run_cli("models", "tiny", "--kind", "qwen3-vl", str(tmp_path / "m"), "--overwrite")
    assert replaced.returncode == 0, replaced.stderr
    assert '"qwen3_vl"' in (tmp_path / "m" / "config.json").read_text()


@pytest.mark.parametrize(
    "args",
    [
        ("infer", "--no-such-flag"),
        ("sft", "--no-such-flag"),
        ("eval", "report"),
        ("config", "show", "a.toml", "b.toml"),
    ],
)
def test_usage_error_prints_short_message_and_exits_2(args):
    result = run_cli(*args)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert "Error:" in result.stderr and f"physreason {args[0]}" in result.stderr


def _sigint_as_in_a_terminal() -> None:
    # A command started in the background by a non-interactive shell (`.ci/run &`) inherits SIGINT ignored, and
    # Python then installs no KeyboardInterrupt handler; a person's Ctrl-C reaches a foreground process.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_exits_130_with_a_message(tmp_path):
    out = tmp_path / "synth"
    command = [sys.executable, "-m", "physreason", "data", "synth", "--out", str(out), "--n", "100000", "--workers", "1",
               "--no-progress"]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_sigint_as_in_a_terminal
    )
    try:
        records = out / "arrow_of_time" / "records"
        # Generous bounds: on a loaded CI machine start-up alone can take a minute; they only cost time on failure.
        deadline = time.monotonic() + 180
        while not (records.is_dir() and any(records.iterdir())) and time.monotonic() < deadline:
            time.sleep(0.1)
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=180)
    finally:
        if process.poll() is None:  # never leave a 100,000-sample generator running after a failure
            process.kill()
            process.wait()
    assert process.returncode == 130, stderr
    assert "interrupted" in stderr and "Traceback" not in stderr


def test_models_tiny_vision_model_warns_nothing_about_torchvision(tmp_path):
    result = run_cli("models", "tiny", str(tmp_path / "vl"))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "vl" / "preprocessor_config.json").is_file()
    assert "torchvision" not in result.stderr


def test_a_model_folder_with_its_own_code_is_refused_naming_physreason_s_setting(tmp_path):
    import json

    from physreason.models.tiny import save_tiny_model

    folder = save_tiny_model("qwen3", tmp_path / "custom")
    config = json.loads((folder / "config.json").read_text())
    config |= {"model_type": "mystery_lm", "architectures": ["MysteryForCausalLM"],
               "auto_map": {"AutoConfig": "configuration_mystery.MysteryConfig"}}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "configuration_mystery.py").write_text("raise SystemExit('custom code ran')\n")
    (tmp_path / "d.jsonl").write_text(json.dumps({"conversations": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}) + "\n")
    (tmp_path / "sft.toml").write_text(
        f"[model]\nmodel_name_or_path = '{folder}'\n[data.dataset]\nname = '{tmp_path / 'd.jsonl'}'\n"
        f"[train]\noutput_dir = '{tmp_path / 'out'}'\n"
    )
    result = run_cli("sft", "-c", str(tmp_path / "sft.toml"))
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "custom code ran" not in result.stderr
    error = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "model.trust_remote_code = true" in error[0] and "trust_remote_code=True" not in error[0]


def test_models_tiny_overwrite_replaces_only_a_tiny_model_it_wrote(tmp_path):
    other = tmp_path / "real"  # a model folder of someone else's (a download, an export)
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "qwen2_5_vl"}')
    for flag in ("--overwrite", "--force"):
        refused = run_cli("models", "tiny", str(other), flag)
        assert refused.returncode == 2 and "physreason-tiny.json" in refused.stderr, refused.stderr
    assert sorted(p.name for p in other.iterdir()) == ["config.json"]
    assert run_cli("models", "tiny", str(tmp_path / "m")).returncode == 0
    assert run_cli("models", "tiny", str(tmp_path / "m"), "--force").returncode == 0  # the older name
