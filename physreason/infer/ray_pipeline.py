"""Corpus-scale batch inference on Ray Data: CPU tasks decode media, engine replicas on GPUs answer, the driver writes.

The pipeline, one Ray Data dataset streamed through three stages:

1. the driver reads the requests and the output so far (`plan_batch`: the same resume rules as the
   single-process path) and hands the pending records to Ray Data;
2. a CPU map stage decodes and samples each record's video frames and images (`physreason.vision`) and
   builds its chat request, so engine replicas never wait on decoding; Ray Data's streaming executor
   keeps this stage ahead of the engines within its memory budget;
3. a `map_batches` stage runs num_gpus / tp engine replicas as a fixed actor pool, tp GPUs each (none on a
   cluster without GPUs), each building the configured engine once.

The driver iterates the results as they finish (in no fixed order) and appends each to the output
(`physreason.infer.results`): a JSONL line flushed per result, or Parquet part files. Only the driver
writes, and it skips an id it has written already, so a rerun after kill -9 at any point (driver or
workers) gives every id exactly once. A replica that dies is restarted by Ray and its in-flight batches
are retried on it up to `infer.max_task_retries` times; a batch that fails more often is recorded as
failed per item and retried by a rerun with --retry-failed. A replica that dies while it builds its engine
makes Ray Data end the whole pipeline: the driver keeps what it wrote and starts a new pipeline on the rest,
up to `infer.max_pipeline_restarts` times, as a rerun of the command would. A replica whose process dies
while building its engine without Ray Data seeing it (Ray restarts the actor in place) is counted by a
`ReplicaStarts` ledger: after `infer.max_replica_start_deaths` such deaths in a row per replica the next start raises an
error that ends the run, where Ray alone would restart it forever. Errors of one item (missing file, corrupt
video, an exception while decoding or generating) become that item's error record.

Runs unchanged on a multi-node cluster: with `infer.ray_address` (--ray-address) or RAY_ADDRESS set it
joins that cluster, else it starts Ray on this machine (docs/ray-inference.md).
"""

from __future__ import annotations

import gc
import json
import logging
import math
import os
import pickle
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from physreason.chat.style import Prompting, StyleName
from physreason.config import Config, EngineConfig, ModelConfig, SamplingConfig, VisionConfig
from physreason.data.structural_tokens import structural_tokens
from physreason.engines import Engine, GenerationResult, create_engine
from physreason.errors import ConfigError, PhysReasonError
from physreason.infer.batch import BatchSummary, batch_progress, locks_out, plan_batch, record_to, request_from_record
from physreason.infer.request import result_record
from physreason.infer.results import open_sink
from physreason.models import loading
from physreason.models.inputs import patch_factor, prompting_for
from physreason.ray_setup import import_ray

log = logging.getLogger(__name__)

# Input blocks hold one engine batch each: decoding spreads over many tasks, and a replica's task (the
# unit Ray retries or loses) is one batch. Past this many blocks they grow instead, to bound the driver's
# bookkeeping on corpora of many millions.
MAX_BLOCKS = 100_000
TASKS_IN_FLIGHT = 2
LOST_ERROR = (
    "no result: the engine replica answering it died (killed, out of memory or crashed) more times than "
    "infer.max_task_retries allows; rerun with --retry-failed to try it again"
)


def replica_layout(num_gpus: int, tp: int, device: str, cluster_gpus: float) -> tuple[int, int]:
    """(engine replicas, GPUs per replica) for `num_gpus` GPUs at `tp` GPUs per engine on a cluster with `cluster_gpus`.

    device 'cpu' runs num_gpus / tp replicas without GPUs (a test or CPU-only cluster); 'gpu' needs the GPUs;
    'auto' is 'gpu' when the cluster has any GPU, else 'cpu'.
    """
    if num_gpus < 1:
        raise ConfigError(f"infer.num_gpus = {num_gpus}: give at least 1 (--num-gpus), or leave it unset for one process")
    if num_gpus % tp:
        raise ConfigError(
            f"infer.num_gpus ({num_gpus}) is not a multiple of engine.tensor_parallel_size ({tp}): "
            "each replica takes tp GPUs; change --num-gpus or --tp"
        )
    replicas = num_gpus // tp
    if device == "cpu" or (device == "auto" and cluster_gpus == 0):
        return replicas, 0
    if cluster_gpus < num_gpus:
        raise ConfigError(
            f"--num-gpus {num_gpus} but the Ray cluster has {cluster_gpus:g} GPUs: add nodes "
            "(ray start --address=...), lower --num-gpus, or set infer.device = 'cpu'"
        )
    return replicas, tp


