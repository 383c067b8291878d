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


def test_resume_command_replaces_an_earlier_resume_key_and_quotes_arguments():
    argv = ["sft", "-c", "my recipe.toml", "--set", "train.resume=false", "--set=train.resume=/x", "--set", "a.b=1"]
    assert resume_command(argv) == (
        "physreason sft -c 'my recipe.toml' --set a.b=1 --set train.resume=true"
    )
