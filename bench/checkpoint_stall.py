"""How long a checkpoint save stalls training: [train.ckpt] save_mode "sync" against "async", in the same run.

Model: the Qwen2.5-VL-3B shape with random weights (built on the GPU, no download), trained as the trainer trains it
in one process: fp32 master weights under bf16 autocast, activation checkpointing, CausalLMLoss with the lm_head + CE
in chunks of 1,024 tokens, fused AdamW with its LambdaLR schedule, one row of --seq-len text tokens per step. A
checkpoint holds the fp32 weights and both AdamW moments, about 3.75 B x 12 bytes = 45 GB: the run needs that much
free disk under --work (each mode's checkpoint is deleted before the next mode) and, in async mode, as much host
memory for the pinned copy.

Each mode, on the same model, continuing its training, makes --saves saves with one Checkpointer, each: --steps plain
steps (the baseline step time is their median), physreason's own Checkpointer.save of the next step, --after steps
while an async write goes on, then Checkpointer.wait; the checkpoint is then deleted (one on disk at a time). The
first async save also pins its host buffers (once per run): compare the later saves. Per save:
  save_s             time inside save(): the step's stall (sync: the whole write; async: the copy to host memory)
  window_overhead_s  save_s + the --after steps - as many baseline steps: the stall plus any slowdown of the steps
                     that run beside the background write
  write_s            save() called until the checkpoint is complete (recorded and renamed)
The async rows also give both stalls as a fraction of the sync save_s of the same index (the goal: under 0.10). The safetensors export
is off here: it is written synchronously at each save in both modes.

Run (one GPU):  python bench/checkpoint_stall.py                   JSON to $OUT/checkpoint_stall.json when OUT is set
CPU check:      python bench/checkpoint_stall.py --tiny --seq-len 64 --steps 2 --after 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
from shapes import make_batch, qwen25_vl_3b

MODES = ("sync", "async")


def build_trained(config, device: torch.device, steps: int):
    """The model, loss wrapper, optimizer and schedule as physreason's single-process trainer builds them."""
    from transformers import AutoModelForImageTextToText

    from physreason.config import TrainConfig
    from physreason.models.parallelize import enable_activation_checkpointing
    from physreason.train.build import TrainingModel
    from physreason.train.model import CausalLMLoss
    from physreason.train.schedule import build_optimizer

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(config)  # fp32 masters, as the trainer loads them
    enable_activation_checkpointing(model)
    module = CausalLMLoss(model, loss_chunk_size=1024).train()
    optimizer, scheduler = build_optimizer(module, TrainConfig(), steps, fused=device.type == "cuda")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    return TrainingModel(model, module, optimizer, scheduler, autocast)


def make_step(trained, batch, device: torch.device):
    """One optimizer step on `batch`, timed to its end on the device; returns seconds."""
    from physreason.models.parallelize import clip_grad_norm

    parameters = [p for p in trained.module.parameters() if p.requires_grad]

    def step() -> float:
        started = time.perf_counter()
        with trained.autocast:
            loss = trained.module(batch)
        (loss / batch.num_targets).backward()
        clip_grad_norm(parameters, 1.0)
        trained.optimizer.step()
        trained.scheduler.step()
        trained.optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        return time.perf_counter() - started

    return step


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class FolderWatch(threading.Thread):
    """Notes the time `folder` appears (a checkpoint is renamed into place once complete), polling every 10 ms."""

    def __init__(self, folder: Path) -> None:
        super().__init__(daemon=True)
        self.folder, self.seen = folder, float("nan")
        self.start()

    def run(self) -> None:
        while not self.folder.is_dir():
            time.sleep(0.01)
        self.seen = time.perf_counter()


def measure_save(checkpointer, out: Path, saved_step: int, trained_step, args, device: torch.device) -> dict:
    """Baseline steps, one save, the steps beside its write, the wait for it; the timings of the docstring."""
    from physreason.train.checkpoint import checkpoint_dirs

    baseline = statistics.median(trained_step() for _ in range(args.steps))
    trained_step()
    complete = FolderWatch(out / "checkpoints" / f"step_{saved_step}")
    started = time.perf_counter()
    checkpointer.save(saved_step, {})
    synchronize(device)
    save_s = time.perf_counter() - started
    after = [trained_step() for _ in range(args.after)]
    checkpointer.wait()
    complete.join()
    (checkpoint,) = checkpoint_dirs(out)
    size = sum(f.stat().st_size for f in checkpoint.rglob("*") if f.is_file())
    shutil.rmtree(checkpoint)  # one checkpoint on disk at a time: the 3B shape's is 45 GB
    return {
        "baseline_step_s": baseline,
        "save_s": save_s,
        "window_overhead_s": save_s + sum(after) - args.after * baseline,
        "write_s": complete.seen - started,
        "after_steps_s": after,
        "checkpoint_gb": size / 1e9,
    }


