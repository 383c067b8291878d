"""`physreason gpu-check`: run every GPU-only path at tiny size on this machine, one pass/fail line each."""

from __future__ import annotations

from pathlib import Path

import typer


def gpu_check(
    only: str = typer.Option("", help="Comma-separated check names (default: all; --list names them)."),
    vllm: bool = typer.Option(False, "--vllm", help="Also run the vLLM checks (vLLM must be installed)."),
    timeout: float = typer.Option(120.0, help="Seconds each check may take (its worker dumps its stacks 10 s before)."),
    jobs: int = typer.Option(
        1, help="One-GPU checks run this many at a time on the same GPU (two-GPU and vLLM checks still run alone)."
    ),
    work: Path | None = typer.Option(None, help="Scratch folder [default: a new temporary one]."),
    commit: str = typer.Option("", help="The commit the tree is at, for the report (a copy without git history)."),
    list_checks: bool = typer.Option(False, "--list", help="Print the checks with their GPU counts and exit."),
    cpu: bool = typer.Option(
        False, "--cpu", help="Run the checks' logic on CPU processes (gloo stands in for NCCL): the command's own test."
    ),
) -> None:
    """Check the paths CPU tests cannot reach (async saves, float8, compiled blocks, CPU offload, FSDP2/TP/CP over
    NCCL, the engines) on this GPU type, in a few minutes. Exit 1 when a check fails; with OUT set, OUT/gpu_check.json
    and each failed check's log are written. docs/gpu-status.md lists what has passed on which GPU."""
    from physreason.errors import ConfigError
    from physreason.gpu_check import CHECKS, main

    if jobs < 1:
        raise ConfigError(f"--jobs {jobs}: give 1 or more (1: one check after another)")
    unknown = sorted({name for name in only.split(",") if name} - {check.name for check in CHECKS})
    if unknown:
        raise ConfigError(f"--only names unknown check(s) {', '.join(unknown)}: physreason gpu-check --list names them")
    argv = ["--timeout", str(timeout), "--jobs", str(jobs)]
    argv += ["--only", only] if only else []
    argv += ["--vllm"] if vllm else []
    argv += ["--work", str(work)] if work is not None else []
    argv += ["--commit", commit] if commit else []
    argv += ["--list"] if list_checks else []
    argv += ["--cpu"] if cpu else []
    code = main(argv)
    if code:
        raise typer.Exit(code)
