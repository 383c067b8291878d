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


def decode(side, batch, run, tok_per_s, tokens=256):
    return {"what": "decode", "side": side, "batch": batch, "run": run, "tokens": tokens, "tok_per_s": tok_per_s}


def test_one_row_per_batch_with_the_three_sides_runs_means_and_each_fp8_sides_ratio(bench):
    rows = [decode("bf16", 256, 0, 9000.0, 65536), decode("bf16", 256, 1, 11000.0, 65536), decode("bf16", 1, 0, 190.0),
            decode("fp8", 256, 0, 14000.0, 65536), decode("fp8", 256, 1, 14000.0, 65536), decode("fp8", 1, 0, 200.0),
            decode("fp8_kv", 256, 0, 15000.0, 65536), decode("fp8_kv", 256, 1, 16000.0, 65536),
            decode("fp8_kv", 1, 0, 209.0)]  # fmt: skip
    table = bench.ratio_rows(rows)
    assert [row["batch"] for row in table] == [1, 256]
    big = table[1]
    assert big["bf16_tok_per_s"] == [9000.0, 11000.0] and big["fp8_tok_per_s"] == [14000.0, 14000.0]
    assert big["fp8_kv_tok_per_s"] == [15000.0, 16000.0] and big["fp8_kv_mean"] == 15500.0
    assert (big["bf16_mean"], big["fp8_mean"], big["ratio"], big["ratio_fp8_kv"]) == (10000.0, 14000.0, 1.4, 1.55)
    assert big["bf16_tokens"] == big["fp8_tokens"] == big["fp8_kv_tokens"] == [65536, 65536]
    assert table[0]["ratio"] == pytest.approx(200 / 190, abs=1e-3) and table[0]["ratio_fp8_kv"] == 1.1
    assert bench.ratio_line(big) == (
        "batch 256: bf16 10,000 tok/s (9,000, 11,000) | fp8 14,000 tok/s (14,000, 14,000) | "
        "fp8+kv8 15,500 tok/s (15,000, 16,000) | fp8/bf16 1.40x | fp8+kv8/bf16 1.55x"
    )


def test_a_side_that_measured_nothing_leaves_its_ratio_empty(bench):
    (row,) = bench.ratio_rows([decode("bf16", 64, 0, 6400.0), decode("fp8_kv", 64, 0, 9600.0)])
    assert (row["fp8_tok_per_s"], row["fp8_mean"], row["ratio"], row["ratio_fp8_kv"]) == ([], None, None, 1.5)
    assert bench.ratio_line(row) == "batch 64: bf16 6,400 tok/s (6,400) | fp8 - | fp8+kv8 9,600 tok/s (9,600) | fp8/bf16 - | fp8+kv8/bf16 1.50x"
    # two sides chosen with --sides: only theirs
    (two,) = bench.ratio_rows([decode("bf16", 64, 0, 6400.0), decode("fp8_kv", 64, 0, 9600.0)], ["bf16", "fp8_kv"])
    assert "fp8_mean" not in two and "ratio" not in two and two["ratio_fp8_kv"] == 1.5
    assert bench.ratio_line(two, ["bf16", "fp8_kv"]) == "batch 64: bf16 6,400 tok/s (6,400) | fp8+kv8 9,600 tok/s (9,600) | fp8+kv8/bf16 1.50x"


def test_engines_capture_cuda_graphs_for_the_measured_batches_and_the_powers_of_two_below(bench):
    assert bench.cudagraph_sizes([1, 64, 256]) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert bench.cudagraph_sizes([3, 100]) == [1, 2, 3, 4, 8, 16, 32, 64, 100]


def test_each_side_gets_its_weights_kv_cache_and_cuda_graph_sizes(bench):
    config, extra = bench.engine_options("bf16", [1, 4], 0.5)
    assert (config.kv_cache_dtype, config.gpu_memory_utilization) == ("auto", 0.5)
    assert extra == {"load_format": "dummy", "compilation_config": {"cudagraph_capture_sizes": [1, 2, 4]}}
    config, extra = bench.engine_options("fp8", [1, 4], 0.5)
    assert config.kv_cache_dtype == "auto" and extra["quantization"] == "fp8" and "load_format" not in extra
    config, extra = bench.engine_options("fp8_kv", [1, 4], 0.5, all_cudagraph_sizes=True)
    assert config.kv_cache_dtype == "fp8" and extra == {"quantization": "fp8"}


def test_compare_runs_the_three_sides_in_children_and_writes_the_ratio_json(bench, tmp_path, monkeypatch, capsys):
    commands = []

    def child(command):
        commands.append(command)
        side = command[command.index("--only") + 1]
        rows = command[command.index("--rows") + 1]
        if side == "fp8":
            return 1  # died before its first row
        speed = 190.0 if side == "bf16" else 380.0
        rows_file = {"rows": [decode(side, 1, 0, speed), decode(side, 1, 1, speed + 2)]}
        with open(rows, "w") as f:
            json.dump(rows_file, f)
        return 0

    monkeypatch.setattr(bench, "run_child", child)
    monkeypatch.setattr(bench, "make_folder", lambda folder, tokenizer, shape: folder)
    out = tmp_path / "fp8.json"
    bench.compare_fp8(tmp_path / "tok", tmp_path / "m", "qwen3-vl-8b", [1], 2, 0.5, out)
    assert [c[c.index("--only") + 1] for c in commands] == ["bf16", "fp8", "fp8_kv"]
    assert all(c[c.index("--shape") + 1] == "qwen3-vl-8b" and c[c.index("--gpu-memory") + 1] == "0.5" for c in commands)
    assert not any("--all-cudagraph-sizes" in c for c in commands)
    data = json.loads(out.read_text())
    assert data["shape"] == "qwen3-vl-8b" and data["failed"] == {"fp8": 1} and len(data["decode"]) == 4
    assert data["sides"]["fp8_kv"] == {"quantization": "fp8", "kv_cache_dtype": "fp8"} and data["cudagraph_sizes"] == [1]
    assert data["rows"] == [{"batch": 1, "bf16_tok_per_s": [190.0, 192.0], "bf16_tokens": [256, 256], "bf16_mean": 191.0,
                             "fp8_tok_per_s": [], "fp8_tokens": [], "fp8_mean": None,
                             "fp8_kv_tok_per_s": [380.0, 382.0], "fp8_kv_tokens": [256, 256], "fp8_kv_mean": 381.0,
                             "ratio": None, "ratio_fp8_kv": 1.995}]  # fmt: skip
    printed = capsys.readouterr().out
    assert printed.startswith("device: ") and "shape qwen3-vl-8b" in printed.splitlines()[0]
    assert "batch 1: bf16 191 tok/s (190, 192) | fp8 - | fp8+kv8 381 tok/s (380, 382) | fp8/bf16 - | fp8+kv8/bf16 2.00x" in printed
    commands.clear()
    bench.compare_fp8(tmp_path / "tok", tmp_path / "m", "qwen3-vl-8b", [1], 2, 0.5, out, ["fp8_kv"], True)
    assert [c[c.index("--only") + 1] for c in commands] == ["fp8_kv"] and "--all-cudagraph-sizes" in commands[0]


@pytest.mark.parametrize(
    "argv, message",
    [(["--runs", "0"], "--runs and --batches"), (["--batches", "64", "0"], "--runs and --batches"),
     (["--gpu-memory", "1.5"], "--gpu-memory 1.5"), (["--compare", "int4"], "--compare"), ([], "no tokenizer.json"),
     (["--sides", "bf16", "int4"], "--sides"), (["--sides", "fp8", "fp8"], "--sides fp8 fp8: name each side once")],
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