def check_cpus(replicas: int, cpus_per_replica: float, decode_cpus: float, cluster_cpus: float) -> None:
    """Refuse a layout whose replicas leave no CPU for a decoding task: Ray Data would wait forever."""
    needed = replicas * cpus_per_replica + decode_cpus
    if cluster_cpus < needed:
        raise ConfigError(
            f"{replicas} engine replicas reserve {replicas * cpus_per_replica:g} CPUs and a decoding task "
            f"{decode_cpus:g}, but the Ray cluster has {cluster_cpus:g}: lower infer.cpus_per_replica or "
            "infer.decode_cpus, use fewer replicas, or add nodes"
        )


def replica_engine(model: ModelConfig, engine: EngineConfig) -> Engine:
    """The engine of one replica, on the GPUs Ray gave its actor.

    vLLM is told its executor: in-process for one GPU, local worker processes for several. Left to choose
    inside a Ray actor, it could pick its Ray executor and ask the cluster for GPUs this actor already holds.
    """
    return create_engine(model, engine, vllm_executor="uni" if engine.tensor_parallel_size == 1 else "mp")


def decode_row(
    row: dict[str, Any],
    *,
    root: str,
    vision: VisionConfig,
    prompting: Prompting,
    factor: int,
    control_tokens: tuple[str, ...] = (),
) -> dict[str, Any]:
    """CPU stage: one input row {"id", "record"} -> {"id", "request": pickled request, "error"}.

    A record that cannot be used (missing or corrupt media, no question, a question or system_prompt holding one of
    `control_tokens`: batch.request_from_record) yields its error instead of raising,
    so one bad clip does not stop the corpus; "" stands for none so every block has the same column types.
    """
    rid = row["id"]
    try:
        record = json.loads(row["record"])
        request = request_from_record(record, rid, Path(root), vision, prompting, factor, control_tokens)
    except PhysReasonError as exc:
        return {"id": rid, "request": b"", "error": str(exc)}
    except Exception as exc:  # a decoder bug on one clip is recorded against that clip, not the run
        log.exception("decoding request %s failed", rid)
        return {"id": rid, "request": b"", "error": f"decoding failed: {type(exc).__name__}: {exc}"}
    return {"id": rid, "request": pickle.dumps(request, protocol=5), "error": ""}


class StartLedger:
    """Deaths of engine replicas while building their engines, counted across the run's replicas (a Ray actor).

    Ray restarts a replica actor whose process died (max_restarts=-1) under the same actor id, so a start
    that `begin`s under an id whose previous start never reached `done` follows a death in the constructor.
    The count is of such deaths in a row over all replicas: any replica that finishes its start resets it, so
    a long run that loses a replica now and then never reaches the limit, and an engine that cannot start on
    this cluster (a segfault or the OOM killer while loading) does.
    """

    def __init__(self) -> None:
        self.unfinished: set[str] = set()
        self.deaths = 0

    def begin(self, replica: str) -> int:
        """Record a start of `replica`; return the deaths in a row so far, this start's predecessor included."""
        if replica in self.unfinished:
            self.deaths += 1
        self.unfinished.add(replica)
        return self.deaths

    def done(self, replica: str) -> None:
        self.unfinished.discard(replica)
        self.deaths = 0


