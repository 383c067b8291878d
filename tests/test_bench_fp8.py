"""bench/fp8.py on CPU: the SFT rows and the loss curve at tiny size as a person runs them, the curve's PNG read back
pixel by pixel, and the one-line refusals where a machine cannot run a measurement (no GPU, no float8 tensor cores, no
torchao, no vLLM, no tokenizer)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from setups import free_port, load_bench

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def fp8():
    return load_bench("fp8")


@pytest.mark.slow
def test_tiny_sft_prints_a_bf16_row_and_a_float8_row_with_the_options_passed_through(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port())}
    command = [sys.executable, str(ROOT / "bench" / "fp8.py"), "sft", "--tiny", "--layers", "1", "--recipes", "rowwise",
               "--", "--seq-len", "32", "--steps", "1", "--warmup", "0"]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines[0]["what"] == "device" and lines[0]["options"] == ["--seq-len", "32", "--steps", "1", "--warmup", "0"]
    shapes = load_bench("shapes")
    config = shapes.qwen25_vl_3b(True)
    config.text_config.num_hidden_layers = 1  # --layers reaches the model the rows train
    flops = 32 * shapes.train_flops_per_token(config, 32)
    rows = [line for line in lines if line["what"] == "sft"]
    assert [r["float8"] for r in rows] == ["none", "rowwise"]
    for row in rows:
        assert "error" not in row, row
        assert row["tokens_per_step"] == 32 and row["flops_per_step"] == flops and row["seconds_per_step"] > 0
        # The row rounds every float to 4 decimals: seconds_per_step (0.0420 s) by up to 5e-5 s, far more than 0.1%
        # of a fast step; tokens_per_s by up to 5e-5, which moves 32 / tokens_per_s by about 32 * 5e-5 / tokens_per_s².
        # Compare the seconds the printed throughput stands for with the printed seconds, within those two roundings.
        tokens = row["tokens_per_s"]
        assert abs(32 / tokens - row["seconds_per_step"]) <= 5e-5 + 1.01 * 32 * 5e-5 / tokens**2
    assert rows[0]["vs_bf16"] == 1.0
    # vs_bf16 is the unrounded ratio rounded to 3 decimals (up to 5e-4 off), the printed throughputs each 5e-5 off
    ratio = rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"]
    slack = 5e-4 + 1.01 * ratio * 5e-5 * (1 / rows[0]["tokens_per_s"] + 1 / rows[1]["tokens_per_s"])
    assert abs(rows[1]["vs_bf16"] - ratio) <= slack


@pytest.mark.parametrize("command", ["sft", "curve"])
def test_float8_training_without_a_gpu_is_refused_at_once_unless_tiny(fp8, monkeypatch, tmp_path, command):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match=f"fp8.py {command} .*compute capability 8.9 or more .* --tiny checks the script"):
        fp8.main([command, *(["--out", str(tmp_path)] if command == "curve" else [])])
    assert not any(tmp_path.iterdir())  # refused before any clip or model was written
    fp8.require_float8_support(command, tiny=True)  # torchao's float8 runs on CPU at tiny size


@pytest.mark.parametrize("command", ["sft", "curve"])
def test_float8_training_on_a_gpu_without_float8_tensor_cores_names_the_gpu(fp8, monkeypatch, command):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(SystemExit, match=f"fp8.py {command} needs float8 tensor cores .* A100-SXM4-80GB is 8.0"):
        fp8.main([command])


@pytest.mark.parametrize("command", ["sft", "curve"])
def test_float8_training_without_torchao_says_how_to_install_it(fp8, monkeypatch, command):
    real = fp8.importlib.util.find_spec
    monkeypatch.setattr(fp8.importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    with pytest.raises(SystemExit, match=rf"fp8.py {command} needs torchao.*physreason\[fp8\]"):
        fp8.main([command, "--tiny"])


def test_decode_refuses_a_folder_without_tokenizer_files_then_a_machine_without_a_gpu(fp8, tmp_path, monkeypatch):
    with pytest.raises(SystemExit, match="no tokenizer.json or tokenizer_config.json"):
        fp8.main(["decode", "--tokenizer", str(tmp_path)])
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="on a CUDA GPU and this machine has none"):
        fp8.main(["decode", "--tokenizer", str(tmp_path)])


@pytest.mark.parametrize(
    "argv, message",
    [(["sft", "--recipes", "rowwise,mxfp8"], "--recipes"), (["decode", "--tokenizer", "t", "--steps", "2"], "unknown options"),
     (["curve", "--recipe", "mxfp8"], "--recipe"), (["curve", "--", "--chunked-ce"], "unknown options for curve"),
     (["curve", "--steps", "0"], "--steps")],
)  # fmt: skip
def test_bad_options_are_refused_with_the_option_named(fp8, capsys, argv, message):
    with pytest.raises(SystemExit):
        fp8.main(argv)
    assert message in capsys.readouterr().err


def test_losses_are_compared_over_the_steps_both_runs_logged(fp8):
    bf16 = {1: 2.0, 2: 1.5, 3: 1.0, 4: 0.8}
    summary = fp8.compare_losses(bf16, {1: 2.1, 2: 1.4, 3: 1.3, 4: 0.9}, window=2)
    assert summary["bf16"] == {"steps": 4, "final_step": 4, "final_loss": 0.8, "mean_loss_last": pytest.approx(0.9)}
    assert summary["float8"]["final_loss"] == 0.9 and summary["float8"]["mean_loss_last"] == pytest.approx(1.1)
    assert summary["mean_abs_diff_last"] == pytest.approx(0.2)  # (0.3 + 0.1) / 2 over steps 3 and 4
    assert (summary["max_abs_diff"], summary["max_abs_diff_step"]) == (pytest.approx(0.3), 3)
    # a float8 run that diverged after step 2: its own last step, the differences over the two shared steps
    stopped = fp8.compare_losses(bf16, {1: 2.0, 2: 1.7}, window=50)
    assert stopped["float8"]["final_step"] == 2 and stopped["bf16"]["final_step"] == 4
    assert (stopped["shared_steps"], stopped["window"], stopped["max_abs_diff_step"]) == (2, 2, 2)
    with pytest.raises(SystemExit, match="no common step"):
        fp8.compare_losses(bf16, {7: 1.0})


# matplotlib's first two colours: the bf16 run's and the float8 run's curves
BF16_RGB, FLOAT8_RGB = (31, 119, 180), (255, 127, 14)


def coloured_columns(png: bytes, rgb: tuple[int, int, int], rows: slice, band: int = 20) -> float:
    """The fraction of the image's bands of `band` columns with a pixel of colour `rgb` (within 30 per channel) among
    `rows`: a line drawn over every step reaches nearly all bands, even where another line covers it but for the gaps
    of its dashes; a dot and its legend sample reach two or three."""
    import numpy as np
    from PIL import Image

    with Image.open(io.BytesIO(png)) as image:
        pixels = np.asarray(image.convert("RGB"), dtype=int)[rows]  # [rows, width, 3]
    near = (np.abs(pixels - np.array(rgb)) <= 30).all(axis=-1).any(axis=0)  # [width]
    bands = near[: len(near) // band * band].reshape(-1, band).any(axis=1)  # [width // band]
    return float(bands.mean())


def loss_panel(png: bytes) -> slice:
    """The rows of the curve PNG's loss panel: its upper half (the learning-rate panel below draws one shared line)."""
    from PIL import Image

    with Image.open(io.BytesIO(png)) as image:
        return slice(0, image.size[1] // 2)


def png_bytes(figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=120)
    return buffer.getvalue()


def test_the_curve_png_draws_both_runs_as_lines_over_every_step_not_dots(fp8):
    def run(offset: float, steps: range) -> dict:
        return {"train/loss": [(s, 3.0 / s + offset) for s in steps], "train/lr": [(s, 1e-4) for s in steps]}

    png = png_bytes(fp8.curve_figure({"bf16": run(0.0, range(1, 201)), "float8-rowwise": run(0.01, range(1, 201))}, "t"))
    top = loss_panel(png)
    # both lines cross the panel's whole width (about 80% of the image's), the bf16 one under the float8 dashes
    assert coloured_columns(png, BF16_RGB, top) > 0.6 and coloured_columns(png, FLOAT8_RGB, top) > 0.6
    # the check tells a dot from a line: one logged step leaves a marker and the legend's sample, no line
    dots = png_bytes(fp8.curve_figure({"bf16": run(0.0, range(1, 2)), "float8-rowwise": run(0.5, range(1, 2))}, "t"))
    assert coloured_columns(dots, BF16_RGB, top) < 0.15 and coloured_columns(dots, FLOAT8_RGB, top) < 0.15


@pytest.mark.slow
def test_tiny_curve_trains_bf16_and_float8_on_the_same_data_and_draws_both(fp8, tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path / "OUT"))
    (tmp_path / "OUT").mkdir()
    fp8.main(["curve", "--tiny", "--steps", "5", "--out", str(tmp_path / "work")])
    work = tmp_path / "work"
    runs = {name: work / f"sft-{name}" for name in ("bf16", "float8-rowwise")}
    configs = {name: tomllib.loads((folder / "config.toml").read_text()) for name, folder in runs.items()}
    assert [c["train"]["fp8"]["enable_fp8"] for c in configs.values()] == [False, True]
    for config in configs.values():  # the same recipe otherwise: data, model, seed, bf16 compute
        assert config["train"]["param_dtype"] == "bfloat16" and config["train"]["max_steps"] == 5
    drop_fp8 = [{**c["train"], "fp8": None, "output_dir": None} for c in configs.values()]
    assert drop_fp8[0] == drop_fp8[1]
    assert configs["bf16"]["data"] == configs["float8-rowwise"]["data"]
    assert configs["bf16"]["model"] == configs["float8-rowwise"]["model"]
    losses = {}
    for name, folder in runs.items():
        rows = [json.loads(line) for line in (folder / "logs" / "metrics.jsonl").read_text().splitlines()]
        losses[name] = {row["step"]: row["train/loss"] for row in rows}
        assert sorted(losses[name]) == [1, 2, 3, 4, 5]
    bf16, float8 = losses["bf16"], losses["float8-rowwise"]
    differences = [abs(float8[s] - bf16[s]) for s in range(1, 6)]
    assert max(differences) > 0  # float8 casts did run: the losses are not bf16's
    assert max(differences) < 0.1 * bf16[1]  # and they track bf16's from the same start
    payload = json.loads((work / "fp8_curve.json").read_text())
    summary = payload["summary"]
    assert summary["bf16"]["final_loss"] == bf16[5] and summary["float8"]["final_loss"] == float8[5]
    assert summary["window"] == 5 and summary["mean_abs_diff_last"] == pytest.approx(sum(differences) / 5)
    assert summary["max_abs_diff"] == pytest.approx(max(differences))
    assert [run["matmuls"] for run in payload["runs"]] == ["bf16", "float8, emulated on CPU"]
    markdown = (work / "fp8_curve.md").read_text()
    assert "| bf16 | bf16 | 5 |" in markdown and "| float8-rowwise | float8, emulated on CPU | 5 |" in markdown
    for name in ("fp8_curve.json", "fp8_curve.md", "fp8_curve.png"):  # what a GPU lease brings back
        assert (tmp_path / "OUT" / name).read_bytes() == (work / name).read_bytes()
    png = (work / "fp8_curve.png").read_bytes()
    top = loss_panel(png)
    assert coloured_columns(png, BF16_RGB, top) > 0.6 and coloured_columns(png, FLOAT8_RGB, top) > 0.6


