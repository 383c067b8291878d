"""Benchmark: batch inference on Ray Data with one engine replica beside the single-process path, end to end.

Writes --clips synthetic H.264 clips once (PyAV, a textured scene panning, --seconds long at --clip-fps and --size;
kept under --workdir and reused) and one request per clip. Then --rounds rounds, the first path alternating
between rounds, each path timed end to end from nothing (the engine built, Ray started, every result written):

  ray     `ray.init` (a local Ray started here unless --ray-address) + `run_ray_batch` with one replica
          (infer.num_gpus = 1) + `ray.shutdown`: today's `physreason infer --jsonl ... --num-gpus 1`;
  single  `create_engine` + `run_batch` in this process: today's `physreason infer --jsonl`.
Both use the same [model] [engine] [generation] [vision] settings. Reported per run (one JSON line each on stdout,
and in $OUT/ray_infer.jsonl): end-to-end seconds, items/s, seconds to the first result, steady items/s (results after
the first batch over the time from the first batch to the last result), and for Ray its start-up phases (unless
--no-phases; from run_ray_batch's debug marks and Ray's task timeline, read after the run and outside its time;
`ray.timeline` reads the task events from Ray's GCS in the Ray releases pyproject allows, no dashboard needed):
  import_ray_s, ray_init_s, ray_shutdown_s    the driver's `import ray`, `ray.init` here, `ray.shutdown`;
  startup_plan_s       requests and output read, the model config checked (transformers), patch factor;
  startup_connect_s    `import ray.data` and Ray joined (already up here; the CLI pays ray.init in this phase);
  startup_build_s      the Ray Data dataset built (lazy);
  startup_ray_data_setup_s   execution start to the replica actor's constructor (Ray Data's own actors start);
  startup_replica_imports_s  the constructor's argument deserialization: the replica module's imports (torch, ...);
  startup_engine_build_s     the rest of the constructor: the engine built (vLLM's start, compilation included);
  startup_first_batch_s      the first engine batch; startup_*_at_s count from run_ray_batch's call;
  startup_decode_imports_s   the first decode task's imports; spilled_mib: object store spilled to disk;
  replica_omp_num_threads    OMP_NUM_THREADS in a worker with a replica's resources (Ray sets it to its CPUs);
  replica_log_timings        the replica's own timing lines (vLLM: weights, torch.compile, CUDA graphs, KV cache);
the single path's engine_load_s is its engine build in this process (its imports already paid), and once per
bench cold_single_imports_s / cold_single_engine_s: the same engine built in a fresh process, as the CLI pays it.
Then a summary line: medians per path and Ray / single.

Model: --model (a local folder or cached hub id) or, by default, a random-weight folder of --shape written once
under --workdir (bench/shapes.py: the tiny tokenizer and processor, so no download).

    python bench/ray_infer.py --engine vllm --clips 1000 --rounds 3          # GPU machine (needs vLLM and Ray)
    python bench/ray_infer.py --tiny                                         # CPU dry run, tiny model
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import re
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import harness

from physreason.chat.style import Prompting
from physreason.config import Config
from physreason.engines import create_engine
from physreason.infer import run_batch, run_ray_batch
from physreason.infer.batch import plan_batch, request_from_record
from physreason.infer.results import result_status
from physreason.models.inputs import patch_factor


def write_clip(path: Path, seconds: float, size: tuple[int, int], seed: int, fps: int = 30) -> None:
    """A textured scene panning right (every frame differs), H.264 yuv420p."""
    harness.write_panning_clip(path, max(2, int(seconds * fps)), size, fps, (0, 1), seed)


class ResultClock:
    """Polls a result file; notes when the first and the last expected result appeared."""

    def __init__(self, out: Path, expected: int) -> None:
        self.out, self.expected = out, expected
        self.first: float | None = None
        self.at_first = 0  # results already there when the first were seen (a whole batch arrives at once)
        self.last: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            count = len(result_status(self.out))
            now = time.perf_counter()
            if count and self.first is None:
                self.first, self.at_first = now, count
            if count >= self.expected:
                self.last = now
                return
            time.sleep(0.02)

    def __enter__(self) -> ResultClock:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._thread.join(timeout=5)
        self._stop.set()

    def steady(self) -> float | None:
        """Results after the first batch, per second between the first batch and the last result."""
        if self.first is None or self.last is None or self.last <= self.first:
            return None
        return (self.expected - self.at_first) / (self.last - self.first)


def measure(run, out: Path, n: int) -> dict:
    """Seconds of `run()` (every result written), items/s, time to the first result and the steady rate."""
    out.unlink(missing_ok=True)
    with ResultClock(out, n) as clock:
        start = time.perf_counter()
        summary = run()
        total = time.perf_counter() - start
    return {
        "seconds": round(total, 2),
        "items_per_s": round(n / total, 3),
        "first_result_s": None if clock.first is None else round(clock.first - start, 2),
        "steady_items_per_s": None if clock.steady() is None else round(clock.steady(), 3),
        "failed": summary.failed,
    }


def write_clips(work: Path, count: int, seconds: float, size: tuple[int, int], fps: int) -> None:
    """The clips (once: a clip already there is kept), written by a few processes."""
    missing = [i for i in range(count) if not (work / "clips" / f"{i:05d}.mp4").exists()]
    (work / "clips").mkdir(parents=True, exist_ok=True)
    with ProcessPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        futures = [pool.submit(write_clip, work / "clips" / f"{i:05d}.mp4", seconds, size, i, fps) for i in missing]
        for future in futures:
            future.result()


class DriverMarks(logging.Handler):
    """Wall-clock times of run_ray_batch's debug marks (physreason.infer.ray_pipeline), by message."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.times: dict[str, float] = {}

    def emit(self, record: logging.LogRecord) -> None:
        self.times.setdefault(record.getMessage(), record.created)

    def __enter__(self) -> DriverMarks:
        logger = logging.getLogger("physreason.infer.ray_pipeline")
        self._level = logger.level
        logger.setLevel(logging.DEBUG)
        logger.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        logger = logging.getLogger("physreason.infer.ray_pipeline")
        logger.removeHandler(self)
        logger.setLevel(self._level)