class ReplicaStarts:
    """What a replica's constructor holds of the run's StartLedger actor: `begin()` first, `done()` last.

    The run ends at `limit` deaths in a row per replica (limit x replicas over the pool): a node lost while many
    replicas start kills each of them once, an engine that cannot start here kills each again and again.
    """

    def __init__(self, ledger, limit: int, replicas: int = 1) -> None:
        self.ledger = ledger
        self.limit = limit
        self.replicas = replicas
        self.replica = ""

    def begin(self) -> None:
        """Count this start; raise (ending the run, which Ray does not retry) at limit x replicas deaths in a row."""
        import ray

        self.replica = ray.get_runtime_context().get_actor_id() or ""
        deaths = ray.get(self.ledger.begin.remote(self.replica))
        if deaths >= self.limit * self.replicas:
            raise PhysReasonError(
                f"engine replicas died {deaths} times in a row while building their engines ({self.replicas} "
                f"replicas, infer.max_replica_start_deaths = {self.limit} each), so Ray would restart them forever: "
                "the cause is in the Ray worker logs of the dead processes (`ray logs`, or the session's logs folder, "
                "worker-*.err); common ones are host memory running out while the weights load (the OOM killer; "
                "fewer replicas per node) and a GPU or driver that fails to start. The results written so far are "
                "kept: fix the cause and rerun the same command to resume"
            )

    def done(self) -> None:
        import ray

        ray.get(self.ledger.done.remote(self.replica))


class EngineReplica:
    """GPU stage: one engine (tp GPUs) answering batches of decoded requests; rows {"id", "record": JSON text}."""

    def __init__(
        self,
        model: ModelConfig,
        engine: EngineConfig,
        sampling: SamplingConfig,
        style: StyleName = "reason1",
        reasoning: bool = True,
        starts: ReplicaStarts | None = None,
    ) -> None:
        if starts is not None:
            starts.begin()
        self.engine = replica_engine(model, engine)
        self.sampling = sampling
        self.style = style
        self.reasoning = reasoning
        if starts is not None:
            starts.done()

    def __call__(self, batch: dict[str, Any]) -> dict[str, list[str]]:
        """Answer the decodable requests of a batch; carry decoding errors through as error records."""
        ids = [str(i) for i in batch["id"]]
        results: dict[str, GenerationResult] = {}
        requests = []
        for rid, blob, error in zip(ids, batch["request"], batch["error"], strict=True):
            if error:
                results[rid] = GenerationResult(request_id=rid, error=str(error))
            else:
                requests.append(pickle.loads(blob))  # written by decode_row in this same job
        if requests:
            try:
                answered = self.engine.generate(requests, self.sampling, logprobs=False)
            except Exception as exc:  # the engine failing a whole batch fails its items, not the run
                log.exception("generate failed for a batch of %d", len(requests))
                message = f"generation failed: {type(exc).__name__}: {exc}"
                answered = [GenerationResult(request_id=r.request_id, error=message) for r in requests]
            for result in answered:
                results[str(result.request_id)] = result
        records = [result_record(results[rid], self.style, self.reasoning) for rid in ids]
        return {"id": ids, "record": [json.dumps(record, ensure_ascii=False) for record in records]}


_NO_RAY_DATA = "--num-gpus runs on Ray Data, which is not installed: pip install 'physreason[ray]'"


def _import_ray(starts_local: bool):
    """Ray and Ray Data; `starts_local`: this run will start a local Ray instance (no cluster address given)."""
    ray = import_ray(starts_local, _NO_RAY_DATA)
    try:
        import ray.data  # noqa: F401  (ray.data is used through `ray`)
    except ImportError as exc:
        raise ConfigError(_NO_RAY_DATA) from exc
    return ray


def _cluster_address(address: str | None) -> str | None:
    """The Ray cluster to join: `address` (--ray-address), else RAY_ADDRESS, else None (start one here)."""
    return address or os.environ.get("RAY_ADDRESS") or None


def _connect(ray, address: str | None) -> bool:
    """Join the cluster at `address`, else start Ray here; True when this call started it."""
    if ray.is_initialized():
        return False
    try:
        # Worker logs stay in the session's log folder (/tmp/ray/session_latest/logs) instead of
        # interleaving with the progress bar; errors come back to the driver as exceptions.
        ray.init(address=address, log_to_driver=False)
    except ConnectionError as exc:
        raise ConfigError(
            f"cannot reach the Ray cluster at {address!r} ({exc}): start it with `ray start --head` or fix --ray-address"
        ) from exc
    return address is None


