"""This process's share of the host's CPUs, for torch's threads, data-loader workers and video decoding.

torch, OpenMP and FFmpeg each size their thread pools by the whole machine. When several physreason processes share
a host (torchrun's ranks, seeds run side by side one a GPU, eval shards), every one of them then starts a thread per
core and they oversubscribe the CPU: measured 7-10x slower steps with four seeds on one 4-GPU host. Each process
instead takes cpus / processes threads, where processes is, first found:

- PHYSREASON_CPU_THREADS: the threads of this process, set explicitly (nothing is derived);
- PHYSREASON_HOST_PROCESSES: how many processes share the host (a launcher of several sets it);
- LOCAL_WORLD_SIZE (torchrun's processes on this node) times the host's GPUs / the GPUs CUDA_VISIBLE_DEVICES leaves
  to this process: a process that sees 1 of 4 GPUs is taken for one of 4 such processes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from physreason.errors import ConfigError

log = logging.getLogger(__name__)

THREADS_ENV = "PHYSREASON_CPU_THREADS"
PROCESSES_ENV = "PHYSREASON_HOST_PROCESSES"
NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")  # one folder per GPU of the host, whatever CUDA_VISIBLE_DEVICES says


@dataclass(frozen=True)
class CpuShare:
    """This process's CPU threads, out of the host's `cpus` shared by `processes`, and why (`source`)."""

    cpus: int
    processes: int
    threads: int
    source: str

    def loader_workers(self, requested: int) -> int:
        """Data-loader worker processes within this share: `requested`, at most threads - 1 (one left to this
        process), at least 1 when any was requested; 0 stays 0 (loading in this process)."""
        if requested <= 0:
            return 0
        return max(1, min(requested, self.threads - 1))

    def describe(self) -> str:
        """One line: threads of how many CPUs, and why."""
        return f"CPU: {self.threads} threads of {self.cpus} CPUs ({self.source}; {THREADS_ENV} sets it)"


def host_cpus() -> int:
    """CPUs this process may run on (its affinity: taskset, cgroup cpusets), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def host_gpus() -> int:
    """GPUs of the host from the NVIDIA driver, 0 when unknown (no driver, not Linux)."""
    try:
        return sum(1 for _ in NVIDIA_GPUS.iterdir())
    except OSError:
        return 0


def _positive(environ: Mapping[str, str], name: str) -> int | None:
    value = environ.get(name, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"{name}={value!r}: give a whole number of at least 1, or unset it")
    return int(value)


def host_processes(environ: Mapping[str, str], gpus: int) -> tuple[int, str]:
    """How many processes share the host, and why (see the module docstring); `gpus`: the host's GPUs (0: unknown)."""
    explicit = _positive(environ, PROCESSES_ENV)
    if explicit is not None:
        return explicit, f"{PROCESSES_ENV}={explicit}"
    local = _positive(environ, "LOCAL_WORLD_SIZE") or 1
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    shown = [d for d in visible.split(",") if d.strip()] if visible is not None else []
    groups = gpus // len(shown) if shown and gpus > len(shown) else 1
    reasons = [f"{local} torchrun processes"] if local > 1 else []
    if groups > 1:
        reasons.append(f"CUDA_VISIBLE_DEVICES shows {len(shown)} of {gpus} GPUs")
    return local * groups, ", ".join(reasons) or "one process"


def cpu_share(environ: Mapping[str, str] | None = None, cpus: int | None = None, gpus: int | None = None) -> CpuShare:
    """This process's CpuShare: PHYSREASON_CPU_THREADS when set, else cpus // processes (at least 1)."""
    environ = os.environ if environ is None else environ
    cpus = host_cpus() if cpus is None else cpus
    explicit = _positive(environ, THREADS_ENV)
    if explicit is not None:
        return CpuShare(cpus, 1, explicit, f"{THREADS_ENV}={explicit}")
    processes, why = host_processes(environ, host_gpus() if gpus is None else gpus)
    share = max(1, cpus // processes)
    return CpuShare(cpus, processes, share, f"shared by {processes} processes: {why}" if processes > 1 else why)


_applied: CpuShare | None = None


def apply_cpu_share(share: CpuShare | None = None) -> CpuShare:
    """Size this process's torch threads (and OpenMP's, for processes it starts) to its share; once per process,
    later calls return the first share. Logs CpuShare.describe() (torchrun: rank 0 only)."""
    global _applied
    if _applied is not None:
        return _applied
    import torch

    share = share or cpu_share()
    torch.set_num_threads(share.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(share.threads))
    _applied = share
    if os.environ.get("RANK", "0") == "0":  # torchrun's ranks share one line
        log.info("%s", share.describe())
    return share


# Threads that decode clips ahead of an engine at most (evaluation, rollouts, batch inference).
MAX_DECODE_AHEAD_THREADS = 8


def decode_ahead_threads() -> int:
    """Threads that decode and patchify the next batch's clips while the engine answers this one: this process's CPU
    share less the one thread the engine's own loop needs, at most MAX_DECODE_AHEAD_THREADS (FFmpeg and the resize
    release the GIL); 1 or 0 means decoding in this thread between batches (a 2-core machine)."""
    return min(MAX_DECODE_AHEAD_THREADS, cpu_share().threads - 1)


def decode_threads() -> int:
    """FFmpeg decoder threads of one video, 0 for FFmpeg's own choice (a thread per core, at most 16): that when this
    process has the host to itself; when it shares the host, 1 in a data-loader worker (the workers are the
    parallelism) and this process's share elsewhere (rollouts and evaluation decode in the main process)."""
    global _computed
    from torch.utils.data import get_worker_info

    if _applied is None and _computed is None:
        _computed = cpu_share()
    share = _applied or _computed
    if share.processes == 1 and not share.source.startswith(THREADS_ENV):
        return 0
    return 1 if get_worker_info() is not None else share.threads


_computed: CpuShare | None = None  # decode_threads' share when apply_cpu_share was not called
