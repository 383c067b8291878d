"""What every measurement script shares: the device line, rows printed as they finish with the JSON rewritten after
each (to $OUT/<name>.json, or --json PATH), the shared options (steps, warm-up, shape), synchronised timers and peak
memory, and the small makers of inputs several scripts use (a free port, a panning clip, MCQ prompts, a GRPO recipe).

A script imports it by name (bench/ is on sys.path when a script runs from there, and tests load scripts the same way).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
_STARTED = time.perf_counter()
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))


# ---- the device line ------------------------------------------------------------------------------------------------


def commit() -> str:
    """The tree's commit: $PHYSREASON_COMMIT (the GPU machines get the tree without git history), else git's."""
    if os.environ.get("PHYSREASON_COMMIT"):
        return os.environ["PHYSREASON_COMMIT"]
    try:
        done = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    except OSError:
        return "unknown"
    return done.stdout.strip() or "unknown"


def gpu_name(device: Any = None) -> str:
    """The GPU's name (torch.cuda.get_device_name), or cpu when there is none or `device` is a CPU device."""
    import torch

    if not torch.cuda.is_available() or getattr(device, "type", "cuda") != "cuda":
        return "cpu"
    return torch.cuda.get_device_name(device)


def device_info(device: Any = None) -> dict[str, Any]:
    """GPU name and count, torch and CUDA versions, commit and date: the facts every result is read against."""
    import torch

    return {"device": gpu_name(device), "gpus": torch.cuda.device_count(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "commit": commit(), "date": time.strftime("%Y-%m-%d")}  # fmt: skip


def device_line(device: Any = None, **extra: Any) -> dict[str, Any]:
    """Print the device line (`device: ...`, flushed) with the script's own `extra` facts; returns them all."""
    info = {**device_info(device), **extra}
    print(f"device: {info['device']}, " + ", ".join(f"{k} {v}" for k, v in info.items() if k != "device"), flush=True)
    return info


# ---- rows and the JSON ----------------------------------------------------------------------------------------------


def out_file(name: str, path: Path | None = None) -> Path | None:
    """Where a result goes: `path` (--json) when given, else $OUT/<name> when OUT is set, else nowhere (None)."""
    if path is not None:
        return Path(path)
    return Path(os.environ["OUT"], name) if os.environ.get("OUT") else None


def write_json(name: str, payload: Any, path: Path | None = None) -> Path | None:
    """`payload` as indented JSON at out_file(name, path) (its folder made); returns the file, or None."""
    target = out_file(name, path)
    if target is not None:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(payload, indent=1, default=str))
    return target


def emit(**fields: Any) -> None:
    """One measurement as one JSON line on stdout, flushed (the scripts whose output is JSON lines)."""
    print(json.dumps(fields), flush=True)


class Report:
    """A script's results: `row()` prints a row as it finishes and rewrites the JSON (header, every row so far, the
    summary), so a run cut short keeps what it measured."""

    def __init__(self, name: str, path: Path | None = None, key: str = "rows", **header: Any) -> None:
        self.name, self.path, self.key = name, path, key
        self.data: dict[str, Any] = {**header, key: []}

    @property
    def rows(self) -> list[dict[str, Any]]:
        return self.data[self.key]

    def row(self, row: dict[str, Any], line: str | None = None) -> dict[str, Any]:
        """Record `row`, print `line` (default: the row as one JSON line) and rewrite the JSON."""
        self.rows.append(row)
        if line is not None:
            print(line, flush=True)
        else:
            emit(**row)
        self.write()
        return row

    def update(self, **fields: Any) -> None:
        self.data.update(fields)
        self.write()

    def write(self) -> Path | None:
        return write_json(self.name, self.data, self.path)


def progress(message: str) -> None:
    """One line stamped with the seconds since the script started, flushed: how far a cut-short run got."""
    print(f"[{time.perf_counter() - _STARTED:7.1f} s] {message}", flush=True)


# ---- shared options -------------------------------------------------------------------------------------------------


def add_steps(parser: argparse.ArgumentParser, steps: int, warmup: int, what: str = "steps") -> None:
    """--steps (timed) and --warmup (untimed, first)."""
    parser.add_argument("--steps", type=int, default=steps, help=f"timed {what} (after --warmup)")
    parser.add_argument("--warmup", type=int, default=warmup, help=f"untimed {what} first")


def add_shape(parser: argparse.ArgumentParser, default: str, choices: Any = None, **kwargs: Any) -> None:
    """--shape: a model shape of bench/shapes.py (random weights)."""
    from shapes import SHAPES

    kwargs.setdefault("help", "model shape (bench/shapes.py; random weights)")
    parser.add_argument("--shape", choices=sorted(choices or SHAPES), default=default, **kwargs)


