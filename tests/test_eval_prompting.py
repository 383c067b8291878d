"""Eval's prompt style, reasoning mode and sampling: one source of truth, resolved from the checkpoint's family,
and written into every report's header."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from physreason.cli.eval_cmd import app
from physreason.config import load_config
from physreason.errors import ConfigError
from physreason.eval import collect_reports, markdown_report, resolve_eval_setup, settings_header
from physreason.eval.results import run_dir, write_run_info


def config_for(model, *overrides: str):
    return load_config(None, [f"model.model_name_or_path={json.dumps(str(model))}", *overrides])


def test_reason1_checkpoint_keeps_its_prompts_and_sampling(tiny_model_dirs):
    cfg = config_for(tiny_model_dirs["qwen2_5_vl"])
    setup = resolve_eval_setup(cfg)
    assert (setup.prompting.style, setup.prompting.reasoning, setup.answer_type) == ("reason1", True, "reasoning")
    assert setup.sampling == cfg.generation  # Reason1's defaults are the schema's: nothing changes
    letter = resolve_eval_setup(config_for(tiny_model_dirs["qwen2_5_vl"], "eval.answer_type='letter'"))
    assert (letter.prompting.reasoning, letter.answer_type) == (False, "letter")
    assert letter.sampling == cfg.generation


def test_reason2_checkpoint_takes_the_style_default_mode_and_its_sampling(tiny_model_dirs):
    model = tiny_model_dirs["qwen3_vl"]
    plain = resolve_eval_setup(config_for(model))
    assert (plain.prompting.style, plain.prompting.reasoning, plain.answer_type) == ("reason2", False, "letter")
    assert (plain.sampling.temperature, plain.sampling.presence_penalty, plain.sampling.seed) == (0.7, 1.5, 3407)
    # eval.answer_type alone sets the mode, and the sampling follows the mode.
    reasoning = resolve_eval_setup(config_for(model, "eval.answer_type='reasoning'"))
    assert (reasoning.prompting.reasoning, reasoning.answer_type) == (True, "reasoning")
    assert (reasoning.sampling.temperature, reasoning.sampling.presence_penalty) == (0.6, 0.0)
    # prompt.reasoning alone names the folder.
    assert resolve_eval_setup(config_for(model, "prompt.reasoning=true")).answer_type == "reasoning"
    assert resolve_eval_setup(config_for(model, "prompt.reasoning=true", "eval.answer_type='reasoning'")).answer_type == (
        "reasoning"
    )


def test_answer_type_and_reasoning_that_disagree_name_both_keys(tiny_model_dirs):
    cfg = config_for(tiny_model_dirs["qwen3_vl"], "prompt.reasoning=false", "eval.answer_type='reasoning'")
    with pytest.raises(ConfigError, match=r"eval.answer_type = 'reasoning' but prompt.reasoning = false"):
        resolve_eval_setup(cfg)


def test_eval_options_set_style_and_mode(tmp_path, tiny_model_dirs):
    args = ["--model", str(tiny_model_dirs["qwen3_vl"]), "--dataset", str(tmp_path / "none.jsonl"), "--no-progress"]
    conflict = CliRunner().invoke(app, [*args, "--answer-type", "reasoning", "--no-reasoning"])
    assert isinstance(conflict.exception, ConfigError)
    assert "prompt.reasoning = false" in str(conflict.exception)
    # --prompt-style and --no-reasoning reach the recipe: the folder and the recorded settings follow them.
    (tmp_path / "toy").mkdir()
    (tmp_path / "toy" / "toy_benchmark_qa_pairs.json").write_text("[]")
    options = ["--benchmark-root", str(tmp_path), "--dataset", "toy", "--results-dir", str(tmp_path / "r"),
               "--set", "engine.backend='hf'", "--set", "model.dtype='float32'"]
    result = CliRunner().invoke(app, [*args[:2], *options, "--prompt-style", "reason1", "--no-reasoning", "--no-progress"])
    assert result.exit_code == 0, result.output
    (info,) = (tmp_path / "r").rglob("run.json")
    assert info.parent.parent.parent.name == "letter"
    settings = json.loads(info.read_text())["settings"]
    assert (settings["prompt_style"], settings["reasoning"]) == ("reason1", False)


def test_header_names_what_a_reproduction_needs(tmp_path):
    base = tmp_path / "results" / "m" / "reasoning"
    settings = {
        "physreason_version": "0.1.0", "model": "nvidia/Cosmos-Reason1-7B", "model_revision": None,
        "model_commit": "abc123", "engine": "vllm", "prompt_style": "reason1", "reasoning": True,
        "system_prompt": None, "fps": 4.0, "nframes": None, "min_frames": 4, "max_frames": 768,
        "min_pixels": 100352, "max_pixels": 602112, "total_pixels": 6422528, "patch_factor": 28, "timestamps": False,
        "temperature": 0.6, "top_p": 0.95, "top_k": -1, "repetition_penalty": 1.05, "presence_penalty": 0.0,
        "frequency_penalty": 0.0, "max_tokens": 4096, "seed_rule": "eval.seed + repeat (replaces generation.seed)",
    }
    for seed in (1, 2):
        run = run_dir(base, "av", seed)
        run.mkdir(parents=True)
        (run / "results.jsonl").write_text(json.dumps({"id": "q0", "is_correct": True}) + "\n")
        write_run_info(run, {"dataset": "av", "seed": seed, "total": 1, "settings": settings | {"seed": seed}})
    header = dict(settings_header(collect_reports(tmp_path / "results")))
    assert header["model"] == "nvidia/Cosmos-Reason1-7B @ default branch (commit abc123)"
    assert header["prompt"] == "reason1, reasoning on"
    assert header["vision"] == (
        "fps 4.0, frames 4-768, pixels min 100352 / max 602112 / total 6422528 (patch factor 28)"
    )
    assert header["sampling"] == (
        "temperature 0.6, top_p 0.95, top_k -1, repetition 1.05, presence 0.0, frequency 0.0, max_tokens 4096"
    )
    assert header["seeds"] == "1,2 (eval.seed + repeat (replaces generation.seed))"
    assert header["physreason"] == "0.1.0"
    report = markdown_report(collect_reports(tmp_path / "results"))
    assert report.index("- sampling: temperature 0.6") < report.index("| model | answer type | dataset |")
    result = CliRunner().invoke(app, ["report", str(tmp_path / "results"), "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert "prompt: reason1, reasoning on" in result.output and "engine: vllm" in result.output


def test_results_without_recorded_settings_say_so(tmp_path):
    run = run_dir(tmp_path / "m" / "letter", "av", 1)
    run.mkdir(parents=True)
    (run / "results.jsonl").write_text(json.dumps({"id": "q0", "is_correct": False}) + "\n")
    assert settings_header(collect_reports(tmp_path)) == [
        ("settings", "not recorded (results written by hand or by an older physreason)")
    ]