class PipelineStopped(PhysReasonError):
    """Ray Data ended the whole pipeline (its iterator raised); the results written are kept in the output.

    `restartable`: a Ray process died (`_process_died`), which a new pipeline on the requests left can get
    past; `reason`: the exception in one line, for the warning that announces a restart.
    """

    def __init__(self, message: str, *, reason: str, restartable: bool) -> None:
        super().__init__(message)
        self.reason = reason
        self.restartable = restartable


def _chain(exc: BaseException) -> list[BaseException]:
    """`exc` and every exception it carries: `__cause__`, `__context__` and Ray's `.cause` (the remote original)."""
    found: list[BaseException] = []
    stack: list[object] = [exc]
    while stack:
        current = stack.pop()
        if not isinstance(current, BaseException) or any(current is seen for seen in found):
            continue
        found.append(current)
        stack += [getattr(current, "cause", None), current.__cause__, current.__context__]
    return found


def _user_error(exc: BaseException) -> PhysReasonError | None:
    """The PhysReasonError a remote failure carries (an engine that cannot load its model), if any.

    Ray re-raises a remote exception as a RayTaskError subclass of the original's type that also holds
    the original as `.cause`; the original is returned, not the wrapper (whose text is the remote traceback).
    """
    for current in _chain(exc):
        if isinstance(current, PhysReasonError) and getattr(current, "cause", None) is None:
            return current
    return None


def _process_died(exc: BaseException) -> bool:
    """Whether Ray Data ended the pipeline because a Ray process or node died, which a new pipeline can get past.

    A replica killed (or out of memory) while it builds its engine reaches Ray Data as the ActorDiedError of its
    first call (ActorPoolMapOperator._on_actor_init_death), and Ray Data fails the whole execution with it;
    WorkerCrashedError and NodeDiedError are the same death for a decoding task or a whole node. A constructor
    that raised also ends as an ActorDiedError, but with `actor_init_failed` set: that error (a model that does
    not load, a bad setting) comes back in every new replica, so it is no reason to restart. Neither is any other
    exception: a bug or a bad input would fail again, and Ctrl-C (KeyboardInterrupt) is no Exception at all.
    """
    from ray.exceptions import NodeDiedError, RayActorError, WorkerCrashedError

    return any(
        isinstance(current, WorkerCrashedError | NodeDiedError)
        or (isinstance(current, RayActorError) and not current.actor_init_failed)
        for current in _chain(exc)
    )


def _one_line(exc: BaseException) -> str:
    """'Type: first line of the text': Ray's errors run over many lines (the remote traceback, the actor's ids)."""
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _block_count(rows: int, batch_size: int) -> int:
    """Input blocks of one engine batch each, so a replica task is one batch; coarser past MAX_BLOCKS blocks."""
    return max(1, min(math.ceil(rows / batch_size), MAX_BLOCKS))


