"""Video decode + fps sampling + resize throughput of physreason.vision.load_video on CPU.

Beside qwen-vl-utils' fetch_video with decord when installed; details: bench/RESULTS.md ("How the scripts measure").

    .venv/bin/python bench/video_preprocess.py [--clip PATH] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import harness

from physreason.config.schema import VisionConfig
from physreason.vision import load_video

REPO = Path(__file__).resolve().parents[1]
FPS, TOTAL_PIXELS = 4.0, 6_422_528


def write_benchmark_clip(path: Path, seconds: int = 30, fps: int = 30, height: int = 720, width: int = 1280) -> Path:
    """A textured scene panning right and down (so every frame differs), H.264 yuv420p, x264 preset veryfast."""
    return harness.write_panning_clip(path, seconds * fps, (height, width), fps, (1, 2))


def time_physreason(clip: Path) -> tuple[float, tuple[int, ...]]:
    config = VisionConfig(fps=FPS, total_pixels=TOTAL_PIXELS)
    start = time.perf_counter()
    video = load_video(clip, config)
    return time.perf_counter() - start, video.frames.shape


def time_qwen_vl_utils(clip: Path) -> tuple[float, tuple[int, ...]]:
    sys.path.insert(0, str(REPO / "tests"))
    from fixtures.vision.qwen_reference import import_qwen_vl_utils

    qwen = import_qwen_vl_utils()
    element = {"video": str(clip), "fps": FPS, "total_pixels": TOTAL_PIXELS}
    start = time.perf_counter()
    video = qwen.fetch_video(element)
    elapsed = time.perf_counter() - start
    return elapsed, (video.shape[0], video.shape[2], video.shape[3], video.shape[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clip", type=Path, help="reuse this clip instead of generating one")
    parser.add_argument("--repeats", type=int, default=3)
    harness.add_json(parser)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        clip = args.clip or write_benchmark_clip(Path(tmp) / "bench_30s_720p.mp4")
        runners = {"physreason": time_physreason}
        try:
            time_qwen_vl_utils(clip)  # import and warm up once
            runners["qwen-vl-utils"] = time_qwen_vl_utils
        except ImportError as error:
            print(f"qwen-vl-utils not run: {error}", file=sys.stderr)
        time_physreason(clip)  # warm up
        seconds: dict[str, list[float]] = {name: [] for name in runners}
        shapes: dict[str, tuple[int, ...]] = {}
        for _ in range(args.repeats):
            for name, runner in runners.items():
                elapsed, shapes[name] = runner(clip)
                seconds[name].append(elapsed)

    report = {
        **harness.device_info(),
        "cpu": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores",
        "clip": "30 s, 1280x720, 30 fps, H.264 (x264 veryfast, crf 23)",
        "settings": {"fps": FPS, "total_pixels": TOTAL_PIXELS},
    }
    for name in runners:
        median = statistics.median(seconds[name])
        report[name] = {
            "frames_hwc": list(shapes[name]),
            "median_s": round(median, 3),
            "sampled_frames_per_s": round(shapes[name][0] / median, 1),
            "runs_s": [round(s, 3) for s in seconds[name]],
        }
    if "qwen-vl-utils" in report:
        report["speedup"] = round(report["qwen-vl-utils"]["median_s"] / report["physreason"]["median_s"], 2)
    harness.emit(**report)
    harness.write_json("video_preprocess.json", report, args.json)


if __name__ == "__main__":
    main()