def _mark(marks: dict[str, float], prefix: str) -> float | None:
    return next((t for message, t in marks.items() if message.startswith(prefix)), None)


def startup_phases(call: float, marks: dict[str, float], events: list[dict]) -> dict:
    """Seconds of each start-up phase of one run_ray_batch call (wall clock `call`), from its marks and Ray's timeline.

    Driver (run_ray_batch's debug marks): plan_s (requests and output read, model config checked, patch factor),
    connect_s (Ray imported and joined), build_s (Ray Data dataset built). Ray Data and the cluster (Ray's
    task events): ray_data_setup_s from execution start to the first replica actor's constructor (Ray Data's own
    actors start: location tracker, autoscaling coordinator, stats), replica_imports_s (the constructor's argument
    deserialization: the replica's module with torch, physreason, the configs), engine_build_s (the rest of the
    constructor), replica_ready_at_s, first_batch_s (the first engine batch), decode_imports_s / decode_first_at_s
    (the first decode task: imports, start); *_at_s count from the call. Replicas: the slowest one.
    """

    def span(event: dict) -> tuple[float, float]:
        return event["ts"] / 1e6, (event["ts"] + event.get("dur", 0)) / 1e6

    def deserialize_in(event: dict) -> float:
        start, end = span(event)
        inner = [span(e) for e in events if e.get("cat") == "task:deserialize_arguments" and e.get("tid") == event.get("tid")
                 and start - 1e-3 <= e["ts"] / 1e6 <= end]  # fmt: skip
        return max((b - a for a, b in inner), default=0.0)

    out: dict[str, float | None] = {}
    planned, connected = _mark(marks, "planned"), _mark(marks, "joined Ray")
    built, first = _mark(marks, "Ray Data pipeline built"), _mark(marks, "first result")
    if planned and connected and built:
        out.update(plan_s=planned - call, connect_s=connected - planned, build_s=built - connected)
    inits = [e for e in events if str(e.get("cat", "")).startswith("task::MapWorker(") and e.get("name") == "__init__"]
    if inits and built:
        slowest = max(inits, key=lambda e: span(e)[1])
        start, end = span(slowest)
        imports = deserialize_in(slowest)
        out.update(ray_data_setup_s=min(span(e)[0] for e in inits) - built, replica_imports_s=imports,
                   engine_build_s=end - start - imports, replica_ready_at_s=end - call)  # fmt: skip
    batches = sorted((e for e in events if str(e.get("cat", "")).startswith("task::MapWorker(")
                      and str(e.get("cat")).endswith(".submit")), key=lambda e: e["ts"])  # fmt: skip
    if batches:
        start, end = span(batches[0])
        out.update(first_batch_at_s=start - call, first_batch_s=end - start)
    decodes = sorted((e for e in events if "decode_row" in str(e.get("cat", ""))), key=lambda e: e["ts"])
    if decodes:
        out.update(decode_first_at_s=span(decodes[0])[0] - call, decode_imports_s=deserialize_in(decodes[0]))
    if first:
        out["first_result_at_s"] = first - call
    return {f"startup_{key}": None if value is None else round(value, 2) for key, value in out.items()}


