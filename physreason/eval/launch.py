"""Run a whole evaluation: every repeat of every data set, split over shard processes, then merged.

Shards = eval.num_gpus / eval.tp_size. With one shard the work runs in this process; with more, each
shard is a subprocess (`python -m physreason.eval.worker`) that sees only its own GPUs through
CUDA_VISIBLE_DEVICES and answers every k-th sample. On CPU the shards are processes all the same.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from physreason.config import Config, EngineConfig, SamplingConfig, dump_config
from physreason.cpu import cpu_share, decode_ahead_threads
from physreason.errors import ConfigError, PhysReasonError
from physreason.eval.benchmark import Benchmark, load_benchmark
from physreason.eval.results import (
    CONFIG_FILE,
    MODEL_FOLDERS_LOCK,
    RUN_FILE,
    answer_type_dir,
    finished_in_run,
    merge_shards,
    read_run,
    read_run_info,
    result_files,
    run_dir,
    write_run_info,
)
from physreason.eval.runner import ShardCounts, ShardJob, evaluate_shards, shard_samples
from physreason.eval.settings import (
    MODEL_IDENTITY,
    EvalSetup,
    effective_config,
    legacy_fingerprint,
    model_identity,
    reproduction_settings,
)
from physreason.infer.results import open_for_append
from physreason.models.source import check_model_source
from physreason.progress import LoggedProgress, progress_display
from physreason.train.runlock import LOCK_NAME, holding

log = logging.getLogger(__name__)

# Settings that change what a model answers: a resumed run must not mix results made under others.
_RESULT_SETTINGS = ("generation", "vision", "prompt", "model.model_name_or_path", "model.revision", "model.dtype")


@dataclass(frozen=True)
class EvalPlan:
    """One evaluation, resolved once (plan_eval) and passed down to everything that runs or records it.

    `config` is the effective config (eval.settings.effective_config: prompt style and mode, answer type and
    generation settings explicit): it is stored beside the results, and each shard process builds its plan from
    that stored copy, which resolves to the same plan.
    """

    config: Config
    setup: EvalSetup  # prompting, sampling before each repeat's seed, answer type
    base: Path  # the answer-type folder every run folder is under
    benchmarks: tuple[Benchmark, ...]
    seeds: tuple[int, ...]  # one per repeat: eval.seed, eval.seed + 1, ...
    engine: EngineConfig  # the engine settings with eval.tp_size as the tensor-parallel size
    num_shards: int  # eval.num_gpus / eval.tp_size

    def runs(self) -> list[tuple[Benchmark, int, Path]]:
        """Every (data set, seed, run folder), repeat by repeat."""
        return [(b, seed, run_dir(self.base, b.name, seed)) for seed in self.seeds for b in self.benchmarks]


@dataclass
class RunStatus:
    """The state of one repeat of one data set after a run."""

    dataset: str
    seed: int
    total: int
    answered: int
    failed: int

    @property
    def missing(self) -> int:
        """Samples with no result yet (a shard stopped early)."""
        return self.total - self.answered - self.failed


@dataclass
class EvalOutcome:
    """Per-run states, how many results existed before this run, and the folder everything is under."""

    base: Path
    runs: list[RunStatus] = field(default_factory=list)
    resumed: int = 0


def plan_eval(cfg: Config, base: Path | None = None) -> EvalPlan:
    """Resolve the evaluation's settings once, load every data set in `eval.datasets` and list the seeds
    (eval.seed, eval.seed + 1, ...); raises ConfigError on a setting no run could use. Reads no model weights.

    `base`: the answer-type folder, as the launcher chose it (a shard process is given it); by default it is chosen
    here (answer_type_dir), which run_eval checks again while it holds the results folder's MODEL_FOLDERS_LOCK."""
    if not cfg.eval.datasets:
        raise ConfigError("eval.datasets is empty: list data set names under eval.benchmark_root, or JSON/JSONL files")
    cfg, setup = effective_config(cfg)  # config errors before any data set is read; from here on, the resolved one
    benchmarks = [load_benchmark(spec, cfg.eval.benchmark_root) for spec in cfg.eval.datasets]
    if cfg.eval.limit is not None:
        benchmarks = [dataclasses.replace(b, samples=b.samples[: cfg.eval.limit]) for b in benchmarks]
    names = [b.name for b in benchmarks]
    if len(set(names)) != len(names):
        raise ConfigError(f"eval.datasets names the same data set twice ({names}); each needs its own results folder")
    label = results_label(setup.answer_type, benchmarks)
    if base is None:
        base = answer_type_dir(cfg.eval.results_dir, cfg.model.model_name_or_path, label, cfg.eval.model_name)
    seeds = tuple(cfg.eval.seed + k for k in range(cfg.eval.num_repeats))
    for seed in seeds:
        repeat_sampling(cfg.generation, seed)
    return EvalPlan(
        config=cfg,
        setup=setup,
        base=base,
        benchmarks=tuple(benchmarks),
        seeds=seeds,
        engine=_engine_config(cfg),
        num_shards=cfg.eval.num_gpus // cfg.eval.tp_size,
    )


