"""bench/fp8.py on CPU: the SFT rows at tiny size as a person runs them, and the one-line refusals where a machine
cannot run a measurement (no GPU, no float8 tensor cores, no torchao, no vLLM, no tokenizer)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
        assert row["tokens_per_s"] == pytest.approx(32 / row["seconds_per_step"], rel=1e-3)
    assert rows[0]["vs_bf16"] == 1.0
    assert rows[1]["vs_bf16"] == pytest.approx(rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"], abs=1e-3)


def test_sft_without_a_gpu_is_refused_at_once_unless_tiny(fp8, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="compute capability 8.9 or more .* --tiny checks the script on CPU"):
        fp8.main(["sft"])
    fp8.require_sft_support(tiny=True)  # torchao's float8 runs on CPU at tiny size


def test_sft_on_a_gpu_without_float8_tensor_cores_names_the_gpu(fp8, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(SystemExit, match="A100-SXM4-80GB is 8.0"):
        fp8.main(["sft"])


def test_sft_without_torchao_says_how_to_install_it(fp8, monkeypatch):
    real = fp8.importlib.util.find_spec
    monkeypatch.setattr(fp8.importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    with pytest.raises(SystemExit, match=r"needs torchao.*physreason\[fp8\]"):
        fp8.main(["sft", "--tiny"])


def test_decode_refuses_a_folder_without_tokenizer_files_then_a_machine_without_a_gpu(fp8, tmp_path, monkeypatch):
    with pytest.raises(SystemExit, match="no tokenizer.json or tokenizer_config.json"):
        fp8.main(["decode", "--tokenizer", str(tmp_path)])
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="on a CUDA GPU and this machine has none"):
        fp8.main(["decode", "--tokenizer", str(tmp_path)])


@pytest.mark.parametrize(
    "argv, message",
    [(["sft", "--recipes", "rowwise,mxfp8"], "--recipes"), (["decode", "--tokenizer", "t", "--steps", "2"], "unknown options")],
)  # fmt: skip
def test_bad_options_are_refused_with_the_option_named(fp8, capsys, argv, message):
    with pytest.raises(SystemExit):
        fp8.main(argv)
    assert message in capsys.readouterr().err


def test_both_engines_get_the_same_seeded_weights_with_unit_norms(fp8, tmp_path):
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 64}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    first, second = dict(fp8.random_weights(tmp_path, "cpu")), dict(fp8.random_weights(tmp_path, "cpu"))
    assert first.keys() == second.keys() and "model.embed_tokens.weight" in first
    for name, tensor in first.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, second[name]), name
        if name.endswith("norm.weight"):
            assert bool((tensor == 1).all()), name
        else:
            assert 0.01 < float(tensor.float().std()) < 0.03, name
