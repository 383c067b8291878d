"""Pre-train a from-scratch model's vision tower on the intuitive-physics SFT clips, before its SFT.

The pre-training itself (a dense per-task loss on the tower's pooled features, a tenth of the clips held out and
scored to keep the best tower, the model saved with the trained tower) is `physreason.train.tower.pretrain_tower`,
which `physreason demo` also runs; this script is its command line, and can first generate one task's clips and
build the model.

Used by the intuitive-physics experiment (`--tower-steps`); run alone:
  python -m physreason.experiments.tower MODEL_DIR DATA_ROOT OUT_DIR [--steps 1500]
where DATA_ROOT holds `sft.jsonl` (letter-answer records) and the clips they name. With `--generate TASK --clips N`
it first writes N clips of one task (train split, seed 0, options in fixed order) and their records there, and with
`--new-model` it first builds the random scale-2 Qwen2.5-VL at MODEL_DIR (`--temporal-patch`), e.g. on CPU:
  python -m physreason.experiments.tower /tmp/tw/model /tmp/tw/data /tmp/tw/out --new-model \
      --generate arrow_of_time --clips 1000 --steps 800 --workers 2
"""

from __future__ import annotations

import argparse
from pathlib import Path

from physreason.train.tower import own_task_loss, pretrain_tower

__all__ = ["own_task_loss", "pretrain_tower", "write_task_records"]


def write_task_records(task: str, clips: int, data_root: Path, workers: int) -> None:
    """Generate `clips` clips of `task` under data_root (reusing finished ones) and its letter-answer sft.jsonl."""
    from physreason.data.synth.generate import generate_task
    from physreason.data.synth.records import letter_sft_records

    generate_task(task, clips, data_root, "train", 0, workers=workers, show_progress=False, option_order="fixed")
    letter_sft_records(data_root, data_root / "sft.jsonl", tasks=[task])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("data_root", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--max-pixels", type=int, default=12544)
    parser.add_argument("--generate", metavar="TASK", help="first write --clips clips of this task and sft.jsonl")
    parser.add_argument("--clips", type=int, default=1000)
    parser.add_argument("--new-model", action="store_true", help="first build a random scale-2 model at MODEL_DIR")
    parser.add_argument("--temporal-patch", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0, help="initialisation of the head, held-out split, batch order")
    parser.add_argument("--eval-every", type=int, default=0, help="score the held-out tenth every N steps (0: steps/30)")
    parser.add_argument("--patience", type=int, default=0, help="stop after N steps without a better score (0: never)")
    args = parser.parse_args(argv)
    if args.generate:
        write_task_records(args.generate, args.clips, args.data_root, args.workers)
    if args.new_model and not (args.model_dir / "model.safetensors").is_file():
        from physreason.models.tiny import save_tiny_model

        save_tiny_model("qwen2_5_vl", args.model_dir, scale=2, temporal_patch_size=args.temporal_patch)
    vision = {"min_pixels": min(12544, args.max_pixels), "max_pixels": args.max_pixels, "max_frames": 12}
    pretrain_tower(
        args.model_dir, args.data_root, args.out_dir, vision, args.steps, args.lr, args.batch, args.workers,
        seed=args.seed, eval_every=args.eval_every, patience=args.patience,
    )  # fmt: skip


if __name__ == "__main__":
    main()