# The answer-type folder of a non-reasoning run, by the kind of question its data sets ask.
_TASK_LABELS = {"box_2d": "grounding", "point_2d": "grounding", "time_span": "localization"}


def results_label(answer_type: str, benchmarks: list[Benchmark]) -> str:
    """The answer-type folder's name: `reasoning`, or for a run without reasoning its task type: `letter` for
    multiple choice, `grounding` for boxes and points, `localization` for time spans (joined with '-' when the
    data sets mix them, e.g. `grounding-letter`)."""
    if answer_type == "reasoning":
        return answer_type
    from physreason.chat.structured import answer_kind

    kinds = set()
    for benchmark in benchmarks:
        for sample in benchmark.samples:
            if not sample.structured:
                kinds.add("letter" if sample.error is None else None)
                continue
            try:
                kinds.add(_TASK_LABELS[answer_kind(sample.answer)])
            except ValueError:
                kinds.add(None)  # scored as a failure; it names no task
    kinds.discard(None)
    return "-".join(sorted(kinds)) if kinds else answer_type


def repeat_sampling(sampling: SamplingConfig, seed: int) -> SamplingConfig:
    """The sampling settings of the repeat with `seed`: the repeat's seed replaces generation.seed (and the style's)."""
    if sampling.n != 1:
        raise ConfigError(
            f"generation.n = {sampling.n}: evaluation scores one completion per question; "
            "set generation.n = 1 and use eval.num_repeats for repeated runs"
        )
    return sampling.model_copy(update={"seed": seed})


def check_resumable(base: Path, cfg: Config) -> None:
    """Refuse to add results to a folder whose earlier results were made with other generation/vision/prompt/model
    settings (compared as resolved: a style's sampling defaults count as set) or with other weights at the same
    model path (the content hash or Hub commit each run.json records)."""
    _check_resumable(
        base, lambda: effective_config(cfg)[0], lambda: model_identity(cfg), lambda: legacy_fingerprint(cfg)
    )


def _check_resumable(
    base: Path,
    resolved: Callable[[], Config],
    identity: Callable[[], dict[str, str | None]],
    legacy: Callable[[], str | None] = lambda: None,
) -> None:
    # `resolved` gives the effective config and `identity` the model's (model_identity); they are asked for only when
    # the folder holds results to compare against.
    stored_path = base / CONFIG_FILE
    if not stored_path.is_file():
        return
    if not any(finished_in_run(run) for run in base.glob("*/seed_*")):
        # A run that stopped before its first result made nothing its settings could skew.
        log.warning("%s holds no result yet: its settings (%s) are replaced by this run's", base, stored_path)
        return
    try:
        stored = tomllib.loads(stored_path.read_text(encoding="utf-8"))
        why = "" if stored else "it is empty"
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        stored, why = {}, f"{type(exc).__name__}: {exc}"
    if why:
        # Empty or cut short: a run stopped while writing it (older versions wrote it in place on every run).
        raise ConfigError(
            f"{stored_path} cannot be read ({why}); it records the settings of the results in {base}. Delete it "
            "(the results stay) and rerun with the settings those results were made with"
        )
    current = resolved().model_dump(mode="json", exclude_none=True)
    changed = [
        key
        for key in _RESULT_SETTINGS
        # Folders written before [prompt] existed hold no prompt settings; their other settings still decide.
        if not (key == "prompt" and key not in stored)
        and _without_seed(_lookup(stored, key)) != _without_seed(_lookup(current, key))
    ]
    if changed:
        raise ConfigError(
            f"{base} holds results made with different {', '.join(changed)} (see {stored_path}); mixing them "
            "would skew the scores: use another eval.results_dir, restore those settings, or delete the folder"
        )
    _check_same_model(base, identity(), legacy)


