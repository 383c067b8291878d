"""Commands typed as the docs show them (exit codes, one-line errors that name the key, no traceback, output printed
once) and the mechanisms behind what they got wrong."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "physreason", *args], capture_output=True, text=True, timeout=300, env=env, cwd=cwd
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


@pytest.mark.slow
@pytest.mark.cpu_only
def test_sft_under_torchrun_with_context_parallel_prints_its_summary_once(tmp_path, tiny_model_dir):
    from setups import free_port, run_torchrun, write_chat_records

    data = write_chat_records(tmp_path, 4)
    recipe = tmp_path / "recipe.toml"
    recipe.write_text("[train]\ntrain_batch_per_replica = 2\nmini_batch = 1\nmax_steps = 1\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = run_torchrun(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
         "-m", "physreason", "sft", "-c", str(recipe), "-m", str(tiny_model_dir), "--output-dir", str(tmp_path / "run"),
         "--set", f"data.dataset.name='{data}'", "--set", "data.num_workers=0", "--set", "policy.parallelism.cp_size=2"],
        env, clean=[tmp_path / "run"],
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("finished 1 steps") == 1 and done.stdout.count("checkpoint: ") == 1, done.stdout


@pytest.mark.parametrize("targets", [[-100, -100, -100], [5, -100, 7]], ids=["no-target", "targets"])
def test_the_sft_loss_is_fp32_whether_or_not_a_slice_has_targets(targets):
    # a context-parallel rank whose slice of the row holds only the prompt sums its loss with the others' (all-reduce)
    import torch

    from physreason.train.loss import cross_entropy_sum

    hidden = torch.randn(1, 3, 8, dtype=torch.bfloat16)  # [B, L, H]
    weight = torch.randn(16, 8, dtype=torch.bfloat16)  # [V, H]
    for chunk_size in (0, 1):
        assert cross_entropy_sum(hidden, weight, torch.tensor([targets]), chunk_size).dtype == torch.float32


def test_export_of_a_checkpoint_folder_points_at_its_run_and_step(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_3").mkdir(parents=True)
    (run / "config.toml").write_text("")
    done = run_cli("export", str(run / "checkpoints" / "step_3"), "--out", str(tmp_path / "out"))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip() == (
        f"error: {run / 'checkpoints' / 'step_3'} is inside the run {run}: give the run folder, "
        f"e.g. physreason export {run} --step 3 --out DIR"
    )
    assert not (tmp_path / "out").exists()


def test_option_order_is_refused_for_a_json_task_and_left_out_of_its_folder_under_all(tmp_path):
    done = run_cli("data", "synth", "--task", "grounding", "--option-order", "fixed", "--n", "1", "--out", str(tmp_path / "g"))
    assert done.returncode == 2 and not (tmp_path / "g").exists()
    assert done.stderr.strip() == "error: --option-order is for the letter tasks; grounding is answered in JSON and has no options"
    done = run_cli("data", "synth", "--task", "all", "--option-order", "fixed", "--n", "1", "--workers", "1", "--no-progress",
                   "--out", str(tmp_path / "all"))  # fmt: skip
    assert done.returncode == 0, done.stderr
    orders = {p.parent.name: json.loads(p.read_text())["option_order"] for p in (tmp_path / "all").glob("*/meta.json")}
    assert orders == {"arrow_of_time": "fixed", "spatial_puzzle": "fixed", "object_permanence": "fixed",
                      "grounding": "shuffled", "temporal_localization": "shuffled"}  # fmt: skip