def test_a_float8_run_that_diverges_is_recorded_with_its_last_step_and_still_compared(fp8, tmp_path, monkeypatch):
    import argparse

    import physreason.train.sft as sft
    from physreason.errors import TrainingDiverged

    def diverging_sft(config):  # logs two steps, then stops as run_sft does on a non-finite loss
        logs = Path(config.train.output_dir, "logs")
        logs.mkdir(parents=True)
        (logs / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "train/loss": 2.0 / s}) + "\n" for s in (1, 2)))
        raise TrainingDiverged("step 3: the loss is nan")

    monkeypatch.setattr(sft, "run_sft", diverging_sft)
    args = argparse.Namespace(steps=4, batch=2, lr=3e-4, warmup=None, scale=1, train_per_task=None, workers=1,
                              tiny=True, out=tmp_path)  # fmt: skip
    run = fp8.curve_run(fp8.curve_recipe(args), tmp_path / "model", 0, "rowwise")
    assert run["run"] == "float8-rowwise" and run["error"] == "step 3: the loss is nan"
    summary = fp8.compare_losses({1: 2.0, 2: 1.0, 3: 0.7, 4: 0.6}, {1: 2.0, 2: 1.0})
    bf16_run = {"run": "bf16", "matmuls": "bf16", "s": 1.0, "error": None}
    markdown = fp8.curve_markdown(["- device: cpu"], [bf16_run, run], summary, "rowwise")
    assert "| float8-rowwise (diverged after step 2) |" in markdown and "| bf16 | bf16 | 4 |" in markdown