def spilled_mib() -> float | None:
    """MiB Ray spilled from its object store to disk in this session (None when Ray does not say)."""
    import ray
    from ray._private.internal_api import memory_summary

    # this session's address: on a shared machine other Ray instances may be running
    summary = memory_summary(address=ray.get_runtime_context().gcs_address, stats_only=True)
    match = re.search(r"Spilled (\d+) MiB", summary)
    return float(match.group(1)) if match else 0.0


# vLLM's own start-up timings (weights loaded, torch.compile, CUDA graphs, profiling and KV cache), as it logs them
TIMING_LINE = re.compile(r"\b(took|takes|finished in|elapsed)\b.*?\d(\.\d+)? ?(s|secs?|seconds?)\b", re.IGNORECASE)


def replica_log_timings(events: list[dict], limit: int = 40) -> list[str]:
    """Timing lines the engine replicas logged (their logs stay in Ray's session folder: log_to_driver is off)."""
    from ray._private.worker import _global_node

    if _global_node is None:
        return []
    workers = {str(e["tid"]).removeprefix("worker:") for e in events
               if str(e.get("cat", "")).startswith("task::MapWorker(") and e.get("name") == "__init__"}  # fmt: skip
    logs = Path(_global_node.get_logs_dir_path())
    lines = []
    for worker in sorted(workers):
        for path in sorted(logs.glob(f"worker-{worker}-*")):
            lines += [
                line.strip() for line in path.read_text(errors="replace").splitlines() if TIMING_LINE.search(line)
            ]
    return lines[:limit]


