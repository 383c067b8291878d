"""Run a tiny SFT whose process dies (as by kill -9) while its background writer is writing one checkpoint.

python killed_async_save.py STEP OVERRIDE...: the run saves with [train.ckpt] save_mode = "async"; when DCP's writer
thread starts writing the checkpoint of STEP, it writes part of a shard and the whole process exits at once
(os._exit: no cleanup, no exception handling, nothing flushed), while the training thread goes on with later steps.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from torch.distributed.checkpoint import FileSystemWriter

from physreason.config import load_config
from physreason.train.sft import run_sft


def main() -> None:
    step, overrides = int(sys.argv[1]), sys.argv[2:]
    real = FileSystemWriter.write_data

    def dying(self, plan, planner):
        if Path(self.path).name == f"step_{step}.tmp":
            (Path(self.path) / "__0_0.distcp").write_bytes(b"half a shard")
            os._exit(137)
        return real(self, plan, planner)

    FileSystemWriter.write_data = dying
    run_sft(load_config(None, overrides))


if __name__ == "__main__":
    main()
