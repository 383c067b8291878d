"""Learnability probe: can a small 3D CNN learn each intuitive-physics task from the frames the VLM sees?

The intuitive-physics experiment (physreason.experiments.intuitive_physics) trains a small Qwen2.5-VL from random
weights on `data synth` clips. When a task stays at chance there, this probe tells the two causes apart: the clips as
sampled for the model (fps 4, frames resized to --max-pixels) carry no learnable signal, or they do and the
from-scratch VLM fails to learn it at that budget. Same clip sets as the VLM run (train split seed 0, test split),
same frame sampling and resize (physreason.vision.video.load_video), labels from the benchmark records (options in
fixed order, so the letter is the class). The probe is a plain 3D CNN with batch norm (about 110k parameters),
trained with cross-entropy.
Prints train and held-out accuracy per epoch and writes $OUT/intuitive_physics_probe.json when OUT is set.
Run: python -m physreason.experiments.probe --workers 14
     python -m physreason.experiments.probe --train-per-task 16 --test-per-task 8 --epochs 1  (CPU check)
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from physreason.data.synth.tasks import LETTER_TASK_NAMES as TASKS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    parser.add_argument("--train-per-task", type=int, default=2000)
    parser.add_argument("--test-per-task", type=int, default=500)
    parser.add_argument("--max-pixels", type=int, default=12544, help="largest frame area (as the VLM run)")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("/tmp/physreason-intuitive-physics/fixed/data"),
        help="clip folder (<out>/train, <out>/test); the default is the intuitive-physics experiment's, so its clips "
        "are reused",
    )
    return parser.parse_args(argv)


def load_split(folder: Path, max_pixels: int, workers: int):
    """uint8 frames [N, 3, T, H, W] and class labels of one task's clip folder."""
    from concurrent.futures import ProcessPoolExecutor

    import numpy as np
    import torch

    from physreason.data.loaders import media_path_in_root

    records = next(folder.glob("*_benchmark_qa_pairs.json"))
    qa = json.loads(records.read_text())
    paths = [str(media_path_in_root(folder.resolve(), row["video"], str(records))) for row in qa]  # inside folder
    with ProcessPoolExecutor(workers) as pool:
        frames = list(pool.map(_frames, paths, [max_pixels] * len(paths), chunksize=16))
    shortest = min(clip.shape[0] for clip in frames)
    x = torch.from_numpy(np.stack([clip[:shortest] for clip in frames])).permute(0, 4, 1, 2, 3).contiguous()
    y = torch.tensor([ord(row["qa_pairs"]["answer"]) - ord("A") for row in qa])
    return x, y


def _frames(path: str, max_pixels: int):
    from physreason.config.schema import VisionConfig
    from physreason.vision.video import load_video

    return load_video(path, VisionConfig(min_pixels=min(3136, max_pixels), max_pixels=max_pixels)).frames


def probe_net(classes: int):
    from torch import nn

    return nn.Sequential(
        nn.Conv3d(3, 16, (3, 5, 5), padding=(1, 2, 2)), nn.BatchNorm3d(16), nn.ReLU(), nn.MaxPool3d((1, 2, 2)),
        nn.Conv3d(16, 32, 3, padding=1), nn.BatchNorm3d(32), nn.ReLU(), nn.MaxPool3d((1, 2, 2)),
        nn.Conv3d(32, 48, 3, padding=1), nn.BatchNorm3d(48), nn.ReLU(), nn.AdaptiveAvgPool3d((4, 2, 2)), nn.Flatten(),
        nn.Linear(48 * 16, 64), nn.ReLU(), nn.Linear(64, classes),
    )  # fmt: skip


def accuracy(net, x, y, device) -> float:
    import torch

    net.eval()
    with torch.no_grad():
        hits = sum(
            (net(x[i : i + 128].to(device).float() / 255).argmax(1).cpu() == y[i : i + 128]).sum().item()
            for i in range(0, len(x), 128)
        )
    net.train()
    return hits / len(x)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)

    import torch

    from physreason.data.synth.generate import generate_task

    device = "cuda" if torch.cuda.is_available() else "cpu"
    report: dict[str, dict] = {}
    for task in args.tasks:
        started = time.perf_counter()
        for split, n in (("train", args.train_per_task), ("test", args.test_per_task)):
            generate_task(
                task, n, args.out / split, split, workers=args.workers, show_progress=False, option_order="fixed"
            )
        (x, y), (xt, yt) = (load_split(args.out / s / task, args.max_pixels, args.workers) for s in ("train", "test"))
        classes = int(y.max()) + 1
        print(f"{task}: train {tuple(x.shape)}, test {tuple(xt.shape)}, {classes} classes, "
              f"loaded in {time.perf_counter() - started:.0f} s", flush=True)  # fmt: skip
        torch.manual_seed(0)
        net = probe_net(classes).to(device)
        opt = torch.optim.AdamW(net.parameters(), lr=args.lr)
        curve = []
        for epoch in range(args.epochs):
            for idx in torch.randperm(len(x)).split(32):
                loss = torch.nn.functional.cross_entropy(net(x[idx].to(device).float() / 255), y[idx].to(device))
                opt.zero_grad()
                loss.backward()
                opt.step()
            curve.append((accuracy(net, x, y, device), accuracy(net, xt, yt, device)))
            print(f"  epoch {epoch + 1}: train {curve[-1][0]:.3f}, held-out {curve[-1][1]:.3f}", flush=True)
        report[task] = {
            "chance": 1 / classes,
            "held_out_final": curve[-1][1],
            "held_out_best": max(c[1] for c in curve),
            "curve": curve,
            "seconds": time.perf_counter() - started,
        }
    summary = {t: {k: r[k] for k in ("chance", "held_out_final", "held_out_best")} for t, r in report.items()}
    print(json.dumps({"device": device, "summary": summary}, indent=1))
    if os.environ.get("OUT"):
        payload = {"device": device, "args": {k: str(v) for k, v in vars(args).items()}, "report": report}
        Path(os.environ["OUT"], "intuitive_physics_probe.json").write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
