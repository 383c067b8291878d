"""Colocated GRPO under torchrun (gloo, tiny Qwen2.5-VL and Qwen3-VL) with mixed visual inputs, tensor and context parallelism.

One single-process run is the reference, on two prompts: the first with an image, the second text-only.
Two data-parallel processes each draw one of them, so one rank's micro-batches carry pixels and the
other's do not: without vision balancing the text-only rank skips the vision tower's FSDP2
collectives and the job crashes (gloo) or hangs (NCCL). Two processes with tp_size=2 hold the same batch
on both ranks: token counts summed over every rank, not the data-parallel group, would halve the
gradients, and torch's clip_grad_norm_ fails on parameters that live on two meshes. Two processes with cp_size=2
split each micro-batch's rows (the image row and the text-only row) over both ranks: each scores and back-propagates
its own tokens, and the policy update must equal one process's.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from media import write_image
from setups import run_torchrun
from test_grpo_fsdp import TESTS, WORKER, _overrides, train_and_record

from physreason.config import load_config
from physreason.models.tiny import save_tiny_model

pytestmark = pytest.mark.cpu_only  # gloo children compared with an in-process run

# A broken run hangs in a collective rather than failing: a run this long has hung.
TIMEOUT_S = 180


def _write_prompts(folder: Path) -> Path:
    records = []
    for i in range(2):
        record = {"question": f"Which way does ball {i} go?", "options": ["up", "down", "left", "right"], "answer": "B"}
        if i == 0:
            write_image(folder / "ball.png", seed=i)
            record["image"] = "ball.png"
        records.append(record)
    path = folder / "mcq.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records))
    return path


def _run_overrides(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    # One step over both prompts, unshuffled: data-parallel rank 0 draws the image prompt, rank 1 the text one.
    # No clipping, so a wrong gradient scale shows in the update (and in the second iteration's loss).
    return _overrides(
        model,
        data,
        out,
        "train.max_steps=1",
        "rollout.batch_size=1",
        "data.shuffle=false",
        "train.param_dtype='float32'",
        "train.optm_grad_norm_clip=0",
        "train.ckpt.enable_checkpoint=false",
        "train.ckpt.export_safetensors=false",
        *extra,
    )


def _torchrun(processes: int, overrides: list[str], out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    script = out / "worker.py"
    script.write_text(WORKER)
    # --standalone picks a free port: other test runs may share this machine
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes)]
    command += [str(script), str(TESTS), json.dumps(overrides), str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = run_torchrun(command, env, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((out / "record.json").read_text())


@pytest.fixture(scope="module")
def setup(tmp_path_factory, vl_kind) -> dict:
    """The model, the prompts, and the single-process reference record."""
    tmp = tmp_path_factory.mktemp("grpo_tp")
    model = save_tiny_model(vl_kind, tmp / "model")
    (tmp / "data").mkdir()
    data = _write_prompts(tmp / "data")
    (tmp / "one").mkdir()
    train_and_record(load_config(None, _run_overrides(model, data, tmp / "one")), tmp / "one", rank=0)
    one = json.loads((tmp / "one" / "record.json").read_text())
    return {"model": model, "data": data, "one": one}


def _assert_matches(record: dict, reference: dict) -> None:
    assert record["rewards"] == pytest.approx(reference["rewards"], rel=1e-9)
    assert torch.allclose(torch.tensor(record["losses"]), torch.tensor(reference["losses"]), rtol=1e-4, atol=1e-6)
    assert torch.allclose(torch.tensor(record["grad_norms"]), torch.tensor(reference["grad_norms"]), rtol=1e-4)


@pytest.mark.slow
def test_data_parallel_ranks_with_image_and_text_only_prompts_train_like_one_process(setup, tmp_path):
    overrides = _run_overrides(setup["model"], setup["data"], tmp_path)
    record = _torchrun(2, overrides, tmp_path)
    assert all(loss != 0.0 for loss in setup["one"]["losses"])
    assert all(norm > 0.0 for norm in setup["one"]["grad_norms"])
    _assert_matches(record, setup["one"])


@pytest.mark.slow
def test_tensor_parallel_policy_matches_one_process_loss_and_grad_norm(setup, tmp_path):
    overrides = _run_overrides(setup["model"], setup["data"], tmp_path, "policy.parallelism.tp_size=2")
    record = _torchrun(2, overrides, tmp_path)
    _assert_matches(record, setup["one"])


@pytest.mark.slow
def test_context_parallel_policy_matches_one_process_loss_and_grad_norm(setup, tmp_path):
    # one data-parallel rank: both ranks generate the same rollouts (the engine seeds per prompt), then split the rows
    overrides = _run_overrides(setup["model"], setup["data"], tmp_path, "policy.parallelism.cp_size=2")
    record = _torchrun(2, overrides, tmp_path)
    assert all(loss != 0.0 for loss in setup["one"]["losses"])
    _assert_matches(record, setup["one"])
