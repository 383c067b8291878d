"""`physreason plot`: training curves of a run as a PNG."""

from __future__ import annotations

from pathlib import Path

import typer


def plot(
    run_dir: Path = typer.Argument(..., help="A run's train.output_dir (reads logs/metrics.jsonl), or a metrics.jsonl."),
    out: Path | None = typer.Option(None, help="PNG to write [default: RUN_DIR/curves.png, beside a metrics.jsonl given]."),
) -> None:
    """Draw loss, reward, learning-rate and accuracy curves from a run's metrics.jsonl into a PNG."""
    from physreason.plots import training_curves

    target = out or (run_dir.parent if run_dir.is_file() else run_dir) / "curves.png"
    path, panels = training_curves(run_dir, target)
    typer.echo(f"wrote {path} ({', '.join(panels)})")
