"""Commands typed as the docs show them: exit codes, one-line errors that name the key, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "physreason", *args], capture_output=True, text=True, timeout=120, env=env, cwd=cwd
    )


def test_a_table_override_written_as_json_is_read_as_a_table():
    # docs/grounding.md writes the reward table as JSON; TOML's inline table works too
    for value in ('{"localization": 1.0, "json_format": 0.2}', "{localization = 1.0, json_format = 0.2}"):
        done = run_cli("config", "show", str(ROOT / "configs" / "grpo_tiny.toml"), "--set", f"grpo.reward_function={value}")
        assert done.returncode == 0, done.stderr
        table = done.stdout.split("[grpo.reward_function]\n", 1)[1].split("\n\n", 1)[0]
        assert table.splitlines() == ["localization = 1.0", "json_format = 0.2"]


def test_grpo_refuses_a_bad_reward_before_loading_the_model(tmp_path):
    recipe = str(ROOT / "configs" / "grpo_tiny.toml")
    # the model folder does not exist: the reward error must come first, before anything is loaded
    cases = [
        (["--set", "grpo.reward_function={localisation = 1.0}"], "error: grpo.reward_function: Unknown reward 'localisation'"),
        (["--set", "grpo.reward_function={localization = 1.0}", "--set", "grpo.reward_options.localization.hit_threshold=0"],
         "error: grpo.reward_options.localization: IoU reward option hit_threshold = 0.0: give a value in (0, 1]"),
    ]
    for extra, message in cases:
        done = run_cli("grpo", "-c", recipe, "-m", "./no-model", "--output-dir", "run", *extra, cwd=tmp_path)
        assert done.returncode == 2, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(message), done.stderr
        assert "Traceback" not in done.stderr and not (tmp_path / "run").exists()
