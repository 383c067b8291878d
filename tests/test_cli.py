"""The command line: help, version, and errors without tracebacks."""

from __future__ import annotations

import subprocess
import sys

from typer.testing import CliRunner

import physreason
from physreason.cli import app

runner = CliRunner()


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "physreason", *args], capture_output=True, text=True, timeout=120)


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
