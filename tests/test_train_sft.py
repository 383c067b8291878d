"""SFT trainer on the tiny Qwen2.5-VL and Qwen3-VL models: it learns, logs, validates and resumes exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from setups import sft_overrides, sft_recipe, write_chat_records

from physreason.models.tiny import save_tiny_model
from physreason.train.checkpoint import checkpoint_dirs
from physreason.train.sft import run_sft


@pytest.fixture(scope="session")
def tiny_vl(tmp_path_factory, vl_kind) -> Path:
    return save_tiny_model(vl_kind, tmp_path_factory.mktemp(f"tiny_{vl_kind}"))


def tiny_config(model: Path, data: Path, out: Path, *extra: str):
    return sft_recipe(model, data, out, "train.ckpt.export_safetensors=false", *extra, lr="2e-3",
                      logger="['jsonl', 'tensorboard']")  # fmt: skip


@pytest.mark.slow
def test_loss_falls_when_overfitting_a_few_samples(tiny_vl, tmp_path):
    data = write_chat_records(tmp_path, 4)
    result = run_sft(tiny_config(tiny_vl, data, tmp_path / "out", "train.max_steps=12", "train.ckpt.enable_checkpoint=false"))
    assert result.losses[-1] < 0.5 * result.losses[0]
    lines = (tmp_path / "out" / "logs" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["step"] == 12
    assert any((tmp_path / "out" / "logs" / "tensorboard").rglob("events.*"))


def test_validation_loss_is_reported_on_the_held_out_split(tiny_vl, tmp_path):
    data = write_chat_records(tmp_path, 10)
    config = tiny_config(tiny_vl, data, tmp_path / "out", "train.max_steps=2", "data.val_fraction=0.2",
                         "train.validation_freq=1", "train.ckpt.enable_checkpoint=false")
    result = run_sft(config)
    assert sorted(result.val_losses) == [1, 2]
    assert result.val_losses[2] < result.val_losses[1]


@pytest.mark.slow
@pytest.mark.parametrize("save_mode", ["sync", "async"])
def test_resume_continues_the_loss_curve_exactly(tiny_vl, tmp_path, save_mode):
    data = write_chat_records(tmp_path, 8)
    mode = f"train.ckpt.save_mode={save_mode}"
    straight = run_sft(tiny_config(tiny_vl, data, tmp_path / "a", "train.max_steps=6", "train.ckpt.save_freq=100"))
    first = run_sft(tiny_config(tiny_vl, data, tmp_path / "b", "train.max_steps=6", "train.ckpt.save_freq=3", mode))
    assert [p.name for p in checkpoint_dirs(tmp_path / "b")] == ["step_3", "step_6"]
    # Throw away the end of the run, then resume from step 3 in a fresh run.
    resumed = run_sft(tiny_config(tiny_vl, data, tmp_path / "c", "train.max_steps=6",
                                  f"train.resume='{tmp_path / 'b' / 'checkpoints' / 'step_3'}'",
                                  "train.trust_checkpoint=true", mode))
    assert first.losses == straight.losses
    assert resumed.losses == straight.losses[3:]


@pytest.mark.slow
@pytest.mark.parametrize("save_mode", ["sync", "async"])
def test_checkpoints_are_rotated_and_never_left_half_written(tiny_vl, tmp_path, save_mode):
    data = write_chat_records(tmp_path, 8)
    run_sft(tiny_config(tiny_vl, data, tmp_path / "out", "train.max_steps=4", "train.ckpt.save_freq=1",
                        "train.ckpt.max_keep=2", f"train.ckpt.save_mode={save_mode}"))
    names = sorted(p.name for p in (tmp_path / "out" / "checkpoints").iterdir())
    assert names == ["step_3", "step_4", "written.json"]  # the record of what the run wrote keeps pace with rotation
    assert sorted(json.loads((tmp_path / "out" / "checkpoints" / "written.json").read_text())) == ["step_3", "step_4"]
    assert (tmp_path / "out" / "checkpoints" / "step_4" / ".metadata").is_file()
    # Trusted without train.trust_checkpoint: the record matches the files the background write left.
    again = run_sft(tiny_config(tiny_vl, data, tmp_path / "out", "train.max_steps=5", "train.resume=true"))
    assert len(again.losses) == 1


@pytest.mark.slow
def test_a_failed_async_write_leaves_no_checkpoint_and_resume_takes_the_previous_one(tiny_model_dir, tmp_path, monkeypatch):
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.api import CheckpointException

    data = write_chat_records(tmp_path, 8)

    def config(out: str, *extra: str):
        return tiny_config(tiny_model_dir, data, tmp_path / out, "train.max_steps=6", "train.ckpt.save_freq=2",
                           "train.ckpt.max_keep=5", "train.ckpt.save_mode=async", *extra)

    straight = run_sft(config("straight"))
    real = FileSystemWriter.write_data

    def failing(self, plan, planner):  # the background write of step 4 fails after it began
        if Path(self.path).name == "step_4.tmp":
            raise OSError(28, "No space left on device")
        return real(self, plan, planner)

    with monkeypatch.context() as patch:
        patch.setattr(FileSystemWriter, "write_data", failing)
        with pytest.raises(CheckpointException, match="No space left") as raised:
            run_sft(config("run"))
    note = "".join(raised.value.__notes__)
    assert "step_4 (step 4) was not completed" in note and "step_2, the last complete checkpoint" in note
    checkpoints = tmp_path / "run" / "checkpoints"
    assert [p.name for p in checkpoint_dirs(tmp_path / "run")] == ["step_2"]
    assert (checkpoints / "step_4.tmp").is_dir()  # left for inspection; nothing loads a .tmp folder
    assert sorted(json.loads((checkpoints / "written.json").read_text())) == ["step_2"]
    resumed = run_sft(config("run", "train.resume=true"))
    assert resumed.losses == straight.losses[2:]


@pytest.mark.slow
def test_a_failed_async_staging_names_the_step_and_the_checkpoint_resume_takes(tiny_model_dir, tmp_path, monkeypatch):
    from physreason.train.checkpoint import ReusingStager

    data = write_chat_records(tmp_path, 8)

    def config(out: str, *extra: str):
        return tiny_config(tiny_model_dir, data, tmp_path / out, "train.max_steps=8", "train.ckpt.save_freq=2",
                           "train.ckpt.max_keep=5", "train.ckpt.save_mode=async", *extra)

    straight = run_sft(config("straight"))  # four async saves with one stager, as a GPU run makes them
    assert [p.name for p in checkpoint_dirs(tmp_path / "straight")] == ["step_2", "step_4", "step_6", "step_8"]
    real = ReusingStager.stage

    def failing(self, state_dict, **kwargs):  # the copy to host memory of the third save fails
        if self.stages == 2:
            raise KeyError(type)
        return real(self, state_dict, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(ReusingStager, "stage", failing)
        with pytest.raises(KeyError) as raised:
            run_sft(config("run"))
    note = "".join(raised.value.__notes__)
    assert "step_6 (step 6) was not completed" in note
    assert f"continues from {tmp_path / 'run' / 'checkpoints' / 'step_4'}, the last complete checkpoint" in note
    assert [p.name for p in checkpoint_dirs(tmp_path / "run")] == ["step_2", "step_4"]
    resumed = run_sft(config("run", "train.resume=true"))
    assert resumed.losses == straight.losses[4:]


@pytest.mark.slow
def test_a_resume_finishes_every_export_a_kill_left_undone_and_says_so(tiny_vl, tmp_path, monkeypatch, capsys):
    from killed_export import killed_during_export
    from safetensors.torch import load_file

    data = write_chat_records(tmp_path, 8)

    def config(out: str, *extra: str):
        return tiny_config(tiny_vl, data, tmp_path / out, "train.max_steps=4", "train.ckpt.save_freq=2",
                           "train.ckpt.export_safetensors=true", "train.ckpt.max_keep=2", *extra)

    run_sft(config("straight"))
    exports = tmp_path / "run" / "safetensors"
    with killed_during_export(monkeypatch, 2):  # mid-run: step 2 checkpointed, its export cut short
        run_sft(config("run"))
    with killed_during_export(monkeypatch, 4):  # the last step: only the export was left to do
        run_sft(config("run", "train.resume=true"))
    assert sorted(p.name for p in exports.iterdir()) == ["step_2", "step_4.tmp", "written.json"]
    capsys.readouterr()
    resumed = run_sft(config("run", "train.resume=true"))
    assert resumed.losses == [] and resumed.export_dir is None
    assert sorted(p.name for p in exports.iterdir()) == ["step_2", "step_4", "written.json"]
    assert f"finished the safetensors export {exports / 'step_4'}" in capsys.readouterr().out
    # An older checkpoint's missing export is written from that checkpoint, not from the latest weights.
    import shutil

    shutil.rmtree(exports / "step_2")
    run_sft(config("run", "train.resume=true"))
    for step in (2, 4):
        got = load_file(exports / f"step_{step}" / "model.safetensors")
        want = load_file(tmp_path / "straight" / "safetensors" / f"step_{step}" / "model.safetensors")
        assert got.keys() == want.keys() and all(got[k].equal(want[k]) for k in want)


@pytest.mark.slow
def test_a_kill_during_an_async_write_leaves_no_checkpoint_and_resume_takes_the_previous_one(tiny_model_dir, tmp_path):
    import os
    import subprocess
    import sys

    data = write_chat_records(tmp_path, 8)
    overrides = ["train.max_steps=6", "train.ckpt.save_freq=2", "train.ckpt.max_keep=5", "train.ckpt.save_mode=async"]
    straight = run_sft(tiny_config(tiny_model_dir, data, tmp_path / "straight", *overrides))
    run = tmp_path / "run"
    killed = subprocess.run(
        [sys.executable, str(Path(__file__).parent / "killed_async_save.py"), "4",
         *sft_overrides(tiny_model_dir, data, run, lr="2e-3", logger="['jsonl']"), "train.ckpt.export_safetensors=false",
         *overrides],
        # the same intra-op thread count as this process, whose runs it is compared with bit for bit
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]),
                                                          "OMP_NUM_THREADS": str(torch.get_num_threads())},
    )  # fmt: skip
    assert killed.returncode == 137, killed.stderr[-2000:]
    assert [p.name for p in checkpoint_dirs(run)] == ["step_2"]
    assert (run / "checkpoints" / "step_4.tmp" / "__0_0.distcp").read_bytes() == b"half a shard"
    resumed = run_sft(tiny_config(tiny_model_dir, data, run, *overrides, "train.resume=true"))
    assert resumed.losses == straight.losses[2:]


def test_sigterm_during_async_saves_returns_only_once_its_checkpoint_is_complete(tiny_model_dir, tmp_path, monkeypatch):
    import os
    import signal
    import time

    from torch.distributed.checkpoint import FileSystemWriter

    from physreason.train import sft
    from physreason.train.loop import TrainingInterrupted

    real_step, real_write, calls = sft.train_step, FileSystemWriter.write_data, []

    def signalled(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler only flags it: step 3 ends, then the stop saves
        return real_step(*args, **kwargs)

    def slow(self, plan, planner):  # a write still going when the run would otherwise raise
        time.sleep(0.5)
        return real_write(self, plan, planner)

    monkeypatch.setattr(sft, "train_step", signalled)
    monkeypatch.setattr(FileSystemWriter, "write_data", slow)
    data = write_chat_records(tmp_path, 8)
    out = tmp_path / "out"
    with pytest.raises(TrainingInterrupted, match="SIGTERM: stopped after step 3") as stopped:
        run_sft(tiny_config(tiny_model_dir, data, out, "train.max_steps=10", "train.ckpt.save_freq=2",
                            "train.ckpt.save_mode=async"))
    assert stopped.value.checkpoint == out / "checkpoints" / "step_3"
    assert [p.name for p in checkpoint_dirs(out)] == ["step_2", "step_3"]
    assert sorted(json.loads((out / "checkpoints" / "written.json").read_text())) == ["step_2", "step_3"]


def test_a_nan_loss_stops_the_run_naming_the_step_and_the_last_good_checkpoint(tiny_vl, tmp_path, monkeypatch):
    from physreason.errors import TrainingDiverged
    from physreason.train import sft

    real, calls = sft.train_step, []

    def diverging(*args, **kwargs):
        calls.append(1)
        loss, norm = real(*args, **kwargs)
        return (float("nan"), float("inf")) if len(calls) == 3 else (loss, norm)

    monkeypatch.setattr(sft, "train_step", diverging)
    data = write_chat_records(tmp_path, 8)
    out = tmp_path / "out"
    with pytest.raises(TrainingDiverged) as diverged:
        run_sft(tiny_config(tiny_vl, data, out, "train.max_steps=4", "train.ckpt.save_freq=1", "train.ckpt.max_keep=5"))
    assert [p.name for p in checkpoint_dirs(out)] == ["step_1", "step_2"]  # the diverged step is never saved
    # step 3's NaN loss was computed from the weights saved as step_2, so step_1 is the last one a loss vouches for
    first = out / "checkpoints" / "step_1"
    assert str(diverged.value).startswith("step 3: the loss is nan and the gradient norm inf")
    assert f"The last good checkpoint is {first} (the loss of step 2, computed from its weights, " in str(diverged.value)
    assert "not the later ones (step_2's weights gave step 3 a loss of nan)" in str(diverged.value)
    assert f"train.resume='{first}' continues from it" in str(diverged.value)


def test_a_step_out_of_gpu_memory_ends_with_what_to_change_and_the_resume_from_the_last_checkpoint(
    tiny_vl, tmp_path, monkeypatch
):
    import torch

    from physreason.train import sft
    from physreason.train.out_of_memory import OutOfGPUMemory

    real, calls = sft.train_step, []

    def exhausted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 166.00 MiB.")
        return real(*args, **kwargs)

    monkeypatch.setattr(sft, "train_step", exhausted)
    monkeypatch.setattr("sys.argv", ["physreason", "sft", "--config", "r.toml"])
    data = write_chat_records(tmp_path, 8)
    out = tmp_path / "out"
    with pytest.raises(OutOfGPUMemory) as failed:
        run_sft(tiny_config(tiny_vl, data, out, "train.max_steps=4", "train.ckpt.save_freq=2"))
    message = str(failed.value)
    assert message.startswith("step 3 ran out of GPU memory: ")
    assert "the memory plan was " in message and "`physreason plan` lists the layouts that fit" in message
    assert "a smaller train.mini_batch" in message
    assert f"The last checkpoint is {out / 'checkpoints' / 'step_2'}" in message
    assert message.endswith("physreason sft --config r.toml --set train.resume=true")
    assert isinstance(failed.value.__cause__, torch.OutOfMemoryError)


def test_a_learning_rate_that_blows_up_the_weights_names_no_checkpoint_good(tiny_vl, tmp_path):
    from physreason.errors import TrainingDiverged

    data = write_chat_records(tmp_path, 8)
    out = tmp_path / "out"
    with pytest.raises(TrainingDiverged) as diverged:
        run_sft(tiny_config(tiny_vl, data, out, "train.max_steps=6", "train.optm_lr=1e30", "train.optm_warmup_steps=0",
                            "train.ckpt.save_freq=1", "train.ckpt.max_keep=5"))
    message = str(diverged.value)
    saved = [p.name for p in checkpoint_dirs(out)]
    assert saved and "last good checkpoint" not in message
    assert message.split(". ")[1].startswith(f"No checkpoint is known good ({saved[0]}'s weights gave step 2 a loss of")


@pytest.mark.timeout(300)
def test_a_step_whose_every_sample_was_skipped_makes_no_update_and_logs_no_loss(tiny_vl, tmp_path, monkeypatch):
    """A step of only too-long samples logged a loss of 0 and still stepped AdamW (momentum and weight decay moved
    the weights): now it runs no forward and no optimizer step, logs train/empty_steps instead of a loss, and the
    schedule keeps its place."""
    from physreason.cli.sft_cmd import _summary
    from physreason.train import sft

    short = {"conversations": [{"from": "human", "value": "Does the ball fall?"}, {"from": "gpt", "value": "Yes."}]}
    long = {"conversations": [{"from": "human", "value": "word " * 400}, {"from": "gpt", "value": "No."}]}
    data = tmp_path / "sft.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in (short, short, long, long, short, short)))
    real, calls = sft.train_step, []

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(sft, "train_step", counted)
    without_update = []
    real_no_update = sft.DivergenceWatch.no_update
    monkeypatch.setattr(sft.DivergenceWatch, "no_update",
                        lambda watch, step: (without_update.append(step), real_no_update(watch, step))[1])  # fmt: skip
    out = tmp_path / "out"
    config = tiny_config(tiny_vl, data, out, "train.train_batch_per_replica=2", "train.mini_batch=1",
                         "train.max_steps=3", "model.model_max_length=128", "data.shuffle=false", "data.val_fraction=0",
                         "train.ckpt.enable_checkpoint=false", "train.optm_warmup_steps=0",
                         "train.optm_decay_type='linear'", "train.log_freq=1")  # fmt: skip
    result = run_sft(config)
    assert result.empty_steps == [2] and len(calls) == 2
    assert without_update == [2]  # step 3's loss vouches for step 1's weights too (tests/test_train_loop_stop.py)
    assert result.losses[1] != result.losses[1] and result.losses[0] > 0 and result.losses[2] > 0
    rows = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    by_step = {row["step"]: row for row in rows if "train/lr" in row}
    assert "train/loss" not in by_step[2] and by_step[2]["train/empty_steps"] == 1.0
    assert by_step[2]["skipped/no assistant tokens within model_max_length"] == 2.0
    # the linear decay still moved on at the empty step
    assert by_step[1]["train/lr"] > by_step[2]["train/lr"] > by_step[3]["train/lr"]
    assert "1 had every sample skipped and made no update (steps 2)" in _summary(result)


@pytest.mark.timeout(300)
def test_samples_cut_at_the_context_are_counted_logged_and_named_at_the_end(tiny_vl, tmp_path, caplog):
    """A sample longer than model_max_length whose answer starts inside it trains on its first tokens only; that was
    silent. Now the run counts such samples in the metrics (truncated/samples), warns at its end and its summary says
    so; samples that fit are not counted."""
    from physreason.cli.sft_cmd import _summary

    short = {"conversations": [{"from": "human", "value": "Does the ball fall?"}, {"from": "gpt", "value": "Yes."}]}
    cut = {"conversations": [{"from": "human", "value": "Why?"}, {"from": "gpt", "value": "because " * 300}]}
    data = tmp_path / "sft.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in (short, cut, short, cut, short, short)))
    out = tmp_path / "out"
    config = tiny_config(tiny_vl, data, out, "train.train_batch_per_replica=2", "train.mini_batch=1",
                         "train.max_steps=3", "model.model_max_length=128", "data.shuffle=false", "data.val_fraction=0",
                         "train.ckpt.enable_checkpoint=false", "train.log_freq=1")  # fmt: skip
    with caplog.at_level("WARNING", logger="physreason.train.sft"):
        result = run_sft(config)
    assert result.truncated == 2 and not result.skipped and result.empty_steps == []
    rows = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    by_step = {row["step"]: row for row in rows if "train/lr" in row}
    assert by_step[1]["truncated/samples"] == 1.0 and by_step[2]["truncated/samples"] == 2.0
    assert "2 samples were longer than model.model_max_length=128" in caplog.text
    assert "2 samples were cut at model.model_max_length" in _summary(result)


@pytest.mark.timeout(300)
def test_a_resume_carries_on_the_counts_of_cut_samples_and_empty_steps(tiny_vl, tmp_path):
    short = {"conversations": [{"from": "human", "value": "Does the ball fall?"}, {"from": "gpt", "value": "Yes."}]}
    cut = {"conversations": [{"from": "human", "value": "Why?"}, {"from": "gpt", "value": "because " * 300}]}
    long = {"conversations": [{"from": "human", "value": "word " * 400}, {"from": "gpt", "value": "No."}]}
    data = tmp_path / "sft.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in (short, cut, long, long, short, cut, short, short)))
    common = ["train.train_batch_per_replica=2", "train.mini_batch=1", "model.model_max_length=128",
              "data.shuffle=false", "data.val_fraction=0", "train.ckpt.save_freq=2", "train.log_freq=1"]  # fmt: skip
    first = run_sft(tiny_config(tiny_vl, data, tmp_path / "a", "train.max_steps=4", *common))
    assert (first.truncated, first.empty_steps) == (2, [2])
    resumed = run_sft(tiny_config(tiny_vl, data, tmp_path / "b", "train.max_steps=4", *common,
                                  f"train.resume='{tmp_path / 'a' / 'checkpoints' / 'step_2'}'",
                                  "train.trust_checkpoint=true"))  # fmt: skip
    assert (resumed.truncated, resumed.empty_steps) == (2, [2])


@pytest.mark.timeout(300)
def test_resuming_from_an_earlier_step_sets_the_later_steps_aside(tiny_vl, tmp_path, caplog):
    from physreason.train.checkpoint import read_record
    from physreason.train.metrics import read_records

    data = write_chat_records(tmp_path, 4)
    out = tmp_path / "out"
    common = ["train.ckpt.save_freq=1", "train.ckpt.max_keep=3", "train.ckpt.export_safetensors=true", "train.log_freq=1"]
    run_sft(tiny_config(tiny_vl, data, out, "train.max_steps=4", *common))
    assert [p.name for p in checkpoint_dirs(out)] == ["step_2", "step_3", "step_4"]
    old_step_4 = (out / "checkpoints" / "step_4" / ".metadata").read_bytes()
    abandoned_records = {name: read_record(out)[name] for name in ("step_3", "step_4")}
    # step_4's export was uploaded to the Hub and step_3's still queued when the run ended (the record as a run with
    # [train.ckpt] upload_hf leaves it, its pin a copy of the folder)
    (out / "uploads.json").write_text(json.dumps({
        "pending": [["hf", "safetensors/step_3"], ["s3", "checkpoints/step_2"]], "s3": {},
        "hf": {"safetensors/step_4": {"repo_id": "me/run", "resolved": "me/run", "commit": "abc"},
               "safetensors/step_2": {"repo_id": "me/run", "resolved": "me/run", "commit": "def"}}}))  # fmt: skip
    (out / ".uploads" / "safetensors").mkdir(parents=True)
    (out / ".uploads" / "safetensors" / "step_3").mkdir()
    (out / ".uploads" / "checkpoints").mkdir()
    (out / ".uploads" / "checkpoints" / "step_2").mkdir()
    left = out / "checkpoints" / ".step_3.old-k1ll3d" / "step_3"  # a kill while a step folder was being replaced
    left.mkdir(parents=True)
    # back to step_2 (as a divergence tells), stopped before reaching step 4: step_4 of the abandoned steps must not
    # stay the run's latest checkpoint or export, nor its upload records skip the new step_4's
    with caplog.at_level("WARNING", logger="physreason.train.loop"):
        run_sft(tiny_config(tiny_vl, data, out, "train.max_steps=3", *common, f"train.resume='{out / 'checkpoints' / 'step_2'}'"))
    assert [p.name for p in checkpoint_dirs(out)] == ["step_2", "step_3"]
    assert [p.name for p in checkpoint_dirs(out, "safetensors")] == ["step_2", "step_3"]
    assert sorted(read_record(out)) == ["step_2", "step_3"]
    assert sorted(read_record(out, "safetensors")) == ["step_2", "step_3"]
    aside = out / "superseded" / "after-step_2"
    assert sorted(p.name for p in (aside / "checkpoints").iterdir()) == ["step_3", "step_4", "written.json"]  # nothing deleted
    assert sorted(p.name for p in (aside / "safetensors").iterdir()) == ["step_3", "step_4", "written.json"]
    assert (aside / "checkpoints" / "step_4" / ".metadata").read_bytes() == old_step_4
    assert "the steps after it (step_3, step_4)" in caplog.text and str(aside) in caplog.text
    assert "queued uploads were dropped (hf safetensors/step_3)" in caplog.text
    assert f"a kill left while an older step folder was being replaced: {left.parent}" in caplog.text
    assert left.is_dir()  # named, never deleted
    # their entries of the run's record lie beside them: put both back to make them the run's again
    assert json.loads((aside / "checkpoints" / "written.json").read_text()) == abandoned_records
    uploads = json.loads((out / "uploads.json").read_text())
    assert uploads["pending"] == [["s3", "checkpoints/step_2"]] and list(uploads["hf"]) == ["safetensors/step_2"]
    assert not (out / ".uploads" / "safetensors" / "step_3").exists()
    assert (out / ".uploads" / "checkpoints" / "step_2").is_dir()
    assert sorted({r["step"] for r in read_records(out / "logs" / "metrics.jsonl")}) == [1, 2, 3]
    # resuming the latest now continues from the new step_3
    run_sft(tiny_config(tiny_vl, data, out, "train.max_steps=4", *common, "train.resume=true"))
    assert [p.name for p in checkpoint_dirs(out)] == ["step_2", "step_3", "step_4"]


@pytest.mark.timeout(300)
def test_a_fresh_run_keeps_an_earlier_runs_log_and_recipe_beside_its_own(tiny_vl, tmp_path, caplog):
    from physreason.train.metrics import read_records

    data = write_chat_records(tmp_path, 4)
    out = tmp_path / "out"
    common = ["train.ckpt.enable_checkpoint=false", "train.log_freq=1"]
    run_sft(tiny_config(tiny_vl, data, out, "train.max_steps=3", *common))
    first_log = (out / "logs" / "metrics.jsonl").read_text()
    first_recipe = (out / "config.toml").read_text()
    # a run without checkpoints has nothing else: the next fresh run in the folder must not write over its history
    with caplog.at_level("WARNING", logger="physreason.train.loop"):
        run_sft(tiny_config(tiny_vl, data, out, "train.max_steps=2", *common, "train.optm_lr=1e-3"))
    assert (out / "logs" / "metrics.earlier-1.jsonl").read_text() == first_log
    assert (out / "config.earlier-1.toml").read_text() == first_recipe
    assert sorted({r["step"] for r in read_records(out / "logs" / "metrics.jsonl")}) == [1, 2]
    assert "optm_lr = 0.001" in (out / "config.toml").read_text()
    assert "config.earlier-1.toml" in caplog.text and "metrics.earlier-1.jsonl" in caplog.text
    # a third run takes the next free number for both
    run_sft(tiny_config(tiny_vl, data, out, "train.max_steps=1", *common))
    assert (out / "config.earlier-2.toml").is_file() and (out / "logs" / "metrics.earlier-2.jsonl").is_file()
    assert (out / "logs" / "metrics.earlier-1.jsonl").read_text() == first_log
