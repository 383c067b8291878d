"""The training loop's stop and resume rules without a model: metrics after a checkpoint, the resume command."""

from __future__ import annotations

import json

from physreason.config import LoggingConfig
from physreason.train.loop import resume_command
from physreason.train.metrics import MetricLogger


def steps(path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_a_resumed_run_drops_metrics_after_its_checkpoint_and_a_fresh_run_starts_anew(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    metrics = logs / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 8)) + '{"step": 8, "lo')
    logger = MetricLogger(tmp_path, LoggingConfig(logger=["jsonl"]), resumed_step=5)
    logger.log(6, {"loss": 0.5})
    logger.close()
    assert steps(metrics) == [1, 2, 3, 4, 5, 6]
    MetricLogger(tmp_path, LoggingConfig(logger=["jsonl"]), resumed_step=0).close()
    assert metrics.read_text() == ""



def test_a_resume_drops_a_last_line_cut_inside_a_character_or_garbled_and_keeps_the_rest(tmp_path):
    # A kill (or power loss) can leave bytes that are not UTF-8: a character cut in half, a garbled block.
    logs = tmp_path / "logs"
    logs.mkdir()
    metrics = logs / "metrics.jsonl"
    good = "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 4))
    metrics.write_bytes(b'{"step": 0, "\xff": 1}\n' + good.encode() + '{"step": 4, "note": "é'.encode()[:-1])
    MetricLogger(tmp_path, LoggingConfig(logger=["jsonl"]), resumed_step=3).close()
    assert steps(metrics) == [0, 1, 2, 3]


def test_a_resume_names_a_stored_config_cut_short_instead_of_a_toml_traceback(tmp_path):
    import pytest

    from physreason.config import load_config
    from physreason.errors import ConfigError
    from physreason.train.loop import resume_changes

    stored = tmp_path / "config.toml"
    for cut in ("", "[train]\noptm_lr = 1.", "\0" * 8):  # as a kill during an in-place write leaves it
        stored.write_text(cut)
        with pytest.raises(ConfigError, match=r"config.toml cannot be read .*Delete it and resume"):
            resume_changes(stored, load_config(None))
    stored.unlink()
    assert resume_changes(stored, load_config(None)) == []

def test_resume_command_replaces_an_earlier_resume_key_and_quotes_arguments():
    argv = ["sft", "-c", "my recipe.toml", "--set", "train.resume=false", "--set=train.resume=/x", "--set", "a.b=1"]
    assert resume_command(argv) == (
        "physreason sft -c 'my recipe.toml' --set a.b=1 --set train.resume=true"
    )


def test_a_checkpoint_is_good_only_when_the_loss_computed_from_it_is_in_range(tmp_path):
    import pytest

    from physreason.errors import TrainingDiverged
    from physreason.train.loop import DivergenceWatch

    for step in (3, 4, 5, 6):  # step_3 predates this process (a resume from step_4)
        (tmp_path / "checkpoints" / f"step_{step}").mkdir(parents=True)
    watch = DivergenceWatch(tmp_path)
    watch.check(5, 2.0, 1.0)  # from step_4's weights: in range
    watch.check(6, 3.0, 4.0)  # from step_5's: in range
    watch.check(7, 2e29, 1e30)  # from step_6's: finite but 1e29 times the first loss, so step_6 is not good
    with pytest.raises(TrainingDiverged) as diverged:
        watch.check(8, float("nan"), float("nan"))
    assert (
        f"The last good checkpoint is {tmp_path / 'checkpoints' / 'step_5'} (the loss of step 6, computed from its "
        f"weights, 3, was in range; not the later ones (step_6's weights gave step 7 a loss of 2e+29)); "
        f"train.resume='{tmp_path / 'checkpoints' / 'step_5'}' continues from it"
    ) in str(diverged.value)

    fresh = DivergenceWatch(tmp_path)
    with pytest.raises(TrainingDiverged) as diverged:
        fresh.check(7, float("inf"), 1.0)
    assert "No checkpoint is known good (step_6's weights gave step 7 a loss of inf; step_3, step_4, step_5 predate " \
           "this process, which did not see a loss from them)" in str(diverged.value)


