"""Batch inference on Ray Data over N GPUs (one engine replica a GPU) beside the single-process path, end to end.

Clips, rounds and rows: bench/RESULTS.md ("How the scripts measure"). JSON to $OUT/ray_infer.json.
    python bench/ray_infer.py --engine vllm --clips 1000 --gpus 1,2,4 --rounds 2   # GPU machine (vLLM and Ray)
    python bench/ray_infer.py --tiny                                                # CPU dry run, tiny model
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import harness

from physreason.chat.style import Prompting
from physreason.config import Config
from physreason.engines import create_engine
from physreason.infer import run_batch, run_ray_batch
from physreason.infer.batch import plan_batch, request_from_record, resolve_decode_workers
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
    """Seconds of `run()` (every result written), time to the first result and the steady rate."""
    out.unlink(missing_ok=True)
    with ResultClock(out, n) as clock:
        start = time.perf_counter()
        summary = run()
        total = time.perf_counter() - start
    first, steady = clock.first, clock.steady()
    return {"run_s": round(total, 2), "first_result_s": None if first is None else round(first - start, 2),
            "steady_clips_per_s": None if steady is None else round(steady, 3), "failed": summary.failed}  # fmt: skip


def write_clips(work: Path, count: int, seconds: float, size: tuple[int, int], fps: int) -> None:
    """The clips (once: a clip already there is kept), written by a few processes."""
    missing = [i for i in range(count) if not (work / "clips" / f"{i:05d}.mp4").exists()]
    (work / "clips").mkdir(parents=True, exist_ok=True)
    with ProcessPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        futures = [pool.submit(write_clip, work / "clips" / f"{i:05d}.mp4", seconds, size, i, fps) for i in missing]
        for future in futures:
            future.result()


def run_ray(cfg: Config, requests: Path, out: Path, n: int, gpus: int) -> dict:
    """The Ray path end to end on `gpus` GPUs: Ray started, run_ray_batch, Ray shut down (the GPUs free again)."""
    started = time.perf_counter()
    import ray

    cfg = cfg.model_copy(update={"infer": cfg.infer.model_copy(update={"num_gpus": gpus})})
    address = cfg.infer.ray_address
    ray.init(address=address, log_to_driver=False, **({} if address else {"include_dashboard": False}))
    init_s = time.perf_counter() - started
    run = measure(lambda: run_ray_batch(cfg, requests, out, show_progress=False), out, n)
    ray.shutdown()
    end_to_end = time.perf_counter() - started
    return {**run, "end_to_end_s": round(end_to_end, 2), "clips_per_s": round(n / end_to_end, 3),
            "ray_init_s": round(init_s, 2)}  # fmt: skip


def run_single(cfg: Config, requests: Path, out: Path, n: int) -> dict:
    """The single-process path end to end, in a process of its own: `physreason infer --jsonl` as a user runs it.

    The child builds the engine, runs run_batch and exits; "end_to_end_s" is from its spawn to its exit (the process's
    start-up, imports and engine included), so the engine's GPU memory leaves with the process. (vLLM's engine, dropped
    in this process before engines had close(), kept ~120 GiB of the H200 it ran on and the next path's engine could
    not start: 2026-11-27. The child closes its engine now too.) "engine_load_s" and "run_s" are the child's own timings of the engine's build and of run_batch.
    """
    import subprocess
    import sys
    import tempfile
    from types import SimpleNamespace

    with tempfile.TemporaryDirectory(prefix="ray-infer-single-") as tmp:
        spec, result = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec.write_text(json.dumps({"config": cfg.model_dump(mode="json"), "requests": str(requests), "out": str(out),
                                    "result": str(result)}))  # fmt: skip
        child: dict = {}

        def run() -> SimpleNamespace:
            done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child-single", str(spec)])
            if done.returncode != 0 or not result.is_file():
                raise SystemExit(f"the single-process path exited with code {done.returncode}: its output is above")
            child.update(json.loads(result.read_text()))
            return SimpleNamespace(failed=child["failed"])

        timing = measure(run, out, n)
    return {**timing, **child, "end_to_end_s": timing["run_s"], "clips_per_s": round(n / timing["run_s"], 3)}


def single_child(spec_path: Path) -> None:
    """--child-single: build the engine, run the batch, write the timings the parent cannot see to spec's "result"."""
    spec = json.loads(spec_path.read_text())
    cfg = Config.model_validate(spec["config"])
    if cfg.infer.device == "cpu":
        import torch

        torch.set_num_threads(1)  # as the --tiny parent does: a CPU replica's one thread
    started = time.perf_counter()
    with create_engine(cfg.model, cfg.engine) as engine:
        load_s = time.perf_counter() - started
        summary = run_batch(engine, Path(spec["requests"]), Path(spec["out"]), sampling=cfg.generation,
                            vision=cfg.vision, batch_size=cfg.engine.batch_size, show_progress=False,
                            decode_workers=cfg.infer.decode_workers)  # fmt: skip
        run_s = time.perf_counter() - started - load_s
    Path(spec["result"]).write_text(json.dumps({"engine_load_s": round(load_s, 2), "run_s": round(run_s, 2),
                                                "failed": summary.failed,
                                                "decode_workers": resolve_decode_workers(cfg.infer.decode_workers)}))  # fmt: skip


