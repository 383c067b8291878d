"""Each physreason process sizes its CPU threads and loader workers by its share of the host, not the whole host.

Four seeds side by side on a 4-GPU host (one GPU each, 14 loader workers each) ran 7-10x slower than one alone: each
process started torch's and FFmpeg's thread per core of the whole host.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from physreason.cpu import PROCESSES_ENV, THREADS_ENV, CpuShare, cpu_share, host_processes
from physreason.errors import ConfigError


def test_one_process_takes_the_whole_host():
    share = cpu_share({}, cpus=64, gpus=4)
    assert (share.processes, share.threads) == (1, 64)


def test_a_seed_on_one_of_four_gpus_takes_a_quarter():
    # the grounding experiment's side-by-side seeds: CUDA_VISIBLE_DEVICES=$((s - 1)) on a 4-GPU host
    share = cpu_share({"CUDA_VISIBLE_DEVICES": "2"}, cpus=64, gpus=4)
    assert (share.processes, share.threads) == (4, 16)
    assert "1 of 4 GPUs" in share.source
    assert share.loader_workers(14) == 14  # the bench's 14 workers fit 16 threads
    assert share.loader_workers(64) == 15  # one thread left to the process itself


def test_torchrun_ranks_split_the_host():
    assert cpu_share({"LOCAL_WORLD_SIZE": "8"}, cpus=128, gpus=8).threads == 16
    # 2 ranks on 2 of 8 GPUs: the other 6 GPUs are taken for 3 more such jobs
    assert host_processes({"LOCAL_WORLD_SIZE": "2", "CUDA_VISIBLE_DEVICES": "0,1"}, gpus=8)[0] == 8


def test_explicit_settings_win():
    # two seeds side by side on one GPU say so; an explicit thread count wins over everything
    assert cpu_share({PROCESSES_ENV: "2"}, cpus=16, gpus=1).threads == 8
    assert cpu_share({PROCESSES_ENV: "2", THREADS_ENV: "3", "LOCAL_WORLD_SIZE": "4"}, cpus=16, gpus=1).threads == 3
    # more processes than CPUs: one thread each, never 0
    assert cpu_share({PROCESSES_ENV: "32"}, cpus=16, gpus=0).threads == 1


def test_unknown_gpu_count_or_all_gpus_visible_is_one_process():
    assert cpu_share({"CUDA_VISIBLE_DEVICES": "0"}, cpus=16, gpus=0).threads == 16
    assert cpu_share({"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, cpus=16, gpus=4).threads == 16
    assert cpu_share({"CUDA_VISIBLE_DEVICES": ""}, cpus=16, gpus=4).threads == 16  # CPU run


@pytest.mark.parametrize("value", ["0", "two", "-1"])
def test_a_bad_setting_is_a_one_line_error(value):
    with pytest.raises(ConfigError, match=f"{THREADS_ENV}='{value}'"):
        cpu_share({THREADS_ENV: value}, cpus=8, gpus=0)


def test_loader_workers_keep_zero_and_at_least_one():
    share = CpuShare(cpus=4, processes=4, threads=1, source="-")
    assert share.loader_workers(0) == 0
    assert share.loader_workers(8) == 1


def test_a_trainer_process_sets_torch_threads_to_its_share():
    code = (
        "import torch; from physreason.train.runtime import init_runtime; init_runtime(); "
        "print(torch.get_num_threads())"
    )
    env = {"PATH": "", PROCESSES_ENV: "2", "PYTHONPATH": ":".join(sys.path)}
    cpus = len(os.sched_getaffinity(0))
    done = subprocess.run([sys.executable, "-c", code], env=env | {"CUDA_VISIBLE_DEVICES": ""}, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) == max(1, cpus // 2)


def test_video_decoding_keeps_ffmpegs_threads_alone_and_takes_the_share_when_shared(monkeypatch):
    from physreason import cpu

    monkeypatch.setattr(cpu, "_applied", CpuShare(cpus=64, processes=1, threads=64, source="one process"))
    assert cpu.decode_threads() == 0  # FFmpeg's own choice, as before
    monkeypatch.setattr(cpu, "_applied", CpuShare(cpus=64, processes=4, threads=16, source="shared by 4 processes"))
    assert cpu.decode_threads() == 16
    monkeypatch.setattr("torch.utils.data.get_worker_info", lambda: object())
    assert cpu.decode_threads() == 1  # a loader worker: the workers are the parallelism
