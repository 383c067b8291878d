"""The gradient norm over dp x tp is one all-reduce and equals one process's norm; clipping gives the same parameters.

tests/grad_norm_worker.py runs on gloo ranks (2 for dp2 and tp2, 4 for dp2 x tp2) against the same tiny Qwen3-VL
model whole in each process: its vision tower (sharded on the dp mesh alone, the same on every tp rank) and its
per-head q/k norms (replicated over tp) are counted once each.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from setups import free_port, run_torchrun

pytestmark = pytest.mark.cpu_only  # gloo children compared with an in-process model

WORKER = Path(__file__).with_name("grad_norm_worker.py")


def run_worker(tmp_path: Path, nproc: int, layouts: list[str]) -> dict:
    out = tmp_path / f"norms{nproc}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
               str(free_port()), str(WORKER), ",".join(layouts), str(out)]  # fmt: skip
    done = run_torchrun(command, env)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


def assert_one_collective_and_same_clip(layout: str, result: dict) -> None:
    assert result["split_norm"] == pytest.approx(result["whole_norm"], rel=1e-6, abs=0), layout
    # one all_reduce over the world, whatever the meshes (DTensor's norm made one per mesh dimension, then one per mesh)
    assert result["collectives"] == 1, (layout, result["collectives"])
    assert result["grads"] > 0 and result["tower_grads"] > 0, layout
    assert result["grad_gap"] <= 1e-5, (layout, result["grad_gap"])
    assert result["param_gap"] <= 1e-5, (layout, result["param_gap"])


@pytest.mark.slow
def test_dp2_and_tp2_grad_norm_is_one_collective_equal_to_one_process(tmp_path):
    results = run_worker(tmp_path, 2, ["2x1", "1x2"])
    for layout, result in results.items():
        assert_one_collective_and_same_clip(layout, result)


@pytest.mark.slow
def test_dp2_x_tp2_grad_norm_is_one_collective_equal_to_one_process(tmp_path):
    results = run_worker(tmp_path, 4, ["2x2"])
    assert_one_collective_and_same_clip("2x2", results["2x2"])
