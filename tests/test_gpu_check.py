"""`physreason gpu-check` (physreason/gpu_check.py) on CPU (--cpu): its lines, exit codes and JSON; the GPU runs are in bench/RESULTS.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "physreason", "gpu-check", "--cpu", "--work", str(tmp_path / "w"),
                           *args], env=env, capture_output=True, text=True, timeout=300)  # fmt: skip


def test_a_check_passes_one_needing_cuda_is_skipped_and_the_json_follows(tmp_path):
    done = run(tmp_path, "--only", "hf-generate,float8-rowwise", "--commit", "abc1234")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if "] " in line]
    assert any(" pass hf-generate " in line and "4 completions" in line for line in lines), done.stdout
    assert any(" skip float8-rowwise " in line and "needs CUDA" in line for line in lines), done.stdout
    assert lines[-1].endswith("1 passed, 0 failed, 1 skipped")
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert report["commit"] == "abc1234"
    assert {r["check"]: r["status"] for r in report["rows"]} == {"float8-rowwise": "skip", "hf-generate": "pass"}


def test_a_check_over_its_time_fails_its_line_and_the_exit_code(tmp_path):
    done = run(tmp_path, "--only", "hf-generate", "--timeout", "1")
    assert done.returncode == 1
    assert " FAIL hf-generate " in done.stdout and "did not finish in 1 s" in done.stdout
    assert done.stdout.strip().splitlines()[-1].endswith("0 passed, 1 failed, 0 skipped: hf-generate")
    assert (tmp_path / "out" / "hf-generate.log").is_file()  # a failed check's log comes back under $OUT


def test_unknown_checks_are_refused_and_the_error_line_is_the_one_naming_it():
    import physreason.gpu_check as check

    log = "Traceback (most recent call last):\n  File x\nRuntimeError: Expected trailing dimension divisible by 16\n"
    assert check.last_error(log) == "RuntimeError: Expected trailing dimension divisible by 16"
    # torchrun ends with its own summary after the rank's exception; the rank's line is the error
    ranks = ("[rank0]:   File x\n[rank0]: TypeError: shard() takes 5 positional arguments but 6 were given\n"
             "    raise ChildFailedError(\ntorch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
             "Root Cause (first observed failure):\n  exitcode  : 1 (pid: 23656)\n  error_file: <N/A>\n"
             "  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html\n")
    assert check.last_error(ranks) == "TypeError: shard() takes 5 positional arguments but 6 were given"
    assert check.missing(check.CHECKS[0], gpus=1, vllm=False, cpu=False) is None
    two = next(c for c in check.CHECKS if c.name == "tp2")
    assert check.missing(two, gpus=1, vllm=False, cpu=False) == "needs 2 GPUs, 1 visible"
    assert not check.close([1.0, 2.0], [1.0, 2.1], 1e-3) and check.close([1.0], [1.0005], 1e-3)
    done = subprocess.run([sys.executable, "-m", "physreason", "gpu-check", "--only", "no-such-check"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2 and "unknown check(s) no-such-check" in done.stderr


def test_the_torchrun_worker_trains_fsdp2_on_one_rank(tmp_path):
    # The worker wraps build.shard to record the mesh; it must pass on whatever build.shard takes (a wrapper of the
    # old arity failed every torchrun check with a TypeError), and fsdp2-torchrun must train FSDP2, not the cast path.
    done = run(tmp_path, "--only", "fsdp2-torchrun", "--timeout", "240")
    assert done.returncode == 0, done.stdout + done.stderr + (tmp_path / "w" / "fsdp2-torchrun.log").read_text()
    assert " pass fsdp2-torchrun " in done.stdout and "FSDP2 on a one-rank mesh" in done.stdout, done.stdout


def test_the_skips_check_counts_both_ranks_skips_and_the_step_without_an_update(tmp_path):
    # dp2-skips runs on 2 gloo processes here (NCCL on a GPU machine): a skip on rank 1 only, a step of only skipped
    # samples, then rank 0 with nothing left while rank 1 trains; the counts are the global batch's
    done = run(tmp_path, "--only", "dp2-skips", "--timeout", "240")
    assert done.returncode == 0, done.stdout + done.stderr
    assert " pass dp2-skips " in done.stdout and "7 skipped over both ranks, 1 step without an update" in done.stdout


def test_jobs_run_one_gpu_checks_at_once_and_keep_the_json_in_list_order(tmp_path):
    done = run(tmp_path, "--only", "chunked-loss,hf-generate,float8-rowwise", "--jobs", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert " pass hf-generate " in done.stdout and " pass chunked-loss " in done.stdout, done.stdout
    assert done.stdout.strip().splitlines()[-1].endswith("2 passed, 0 failed, 1 skipped")
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert [r["check"] for r in report["rows"]] == ["float8-rowwise", "chunked-loss", "hf-generate"]
    refused = subprocess.run([sys.executable, "-m", "physreason", "gpu-check", "--jobs", "0"],
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    assert refused.returncode == 2 and "--jobs 0: give 1 or more" in refused.stdout + refused.stderr


class _FakeEngine:
    """Stands in for a vLLM engine in check_vllm_close: answers the same greedy tokens, records its close."""

    closed = 0

    def __init__(self, tokens):
        self.tokens = tokens

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        _FakeEngine.closed += 1

    def generate(self, requests, sampling):
        from physreason.engines.base import Completion, GenerationResult

        completion = Completion(text="x", token_ids=self.tokens, logprobs=[], finish_reason="length")
        return [GenerationResult(request_id=None, completions=[completion])]


def _close_check(monkeypatch, tmp_path, free_gib, tokens):
    """check_vllm_close with create_engine and torch.cuda.mem_get_info replaced: free_gib in the order read."""
    import torch

    from physreason import gpu_check
    from physreason.engines import factory

    reads = iter(free_gib)
    engines = iter(tokens)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (int(next(reads) * 1024**3), 80 * 1024**3))
    monkeypatch.setattr(factory, "create_engine", lambda *a, **k: _FakeEngine(next(engines)))
    _FakeEngine.closed = 0
    return gpu_check


def test_vllm_close_check_passes_when_memory_comes_back(monkeypatch, tmp_path):
    gpu_check = _close_check(monkeypatch, tmp_path, [70, 46, 69.5, 46, 69.5], [[1, 2], [1, 2]])
    detail = gpu_check.check_vllm_close(tmp_path)
    assert _FakeEngine.closed == 2
    assert detail.startswith("98% of 24.0 GiB back after close; second engine same tokens")


def test_vllm_close_check_fails_when_close_keeps_memory_or_tokens_differ(monkeypatch, tmp_path):
    gpu_check = _close_check(monkeypatch, tmp_path, [70, 46, 50, 26, 30], [[1, 2], [1, 2]])
    monkeypatch.setattr(gpu_check, "cuda_tensor_holders", lambda: ["42.00 GiB (8, 2) torch.bfloat16 <- dict['kv_cache']"])
    with pytest.raises(AssertionError, match=r"close\(\) gave back 4.0 of the 24.0 GiB") as failed:
        gpu_check.check_vllm_close(tmp_path)
    # it stops after the first engine (a second would only add its own leftovers) and names what still holds memory
    assert _FakeEngine.closed == 1
    assert "torch's allocator 0.0 / 0.0 / 0.0 GiB allocated" in str(failed.value)
    assert "largest CUDA tensors left: 42.00 GiB (8, 2) torch.bfloat16 <- dict['kv_cache']" in str(failed.value)
    gpu_check = _close_check(monkeypatch, tmp_path, [70, 46, 69.5, 46, 69.5], [[1, 2], [3]])
    with pytest.raises(AssertionError, match="second engine's greedy tokens"):
        gpu_check.check_vllm_close(tmp_path)


def test_cuda_tensor_holders_names_the_chain_that_keeps_a_tensor(monkeypatch):
    """On CPU the search for CUDA tensors is exercised with CPU tensors standing in (is_cuda patched on a subclass)."""
    import torch

    from physreason import gpu_check

    class Held(torch.Tensor):
        is_cuda = True

    class Layer:
        pass

    layer = Layer()
    layer.kv_cache = torch.zeros(2, 1024, 1024, 8).as_subclass(Held)  # 64 MiB of float32
    holders = {"layers": [layer]}
    small = torch.zeros(4).as_subclass(Held)  # under min_bytes: not listed
    lines = gpu_check.cuda_tensor_holders(min_bytes=64 * 1024**2)
    assert len(lines) == 1, lines
    assert lines[0].startswith("0.06 GiB (2, 1024, 1024, 8) torch.float32 <- ")
    assert lines[0].endswith("Layer.kv_cache <- list[0] <- dict['layers'] <- (no Python referrer)"), lines[0]
    del small, holders


def test_a_vllm_check_gets_at_least_its_cold_start_time_whatever_timeout_says(tmp_path, monkeypatch):
    """A fresh machine compiles and captures vLLM's graphs cold: --timeout 120 must not fail vllm-fp8-rollout early."""
    from physreason import gpu_check

    given = {}

    def fake_run(command, stdout, stderr, timeout, check):
        given[command[command.index("--worker") + 1]] = (timeout, float(command[command.index("--timeout") + 1]))
        raise subprocess.TimeoutExpired(command, timeout)

    monkeypatch.setattr(gpu_check.subprocess, "run", fake_run)
    checks = {check.name: check for check in gpu_check.CHECKS}
    rows = [gpu_check.run_worker(checks[name], tmp_path, 120.0) for name in ("vllm-fp8-rollout", "vllm-close", "hf-generate")]
    assert given == {"vllm-fp8-rollout": (420, 420.0), "vllm-close": (300, 300.0), "hf-generate": (120.0, 120.0)}
    assert "did not finish in 420 s" in rows[0]["detail"] and rows[0]["status"] == "FAIL"
    assert gpu_check.run_worker(checks["hf-generate"], tmp_path, 900.0) and given["hf-generate"] == (900.0, 900.0)