def summarize(rows: list[dict]) -> dict:
    """Medians per path (single, ray-N), each Ray path's clips/s over the single path's and over Ray on 1 GPU."""
    summary: dict = {}
    paths = list(dict.fromkeys(row["path"] for row in rows))
    for path in paths:
        for key in ("end_to_end_s", "clips_per_s", "first_result_s", "steady_clips_per_s"):
            values = [row[key] for row in rows if row["path"] == path and row.get(key) is not None]
            summary[f"{path}_{key}_median"] = round(statistics.median(values), 3) if values else None
    single, one = summary.get("single_clips_per_s_median"), summary.get("ray-1_clips_per_s_median")
    for path in paths:
        rate = summary[f"{path}_clips_per_s_median"]
        if path == "single" or not rate:
            continue
        if single:
            summary[f"{path}_over_single"] = round(rate / single, 3)
        if one and path != "ray-1":
            summary[f"{path}_over_ray-1"] = round(rate / one, 3)
    return summary


def earlier_rows(path: Path | None, setup: dict) -> list[dict]:
    """--append: the rows of the JSON at `path` (none when there is no file), refused when it was measured elsewhere."""
    if path is None:
        raise SystemExit("--append needs the JSON's place: give --json PATH or set OUT")
    if not path.is_file():
        return []
    earlier = json.loads(path.read_text())
    for key in ("device", "gpus", "engine", "model", "clips", "clip", "max_tokens", "batch_size", "cuda_graph_sizes"):
        if earlier.get(key) != setup.get(key):
            raise SystemExit(f"--append: {path} was measured with {key} {earlier.get(key)!r}, this run has "
                             f"{setup.get(key)!r}: compare only runs of one setup on one machine (other --json)")
    return list(earlier.get("rows", []))


