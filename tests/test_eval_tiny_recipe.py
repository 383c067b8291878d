"""configs/eval_tiny.toml runs as its header says, in a fresh folder, after `physreason data synth`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

RECIPE = Path(__file__).resolve().parent.parent / "configs" / "eval_tiny.toml"


def run_in(folder: Path, *args: str) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "physreason", *args], cwd=folder, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, f"physreason {' '.join(args)}:\n{result.stderr}"
    return result


@pytest.mark.slow
def test_eval_tiny_recipe_runs_on_data_synth_output(tmp_path):
    header = [line[1:].strip() for line in RECIPE.read_text().splitlines() if line.startswith("#   physreason ")]
    assert header[1].startswith("physreason data synth") and header[2] == "physreason eval --config configs/eval_tiny.toml"
    run_in(tmp_path, "models", "tiny", "./tiny-vl")
    synth = header[1].split()[1:]
    synth[synth.index("--n") + 1] = "1"  # one clip per task keeps the test short; the layout is the same
    run_in(tmp_path, *synth, "--no-progress")
    run_in(tmp_path, "eval", "--config", str(RECIPE), "--set", "eval.num_repeats=1", "--set", "generation.max_tokens=4")
    report = run_in(tmp_path, "eval", "report", "./results-tiny")
    table = (tmp_path / "results-tiny" / "report.csv").read_text()
    for task in ("arrow_of_time", "spatial_puzzle", "object_permanence"):
        assert task in table
    assert "report.csv" in report.stdout