# How the error names each MODEL_IDENTITY key.
_IDENTITY_NAMES = {"model_commit": "Hub commit", "model_fingerprint": "content hash"}


def _check_same_model(
    base: Path, current: dict[str, str | None], legacy: Callable[[], str | None] = lambda: None
) -> None:
    """Refuse when a run under `base` holds results its run.json says were made with other weights than `current`.

    A value unknown on either side (a run.json written before content hashes were recorded, a Hub model not in the
    cache) decides nothing: such results resume as they are. A content hash recorded the older way (every file of the
    folder, `legacy()`) matches as well, asked for only when the current one differs.
    """
    for run in sorted(base.glob("*/seed_*")):
        if not finished_in_run(run):
            continue
        stored = read_run_info(run).get("settings")
        stored = stored if isinstance(stored, dict) else {}
        for key in MODEL_IDENTITY:
            old, new = stored.get(key), current.get(key)
            if old is not None and new is not None and old != new:
                if key == "model_fingerprint" and old == legacy():
                    continue
                name = _IDENTITY_NAMES[key]
                raise ConfigError(
                    f"{base} holds results of another model: {run / RUN_FILE} records the {name} {old}, and the "
                    f"model at that path has the {name} {new} now; adding to those results would credit one model's "
                    "scores to the other. Write to another --out (eval.results_dir), name this model's folder with "
                    f"--set eval.model_name=NAME, or delete {base} to start over"
                )


