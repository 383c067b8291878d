"""`physreason sft` as a person types it: bad data files are refused up front with the file and line named."""

from __future__ import annotations

import json
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
        command += ["--set", item]
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
