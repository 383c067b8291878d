"""The GRPO loop on tiny models: it learns a trivial task, resumes exactly, pushes weights, and runs from the CLI."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from setups import grpo_recipe
from typer.testing import CliRunner

from physreason.config import SamplingConfig, load_config
from physreason.engines import GenerationRequest
from physreason.engines.hf import HFEngine
from physreason.train.checkpoint import checkpoint_dirs
from physreason.train.grpo import groups_per_rank, run_grpo

REPO = Path(__file__).resolve().parents[1]


def grpo_config(model: Path, data: Path, out: Path, *extra: str):
    return grpo_recipe(model, data, out, "train.gradient_checkpointing=false", "train.ckpt.export_safetensors=false",
                       "logging.logger=['jsonl', 'tensorboard']", "train.log_freq=1", *extra, lr="2e-2")  # fmt: skip


@pytest.mark.slow
def test_grpo_raises_the_mean_reward_on_a_trivial_task(tiny_text, mcq_file, tmp_path):
    result = run_grpo(grpo_config(tiny_text, mcq_file, tmp_path, "train.max_steps=12", "train.ckpt.enable_checkpoint=false"))
    first, last = sum(result.rewards[:3]) / 3, sum(result.rewards[-3:]) / 3
    assert last > first + 0.4, result.rewards
    logged = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in logged] == list(range(1, 13))
    for key in ("reward/test_mentions_b_mean", "reward/accuracy_std", "rollout/format_rate", "policy/entropy",
                "policy/clip_frac_high", "rollout/logprob_mismatch", "time/generate_s", "time/sync_s"):
        assert key in logged[-1]
    assert logged[0]["rollout/logprob_mismatch"] < 1e-4  # engine and policy agree before any update
    assert any((tmp_path / "logs" / "tensorboard").rglob("events.*"))


@pytest.mark.slow
@pytest.mark.parametrize("save_mode", ["sync", "async"])
def test_resume_continues_the_reward_curve_exactly(tiny_text, mcq_file, tmp_path, save_mode):
    extra = ("train.max_steps=4", "grpo.mu_iterations=2", "train.sync_weight_interval=2",
             f"train.ckpt.save_mode={save_mode}")
    straight = run_grpo(grpo_config(tiny_text, mcq_file, tmp_path / "a", *extra, "train.ckpt.save_freq=100"))
    saved = run_grpo(grpo_config(tiny_text, mcq_file, tmp_path / "b", *extra, "train.ckpt.save_freq=2"))
    assert saved.rewards == straight.rewards
    assert [p.name for p in checkpoint_dirs(tmp_path / "b")] == ["step_2", "step_4"]
    step_2 = tmp_path / "b" / "checkpoints" / "step_2"
    resumed = run_grpo(grpo_config(tiny_text, mcq_file, tmp_path / "c", *extra, f"train.resume='{step_2}'",
                                  "train.trust_checkpoint=true"))
    assert len(resumed.rewards) == 2
    assert resumed.rewards == straight.rewards[2:]
    assert [m["loss"] for m in resumed.metrics] == [m["loss"] for m in straight.metrics[2:]]


def greedy_answer(engine: HFEngine) -> list[int]:
    request = GenerationRequest(messages=[{"role": "user", "content": "Which way does ball 1 go?"}])
    (result,) = engine.generate([request], SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_tokens=8))
    return result.completions[0].token_ids


@pytest.mark.slow
def test_weights_reach_the_engine_only_at_the_sync_interval(tiny_text, mcq_file, tmp_path):
    config = grpo_config(tiny_text, mcq_file, tmp_path / "a", "train.max_steps=1", "train.sync_weight_interval=2",
                         "train.ckpt.enable_checkpoint=false", "train.optm_lr=0.2")
    engine = HFEngine(config.model, config.engine)  # the recipe's engine, built here to look at it before and after
    before = greedy_answer(engine)
    lm_head = engine.model.lm_head.weight.detach().clone()
    run_grpo(config, engine=engine)
    assert torch.equal(engine.model.lm_head.weight, lm_head)  # one step < interval: nothing pushed
    config.train.sync_weight_interval = 1
    config.train.output_dir = str(tmp_path / "b")
    run_grpo(config, engine=engine)
    assert not torch.equal(engine.model.lm_head.weight, lm_head)
    assert greedy_answer(engine) != before


def test_recipes_load_and_fill_whole_prompt_groups():
    for name in ("grpo-cosmos-reason1-7b.toml", "grpo_tiny.toml"):
        config = load_config(REPO / "configs" / name)
        groups = groups_per_rank(config, dp_size=1)
        assert groups * config.rollout.n_generation == config.train.train_batch_per_replica
        assert config.policy_temperature == config.rollout.sampling_config.temperature


@pytest.mark.slow
def test_grpo_command_runs_a_recipe_and_writes_checkpoint_and_export(tiny_text, mcq_file, tmp_path):
    import typer

    from physreason.cli.grpo_cmd import grpo

    app = typer.Typer()
    app.command("grpo")(grpo)
    app.command("other")(lambda: None)  # two commands, so typer keeps the subcommand name
    overrides = [f"model.model_name_or_path='{tiny_text}'", f"data.dataset.name='{mcq_file}'",
                 f"train.output_dir='{tmp_path}'", "train.max_steps=2", "train.ckpt.save_freq=2",
                 "rollout.max_response_length=4", "logging.logger=['jsonl']"]
    args = ["grpo", "--config", str(REPO / "configs" / "grpo_tiny.toml")]
    for item in overrides:
        args += ["--set", item]
    outcome = CliRunner().invoke(app, args)
    assert outcome.exit_code == 0, outcome.output
    assert "finished 2 steps" in outcome.output
    assert (tmp_path / "checkpoints" / "step_2" / ".metadata").is_file()
    assert (tmp_path / "safetensors" / "step_2" / "config.json").is_file()


def test_ignore_eos_fills_every_completion_and_the_prompt_length_is_logged(tiny_text, mcq_file, tmp_path):
    from physreason.config import DatasetConfig
    from physreason.data.mcq import load_mcq_prompts
    from physreason.models import loading

    config = grpo_config(
        tiny_text, mcq_file, tmp_path, "train.max_steps=1", "train.ckpt.enable_checkpoint=false",
        "rollout.sampling_config.ignore_eos=true", "grpo.shuffle_options=false",
    )
    (metrics,) = run_grpo(config).metrics
    assert metrics["rollout/response_length_mean"] == 6.0 and metrics["rollout/truncated_frac"] == 1.0
    tokenizer = loading.load_tokenizer(config.model)
    texts = [
        tokenizer.apply_chat_template(p.messages("grpo"), tokenize=False, add_generation_prompt=True)
        for p in load_mcq_prompts(DatasetConfig(name=str(mcq_file)))
    ]
    lengths = {len(ids) for ids in tokenizer(texts, add_special_tokens=False).input_ids}
    assert min(lengths) <= metrics["rollout/prompt_length_mean"] <= max(lengths)


def test_packed_token_sized_micro_batches_train_like_padded_ones(tiny_text, mcq_file, tmp_path, monkeypatch):
    import physreason.train.grpo as grpo_module

    shapes = []  # (samples, rows, tokens) of every policy batch
    build = grpo_module.build_micro_batches

    def recorded(*args, **kwargs):
        batches = build(*args, **kwargs)
        shapes.append([(len(b.advantages), b.model_batch.input_ids.shape[0], b.num_tokens) for b in batches])
        return batches

    monkeypatch.setattr(grpo_module, "build_micro_batches", recorded)
    runs = []
    for name, extra in (("padded", ("grpo.pack_completions=false",)), ("packed", ("grpo.mini_batch_tokens=200",))):
        config = grpo_config(tiny_text, mcq_file, tmp_path / name, "train.max_steps=2",
                             "train.ckpt.enable_checkpoint=false", *extra)
        runs.append(run_grpo(config))
    padded, packed = runs
    assert shapes[0] == shapes[1] and all(rows == samples == 8 for samples, rows, _ in shapes[0])
    assert all(rows == 1 and samples == 8 and tokens <= 200 for step in shapes[2:] for samples, rows, tokens in step)
    assert packed.rewards == padded.rewards  # same rollouts: the first update moved the weights alike
    for step_padded, step_packed in zip(padded.metrics, packed.metrics, strict=True):
        for key in ("loss", "policy/grad_norm", "policy/entropy", "rollout/logprob_mismatch"):
            assert step_packed[key] == pytest.approx(step_padded[key], rel=1e-4, abs=1e-6), key


@pytest.mark.slow
def test_grpo_rerun_into_its_run_folder_is_refused_until_resumed(tiny_text, mcq_file, tmp_path):
    def grpo_cli(*extra: str) -> subprocess.CompletedProcess:
        sets = [f"model.model_name_or_path='{tiny_text}'", f"data.dataset.name='{mcq_file}'",
                f"train.output_dir='{tmp_path}'", "train.ckpt.save_freq=1", "train.log_freq=1",
                "rollout.max_response_length=4", "logging.logger=['jsonl']", "train.ckpt.export_safetensors=false",
                *extra]
        command = [sys.executable, "-m", "physreason", "grpo", "--config", str(REPO / "configs" / "grpo_tiny.toml")]
        for item in sets:
            command += ["--set", item]
        return subprocess.run(command, capture_output=True, text=True, timeout=600)

    def steps() -> list[int]:
        return [json.loads(line)["step"] for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]

    assert grpo_cli("train.max_steps=1").returncode == 0
    again = grpo_cli("train.max_steps=1")
    assert again.returncode == 2 and "Traceback" not in again.stderr
    assert "already holds checkpoints of an earlier run (step_1)" in again.stderr and "train.resume=true" in again.stderr
    assert steps() == [1]
    resumed = grpo_cli("train.max_steps=2", "train.resume=true")
    assert resumed.returncode == 0, resumed.stderr
    assert steps() == [1, 2]


def test_sigterm_mid_run_saves_that_step_resumes_from_it_and_says_nothing_to_do_at_the_end(
    tiny_text, mcq_file, tmp_path, monkeypatch
):
    import os
    import signal

    from physreason.train import grpo as grpo_module
    from physreason.train.loop import TrainingInterrupted

    real = grpo_module.collect_rollouts
    calls = []

    def rollouts_then_sigterm(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # a scheduler's SIGTERM arrives while step 2 generates
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(grpo_module, "collect_rollouts", rollouts_then_sigterm)
    extra = ("train.max_steps=3", "train.ckpt.save_freq=100")
    with pytest.raises(TrainingInterrupted) as stopped:
        run_grpo(grpo_config(tiny_text, mcq_file, tmp_path, *extra))
    assert stopped.value.step == 2 and stopped.value.checkpoint == tmp_path / "checkpoints" / "step_2"
    assert "SIGTERM: stopped after step 2" in str(stopped.value) and "train.resume=true" in stopped.value.command
    assert signal.getsignal(signal.SIGTERM) is not None  # the handler was put back
    monkeypatch.setattr(grpo_module, "collect_rollouts", real)
    resumed = run_grpo(grpo_config(tiny_text, mcq_file, tmp_path, *extra, "train.resume=true"))
    assert len(resumed.rewards) == 1 and resumed.finished_before is None
    logged = [json.loads(line)["step"] for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert logged == [1, 2, 3]
    again = run_grpo(grpo_config(tiny_text, mcq_file, tmp_path, *extra, "train.resume=true"))
    assert again.rewards == [] and again.finished_before == tmp_path / "checkpoints" / "step_3"


def test_grpo_summary_compares_window_means_not_single_steps():
    from physreason.cli.train_options import window_means

    assert window_means([0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0]) == (2, 0.5, 1.0)
    assert window_means([0.3]) == (1, 0.3, 0.3)


def test_a_grpo_resume_finishes_the_final_export_a_kill_cut_short(tiny_text, mcq_file, tmp_path, monkeypatch, capsys):
    from killed_export import killed_during_export

    def config(*extra):
        return grpo_config(tiny_text, mcq_file, tmp_path / "out", "train.max_steps=1",
                           "train.ckpt.export_safetensors=true", *extra)

    with killed_during_export(monkeypatch, 1):
        run_grpo(config())
    capsys.readouterr()
    resumed = run_grpo(config("train.resume=true"))
    assert resumed.rewards == []
    exports = tmp_path / "out" / "safetensors"
    assert f"finished the safetensors export {exports / 'step_1'}" in capsys.readouterr().out
    assert sorted(p.name for p in exports.iterdir()) == ["step_1", "written.json"]
    assert (exports / "step_1" / "model.safetensors").is_file()


def test_a_nan_policy_loss_stops_grpo_naming_the_step_and_the_last_good_checkpoint(tiny_text, mcq_file, tmp_path,
                                                                                     monkeypatch):
    from physreason.errors import TrainingDiverged
    from physreason.train import grpo

    real, calls = grpo.update_policy, []

    def diverging(*args, **kwargs):
        calls.append(1)
        metrics = real(*args, **kwargs)
        return metrics | ({"loss": float("nan")} if len(calls) == 3 else {})

    monkeypatch.setattr(grpo, "update_policy", diverging)
    out = tmp_path / "out"
    # step 3's NaN loss was computed from the weights saved as step_2: step_1 is the last checkpoint a loss vouches for
    first = out / "checkpoints" / "step_1"
    with pytest.raises(TrainingDiverged, match=rf"step 3: the loss is nan.*last good checkpoint is {first} .*"
                                               rf"step_2's weights gave step 3 a loss of nan.*train.resume='{first}'"):
        run_grpo(grpo_config(tiny_text, mcq_file, out, "train.max_steps=4", "train.ckpt.save_freq=1"))
    assert [p.name for p in checkpoint_dirs(out)] == ["step_1", "step_2"]
    # the diverged step's metrics are in the log (they were dropped before): what went non-finite is readable
    from physreason.train.metrics import read_records

    logged = {record["step"]: record for record in read_records(out / "logs" / "metrics.jsonl")}
    assert sorted(logged) == [1, 2, 3] and math.isnan(logged[3]["loss"])


def test_a_prompt_longer_than_the_context_is_skipped_and_counted_not_fatal(tiny_text, tmp_path, caplog):
    records = [{"question": f"Which way does ball {i} go?" + (" far" * 400 if i == 1 else ""),
                "options": ["up", "down", "left", "right"], "answer": "B", "id": f"q{i}"} for i in range(4)]
    data = tmp_path / "mcq.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in records))
    config = grpo_config(tiny_text, data, tmp_path / "out", "train.max_steps=1", "rollout.batch_size=4",
                         "train.train_batch_per_replica=32", "model.model_max_length=256",
                         "train.ckpt.enable_checkpoint=false", "data.shuffle=false")
    with caplog.at_level("WARNING", logger="physreason.train.rollout"):
        result = run_grpo(config)
    assert result.metrics[0]["rollout/requests_failed"] == 1.0
    assert result.metrics[0]["rollout/reward_errors"] == 0.0  # logged every step beside the other counts
    assert result.metrics[0]["rollout/groups_kept"] == 3.0
    assert any("q1" in r.getMessage() and "256" in r.getMessage() for r in caplog.records)


def test_grpo_stops_when_every_rollout_request_fails_three_steps_in_a_row(tiny_text, tmp_path, monkeypatch):
    from physreason.errors import PhysReasonError
    from physreason.train import grpo

    without_update = []
    real_no_update = grpo.DivergenceWatch.no_update
    monkeypatch.setattr(grpo.DivergenceWatch, "no_update",
                        lambda watch, step: (without_update.append(step), real_no_update(watch, step))[1])  # fmt: skip

    records = [{"question": f"Which way does ball {i} go?" + " far" * 400, "options": ["up", "down", "left", "right"],
                "answer": "B", "id": f"q{i}"} for i in range(4)]  # fmt: skip
    data = tmp_path / "mcq.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in records))
    out = tmp_path / "out"
    config = grpo_config(tiny_text, data, out, "train.max_steps=6", "rollout.batch_size=4",
                         "train.train_batch_per_replica=32", "model.model_max_length=256",
                         "train.ckpt.enable_checkpoint=false")  # fmt: skip
    with pytest.raises(PhysReasonError, match=r"step 3: every rollout request failed in steps 1-3 \(4 of 4 this step\)"
                                              r".*First error on this rank: request q\d#\d+: .* the context is 256"):
        run_grpo(config)
    logged = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in logged] == [1, 2]
    assert all(row["rollout/empty_step"] == 1.0 for row in logged)
    assert without_update == [1, 2]  # the steps without an update pass the next loss back to the weights before them


def test_one_step_with_every_request_failed_does_not_stop_grpo():
    from physreason.train.grpo import _check_failing_rollouts
    from physreason.train.rollout import RolloutBatch

    failed = {"rollout/prompts_drawn": 4.0, "rollout/requests_failed": 4.0}
    some = {"rollout/prompts_drawn": 4.0, "rollout/requests_failed": 3.0}
    batch = RolloutBatch()
    count = 0
    for step, metrics in enumerate([failed, failed, some, failed, failed, some]):
        count = _check_failing_rollouts(metrics, batch, step, count)
    assert count == 0
    assert _check_failing_rollouts({"rollout/prompts_drawn": 0.0, "rollout/requests_failed": 0.0}, batch, 9, 2) == 0