def comma_list(parser: argparse.ArgumentParser, flag: str, value: str, known: Any) -> list[str]:
    """The items of a comma-separated option, each one of `known`; else a usage error (exit 2) that lists them."""
    items = [item.strip() for item in value.split(",") if item.strip()]
    if not items or any(item not in known for item in items):
        parser.error(f"{flag} {value!r}: give a comma-separated list of {', '.join(known)}")
    return items


def add_json(parser: argparse.ArgumentParser) -> None:
    """--json PATH: where the JSON goes instead of $OUT."""
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the JSON here (default: $OUT)")


# ---- timing and memory ----------------------------------------------------------------------------------------------


def sync(device: Any = None) -> None:
    """Wait for the GPU's queued work (nothing on a CPU)."""
    import torch

    if torch.cuda.is_available() and getattr(device, "type", "cuda") == "cuda":
        torch.cuda.synchronize()


class Laps:
    """Wall seconds of the parts of a step, the device synchronised at each lap (timings=None: nothing is timed and
    nothing synchronised, as in timed steps). `lap(name)` appends the seconds since the last synchronised lap (or
    since the Laps was made) to timings[name]; sync=False reads the clock without waiting for the device (the
    seconds until the host returned) and does not start a new lap."""

    def __init__(self, timings: dict[str, list[float]] | None, device: Any = None) -> None:
        self.timings, self.device = timings, device
        if timings is not None:
            sync(device)
            self.lap_start = time.perf_counter()

    def lap(self, name: str, sync_device: bool = True) -> None:
        if self.timings is None:
            return
        if sync_device:
            sync(self.device)
        now = time.perf_counter()
        self.timings.setdefault(name, []).append(now - self.lap_start)
        if sync_device:
            self.lap_start = now


def timed(call: Callable[[], Any], device: Any = None) -> tuple[float, Any]:
    """(seconds, result) of `call()`, synchronised before and after."""
    sync(device)
    started = time.perf_counter()
    result = call()
    sync(device)
    return time.perf_counter() - started, result


def timed_steps(step: Callable[[], Any], warmup: int, steps: int, device: Any = None) -> float:
    """Seconds per step of `steps` steps after `warmup` untimed ones (synchronised)."""
    for _ in range(warmup):
        step()
    return timed(lambda: [step() for _ in range(steps)], device)[0] / steps


def reset_peak() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def peak_gib(cpu: Any = 0.0) -> Any:
    """torch.cuda.max_memory_allocated in GiB; `cpu` where there is no GPU."""
    import torch

    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else cpu


def free_memory() -> None:
    """Drop what a finished (or failed) row left behind, so the next starts from an empty GPU."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def versions(*packages: str) -> dict[str, str]:
    """Each package's installed version ("not installed" when absent) and physreason's commit."""
    from importlib import metadata

    found = {}
    for name in packages:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    return {**found, "physreason_commit": commit()}


# ---- child processes ------------------------------------------------------------------------------------------------


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment with the repository first on PYTHONPATH (children import physreason), and `extra`."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def run_logged(command: list[str], log_path: Path, timeout: float, **popen: Any) -> int | None:
    """Run `command` in its own session with its output in `log_path`: its exit code, or None when it ran past
    `timeout` seconds. What it leaves behind (Ray, torchrun and vLLM helpers) is killed before the next run."""
    import signal

    with Path(log_path).open("w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, **popen)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            time.sleep(5 if sig == signal.SIGTERM else 0)
        proc.wait()
    return code


def guarded(run: Callable[..., Any], *args: Any, errors: tuple[type[Exception], ...] = ()) -> Any:
    """`run(*args)`, or {"error": "OOM"} when it runs out of GPU memory (or "error: <first line>" for one of `errors`,
    such as a missing attention kernel), so the rows after it still run; the failed row's memory is freed either way."""
    import torch

    error = None
    try:
        result = run(*args)
    except torch.cuda.OutOfMemoryError:
        error = "OOM"
    except errors as failure:
        error = f"error: {str(failure).strip().splitlines()[0][:120]}"
    free_memory()  # after the except block, whose exception held the failed row's tensors
    return {"error": error} if error is not None else result


def init_world() -> Any:
    """Join torchrun's process group, or make a world of one (a free port on 127.0.0.1); this rank's device."""
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    torchrun = "WORLD_SIZE" in os.environ
    local = int(os.environ.get("LOCAL_RANK", 0)) if torchrun else 0
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if torchrun:
        dist.init_process_group("nccl" if cuda else "gloo")
    else:
        from physreason.net import free_port

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    return device


# ---- inputs ---------------------------------------------------------------------------------------------------------


