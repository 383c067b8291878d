"""bench/engine_throughput.py's --compare fp8 on CPU: the options, the seeded policy both engines get, the ratio table
and its JSON (the engines themselves run on a GPU: bench/PENDING.md)."""

from __future__ import annotations

import json

import pytest
import torch
from setups import load_bench


@pytest.fixture(scope="module")
def bench():
    return load_bench("engine_throughput")


def decode(quantization, batch, run, tok_per_s, tokens=256):
    return {"what": "decode", "quantization": quantization, "batch": batch, "run": run, "tokens": tokens,
            "tok_per_s": tok_per_s}  # fmt: skip


def test_one_row_per_batch_with_both_sides_runs_means_and_their_ratio(bench):
    rows = [decode("bf16", 256, 0, 9000.0, 65536), decode("bf16", 256, 1, 11000.0, 65536), decode("bf16", 1, 0, 190.0),
            decode("fp8", 256, 0, 14000.0, 65536), decode("fp8", 256, 1, 14000.0, 65536), decode("fp8", 1, 0, 200.0)]  # fmt: skip
    table = bench.ratio_rows(rows)
    assert [row["batch"] for row in table] == [1, 256]
    big = table[1]
    assert big["bf16_tok_per_s"] == [9000.0, 11000.0] and big["fp8_tok_per_s"] == [14000.0, 14000.0]
    assert (big["bf16_mean"], big["fp8_mean"], big["ratio"]) == (10000.0, 14000.0, 1.4)
    assert big["bf16_tokens"] == big["fp8_tokens"] == [65536, 65536]
    assert table[0]["ratio"] == pytest.approx(200 / 190, abs=1e-3)
    assert bench.ratio_line(big) == "batch 256: bf16 10,000 tok/s (9,000, 11,000) | fp8 14,000 tok/s (14,000, 14,000) | fp8/bf16 1.40x"


def test_a_side_that_measured_nothing_leaves_the_ratio_empty(bench):
    (row,) = bench.ratio_rows([decode("bf16", 64, 0, 6400.0)])
    assert (row["fp8_tok_per_s"], row["fp8_mean"], row["ratio"]) == ([], None, None)
    assert bench.ratio_line(row) == "batch 64: bf16 6,400 tok/s (6,400) | fp8 - | fp8/bf16 -"


def test_compare_runs_bf16_then_fp8_in_children_and_writes_the_ratio_json(bench, tmp_path, monkeypatch, capsys):
    commands = []

    def child(command):
        commands.append(command)
        quantization = command[command.index("--only") + 1]
        rows = command[command.index("--rows") + 1]
        if quantization == "fp8":
            return 1  # died before its first row
        rows_file = {"rows": [decode("bf16", 1, 0, 190.0), decode("bf16", 1, 1, 192.0)]}
        with open(rows, "w") as f:
            json.dump(rows_file, f)
        return 0

    monkeypatch.setattr(bench, "run_child", child)
    monkeypatch.setattr(bench, "make_folder", lambda folder, tokenizer, shape: folder)
    out = tmp_path / "fp8.json"
    bench.compare_fp8(tmp_path / "tok", tmp_path / "m", "qwen3-vl-8b", [1], 2, 0.5, out)
    assert [c[c.index("--only") + 1] for c in commands] == ["bf16", "fp8"]
    assert all(c[c.index("--shape") + 1] == "qwen3-vl-8b" and c[c.index("--gpu-memory") + 1] == "0.5" for c in commands)
    data = json.loads(out.read_text())
    assert data["shape"] == "qwen3-vl-8b" and data["failed"] == {"fp8": 1} and len(data["decode"]) == 2
    assert data["rows"] == [{"batch": 1, "bf16_tok_per_s": [190.0, 192.0], "bf16_tokens": [256, 256], "bf16_mean": 191.0,
                             "fp8_tok_per_s": [], "fp8_tokens": [], "fp8_mean": None, "ratio": None}]  # fmt: skip
    printed = capsys.readouterr().out
    assert printed.startswith("device: ") and "shape qwen3-vl-8b" in printed.splitlines()[0]
    assert "batch 1: bf16 191 tok/s (190, 192) | fp8 - | fp8/bf16 -" in printed


@pytest.mark.parametrize(
    "argv, message",
    [(["--runs", "0"], "--runs and --batches"), (["--batches", "64", "0"], "--runs and --batches"),
     (["--gpu-memory", "1.5"], "--gpu-memory 1.5"), (["--compare", "int4"], "--compare"), ([], "no tokenizer.json")],
)  # fmt: skip
def test_bad_options_exit_2_naming_the_option(bench, tmp_path, capsys, argv, message):
    folder = tmp_path / "tok"
    folder.mkdir()
    if message != "no tokenizer.json":
        (folder / "tokenizer.json").write_text("{}")
    with pytest.raises(SystemExit) as exit_:
        bench.main(["vllm", "--tokenizer", str(folder), "--compare", "fp8", *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_without_a_gpu_it_says_so_before_building_anything(bench, tmp_path, monkeypatch):
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="on a CUDA GPU and this machine has none"):
        bench.main(["vllm", "--tokenizer", str(tmp_path), "--compare", "fp8", "--folder", str(tmp_path / "m")])
    assert not (tmp_path / "m").exists()


def test_both_engines_get_the_same_seeded_policy_with_unit_norms(bench, tmp_path):
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 64}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    first, second = (dict(bench.policy_model(tmp_path, "cpu").named_parameters()) for _ in range(2))
    assert first.keys() == second.keys() and "model.embed_tokens.weight" in first
    for name, tensor in first.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, second[name]), name
        if name.endswith("norm.weight"):
            assert bool((tensor == 1).all()), name
        else:
            assert 0.01 < float(tensor.detach().float().std()) < 0.03, name
