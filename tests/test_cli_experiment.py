"""`physreason experiment intuitive-physics|grounding`: the experiments' own options through the command, a tiny
resumable run of the data stage, tables joined through --combine, and the bench scripts that take the same arguments."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from physreason.cli import app

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def experiment(*args: str):
    return runner.invoke(app, ["experiment", *args])


@pytest.mark.parametrize(
    ("name", "first_line", "own_options"),
    [
        ("intuitive-physics", "Intuitive-physics table on a GPU", ("--option-order", "--grpo-name", "--sft-control")),
        ("grounding", "Grounding and temporal localization on a GPU", ("--variants", "--iou-hit-weight", "--tasks")),
    ],
)
def test_help_lists_the_experiments_own_options_under_the_commands_name(name, first_line, own_options):
    result = experiment(name, "--help")
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"usage: physreason experiment {name} ")
    assert first_line in result.output  # the experiment module's docstring, as the bench script showed it
    for option in ("--seeds", "--stop-after", "--out", "--combine", "--sft-steps", "--workers", *own_options):
        assert f" {option} " in result.output, option
    listing = experiment("--help")
    assert listing.exit_code == 0 and f"  {name} " in listing.output


def test_a_bad_option_is_refused_with_exit_code_2_naming_it():
    result = experiment("intuitive-physics", "--seeds", "1,1")
    assert result.exit_code == 2
    assert "physreason experiment intuitive-physics: error: argument --seeds: --seeds '1,1'" in result.output
    assert experiment("grounding", "--stop-after", "tower").exit_code == 2  # grounding has no tower stage to stop at


def test_a_tiny_data_stage_through_the_command_writes_every_record_file_and_a_rerun_reuses_the_clips(tmp_path):
    argv = ["intuitive-physics", "--train-per-task", "1", "--rl-per-task", "1", "--test-per-task", "1",
            "--workers", "1", "--stop-after", "data", "--out", str(tmp_path)]  # fmt: skip
    first = experiment(*argv)
    assert first.exit_code == 0, first.output
    data = tmp_path / "fixed" / "data"
    for records in ("train/sft.jsonl", "rl/rl.jsonl", "rl/grpo.jsonl", "rl/grpo-sft.jsonl"):
        assert len((data / records).read_text().splitlines()) == 3, records  # one clip of each letter task
    assert first.output.count("1 generated, 0 reused") == 9  # three tasks in each of the three clip sets
    again = experiment(*argv)
    assert again.exit_code == 0 and again.output.count("0 generated, 1 reused") == 9


def test_combine_through_the_command_writes_one_table_over_the_runs_seeds(tmp_path):
    for seed, score in ((1, 0.8), (2, 0.9)):
        run = {"seed": seed, "table": {"after SFT": {"arrow_of_time": score}}}
        (tmp_path / f"s{seed}.json").write_text(json.dumps({"device": "NVIDIA H100 80GB HBM3", "per_seed": [run]}))
    result = experiment("intuitive-physics", "--combine", str(tmp_path / "s1.json"), str(tmp_path / "s2.json"))
    assert result.exit_code == 0, result.output
    text = (tmp_path / "intuitive_physics-combined.md").read_text()
    assert "- seeds: 1, 2" in text and "| after SFT | 85.0 ± 7.1 [80.0-90.0] | - | - |" in text
    summary = json.loads((tmp_path / "intuitive_physics-combined.json").read_text())["summary"]
    assert summary["after SFT"]["arrow_of_time"]["n"] == 2


@pytest.mark.parametrize(
    ("argv0", "expected"),
    [
        ("/venv/bin/physreason", "physreason experiment grounding --seeds '1 2'"),
        (str(ROOT / "physreason" / "__main__.py"), "physreason experiment grounding --seeds '1 2'"),
        ("tools/run.py", "python tools/run.py experiment grounding --seeds '1 2'"),
    ],
)
def test_the_tables_command_line_is_the_one_to_type_again(monkeypatch, argv0, expected):
    from physreason.experiments.common import command_line

    monkeypatch.setattr(sys, "argv", [argv0, "experiment", "grounding", "--seeds", "1 2"])
    assert command_line() == expected


@pytest.mark.parametrize("module", ["tower", "probe"])
def test_the_helpers_run_as_the_docs_say(module):
    # docs/experiments.md: python -m physreason.experiments.tower / .probe (the bench wrappers are gone)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", f"physreason.experiments.{module}", "--help"], capture_output=True, text=True, env=env,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.startswith(f"usage: {module}.py ") and "--workers" in done.stdout
