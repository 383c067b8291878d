"""One flag name per meaning across subcommands (vLLM/TRL names), readable help, config keys with suggestions."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "80"}
    return subprocess.run(
        [sys.executable, "-m", "physreason", *args], capture_output=True, text=True, timeout=300, env=env, cwd=cwd
    )


def all_commands() -> list[list[str]]:
    import typer.main

    from physreason.cli import app

    found = []

    def walk(command, path):
        found.append(path)
        for name, sub in getattr(command, "commands", {}).items():
            walk(sub, [*path, name])

    walk(typer.main.get_command(app), [])
    return found


def test_help_of_every_command_has_no_python_types_and_breaks_no_word():
    for path in all_commands():
        result = run_cli(*path, "--help")
        assert result.returncode == 0, path
        assert "list[" not in result.stdout, (path, result.stdout)
        for line in result.stdout.splitlines():
            assert not re.search(r"<[A-Za-z_]\w*$", line.rstrip()), (path, line)  # `<answer_t` + `ype>` wrapped


@pytest.mark.parametrize("command", ["infer", "serve", "eval"])
def test_tensor_parallel_flags_are_the_same_everywhere(command):
    result = run_cli(command, "--help")
    assert "--tensor-parallel-size" in result.stdout and "--tp " in result.stdout
    assert "--tp-size" not in result.stdout


def test_serve_takes_tp(tmp_path, tiny_model_dir):
    result = run_cli("serve", "-m", str(tiny_model_dir), "--tp", "2", "--print-command", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "--tensor-parallel-size 2" in result.stdout


def test_eval_tp_sets_the_engines_size(tmp_path):
    result = run_cli("eval", "--tp", "2", "--num-gpus", "1", cwd=tmp_path)
    assert result.returncode == 2 and "num_gpus (1) must be a multiple of tp_size (2)" in result.stderr


def test_infer_v_is_not_video():
    result = run_cli("infer", "-v", "clip.mp4", "-q", "x")
    assert result.returncode == 2 and "No such option: -v" in result.stderr
    assert "-v," not in run_cli("infer", "--help").stdout


@pytest.mark.parametrize("command", ["sft", "grpo"])
def test_training_takes_model_and_output_dir(tmp_path, command):
    recipe = ROOT / "configs" / f"{command}_tiny.toml"
    result = run_cli(command, "-c", str(recipe), "-m", "./no-model", "--output-dir", "chosen", cwd=tmp_path)
    assert result.returncode == 2 and "'./no-model': no such folder" in result.stderr
    written = tomllib.loads((tmp_path / "chosen" / "config.toml").read_text())
    assert written["model"]["model_name_or_path"] == "./no-model" and written["train"]["output_dir"] == "chosen"


@pytest.mark.parametrize(
    ("key", "hint"),
    [
        ("train.learning_rate", "did you mean train.optm_lr?"),
        ("rollout.num_generations", "did you mean rollout.n_generation?"),
        ("generation.temprature", "did you mean generation.temperature?"),
    ],
)
def test_unknown_config_key_suggests_the_one_meant(key, hint):
    result = run_cli("config", "show", "--set", f"{key}=1")
    assert result.returncode == 2 and f"{key}: unknown key ({hint})" in result.stderr


def test_every_option_of_infer_and_serve_sets_a_key_the_recipe_has():
    from physreason.cli.recipe_options import RECIPE_KEYS, recipe_values
    from physreason.config import Config

    defaults = Config().model_dump()
    for key in RECIPE_KEYS.values():
        section, field = key.split(".")
        assert field in defaults[section], key
    # only given options count, and a path goes in as its text
    assert recipe_values({"lora": Path("adapter"), "fps": None, "host": "0.0.0.0", "top_k": 0}) == {
        "engine.lora": "adapter",
        "generation.top_k": 0,
    }


class Ran(Exception):
    """Raised by a stand-in trainer or evaluator with the recipe the command built, so nothing runs."""

    def __init__(self, cfg) -> None:
        super().__init__("ran")
        self.cfg = cfg


def invoke(monkeypatch, target: str, *args: str):
    """Run `physreason ARGS` in this process with `target` (module:function) replaced; the recipe it was given."""
    import importlib

    from typer.testing import CliRunner

    from physreason.cli.app import app

    module, name = target.split(":")

    def stand_in(cfg, *a, **k):
        raise Ran(cfg)

    monkeypatch.setattr(importlib.import_module(module), name, stand_in)
    result = CliRunner().invoke(app, list(args))
    if isinstance(result.exception, Ran):
        return result.exception.cfg
    return result


@pytest.mark.parametrize("command, target", [("sft", "physreason.train.sft:run_sft"),
                                             ("grpo", "physreason.train.grpo:run_grpo")])  # fmt: skip
def test_train_commands_take_out_and_still_take_output_dir(monkeypatch, tmp_path, command, target):
    recipe = str(ROOT / "configs" / "sft_tiny.toml")
    for flag in ("--out", "--output-dir"):
        cfg = invoke(monkeypatch, target, command, "-c", recipe, flag, str(tmp_path / flag))
        assert cfg.train.output_dir == str(tmp_path / flag)
    both = invoke(monkeypatch, target, command, "-c", recipe, "--out", "a", "--output-dir", "b")
    assert both.exit_code == 2 and "--out and --output-dir name the same output" in both.output
    same = invoke(monkeypatch, target, command, "-c", recipe, "--out", "a", "--output-dir", "a")
    assert same.train.output_dir == "a"


def test_eval_takes_out_and_still_takes_results_dir(monkeypatch, tmp_path):
    for flag in ("--out", "--results-dir", "--output-dir"):
        cfg = invoke(monkeypatch, "physreason.eval:run_eval", "eval", "-m", "some/model", flag, str(tmp_path / flag))
        assert cfg.eval.results_dir == str(tmp_path / flag)


def test_data_synth_takes_out_or_output_dir_and_needs_one(tmp_path):
    done = run_cli("data", "synth", "--task", "arrow_of_time", "--n", "1", "--workers", "1", "--no-progress",
                   "--output-dir", str(tmp_path / "clips"))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "clips" / "arrow_of_time").is_dir()
    missing = run_cli("data", "synth", "--task", "arrow_of_time")
    assert missing.returncode == 2 and "--out" in missing.stderr and "Traceback" not in missing.stderr


def test_help_shows_one_name_per_meaning():
    from typer.testing import CliRunner

    from physreason.cli.app import app

    def shown(*path: str) -> str:
        return CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "200"}).output

    for path in (["sft"], ["grpo"], ["eval"], ["export"], ["data", "synth"], ["infer"]):
        text = shown(*path)
        assert "--out " in text, path
        assert "--output-dir" not in text and "--results-dir" not in text and "--force" not in text, path
    for path in (["export"], ["infer"], ["models", "tiny"]):
        assert "--overwrite" in shown(*path), path


def test_plan_takes_model_as_the_other_commands_do(tiny_model_dir, tmp_path):
    recipe = str(ROOT / "configs" / "sft_tiny.toml")
    for flag in ("-m", "--model"):
        done = run_cli("plan", recipe, flag, str(tiny_model_dir), cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(f"{tiny_model_dir}: "), done.stdout
