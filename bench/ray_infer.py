"""Benchmark: batch inference on Ray Data with one engine replica beside the single-process path, same clips.

Writes --clips synthetic H.264 clips (PyAV, a textured scene panning, --seconds long at --size) and one request
per clip, then in this process:

1. Ray path: `run_ray_batch` with one replica (infer.num_gpus = 1: one GPU, or a CPU replica with --tiny);
2. single-process path: `run_batch` with one engine built here (today's `infer --jsonl`);
3. CPU decode: `request_from_record` (PyAV decode, fps sampling, resize, chat messages) on every clip, serially in
   this process, as one Ray decoding task does it.

Reported per path: end-to-end seconds (engine start included) and steady items/s (results after the first batch
over the seconds from the first batch to the last result, so engine start and warm-up are left out; give many
batches: --clips well above --batch-size); the Ray overhead is
1 - ray steady / single steady. Decode: clips/s of one process and, against the single-process engine rate, the
decoding tasks (infer.decode_cpus each) that one GPU needs so its engine never waits. The Ray path runs first: its replica has
released the GPU when the single-process engine loads. Prints one JSON object.

    python bench/ray_infer.py --model nvidia/Cosmos-Reason1-7B --clips 256       # GPU machine
    python bench/ray_infer.py --tiny                                             # CPU dry run, tiny model
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import threading
import time
from pathlib import Path

import av
import numpy as np

from physreason.chat.style import Prompting
from physreason.config import Config
from physreason.engines import create_engine
from physreason.infer import run_batch, run_ray_batch
from physreason.infer.batch import plan_batch, request_from_record
from physreason.infer.results import result_status
from physreason.models.inputs import patch_factor


def write_clip(path: Path, seconds: float, size: tuple[int, int], seed: int, fps: int = 30) -> None:
    """A textured scene panning right (every frame differs), H.264 yuv420p."""
    height, width = size
    frames = max(2, int(seconds * fps))
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (height // 8 + 1, width // 8 + frames, 3), dtype=np.uint8)
    texture = coarse.repeat(8, axis=0).repeat(8, axis=1)
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"preset": "veryfast", "crf": "23"}
        for index in range(frames):
            frame = np.ascontiguousarray(texture[:height, index : index + width])
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())


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
    with ResultClock(out, n) as clock:
        start = time.perf_counter()
        summary = run()
        total = time.perf_counter() - start
    return {
        "seconds": round(total, 2),
        "items_per_s": round(n / total, 3),
        "steady_items_per_s": None if clock.steady() is None else round(clock.steady(), 3),
        "failed": summary.failed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="nvidia/Cosmos-Reason1-7B")
    parser.add_argument("--engine", default="auto", choices=["auto", "vllm", "hf"])
    parser.add_argument("--clips", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=10.0, help="Length of each clip.")
    parser.add_argument("--size", default="720x1280", help="HEIGHTxWIDTH of the clips.")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=64, help="engine.batch_size: requests per generate call.")
    parser.add_argument("--ray-address", default=None, help="Join this Ray cluster instead of starting one here.")
    parser.add_argument("--tiny", action="store_true", help="CPU dry run: tiny random model, small short clips.")
    parser.add_argument("--workdir", type=Path, default=None, help="Where clips and results go (default: a temp dir).")
    args = parser.parse_args()
    if args.tiny:
        args.engine, args.clips, args.seconds, args.size = "hf", min(args.clips, 24), 2.0, "96x128"
        args.max_tokens, args.batch_size = min(args.max_tokens, 8), min(args.batch_size, 4)
    height, width = (int(v) for v in args.size.split("x"))
    work = args.workdir or Path(tempfile.mkdtemp(prefix="ray-infer-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    model = args.model
    if args.tiny:
        from physreason.models.tiny import save_tiny_model

        model = str(save_tiny_model("qwen2_5_vl", work / "tiny"))
    for i in range(args.clips):
        clip = work / "clips" / f"{i:05d}.mp4"
        if not clip.exists():
            clip.parent.mkdir(parents=True, exist_ok=True)
            write_clip(clip, args.seconds, (height, width), seed=i)
    requests = work / "requests.jsonl"
    requests.write_text("".join(
        json.dumps({"id": f"{i:05d}", "question": "What happens in this clip?", "video": f"clips/{i:05d}.mp4"}) + "\n"
        for i in range(args.clips)
    ))
    overrides = {
        "model": {"model_name_or_path": model, "dtype": "float32" if args.tiny else "bfloat16"},
        "engine": {"backend": args.engine, "batch_size": args.batch_size},
        "generation": {"max_tokens": args.max_tokens, "temperature": 0.0, "repetition_penalty": 1.0},
        "infer": {"num_gpus": 1, "device": "cpu" if args.tiny else "gpu", "ray_address": args.ray_address},
    }
    if args.tiny:
        overrides["vision"] = {"min_pixels": 3136, "max_pixels": 56 * 84, "total_pixels": 56 * 84 * 8}
    cfg = Config.model_validate(overrides)

    import ray

    if not ray.is_initialized():
        extra = {} if args.ray_address else {"include_dashboard": False}
        ray.init(address=args.ray_address, log_to_driver=False, **extra)
    ray_out, single_out = work / "ray.jsonl", work / "single.jsonl"
    for out in (ray_out, single_out):
        out.unlink(missing_ok=True)
    ray_run = measure(lambda: run_ray_batch(cfg, requests, ray_out, show_progress=False), ray_out, args.clips)
    ray.shutdown()  # the replica's GPU is free for the single-process engine

    if args.tiny:  # a CPU replica computes with its Ray CPUs' worth of threads (OMP_NUM_THREADS); match it here
        import torch

        torch.set_num_threads(max(1, int(cfg.infer.cpus_per_replica)))
    started = time.perf_counter()
    engine = create_engine(cfg.model, cfg.engine)
    load_s = time.perf_counter() - started
    single = measure(
        lambda: run_batch(engine, requests, single_out, sampling=cfg.generation, vision=cfg.vision,
                          batch_size=cfg.engine.batch_size, show_progress=False),
        single_out, args.clips,
    )
    single["engine_load_s"] = round(load_s, 2)

    plan = plan_batch(requests, work / "none.jsonl")
    started = time.perf_counter()
    frames = 0
    for rid, record in plan.pending:
        request = request_from_record(record, rid, plan.root, cfg.vision, Prompting(), patch_factor(model))
        frames += sum(len(v.frames) for v in request.videos)
    decode_s = time.perf_counter() - started
    clips_per_s = args.clips / decode_s
    rate = single["steady_items_per_s"] or single["items_per_s"]
    report = {
        "device": platform.node(),
        "gpu": _gpu_name(),
        "engine": args.engine,
        "model": args.model if not args.tiny else "tiny qwen2_5_vl",
        "clips": args.clips,
        "clip": f"{args.seconds:g} s {height}x{width} H.264 30 fps",
        "max_tokens": args.max_tokens,
        "batch_size": args.batch_size,
        "ray_1_replica": ray_run,
        "single_process": single,
        "ray_overhead_steady": None if not (ray_run["steady_items_per_s"] and single["steady_items_per_s"])
        else round(1 - ray_run["steady_items_per_s"] / single["steady_items_per_s"], 4),
        "decode": {
            "clips_per_s_one_process": round(clips_per_s, 3),
            "sampled_frames_per_s_one_process": round(frames / decode_s, 1),
            "decode_tasks_needed_per_gpu": round(rate / clips_per_s, 2),
            "cpu_cores_here": os.cpu_count(),
        },
    }
    print(json.dumps(report, indent=2))


def _gpu_name() -> str | None:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


if __name__ == "__main__":
    main()
