"""Metric sinks for training runs: JSONL, TensorBoard, wandb (when installed) and console lines."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from physreason.config import LoggingConfig
from physreason.errors import InputError
from physreason.files import write_atomic

log = logging.getLogger(__name__)


def keep_records_up_to(path: Path, step: int) -> None:
    """Rewrite a metrics.jsonl (atomically) with only its records of steps <= `step`; a torn last line goes too.

    A resumed run continues from its checkpoint's step: records an interrupted run wrote after that checkpoint
    would otherwise stand beside the resumed run's own records of the same steps.
    """
    if not path.is_file():
        return
    kept = []
    # errors="replace": a kill inside a multi-byte character leaves bytes that are not UTF-8; that line fails to
    # parse below and goes, like any torn line, instead of the resume failing on the whole file.
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):  # torn, or no JSON reader takes it (4,301 digits, deep nesting)
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
            kept.append(line + "\n")
    write_atomic(path, "".join(kept))  # flushed to disk before the rename: a power cut never leaves it empty


def read_records(path: Path) -> list[dict[str, Any]]:
    """Every record of a metrics.jsonl, in file order; a torn last line is skipped.

    A run killed mid-write leaves its last line cut short, or (kill -9 on some filesystems) a tail of NUL bytes:
    blank and NUL-only lines are skipped, and so is a last line that is not a JSON object. Such a line anywhere
    else is no kill's doing: InputError naming the file and line.
    """
    lines = path.read_text(encoding="utf-8", errors="replace").split("\n")
    numbered = [(number, line) for number, line in enumerate(lines, 1) if line.strip("\x00 \t\r")]
    records = []
    for index, (number, line) in enumerate(numbered):
        try:
            record = json.loads(line)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, or 4,301 digits
            record, problem = None, f"not valid JSON ({exc})"
        else:
            problem = "not a JSON object"
        if isinstance(record, dict):
            records.append(record)
        elif index < len(numbered) - 1:
            raise InputError(
                f"{path}:{number} is {problem}: each line of a metrics log is one step's JSON object; delete or "
                "fix that line and run again"
            )
    return records


class MetricLogger:
    """Write scalar metrics per step to every configured sink; a no-op on ranks other than 0."""

    def __init__(
        self,
        output_dir: str | Path,
        config: LoggingConfig,
        enabled: bool = True,
        run_config: Any = None,
        resumed_step: int = 0,
    ) -> None:
        """resumed_step: the step the run starts after; metrics.jsonl keeps only the records up to it (0: none)."""
        self.enabled = enabled
        self.sinks = set(config.logger)
        self.name = config.experiment_name or time.strftime("sft-%Y%m%d-%H%M%S")
        self._jsonl = None
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        folder = Path(output_dir) / "logs"
        folder.mkdir(parents=True, exist_ok=True)
        if "jsonl" in self.sinks:
            path = folder / "metrics.jsonl"
            keep_records_up_to(path, resumed_step)
            self._jsonl = path.open("a", encoding="utf-8")
        if "tensorboard" in self.sinks:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(folder / "tensorboard" / self.name))
        if "wandb" in self.sinks:
            try:
                import wandb
            except ImportError:
                log.warning("logging.logger names wandb but it is not installed; pip install wandb to use it")
            else:
                self._wandb = wandb.init(project=config.project_name, name=self.name, config=run_config, dir=str(folder))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record metrics (a flat dict of floats) for a step."""
        if not self.enabled:
            return
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for key, value in metrics.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)
        if "console" in self.sinks:
            log.info("step %d %s", step, " ".join(f"{k}={v:.4g}" for k, v in metrics.items()))

    def close(self) -> None:
        """Flush and close every sink."""
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
