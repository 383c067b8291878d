"""A Ray Data pipeline that ends because a Ray process died is started again on the requests not yet written.

Ray Data is stood in for by pipelines that stop on cue (`_build_dataset` monkeypatched, no Ray session), so each
case runs in a second; tests/test_infer_ray.py kills real replicas.
"""

from __future__ import annotations

import json
import logging
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

ray_exceptions = pytest.importorskip("ray.exceptions")

from physreason.config import Config
from physreason.errors import ConfigError, PhysReasonError
from physreason.infer import ray_pipeline, run_ray_batch
from physreason.infer.ray_pipeline import PipelineStopped
from physreason.infer.results import result_status

pytestmark = pytest.mark.timeout(120)

N = 12
ANSWERS_BEFORE_STOP = 4
FAILING = "q001"  # its result is an error record: a restart must not run it again


def replica_killed() -> Exception:
    """What Ray Data's iterator raises when a replica died while it built its engine (its first call's error)."""
    return ray_exceptions.ActorDiedError()


class StoppingPipelines:
    """Stands in for `_build_dataset`: each pipeline answers its requests in order; while `stops` lasts, the next
    one is raised after ANSWERS_BEFORE_STOP results, as Ray Data ends a pipeline."""

    def __init__(self, *stops: BaseException) -> None:
        self.stops = list(stops)
        self.inputs: list[list[str]] = []  # the request ids each pipeline was given
        self.answered: Counter[str] = Counter()

    def __call__(self, ray, cfg, plan, replicas, gpus_each, prompt, factor, starts, control_tokens=()) -> SimpleNamespace:
        ids = [rid for rid, _ in plan.pending]
        self.inputs.append(ids)
        stop = self.stops.pop(0) if self.stops else None
        return SimpleNamespace(iter_rows=lambda: self._rows(ids, stop))

    def _rows(self, ids: list[str], stop: BaseException | None) -> Iterator[dict[str, str]]:
        for count, rid in enumerate(ids):
            if stop is not None and count == ANSWERS_BEFORE_STOP:
                raise stop
            self.answered[rid] += 1
            record = {"id": rid, "error": "video unreadable"} if rid == FAILING else {"id": rid, "prompt_tokens": 3}
            yield {"id": rid, "record": json.dumps(record)}
        if stop is not None:
            raise stop


@pytest.fixture
def requests(tmp_path) -> Path:
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps({"id": f"q{i:03d}", "question": f"Scene {i}?"}) + "\n" for i in range(N)))
    return path


@pytest.fixture
def pipelines(monkeypatch):
    """Installs a StoppingPipelines (given its stops) in place of Ray and Ray Data."""

    def install(*stops: BaseException) -> StoppingPipelines:
        fake = StoppingPipelines(*stops)
        monkeypatch.setattr(ray_pipeline, "_build_dataset", fake)
        ledger = SimpleNamespace(remote=lambda: None)  # the run's StartLedger actor, unused by the stand-in
        monkeypatch.setattr(ray_pipeline, "_import_ray", lambda starts_local: SimpleNamespace(
            cluster_resources=lambda: {"CPU": 8.0}, remote=lambda **options: lambda cls: ledger))  # fmt: skip
        monkeypatch.setattr(ray_pipeline, "_connect", lambda ray, address: False)
        return fake

    return install


def make_config(model_dir: Path, restarts: int | None = None) -> Config:
    infer = {"num_gpus": 2, "device": "cpu"} | ({} if restarts is None else {"max_pipeline_restarts": restarts})
    return Config.model_validate({"model": {"model_name_or_path": str(model_dir)}, "infer": infer})


def restart_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "restart " in r.getMessage()]


def output_ids(out: Path) -> Counter[str]:
    if out.suffix == ".parquet":
        import pyarrow.parquet as pq

        return Counter(pq.read_table(out).column("id").to_pylist())
    return Counter(json.loads(line)["id"] for line in out.read_text().splitlines())


@pytest.mark.parametrize("name", ["out.jsonl", "out.parquet"])
def test_a_pipeline_ended_by_a_dead_replica_restarts_on_the_requests_not_yet_written(
    pipelines, requests, tiny_model_dir, tmp_path, caplog, name
):
    fake = pipelines(replica_killed(), replica_killed())
    out = tmp_path / name
    summary = run_ray_batch(make_config(tiny_model_dir), requests, out, show_progress=False)  # default: 2 restarts
    assert len(fake.inputs) == 3
    written = []
    for ids in fake.inputs:  # each pipeline gets what the output lacks when it starts, nothing written before
        assert ids == [f"q{i:03d}" for i in range(N) if f"q{i:03d}" not in written]
        written += ids[:ANSWERS_BEFORE_STOP]
    assert FAILING in fake.inputs[0] and FAILING not in fake.inputs[1]  # a failure this run wrote is not rerun
    assert set(fake.answered.values()) == {1} and len(fake.answered) == N  # no request answered twice
    assert output_ids(out) == Counter({f"q{i:03d}": 1 for i in range(N)})
    assert list(result_status(out).values()).count(False) == 1
    assert (summary.total, summary.done, summary.failed, summary.skipped) == (N, N, 1, 0)
    warnings = restart_warnings(caplog)
    assert len(warnings) == 2
    for attempt, (line, left) in enumerate(zip(warnings, [N - 4, N - 8], strict=True), start=1):
        assert "\n" not in line and "ActorDiedError: The actor died unexpectedly" in line
        assert f"the {attempt * ANSWERS_BEFORE_STOP} results written are kept" in line
        assert f"restart {attempt} of 2 (infer.max_pipeline_restarts) on the {left} requests left" in line


