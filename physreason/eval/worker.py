"""One evaluation shard as its own process: `python -m physreason.eval.worker --config C --shard I --num-shards K`.

`run_eval` starts these with CUDA_VISIBLE_DEVICES set to the shard's GPUs; the config is the resolved
one it stored beside the results, from which the shard builds the same plan (plan_eval) once, in the
answer-type folder run_eval passes as --base (the one it holds: a choice made again could differ, should
another model's evaluation have taken or freed a folder since).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from physreason.config import load_config
from physreason.errors import PhysReasonError
from physreason.eval.launch import plan_eval, run_shard


def main(argv: list[str] | None = None) -> int:
    """Answer one shard of every repeat and data set in the config; return the process exit code."""
    parser = argparse.ArgumentParser(prog="python -m physreason.eval.worker", description=__doc__)
    parser.add_argument("--config", required=True, help="Resolved TOML config written by run_eval.")
    parser.add_argument(
        "--base",
        type=Path,
        help="The answer-type folder to write to, as run_eval chose it (by default chosen again from the config).",
    )
    parser.add_argument("--shard", type=int, required=True, help="This shard's index, 0-based.")
    parser.add_argument("--num-shards", type=int, required=True, help="Shards in all.")
    args = parser.parse_args(argv)
    if not 0 <= args.shard < args.num_shards:
        parser.error(f"--shard must be in [0, {args.num_shards}), got {args.shard}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        counts = run_shard(plan_eval(load_config(args.config), args.base), args.shard, args.num_shards)
    except PhysReasonError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    answered = sum(c.answered for c in counts)
    failed = sum(c.failed for c in counts)
    skipped = sum(c.skipped for c in counts)
    print(f"shard {args.shard}/{args.num_shards}: {answered} answered, {failed} failed, {skipped} already done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