def write_panning_clip(path: Path, frames: int, size: tuple[int, int], fps: int, step: tuple[int, int], seed: int = 0):
    """A textured scene panning `step` (down, right) pixels a frame (so every frame differs), H.264 yuv420p, x264
    veryfast crf 23, written one frame at a time (a long clip never sits in memory)."""
    import av
    import numpy as np

    height, width = size
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (height // 8 + (frames if step[0] else 1), width // 8 + frames, 3), dtype=np.uint8)
    texture = coarse.repeat(8, axis=0).repeat(8, axis=1)  # blocks large enough to survive compression
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"preset": "veryfast", "crf": "23"}
        for index in range(frames):
            top, left = step[0] * index, step[1] * index
            frame = np.ascontiguousarray(texture[top : top + height, left : left + width])
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return path


def vision_settings(tiny: bool):
    """[vision]: the defaults (4 fps), or with --tiny a 2 fps, 56x84 budget so the tiny tower's grids stay small."""
    from physreason.config import VisionConfig

    if not tiny:
        return VisionConfig()
    return VisionConfig(fps=2.0, min_frames=2, min_pixels=28 * 28, max_pixels=56 * 84, total_pixels=56 * 84 * 8)


def write_mcq_prompts(path: Path, count: int, filler: int = 0) -> Path:
    """`count` text multiple-choice questions (answer A), each after `filler` sentences (ten words) of scene, as JSONL."""
    filler = " ".join(["the ball rolls down the slope and hits the box"] * filler)
    records = [{"question": f"{filler + ' ' if filler else ''}Which way does ball {i} move next?",
                "options": ["left", "right", "up", "down"], "answer": "A"} for i in range(count)]  # fmt: skip
    path.write_text("\n".join(json.dumps(r) for r in records))
    return path


def add_grpo_sizes(parser: argparse.ArgumentParser, what: str = "") -> None:
    """--prompts, --n, --response-len, --mini-batch and --gpu-memory: the sizes grpo_settings reads (`what` prefixes
    their help)."""
    parser.add_argument("--prompts", type=int, default=8, help=f"{what}prompts per step")
    parser.add_argument("--n", type=int, default=8, help=f"{what}completions per prompt")
    parser.add_argument("--response-len", type=int, default=256, help=f"{what}most new tokens per completion")
    parser.add_argument("--mini-batch", type=int, default=8, help=f"{what}completions per policy forward")
    parser.add_argument("--gpu-memory", type=float, default=0.3, help=f"{what}vLLM gpu_memory_utilization")


def grpo_settings(model: Path, data: Path, out: Path, args: argparse.Namespace, backend: str, bf16: bool,
                  steps: int, max_length: int) -> list[str]:  # fmt: skip
    """The colocated GRPO recipe of the GRPO benches as config overrides: `args` gives prompts, n, response_len,
    mini_batch and gpu_memory; bf16 weights, compute and checkpointing on a GPU, no checkpoints, jsonl logs."""
    dtype = "bfloat16" if bf16 else "float32"
    return [
        f"model.model_name_or_path='{model}'", f"model.dtype='{dtype}'", f"model.model_max_length={max_length}",
        f"engine.backend='{backend}'", f"engine.gpu_memory_utilization={args.gpu_memory}",
        f"engine.batch_size={args.prompts * args.n}", f"data.dataset.name='{data}'", f"train.output_dir='{out}'",
        f"train.max_steps={steps}", f"train.train_batch_per_replica={args.prompts * args.n}",
        f"train.param_dtype='{dtype}'", "train.ckpt.enable_checkpoint=false", f"rollout.n_generation={args.n}",
        f"rollout.batch_size={args.prompts}", f"rollout.max_response_length={args.response_len}",
        f"grpo.mini_batch={args.mini_batch}", "logging.logger=['jsonl']",
    ]  # fmt: skip


def engine_backend(choice: str) -> str:
    """--engine auto: vLLM when it is installed, else the hf engine."""
    import importlib.util

    if choice != "auto":
        return choice
    return "vllm" if importlib.util.find_spec("vllm") is not None else "hf"


@contextlib.contextmanager
def recorded_checkpoint_every():
    """Inside: what train.checkpoint_every each GRPO run's start resolved to ("auto": the plan's choice on this GPU),
    appended to the yielded list (physreason.train.grpo looks the resolver up at call time)."""
    import physreason.train.grpo as grpo_module

    chosen: list[int] = []
    resolve = grpo_module.resolve_runtime_checkpoint_every

    def recorded(*args, **kwargs):
        resolved = resolve(*args, **kwargs)
        chosen.append(resolved.train.checkpoint_every)
        return resolved

    grpo_module.resolve_runtime_checkpoint_every = recorded
    try:
        yield chosen
    finally:
        grpo_module.resolve_runtime_checkpoint_every = resolve
