"""How long a checkpoint save stalls training: [train.ckpt] save_mode "sync" against "async", in the same run.

What each save's figures mean and what the run needs (about 45 GB free under --work): bench/RESULTS.md ("How the
scripts measure"). Phases print as they start; JSON to $OUT/checkpoint_stall.json after each save.
Run (one GPU):  python bench/checkpoint_stall.py --saves 2 --steps 3 --after 6
CPU check:      python bench/checkpoint_stall.py --tiny --seq-len 64 --steps 2 --after 2
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from harness import add_json, comma_list, device_info, progress, sync, write_json
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


def checkpoint_bytes(module: torch.nn.Module) -> int:
    """Bytes of a checkpoint of `module`'s fp32 weights with both AdamW moments, at most (3 x the weights): weights
    that never get a gradient (the vision tower, on text rows) have no moments."""
    return 3 * sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)


def check_room(work: Path, needed: int) -> None:
    """Refuse at once when `work` cannot hold one checkpoint, rather than failing after minutes of writing."""
    free = shutil.disk_usage(work).free
    if free < needed * 1.05:  # DCP's metadata and the trainer file come on top of the tensors
        raise SystemExit(f"--work {work}: {free / 1e9:.1f} GB free, one checkpoint needs up to {needed / 1e9:.1f} GB; "
                         "give --work a folder with more room (e.g. /dev/shm when it is large enough) or fewer "
                         "--layers")


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
        sync(device)
        return time.perf_counter() - started

    return step


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
    """Baseline steps, one save, the steps beside its write, the wait for it; the timings bench/RESULTS.md names."""
    from physreason.train.checkpoint import checkpoint_dirs

    baseline = statistics.median(trained_step() for _ in range(args.steps))
    trained_step()
    complete = FolderWatch(out / "checkpoints" / f"step_{saved_step}")
    progress(f"  save of step {saved_step} (baseline step {baseline:.3f} s)")
    started = time.perf_counter()
    checkpointer.save(saved_step, {})
    sync(device)
    save_s = time.perf_counter() - started
    progress(f"  save returned after {save_s:.3f} s; {args.after} steps beside the write")
    after = [trained_step() for _ in range(args.after)]
    checkpointer.wait()
    complete.join()
    (checkpoint,) = checkpoint_dirs(out)
    size = sum(f.stat().st_size for f in checkpoint.rglob("*") if f.is_file())
    progress(f"  checkpoint complete after {complete.seen - started:.3f} s ({size / 1e9:.2f} GB); deleting it")
    shutil.rmtree(checkpoint)  # one checkpoint on disk at a time: the 3B shape's is 45 GB
    overhead = save_s + sum(after) - args.after * baseline
    return {"baseline_step_s": baseline, "save_s": save_s, "window_overhead_s": overhead,
            "write_s": complete.seen - started, "after_steps_s": after, "checkpoint_gb": size / 1e9}  # fmt: skip


def measure_mode(mode: str, trained, trained_step, args, work: Path, first_step: int, device: torch.device, record):
    """--saves saves in `mode` with one Checkpointer, as a run makes them (the first async one also pins its buffers);
    record(row) after each save keeps the rows measured so far if the run is cut short."""
    from physreason.config import load_config
    from physreason.train.loop import Checkpointer

    out = work / mode
    shutil.rmtree(out, ignore_errors=True)
    config = load_config(None, [f"train.output_dir='{out}'", f"train.ckpt.save_mode='{mode}'",
                                "train.ckpt.max_keep=1", "train.ckpt.export_safetensors=false"])  # fmt: skip
    checkpointer = Checkpointer(config, trained)
    step = first_step
    for index in range(args.saves):
        progress(f"{mode} save {index + 1} of {args.saves}: {args.steps} baseline steps")
        step += args.steps + 1
        record({"mode": mode, "save": index + 1, **measure_save(checkpointer, out, step, trained_step, args, device)})
        step += args.after
    checkpointer.finish()  # frees the pinned host buffers of async saves
    shutil.rmtree(out)


def compare(rows: list[dict]) -> None:
    """Each async save against the sync save of the same index (the first of each mode pays its one-time costs)."""
    sync = {r["save"]: r for r in rows if r["mode"] == "sync"}
    for row in rows:
        if row["mode"] == "async" and row["save"] in sync:
            row["stall_vs_sync"] = row["save_s"] / sync[row["save"]]["save_s"]
            row["window_overhead_vs_sync"] = row["window_overhead_s"] / sync[row["save"]]["save_s"]


def summarize(rows: list[dict]) -> dict:
    """Per mode: the steady step time (median of every baseline step time) and the stall of each save, in order."""
    summary = {}
    for mode in dict.fromkeys(r["mode"] for r in rows):
        own = [r for r in rows if r["mode"] == mode]
        summary[mode] = {"steady_step_s": statistics.median(r["baseline_step_s"] for r in own),
                         "stall_s": [r["save_s"] for r in own], "write_s": [r["write_s"] for r in own]}  # fmt: skip
        if all("stall_vs_sync" in r for r in own):
            summary[mode]["stall_vs_sync"] = [r["stall_vs_sync"] for r in own]
    return summary


def print_table(result: dict) -> None:
    print(f"{result['device']}, torch {result['torch']}, {result['shape']}, seq {result['seq_len']}")
    print(f"{'mode':<6} {'save':>4} {'step_s':>8} {'save_s':>8} {'overhead_s':>10} {'write_s':>8} {'GB':>7} {'stall/sync':>10}")
    for row in result["rows"]:
        ratio = f"{row['stall_vs_sync']:.3f}" if "stall_vs_sync" in row else "-"
        print(f"{row['mode']:<6} {row['save']:4d} {row['baseline_step_s']:8.3f} {row['save_s']:8.3f} "
              f"{row['window_overhead_s']:10.3f} {row['write_s']:8.3f} {row['checkpoint_gb']:7.2f} {ratio:>10}")  # fmt: skip
    for mode, figures in result["summary"].items():
        stalls = ", ".join(f"{s:.3f}" for s in figures["stall_s"])
        ratios = figures.get("stall_vs_sync")
        against = f"; stall / sync {', '.join(f'{r:.3f}' for r in ratios)}" if ratios else ""
        print(f"{mode}: steady step {figures['steady_step_s']:.3f} s, stall per save {stalls} s{against}")
    sys.stdout.flush()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096, help="tokens of the one row each step trains")
    parser.add_argument("--steps", type=int, default=5, help="plain steps before each save (their median: baseline)")
    parser.add_argument("--after", type=int, default=10, help="steps after each save, beside an async write")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps at the start")
    parser.add_argument("--saves", type=int, default=2, help="saves per mode (the first async one pins its buffers)")
    parser.add_argument("--modes", default="sync,async", help="comma-separated save modes, measured in this order")
    parser.add_argument("--work", type=Path, default=None,
                        help="folder for the checkpoints, one at a time (default: a temporary one; /dev/shm: RAM)")
    parser.add_argument("--layers", type=int, default=None, help="decoder blocks kept (default: the shape's 36)")
    parser.add_argument("--tiny", action="store_true", help="the tiny stand-in shape, to check the script on CPU")
    add_json(parser)
    return parser


def main(argv: list[str] | None = None) -> dict:
    """Measure both modes as bench/RESULTS.md says; prints progress, the table and the summary; returns the result."""
    parser = build_parser()
    args = parser.parse_args(argv)
    modes = comma_list(parser, "--modes", args.modes, MODES)
    for name in ("steps", "saves"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = qwen25_vl_3b(args.tiny)
    if args.layers:
        config.text_config.num_hidden_layers = args.layers
    per_save = args.steps + 1 + args.after
    work = args.work or Path(tempfile.mkdtemp(prefix="checkpoint_stall_"))
    work.mkdir(parents=True, exist_ok=True)
    progress(f"building the {'tiny' if args.tiny else 'qwen2.5-vl-3b'} shape on {device}")
    trained = build_trained(config, device, args.warmup + len(modes) * args.saves * per_save + 1)
    needed = checkpoint_bytes(trained.module)
    check_room(work, needed)
    progress(f"checkpoints of at most {needed / 1e9:.2f} GB each go to {work} ({shutil.disk_usage(work).free / 1e9:.1f} GB "
             f"free); {args.warmup} warm-up steps of {args.seq_len} tokens")  # fmt: skip
    step = make_step(trained, make_batch(config, args.seq_len, 1, False, device), device)
    for _ in range(args.warmup):
        step()
    result = {**device_info(device), "shape": "tiny" if args.tiny else "qwen2.5-vl-3b",
              "layers": config.text_config.num_hidden_layers, "seq_len": args.seq_len, "work": str(work),
              "checkpoint_estimate_gb": needed / 1e9, "rows": [], "summary": {}}  # fmt: skip

    def record(row: dict) -> None:
        result["rows"].append(row)
        compare(result["rows"])
        result["summary"] = summarize(result["rows"])
        write_json("checkpoint_stall.json", result, args.json)

    done = args.warmup
    for mode in modes:
        measure_mode(mode, trained, step, args, work, done, device, record)
        done += args.saves * per_save
    print_table(result)
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return result


if __name__ == "__main__":
    main()