@locks_out
def run_ray_batch(
    cfg: Config,
    requests_path: str | Path,
    out_path: str | Path,
    *,
    media_root: str | Path | None = None,
    show_progress: bool = True,
    settings: Mapping[str, Any] | None = None,
    overwrite: bool = False,
) -> BatchSummary:
    """Answer every request not yet in `out_path` with `[infer] num_gpus / [engine] tensor_parallel_size` replicas.

    Same inputs, outputs and resume rules as `run_batch` (which uses one engine in this process), with
    `[infer]` choosing the cluster, the devices, retries and Parquet part sizes, and `[prompt]` the prompt
    style, reasoning mode and (with `[generation]`) the sampling, resolved for the checkpoint's family.
    When Ray Data ends the pipeline because a replica died while building its engine, the results written are
    kept and a new pipeline answers the rest, at most `infer.max_pipeline_restarts` times (PipelineStopped after).
    """
    infer = cfg.infer
    if infer.num_gpus is None:
        raise ConfigError("run_ray_batch needs infer.num_gpus (--num-gpus); without it use run_batch")
    out = Path(out_path)
    plan = plan_batch(
        requests_path, out, retry_failed=infer.retry_failed, media_root=media_root, settings=settings,
        overwrite=overwrite,
    )
    summary = plan.summary()
    if not plan.pending:
        return summary
    # A model folder or hub id that does not resolve fails here in a second, not in every replica; the
    # decoding tasks size frames by the model's patch factor, read from its JSON files alone.
    loading.load_model_config(cfg.model)
    factor = patch_factor(cfg.model.model_name_or_path, cfg.model.revision)
    # the chat-structure tokens a record's text may not hold, as the replicas' tokenizer reads them (batch.run_batch)
    control_tokens = structural_tokens(loading.load_tokenizer(cfg.model))
    prompting, sampling = prompting_for(cfg)
    log.debug("planned %d pending requests; model config checked", len(plan.pending))
    address = _cluster_address(infer.ray_address)
    ray = _import_ray(starts_local=address is None)
    started_here = _connect(ray, address)
    log.debug("joined Ray")
    try:
        resources = ray.cluster_resources()
        replicas, gpus_each = replica_layout(
            infer.num_gpus, cfg.engine.tensor_parallel_size, infer.device, resources.get("GPU", 0)
        )
        check_cpus(replicas, infer.cpus_per_replica, infer.decode_cpus, resources.get("CPU", 0))
        if gpus_each == 0:
            log.warning("running %d engine replicas without GPUs (infer.device = %r)", replicas, infer.device)
        restarts = 0
        # One ledger for the run: its count of deaths in a row carries over a restarted pipeline's replicas.
        starts = ReplicaStarts(ray.remote(num_cpus=0)(StartLedger).remote(), infer.max_replica_start_deaths, replicas)
        while plan.pending:
            try:
                # No local name holds the dataset, so it can be collected below with the run's actor handles.
                _drain(
                    _build_dataset(
                        ray, cfg, plan, replicas, gpus_each, (prompting, sampling), factor, starts, control_tokens
                    ),
                    plan,
                    summary,
                    out,
                    infer,
                    show_progress,
                )
                break
            except PipelineStopped as stop:
                if not stop.restartable or restarts >= infer.max_pipeline_restarts:
                    raise
                restarts += 1
                reason = stop.reason
            # Out of the except block the stopped pipeline's traceback is gone: a collection frees its replicas
            # (see below) before the next pipeline asks for their CPUs and GPUs.
            gc.collect()
            # What a rerun of the command reads: the ids written so far are skipped. Failures this run wrote stay
            # (no retry_failed, no overwrite), so no request is answered twice.
            plan = plan_batch(requests_path, out, media_root=media_root, settings=settings)
            log.warning(
                "the Ray Data pipeline stopped (%s); the %d results written are kept; restart %d of %d "
                "(infer.max_pipeline_restarts) on the %d requests left",
                reason, summary.done, restarts, infer.max_pipeline_restarts, len(plan.pending),
            )  # fmt: skip
    finally:
        # Ray Data drops its handles to replicas whose tasks failed when they died, but Ray restarts those
        # actors; the remaining handles sit in reference cycles (exception tracebacks), and the actors keep
        # their CPUs and GPUs, until a collection. A later run in this process could wait for them forever.
        gc.collect()
        if started_here:
            ray.shutdown()
    return summary