def replica_environment(cpus: float, gpus: float) -> dict:
    """What a worker shaped like a replica sees: its OMP_NUM_THREADS (Ray sets it to the CPUs reserved) and CPU count."""
    import ray

    @ray.remote
    def environment() -> dict:
        return {"replica_omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "replica_cpu_count": os.cpu_count()}

    return ray.get(environment.options(num_cpus=cpus, num_gpus=gpus).remote())


def run_ray(cfg: Config, requests: Path, out: Path, n: int, address: str | None, phases: bool) -> dict:
    """The Ray path end to end: Ray started, run_ray_batch with one replica, Ray shut down; its start-up phases."""
    started = time.perf_counter()
    import ray

    import_s = time.perf_counter() - started
    extra = {} if address else {"include_dashboard": False}
    ray.init(address=address, log_to_driver=False, **extra)
    init_s = time.perf_counter() - started - import_s
    call = time.time()
    with DriverMarks() as marks:
        run = measure(lambda: run_ray_batch(cfg, requests, out, show_progress=False), out, n)
    ran = time.perf_counter()
    probe: dict = {}
    if phases:
        time.sleep(1.5)  # Ray reports task events once a second: the last ones reach the timeline
        events = ray.timeline()
        gpus = cfg.engine.tensor_parallel_size if cfg.infer.device == "gpu" else 0
        probe = {**startup_phases(call, marks.times, events), "spilled_mib": spilled_mib(),
                 **replica_environment(cfg.infer.cpus_per_replica, gpus), "replica_log_timings": replica_log_timings(events)}  # fmt: skip
    probe_s = time.perf_counter() - ran
    shutdown = time.perf_counter()
    ray.shutdown()  # the replica's GPU is free for the single-process engine
    shutdown_s = time.perf_counter() - shutdown
    return {**run, "end_to_end_s": round(time.perf_counter() - started - probe_s, 2), "import_ray_s": round(import_s, 2),
            "ray_init_s": round(init_s, 2), "ray_shutdown_s": round(shutdown_s, 2), **probe}  # fmt: skip


def run_single(cfg: Config, requests: Path, out: Path, n: int) -> dict:
    """The single-process path end to end: the engine built here, run_batch, the engine released."""
    import gc

    started = time.perf_counter()
    engine = create_engine(cfg.model, cfg.engine)
    load_s = time.perf_counter() - started
    run = measure(
        lambda: run_batch(engine, requests, out, sampling=cfg.generation, vision=cfg.vision,
                          batch_size=cfg.engine.batch_size, show_progress=False),
        out, n,
    )  # fmt: skip
    end_to_end = time.perf_counter() - started
    close = getattr(engine, "close", None)
    if close is not None:
        close()
    engine = None  # the engine's memory (a GPU's worth) goes before the next run
    gc.collect()
    return {**run, "end_to_end_s": round(end_to_end, 2), "engine_load_s": round(load_s, 2)}


def cold_single_start(cfg: Config) -> dict:
    """Seconds a fresh process takes to import what the single path needs and to build its engine (the CLI's start)."""
    code = (
        "import json, sys, time\n"
        "started = time.perf_counter()\n"
        "from physreason.config import Config\n"
        "from physreason.engines import create_engine\n"
        "from physreason.infer import run_batch\n"
        "imported = time.perf_counter()\n"
        "cfg = Config.model_validate_json(sys.argv[1])\n"
        "create_engine(cfg.model, cfg.engine)\n"
        "print(json.dumps({'cold_single_imports_s': round(imported - started, 2),"
        " 'cold_single_engine_s': round(time.perf_counter() - imported, 2)}))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, cfg.model_dump_json()], capture_output=True, text=True, check=True
    )
    # vLLM logs to stdout too, before and after this line
    return json.loads(next(line for line in reversed(run.stdout.splitlines()) if line.startswith('{"cold_single')))


def emit(record: dict) -> None:
    """One JSON line on stdout and in $OUT/ray_infer.jsonl."""
    line = json.dumps(record)
    print(line, flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        with Path(os.environ["OUT"], "ray_infer.jsonl").open("a") as file:
            file.write(line + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder or cached hub id (default: --shape, random)")
    parser.add_argument("--shape", default="qwen2.5-vl-7b", help="bench/shapes.py shape of the random model")
    parser.add_argument("--engine", default="auto", choices=["auto", "vllm", "hf"])
    parser.add_argument("--clips", type=int, default=None, help="clips (default 1,000; 24 with --tiny)")
    parser.add_argument("--seconds", type=float, default=2.0, help="Length of each clip.")
    parser.add_argument("--clip-fps", type=int, default=4, help="Frame rate the clips are written at.")
    parser.add_argument("--size", default="360x640", help="HEIGHTxWIDTH of the clips.")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=64, help="engine.batch_size: requests per generate call.")
    parser.add_argument(
        "--rounds", type=int, default=None, help="rounds of both paths, first path alternating (2; --tiny 1)"
    )
    parser.add_argument("--no-phases", action="store_true", help="skip the start-up breakdown and cold start")
    parser.add_argument("--ray-address", default=None, help="Join this Ray cluster instead of starting one here.")
    parser.add_argument("--tiny", action="store_true", help="CPU dry run: tiny random model, few small clips.")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ray-infer-bench"), help="clips, model, results")
    parser.add_argument("--skip-decode", action="store_true", help="skip the serial decode measurement")
    args = parser.parse_args()
    if args.tiny:
        args.engine, args.clips, args.size = "hf", args.clips or 24, "96x128"
        args.max_tokens, args.batch_size, args.rounds = (
            min(args.max_tokens, 8),
            min(args.batch_size, 4),
            args.rounds or 1,
        )
    args.clips, args.rounds = args.clips or 1000, args.rounds or 2
    height, width = (int(v) for v in args.size.split("x"))
    work = args.workdir / ("tiny" if args.tiny else "gpu")
    work.mkdir(parents=True, exist_ok=True)
    model = args.model
    if model is None:
        from shapes import build_model_folder

        model = str(build_model_folder(work / f"model-{'tiny' if args.tiny else args.shape}", args.shape, args.tiny))
    started = time.perf_counter()
    clips_dir = work / f"clips-{args.seconds:g}s-{args.clip_fps}fps-{height}x{width}"
    write_clips(clips_dir, args.clips, args.seconds, (height, width), args.clip_fps)
    clips_s = time.perf_counter() - started
    requests = work / "requests.jsonl"
    requests.write_text("".join(
        json.dumps({"id": f"{i:05d}", "question": "What happens in this clip?",
                    "video": str(clips_dir / "clips" / f"{i:05d}.mp4")}) + "\n"
        for i in range(args.clips)
    ))  # fmt: skip
    engine = harness.engine_backend(args.engine)
    overrides = {
        "model": {"model_name_or_path": model, "dtype": "float32" if args.tiny else "bfloat16"},
        "engine": {"backend": engine, "batch_size": args.batch_size},
        "generation": {"max_tokens": args.max_tokens, "temperature": 0.0, "repetition_penalty": 1.0},
        "infer": {"num_gpus": 1, "device": "cpu" if args.tiny else "gpu", "ray_address": args.ray_address},
    }
    if args.tiny:
        overrides["vision"] = {"min_pixels": 3136, "max_pixels": 56 * 84, "total_pixels": 56 * 84 * 8}
        # A CPU replica computes with its Ray CPUs' worth of threads (OMP_NUM_THREADS); match it here.
        import torch

        torch.set_num_threads(1)
    cfg = Config.model_validate(overrides)
    setup = {"kind": "setup", **harness.device_info(), "host": platform.node(), "engine": engine, "model": model,
             "clips": args.clips, "clip": f"{args.seconds:g} s {height}x{width} H.264 {args.clip_fps} fps",
             "max_tokens": args.max_tokens, "batch_size": args.batch_size, "clips_written_s": round(clips_s, 1),
             "cpu_cores": os.cpu_count()}  # fmt: skip
    if not args.no_phases:
        setup.update(cold_single_start(cfg))
    emit(setup)
    runs: dict[str, list[dict]] = {"ray": [], "single": []}
    for round_index in range(args.rounds):
        order = ("ray", "single") if round_index % 2 == 0 else ("single", "ray")
        for path in order:
            out = work / f"{path}.jsonl"
            if path == "ray":
                result = run_ray(cfg, requests, out, args.clips, args.ray_address, not args.no_phases)
            else:
                result = run_single(cfg, requests, out, args.clips)
            runs[path].append(result)
            emit({"kind": "run", "path": path, "round": round_index, **result})
    summary = {"kind": "summary", "clips": args.clips, "rounds": args.rounds}
    for path, results in runs.items():
        keys = ("end_to_end_s", "first_result_s", "steady_items_per_s", "engine_load_s", "import_ray_s", "ray_init_s",
                "ray_shutdown_s", *sorted({k for r in results for k in r if k.startswith("startup_")}))  # fmt: skip
        for key in keys:
            values = [r[key] for r in results if r.get(key) is not None]
            if values or key in ("end_to_end_s", "first_result_s", "steady_items_per_s"):
                summary[f"{path}_{key}_median"] = round(statistics.median(values), 3) if values else None
    if summary["ray_end_to_end_s_median"] and summary["single_end_to_end_s_median"]:
        summary["ray_over_single_end_to_end"] = round(
            summary["ray_end_to_end_s_median"] / summary["single_end_to_end_s_median"], 3
        )
    if not args.skip_decode:
        summary["decode"] = decode_rate(cfg, requests, model, args.clips)
    emit(summary)


def decode_rate(cfg: Config, requests: Path, model: str, clips: int) -> dict:
    """Clips/s of `request_from_record` (decode, sample, resize, messages) serially in this process."""
    plan = plan_batch(requests, requests.parent / "none.jsonl")
    started = time.perf_counter()
    frames = 0
    for rid, record in plan.pending:
        request = request_from_record(record, rid, plan.root, cfg.vision, Prompting(), patch_factor(model))
        frames += sum(len(v.frames) for v in request.videos)
    seconds = time.perf_counter() - started
    return {"clips_per_s_one_process": round(clips / seconds, 3), "sampled_frames_per_s": round(frames / seconds, 1)}


if __name__ == "__main__":
    main()