def measure_mode(mode: str, trained, trained_step, args, work: Path, first_step: int, device: torch.device) -> list:
    """--saves saves in `mode` with one Checkpointer, as a run makes them (the first async one also pins its buffers)."""
    from physreason.config import load_config
    from physreason.train.loop import Checkpointer

    out = work / mode
    shutil.rmtree(out, ignore_errors=True)
    config = load_config(None, [f"train.output_dir='{out}'", f"train.ckpt.save_mode='{mode}'",
                                "train.ckpt.max_keep=1", "train.ckpt.export_safetensors=false"])  # fmt: skip
    checkpointer = Checkpointer(config, trained)
    rows, step = [], first_step
    for index in range(args.saves):
        step += args.steps + 1
        rows.append({"mode": mode, "save": index + 1, **measure_save(checkpointer, out, step, trained_step, args, device)})
        step += args.after
    checkpointer.finish()
    shutil.rmtree(out)
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096, help="tokens of the one row each step trains")
    parser.add_argument("--steps", type=int, default=5, help="plain steps before each save (their median: baseline)")
    parser.add_argument("--after", type=int, default=10, help="steps after each save, beside an async write")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps at the start")
    parser.add_argument("--saves", type=int, default=2, help="saves per mode (the first async one pins its buffers)")
    parser.add_argument("--modes", default="sync,async", help="comma-separated save modes, measured in this order")
    parser.add_argument("--work", type=Path, default=None, help="folder for the checkpoints (default: a temporary one)")
    parser.add_argument("--tiny", action="store_true", help="the tiny stand-in shape, to check the script on CPU")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        raise SystemExit(f"--modes {args.modes!r}: give a comma-separated list of {', '.join(MODES)}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = qwen25_vl_3b(args.tiny)
    per_save = args.steps + 1 + args.after
    trained = build_trained(config, device, args.warmup + len(modes) * args.saves * per_save + 1)
    step = make_step(trained, make_batch(config, args.seq_len, 1, False, device), device)
    for _ in range(args.warmup):
        step()
    work = args.work or Path(tempfile.mkdtemp(prefix="checkpoint_stall_"))
    work.mkdir(parents=True, exist_ok=True)
    rows, done = [], args.warmup
    for mode in modes:
        rows += measure_mode(mode, trained, step, args, work, done, device)
        done += args.saves * per_save
    # Each async save against the sync save of the same index (the first of each mode pays its one-time costs).
    sync = {r["save"]: r for r in rows if r["mode"] == "sync"}
    for row in rows:
        if row["mode"] == "async" and row["save"] in sync:
            row["stall_vs_sync"] = row["save_s"] / sync[row["save"]]["save_s"]
            row["window_overhead_vs_sync"] = row["window_overhead_s"] / sync[row["save"]]["save_s"]
    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "shape": "tiny" if args.tiny else "qwen2.5-vl-3b",
        "seq_len": args.seq_len,
        "rows": rows,
    }
    print(f"{result['device']}, torch {result['torch']}, {result['shape']}, seq {args.seq_len}")
    print(f"{'mode':<6} {'save':>4} {'step_s':>8} {'save_s':>8} {'overhead_s':>10} {'write_s':>8} {'GB':>7} {'stall/sync':>10}")
    for row in rows:
        ratio = f"{row['stall_vs_sync']:.3f}" if "stall_vs_sync" in row else "-"
        print(f"{row['mode']:<6} {row['save']:4d} {row['baseline_step_s']:8.3f} {row['save_s']:8.3f} {row['window_overhead_s']:10.3f} "
              f"{row['write_s']:8.3f} {row['checkpoint_gb']:7.2f} {ratio:>10}")  # fmt: skip
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "checkpoint_stall.json").write_text(json.dumps(result, indent=1))
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