def test_a_step_without_an_update_passes_the_next_loss_back_to_the_checkpoint_before_it(tmp_path):
    """A step whose every sample was skipped (SFT) or dropped (GRPO) changes no weight: the loss after it judges the
    checkpoint saved before it too (that checkpoint had been left "predating this process")."""
    import pytest

    from physreason.errors import TrainingDiverged
    from physreason.train.loop import DivergenceWatch

    (tmp_path / "checkpoints" / "step_4").mkdir(parents=True)
    watch = DivergenceWatch(tmp_path)
    watch.check(4, 2.0, 1.0)
    watch.no_update(5)  # step 5: no update, step_4's weights unchanged
    watch.no_update(6)
    watch.check(7, 2e29, 1e30)  # from step_4's weights, through two steps without an update
    with pytest.raises(TrainingDiverged) as diverged:
        watch.check(8, float("nan"), float("nan"))
    assert "No checkpoint is known good (step_4's weights gave step 7 a loss of 2e+29)" in str(diverged.value)

    good = DivergenceWatch(tmp_path)
    good.check(4, 2.0, 1.0)
    good.no_update(5)
    good.check(6, 2.5, 1.0)
    with pytest.raises(TrainingDiverged) as diverged:
        good.check(7, float("inf"), 1.0)
    assert f"The last good checkpoint is {tmp_path / 'checkpoints' / 'step_4'} (the loss of step 6, computed from its " \
        "weights, 2.5, was in range" in str(diverged.value)


def _deliver(signum: int) -> None:
    """Send `signum` to this process and let its Python handler run (handlers run between bytecodes of the main
    thread)."""
    import os
    import time

    os.kill(os.getpid(), signum)
    time.sleep(0.01)


def test_a_second_sigterm_stops_at_once_and_one_repeated_by_timeout_or_torchrun_is_the_same_request(
    monkeypatch, capsys
):
    import signal

    import pytest

    from physreason.train import loop

    previous = signal.getsignal(signal.SIGTERM)
    with loop.StopOnSignal(saves=False) as stop:
        _deliver(signal.SIGTERM)
        _deliver(signal.SIGTERM)  # GNU timeout: the child, then its process group, microseconds apart
        assert stop.signal_name == "SIGTERM"
        monkeypatch.setattr(loop, "SAME_REQUEST_S", 0.0)  # a later one: the scheduler's grace is running out
        with pytest.raises(loop.StoppedAtOnce, match="SIGTERM again: stopped at once, mid-step, without a checkpoint"):
            _deliver(signal.SIGTERM)
    said = capsys.readouterr().err
    assert said.count("SIGTERM:") == 1
    assert "SIGTERM: stopping after this step (checkpoints are off) (SIGTERM again stops at once" in said
    assert signal.getsignal(signal.SIGTERM) is previous


def test_a_second_ctrl_c_stops_at_once_and_the_message_names_ctrl_c(monkeypatch, capsys):
    import signal

    import pytest

    from physreason.train import loop

    previous = signal.getsignal(signal.SIGINT)
    monkeypatch.setattr(loop, "SAME_REQUEST_S", 0.0)
    with pytest.raises(KeyboardInterrupt), loop.StopOnSignal() as stop:  # the CLI exits 130 on it
        _deliver(signal.SIGINT)
        assert stop.signal_name == "SIGINT"
        _deliver(signal.SIGINT)
    assert "SIGINT: saving a checkpoint after this step (Ctrl-C again stops at once, without a checkpoint)" in (
        capsys.readouterr().err
    )
    assert signal.getsignal(signal.SIGINT) is previous  # the handlers were put back