def _lookup(tree: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


def _without_seed(section: Any) -> Any:
    # Each repeat sets its own seed, so generation.seed never decides a result.
    return {k: v for k, v in section.items() if k != "seed"} if isinstance(section, dict) else section


def prepare_runs(plan: EvalPlan) -> int:
    """Check the folder can be resumed, store the resolved config and each run's `run.json` (with what a
    reproduction needs); return how many results are already there.

    A run that holds results keeps the model identity (MODEL_IDENTITY) its run.json recorded with them: the check
    refused other weights, and results recorded without one stay without one rather than take this model's."""
    settings = reproduction_settings(plan.config, plan.setup)
    current = {key: settings[key] for key in MODEL_IDENTITY}
    _check_resumable(plan.base, lambda: plan.config, lambda: current, lambda: legacy_fingerprint(plan.config))
    plan.base.mkdir(parents=True, exist_ok=True)
    dump_config(plan.config, plan.base / CONFIG_FILE)
    existing = 0
    for benchmark, seed, run in plan.runs():
        run_settings = settings
        if finished_in_run(run):
            stored = read_run_info(run).get("settings")
            recorded = {key: stored.get(key) if isinstance(stored, dict) else None for key in MODEL_IDENTITY}
            unknown = [_IDENTITY_NAMES[k] for k in MODEL_IDENTITY if recorded[k] is None and current[k] is not None]
            if unknown:
                log.warning(
                    "%s holds results whose run.json records no %s of the model (an older physreason wrote it): "
                    "which weights made them is unknown; they are resumed as they are and run.json keeps none",
                    run,
                    " or ".join(unknown),
                )
            run_settings = settings | recorded
        info = {
            "dataset": benchmark.name,
            "seed": seed,
            "total": len(benchmark.samples),
            "chance": chance_accuracy(benchmark),
            "model": plan.config.model.model_name_or_path,
            "answer_type": plan.setup.answer_type,
            "settings": run_settings | {"seed": seed},
        }
        if benchmark.board is not None:
            info["board"] = benchmark.board
        write_run_info(run, info)
        existing += len(finished_in_run(run) & {s.id for s in benchmark.samples})
    return existing


def chance_accuracy(benchmark: Benchmark) -> float | None:
    """Accuracy of a uniform guess: the mean over questions of 1 / options (None when no question has options)."""
    counts = [len(s.options) for s in benchmark.samples if s.options]
    return sum(1 / n for n in counts) / len(counts) if counts else None


def discard_unstarted_runs(plan: EvalPlan) -> None:
    """Remove the run folders of `plan` that hold no result, and the folders left empty above them.

    Called when an evaluation fails: without it, the run.json written up front would make `eval report` list the
    model with every question "missing". The stored config goes too when no run of this model has a result, so
    a corrected rerun is not refused for settings no result was made with. Shard logs stay (they say what failed),
    and so does the folder's run lock (the answer-type folder then holds only `.physreason.lock`).
    """
    for _, _, run in plan.runs():
        if not result_files(run):
            (run / RUN_FILE).unlink(missing_ok=True)
            _remove_if_empty(run, run.parent)
    if not any(result_files(run) for run in plan.base.glob("*/seed_*")):
        (plan.base / CONFIG_FILE).unlink(missing_ok=True)
        _remove_if_empty(plan.base, plan.base.parent)


def _remove_if_empty(*folders: Path) -> None:
    for folder in folders:
        # A folder holding only lock files stays: run_eval holds the answer-type folder's lock until it returns, and a
        # held lock file is never deleted (an evaluation that opened it just before would lock the deleted file while
        # the next one locks a new file, and both would run here). Such a folder counts as empty (holds_more_than_locks)
        # and holds no config.toml, so it names no model's results.
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()


def run_shard(plan: EvalPlan, shard: int, num_shards: int, *, show_progress: bool = False) -> list[ShardCounts]:
    """Load the engine once and answer this shard's samples of every repeat and data set."""
    from physreason.engines import create_engine

    setup, engine_cfg = plan.setup, plan.engine
    with create_engine(plan.config.model, engine_cfg) as engine:
        # Clips decode in threads of this process's CPU share while the engine answers the batch before (one thread is
        # the engine's). One after another, decoding and patchifying cost ~13 ms of CPU a grounding-experiment clip: ~4 s
        # of 300, as much as a small model's whole generation on a GPU.
        decode_workers = decode_ahead_threads()
        runs = plan.runs()
        todo = 0
        for benchmark, _, run in runs:
            done = finished_in_run(run)
            todo += sum(1 for s in shard_samples(benchmark.samples, shard, num_shards) if s.id not in done)
        jobs = [ShardJob(benchmark, run, repeat_sampling(setup.sampling, seed)) for benchmark, seed, run in runs]
        # each repeat names its own seed, as when the repeats ran one after another
        names = [f"{benchmark.name} seed {seed}" for benchmark, seed, _ in runs]
        with _progress(show_progress) as progress:
            task = progress.add_task(f"eval {', '.join(names)}"[:100], total=todo)
            # Every data set and repeat in one stream: those of the same sampling share generate calls (evaluate_shards).
            counts = evaluate_shards(
                engine,
                jobs,
                prompting=setup.prompting,
                vision=plan.config.vision,
                shard=shard,
                num_shards=num_shards,
                batch_size=engine_cfg.batch_size,
                on_result=lambda _record: progress.advance(task),
                decode_workers=decode_workers,
            )
        return counts


def _engine_config(cfg: Config) -> EngineConfig:
    """The engine settings with eval.tp_size as the tensor-parallel size (the two must not disagree)."""
    if cfg.engine.tensor_parallel_size not in (1, cfg.eval.tp_size):
        raise ConfigError(
            f"engine.tensor_parallel_size = {cfg.engine.tensor_parallel_size} but eval.tp_size = {cfg.eval.tp_size}: "
            "evaluation sizes engines by eval.tp_size; set engine.tensor_parallel_size to the same value or leave it at 1"
        )
    return cfg.engine.model_copy(update={"tensor_parallel_size": cfg.eval.tp_size})


def _progress(show: bool) -> LoggedProgress:
    return progress_display(disable=not show)


def shard_devices(shard: int, tp_size: int, num_gpus: int, visible: str | None) -> str:
    """CUDA_VISIBLE_DEVICES for one shard: its tp_size GPUs, taken from the already visible ones when set."""
    pool = [d.strip() for d in visible.split(",") if d.strip()] if visible else [str(i) for i in range(num_gpus)]
    if len(pool) < num_gpus:
        raise ConfigError(
            f"eval.num_gpus = {num_gpus} but CUDA_VISIBLE_DEVICES={visible!r} shows {len(pool)}: "
            "lower eval.num_gpus or make more GPUs visible"
        )
    return ",".join(pool[shard * tp_size : (shard + 1) * tp_size])


def _launch_shards(plan: EvalPlan, show_progress: bool) -> list[tuple[int, int, Path]]:
    """Start one worker process per shard, show combined progress from their files; return failed (shard, code, log).

    Each worker builds its plan from the effective config prepare_runs stored (the plan's serialised form), in the
    answer-type folder it is given (--base: the one this process chose and holds, not one chosen again). Every
    shard's log is opened before any worker starts: one that cannot be (a symbolic link there, refused: a log is
    appended to in place, never through a link into the file it names) leaves no worker running."""
    num_shards, eval_cfg = plan.num_shards, plan.config.eval
    logs = plan.base / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    log_paths = [logs / f"shard-{shard}-of-{num_shards}.log" for shard in range(num_shards)]
    processes = []
    with contextlib.ExitStack() as opened:
        log_files = [
            opened.enter_context(open_for_append(path, "a shard's log is appended to in place")) for path in log_paths
        ]
        for shard, (log_path, log_file) in enumerate(zip(log_paths, log_files, strict=True)):
            devices = shard_devices(shard, eval_cfg.tp_size, eval_cfg.num_gpus, visible)
            env = os.environ | {"CUDA_VISIBLE_DEVICES": devices}
            # Shards share this process's CPUs (video decoding, CPU engines): without a limit each would start a thread
            # per core of the whole host.
            env.setdefault("OMP_NUM_THREADS", str(max(1, cpu_share().threads // num_shards)))
            command = [
                sys.executable,
                "-m",
                "physreason.eval.worker",
                "--config",
                str(plan.base / CONFIG_FILE),
                "--base",
                str(plan.base),
                "--shard",
                str(shard),
                "--num-shards",
                str(num_shards),
            ]
            processes.append(
                (shard, subprocess.Popen(command, env=env, stdout=log_file, stderr=subprocess.STDOUT), log_path)
            )
    total = sum(len(b.samples) for b, _, _ in plan.runs())
    try:
        with _progress(show_progress) as progress:
            task = progress.add_task(f"eval ({num_shards} shards)", total=total)
            while any(p.poll() is None for _, p, _ in processes):
                progress.update(task, completed=_finished_count(plan))
                time.sleep(1.0)
            progress.update(task, completed=_finished_count(plan))
    except BaseException:
        for _, process, _ in processes:
            process.terminate()
        for _, process, _ in processes:
            process.wait()
        raise
    return [(shard, p.returncode, log_path) for shard, p, log_path in processes if p.returncode != 0]


def _finished_count(plan: EvalPlan) -> int:
    return sum(len(finished_in_run(run)) for _, _, run in plan.runs())


def run_eval(
    cfg: Config, *, show_progress: bool = True, on_start: Callable[[EvalPlan], None] | None = None
) -> EvalOutcome:
    """Evaluate every repeat of every data set, resuming from saved results, and merge the shards' files.

    The settings are resolved once, here (plan_eval); everything below is given that plan. `on_start` is called
    with the plan once the settings are checked, before anything is written or a model loads (the CLI prints its
    start-up summary there). Raises PhysReasonError after merging when a shard process failed; rerunning resumes.
    """
    from physreason.models.inputs import checked_vision_factor

    # One line, in seconds, for a model that can be neither read here nor fetched (offline: no minute of retries)
    check_model_source(cfg.model.model_name_or_path, cfg.model.revision)
    plan = plan_eval(cfg)
    checked_vision_factor(plan.config)  # the model is found and the pixel budgets fit it before the folder is touched
    if on_start is not None:
        on_start(plan)
    with contextlib.ExitStack() as held:
        plan, resumed = _take_folder(plan, held)
        return _run_planned(plan, show_progress, resumed)


# How long an evaluation waits for another one to choose its model's folder (prepare_runs: well under a second).
MODEL_FOLDERS_WAIT_S = 300.0


def _take_folder(plan: EvalPlan, held: contextlib.ExitStack) -> tuple[EvalPlan, int]:
    """Choose the model's folder again and take it: lock its answer-type folder (until `held` closes) and prepare the
    runs there (prepare_runs: its config.toml records the folder's model), all while holding the results folder's
    MODEL_FOLDERS_LOCK; return the plan (with the folder chosen here) and how many results were already there.

    plan_eval's choice was made unlocked: another evaluation started at the same time, of another model with the same
    label, may have taken that folder since; it is then found to hold that model's config.toml and the next free
    folder is taken. Without this lock both would take it (the answer-type folders' locks differ when the answer modes
    do), and a rerun of either model would be sent to another folder than its results."""
    cfg = plan.config
    root = Path(cfg.eval.results_dir).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    with holding(
        root / MODEL_FOLDERS_LOCK,
        f"the choice of a model's folder in {root}",
        f"an evaluation chooses its model's folder and records its model there, which takes a moment; this one waited "
        f"{MODEL_FOLDERS_WAIT_S:.0f} s. Stop that process if it is stuck, or set another eval.results_dir",
        wait_s=MODEL_FOLDERS_WAIT_S,
    ):
        base = answer_type_dir(root, cfg.model.model_name_or_path, plan.base.name, cfg.eval.model_name)
        if base != plan.base:
            log.warning(
                "%s holds another model's results now (an evaluation started at the same time took it): this "
                "evaluation writes to %s instead",
                plan.base.parent,
                base.parent,
            )
            plan = dataclasses.replace(plan, base=base)
        plan.base.mkdir(parents=True, exist_ok=True)
        held.enter_context(
            holding(
                plan.base / LOCK_NAME,
                f"the evaluation folder {plan.base}",
                "two evaluations writing one folder repeat and mix results. Wait for that one to end (or stop it), or "
                "set another eval.results_dir or eval.model_name",
            )
        )
        return plan, prepare_runs(plan)


def _run_planned(plan: EvalPlan, show_progress: bool, resumed: int) -> EvalOutcome:
    """run_eval's work once the plan is made, the folder held and its runs prepared: run the shards, merge, count."""
    outcome = EvalOutcome(base=plan.base, resumed=resumed)
    failed_shards: list[tuple[int, int, Path]] = []
    try:
        if plan.num_shards == 1:
            run_shard(plan, 0, 1, show_progress=show_progress)
        else:
            failed_shards = _launch_shards(plan, show_progress)
    except BaseException:  # an engine that cannot load, Ctrl-C: the error goes on, but not as a model with no answers
        discard_unstarted_runs(plan)
        raise
    if failed_shards:
        discard_unstarted_runs(plan)
    for benchmark, seed, run in plan.runs():
        merge_shards(run, order=[s.id for s in benchmark.samples])
        records = read_run(run)
        ids = {s.id for s in benchmark.samples}
        failed = sum(1 for i, r in records.items() if i in ids and "error" in r)
        answered = sum(1 for i, r in records.items() if i in ids and "error" not in r)
        outcome.runs.append(RunStatus(benchmark.name, seed, len(benchmark.samples), answered, failed))
    if failed_shards:
        details = "; ".join(f"shard {s} exited with code {code} (log: {path})" for s, code, path in failed_shards)
        raise PhysReasonError(f"{details}. Results so far are saved in {plan.base}; rerun the same command to resume")
    return outcome


def accuracy_by_dataset(cfg: Config, results_dir: str | Path, *, show_progress: bool = True) -> dict[str, float | None]:
    """Evaluate cfg's model on its benchmarks into `results_dir` (resumable there); mean accuracy per dataset."""
    from physreason.eval.report import collect_reports
    from physreason.eval.scoring import mean_std

    cfg = cfg.model_copy(deep=True)
    cfg.eval.results_dir = str(results_dir)
    outcome = run_eval(cfg, show_progress=show_progress)
    # This run's model, data sets and seeds only: what an earlier run left in the folder is not averaged in.
    seeds, datasets = {str(run.seed) for run in outcome.runs}, {run.dataset for run in outcome.runs}
    return {
        report.dataset: mean_std([r.accuracy for r in report.repeats if r.seed in seeds and r.accuracy is not None])[0]
        for report in collect_reports(outcome.base)
        if report.dataset in datasets
    }