@pytest.mark.parametrize("restarts", [0, 2])
def test_past_the_last_restart_the_run_stops_with_the_rerun_hint_and_a_rerun_finishes(
    pipelines, requests, tiny_model_dir, tmp_path, caplog, restarts
):
    fake = pipelines(*[replica_killed()] * 5)
    out = tmp_path / "out.jsonl"
    cfg = make_config(tiny_model_dir, restarts)
    with pytest.raises(PipelineStopped) as stopped:
        run_ray_batch(cfg, requests, out, show_progress=False)
    kept = (restarts + 1) * ANSWERS_BEFORE_STOP
    assert len(fake.inputs) == restarts + 1 and len(restart_warnings(caplog)) == restarts
    message = str(stopped.value)
    assert message.startswith("the Ray Data pipeline stopped (ActorDiedError: The actor died unexpectedly")
    assert f"the {kept} results written are kept in {out}" in message and "rerun the same command" in message
    assert sum(output_ids(out).values()) == len(output_ids(out)) == kept
    fake.stops.clear()
    resumed = run_ray_batch(cfg, requests, out, show_progress=False)
    assert (resumed.done, resumed.skipped) == (N - kept, kept)
    assert output_ids(out) == Counter({f"q{i:03d}": 1 for i in range(N)})


def test_errors_a_restart_cannot_fix_are_not_retried(pipelines, requests, tiny_model_dir, tmp_path, caplog):
    model_missing = ray_exceptions.RayTaskError("__init__", "Traceback ...", ConfigError("model: no weights found"))
    cases = [
        # a replica whose constructor raised (here CUDA) raises the same in every new replica
        (ray_exceptions.ActorDiedError(ray_exceptions.RayTaskError("__init__", "...", RuntimeError("CUDA error"))),
         PipelineStopped, "actor died because of an error raised in its creation task"),
        (model_missing.as_instanceof_cause(), ConfigError, "model: no weights found"),  # the user's to fix
        (ValueError("a block of the wrong schema"), PipelineStopped, "ValueError: a block of the wrong schema"),
        (KeyboardInterrupt(), KeyboardInterrupt, None),  # Ctrl-C
    ]  # fmt: skip
    for number, (error, raised, text) in enumerate(cases):
        fake = pipelines(error, replica_killed())
        out = tmp_path / f"out-{number}.jsonl"
        with pytest.raises(raised, match=text):
            run_ray_batch(make_config(tiny_model_dir), requests, out, show_progress=False)
        assert len(fake.inputs) == 1, raised
        assert sum(output_ids(out).values()) == ANSWERS_BEFORE_STOP  # what was written is kept
    assert restart_warnings(caplog) == []


def test_pipeline_restarts_are_bounded_in_the_config():
    assert Config().infer.max_pipeline_restarts == 2
    for value in (-1, 101):
        with pytest.raises(ValueError, match="max_pipeline_restarts"):
            Config.model_validate({"infer": {"max_pipeline_restarts": value}})


def test_start_ledger_counts_deaths_in_a_row_over_all_replicas_and_a_finished_start_resets_them():
    ledger = ray_pipeline.StartLedger()
    assert ledger.begin("a") == 0 and ledger.begin("b") == 0  # first starts: nobody died yet
    assert ledger.begin("a") == 1  # a started again before finishing: its process died in the constructor
    assert ledger.begin("b") == 2  # deaths in a row are counted over the replicas, not per replica
    ledger.done("b")  # one replica built its engine: the engines can start here
    assert ledger.deaths == 0
    assert ledger.begin("a") == 1  # a's start before b's success had not finished either
    ledger.done("a")
    assert ledger.begin("a") == 0  # a replica that ran, died and restarts is no death in the constructor


def test_a_replica_start_past_the_limit_raises_naming_the_setting_and_the_logs(monkeypatch):
    deaths = iter([0, 1, 2, 3, 4])
    fake_ray = SimpleNamespace(get=lambda ref: ref, get_runtime_context=lambda: SimpleNamespace(get_actor_id=lambda: "a1"))
    monkeypatch.setitem(sys.modules, "ray", fake_ray)
    ledger = SimpleNamespace(begin=SimpleNamespace(remote=lambda replica: next(deaths)))
    starts = ray_pipeline.ReplicaStarts(ledger, limit=2, replicas=2)  # the run ends at 4 deaths in a row
    for _ in range(4):
        starts.begin()
    with pytest.raises(PhysReasonError, match=r"died 4 times in a row .*2 replicas, infer.max_replica_start_deaths = 2 each.*worker-\*.err"):
        starts.begin()