def gpu_counts(text: str) -> list[int]:
    """--gpus: comma-separated GPU counts of the Ray path, each at least 1."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"--gpus {text!r}: give comma-separated GPU counts of at least 1, e.g. 1,2,4")
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder or cached hub id (default: --shape, random)")
    parser.add_argument("--shape", default="qwen2.5-vl-7b", help="bench/shapes.py shape of the random model")
    parser.add_argument("--engine", default="auto", choices=["auto", "vllm", "hf"])
    parser.add_argument("--gpus", type=gpu_counts, default=[1], help="GPU counts of the Ray path, e.g. 1,2,4 (1)")
    parser.add_argument("--clips", type=int, default=None, help="clips (default 1,000; 24 with --tiny)")
    parser.add_argument("--seconds", type=float, default=2.0, help="Length of each clip.")
    parser.add_argument("--clip-fps", type=int, default=4, help="Frame rate the clips are written at.")
    parser.add_argument("--size", default="360x640", help="HEIGHTxWIDTH of the clips.")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=64, help="engine.batch_size: requests per generate call.")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds of every path, first path alternating (2; --tiny 1)")
    parser.add_argument("--ray-address", default=None, help="Join this Ray cluster instead of starting one here.")
    parser.add_argument("--tiny", action="store_true", help="CPU dry run: tiny random model, few small clips.")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ray-infer-bench"), help="clips, model, results")
    parser.add_argument("--skip-decode", action="store_true", help="skip the serial decode measurement")
    parser.add_argument("--no-single", action="store_true", help="run only the Ray paths (e.g. the single path's "
                        "rows are already in the JSON: --append)")
    parser.add_argument("--append", action="store_true", help="keep the rows already in the JSON (the same device "
                        "only) and add this run's; the summary covers them all")
    parser.add_argument("--no-ray", action="store_true", help="run only the single path (e.g. again with another "
                        "--decode-workers, --append)")
    parser.add_argument("--decode-workers", type=int, default=None, help="the single path's infer.decode_workers "
                        "(threads decoding the next batch while the engine answers; default: the config's)")
    parser.add_argument("--cuda-graph-sizes", choices=["vllm", "batch"], default="vllm",
                        help="engine.cuda_graph_sizes of every path (batch: --batch-size and the powers of two below)")
    parser.add_argument("--child-single", type=Path, default=None, help=argparse.SUPPRESS)
    harness.add_json(parser)
    args = parser.parse_args()
    if args.child_single is not None:
        single_child(args.child_single)
        return
    if args.tiny:
        args.engine, args.clips, args.size = "hf", args.clips or 24, "96x128"
        args.max_tokens, args.batch_size = min(args.max_tokens, 8), min(args.batch_size, 4)
        args.rounds = args.rounds or 1
    args.clips, args.rounds = args.clips or 1000, args.rounds or 2
    height, width = (int(v) for v in args.size.split("x"))
    work = args.workdir / ("tiny" if args.tiny else "gpu")
    work.mkdir(parents=True, exist_ok=True)
    model = args.model
    if model is None:
        from shapes import build_model_folder

        model = str(build_model_folder(work / f"model-{'tiny' if args.tiny else args.shape}", args.shape, args.tiny))
    clips_dir = work / f"clips-{args.seconds:g}s-{args.clip_fps}fps-{height}x{width}"
    write_clips(clips_dir, args.clips, args.seconds, (height, width), args.clip_fps)
    requests = work / "requests.jsonl"
    requests.write_text("".join(
        json.dumps({"id": f"{i:05d}", "question": "What happens in this clip?",
                    "video": str(clips_dir / "clips" / f"{i:05d}.mp4")}) + "\n"
        for i in range(args.clips)
    ))  # fmt: skip
    engine = harness.engine_backend(args.engine)
    overrides = {
        "model": {"model_name_or_path": model, "dtype": "float32" if args.tiny else "bfloat16"},
        "engine": {"backend": engine, "batch_size": args.batch_size, "cuda_graph_sizes": args.cuda_graph_sizes},
        "generation": {"max_tokens": args.max_tokens, "temperature": 0.0, "repetition_penalty": 1.0},
        "infer": {"num_gpus": 1, "device": "cpu" if args.tiny else "gpu", "ray_address": args.ray_address},
    }
    if args.decode_workers is not None:
        overrides["infer"]["decode_workers"] = args.decode_workers
    if args.tiny:
        overrides["vision"] = {"min_pixels": 3136, "max_pixels": 56 * 84, "total_pixels": 56 * 84 * 8}
        # A CPU replica computes with its Ray CPUs' worth of threads (OMP_NUM_THREADS); match it here.
        import torch

        torch.set_num_threads(1)
    cfg = Config.model_validate(overrides)
    setup = harness.device_line(engine=engine, model=model, clips=args.clips, cpu_cores=os.cpu_count(),
                                clip=f"{args.seconds:g} s {height}x{width} H.264 {args.clip_fps} fps",
                                max_tokens=args.max_tokens, batch_size=args.batch_size,
                                cuda_graph_sizes=args.cuda_graph_sizes)  # fmt: skip
    report = harness.Report("ray_infer.json", args.json, **setup)
    if args.append:
        report.rows.extend(earlier_rows(harness.out_file("ray_infer.json", args.json), setup))
    paths = [*([] if args.no_single else ["single"]), *([] if args.no_ray else (f"ray-{n}" for n in args.gpus))]
    if not paths:
        raise SystemExit("--no-single with --no-ray leaves nothing to run")
    for round_index in range(args.rounds):
        for path in paths if round_index % 2 == 0 else paths[::-1]:
            out = work / f"{path}.jsonl"
            if path == "single":
                result = run_single(cfg, requests, out, args.clips)
            else:
                result = run_ray(cfg, requests, out, args.clips, int(path.removeprefix("ray-")))
            report.row({"path": path, "round": round_index, **result})
    summary = summarize(report.rows)
    if not args.skip_decode:
        summary["decode"] = decode_rate(cfg, requests, model, args.clips)
    harness.emit(kind="summary", **summary)
    report.update(summary=summary)


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