def _build_dataset(
    ray,
    cfg: Config,
    plan,
    replicas: int,
    gpus_each: int,
    prompt: tuple[Prompting, SamplingConfig],
    factor: int,
    starts: ReplicaStarts | None = None,
    control_tokens: tuple[str, ...] = (),
):
    from ray.data import DataContext

    context = DataContext.get_current()
    context.enable_progress_bars = False  # the driver draws its own bar of written results
    # A block whose replica died more than max_task_retries times must not stop the corpus: its rows come
    # back missing and the driver records them as failed.
    context.max_errored_blocks = -1
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    # This logger only tells which progress bar Ray Data would draw, and warns that its bars are off: they are,
    # on purpose (the line above), so the warning would only interrupt the driver's own bar on every run.
    logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)
    # default=str: extra Parquet columns (timestamps, decimals) need not be JSON types; decoding reads only the known keys
    rows = [{"id": rid, "record": json.dumps(record, ensure_ascii=False, default=str)} for rid, record in plan.pending]
    dataset = ray.data.from_items(rows, override_num_blocks=_block_count(len(rows), cfg.engine.batch_size))
    dataset = dataset.map(
        decode_row,
        fn_kwargs={
            "root": str(plan.root), "vision": cfg.vision, "prompting": prompt[0], "factor": factor,
            "control_tokens": control_tokens,
        },  # fmt: skip
        num_cpus=cfg.infer.decode_cpus,
    )
    with warnings.catch_warnings():
        # max_restarts / max_task_retries still pass through map_batches' **ray_remote_args, which Ray
        # deprecates for 2.64 (ray-project/ray#65227); pyproject keeps ray below 2.64 until they move.
        warnings.filterwarnings("ignore", message="`ray_remote_args` is deprecated")
        return _engine_stage(dataset, cfg, replicas, gpus_each, prompt, starts)


def _engine_stage(
    dataset,
    cfg: Config,
    replicas: int,
    gpus_each: int,
    prompt: tuple[Prompting, SamplingConfig],
    starts: ReplicaStarts | None = None,
):
    from ray.data import ActorPoolStrategy

    return dataset.map_batches(
        EngineReplica,
        fn_constructor_kwargs={
            "model": cfg.model,
            "engine": cfg.engine,
            "sampling": prompt[1],
            "style": prompt[0].style,
            "reasoning": prompt[0].reasoning,
            "starts": starts,
        },
        # One batch generating and one waiting per replica: the engine never idles between batches, and a
        # replica that dies has at most TASKS_IN_FLIGHT batches (of engine.batch_size items) in flight.
        compute=ActorPoolStrategy(size=replicas, max_tasks_in_flight_per_actor=TASKS_IN_FLIGHT),
        batch_size=cfg.engine.batch_size,
        batch_format="numpy",
        num_cpus=cfg.infer.cpus_per_replica,
        num_gpus=gpus_each,
        # Restart a dead replica for as long as the job runs (`starts` ends a run whose replicas die in every
        # start); retry its in-flight batches a bounded number of times, so an item that kills every replica it
        # reaches cannot loop forever.
        max_restarts=-1,
        max_task_retries=cfg.infer.max_task_retries,
    )


def _drain(dataset, plan, summary: BatchSummary, out: Path, infer, show_progress: bool) -> None:
    """Write results as Ray Data yields them; at the end, record the pending ids that got none as failed."""
    log.debug("Ray Data pipeline built; executing")
    sink = open_sink(out, rows_per_file=infer.parquet_rows_per_file, flush_s=infer.parquet_flush_s)
    written: set[str] = set()
    try:
        with batch_progress(show_progress) as progress:
            task = progress.add_task("infer", total=len(plan.pending))
            try:
                for row in dataset.iter_rows():
                    rid = str(row["id"])
                    if rid in written:  # a retried batch answered twice: the first answer stays
                        log.warning("request %s came back twice; keeping the first result", rid)
                        continue
                    if not written:
                        log.debug("first result")
                    written.add(rid)
                    record_to(sink, summary, json.loads(row["record"]))
                    progress.advance(task)
            except Exception as exc:
                cause = _user_error(exc)
                if cause is not None:
                    raise type(cause)(str(cause)) from exc
                raise PipelineStopped(
                    f"the Ray Data pipeline stopped ({type(exc).__name__}: {exc}); the {summary.done} results "
                    f"written are kept in {out}: fix the cause and rerun the same command to resume",
                    reason=_one_line(exc),
                    restartable=_process_died(exc),
                ) from exc
            for rid, _ in plan.pending:
                if rid not in written:
                    record_to(sink, summary, {"id": rid, "error": LOST_ERROR})
                    progress.advance(task)
    finally:
        sink.close()
