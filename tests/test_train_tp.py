"""Tensor parallelism (DTensor TP composed with FSDP2) trains exactly like one process, on gloo with the tiny VL model.

One single-process run is the reference. Two processes with tp_size=2 (mesh dp=1 x tp=2) must match its losses,
gradient norms and exported weights, and their DCP checkpoint (DTensor shards) must resume in one process. Four
processes (dp=2 x tp=2, FSDP2 over a 2D mesh) resume from the single-process checkpoint and must match the rest of
its curve. Half the records carry an image, so the replicated vision tower takes part in the forward and backward.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from media import write_image
from safetensors.torch import load_file
from setups import run_torchrun

from physreason.config import load_config
from physreason.models.tiny import save_tiny_model
from physreason.train.sft import run_sft

pytestmark = pytest.mark.cpu_only  # gloo children compared with an in-process run

ANSWER = "<think>\nthe ball falls\n</think>\n\n<answer>\nyes\n</answer>"
STEPS = 4
LR = 2e-3

WORKER = textwrap.dedent(
    """
    import json, sys
    import torch.distributed as dist
    from physreason.config import load_config
    from physreason.train.sft import run_sft
    run_sft(load_config(None, json.loads(sys.argv[1])))
    dist.destroy_process_group()
    """
)


def _write_data(folder: Path) -> Path:
    records = []
    for i in range(8):
        record = {"conversations": [{"role": "user", "content": f"Does it roll {i}?"}, {"role": "assistant", "content": ANSWER}]}
        if i % 2 == 0:
            write_image(folder / f"img{i}.png", seed=i)
            record["image"] = f"img{i}.png"
        records.append(record)
    data = folder / "train.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in records))
    return data


def _overrides(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return [
        f"model.model_name_or_path='{model}'", f"data.dataset.name='{data}'", f"train.output_dir='{out}'",
        "train.train_batch_per_replica=4", "train.mini_batch=1", f"train.max_steps={STEPS}", f"train.optm_lr={LR}",
        "train.param_dtype='float32'", "data.num_workers=0", "logging.logger=['jsonl']", "model.dtype='float32'",
        # no clipping: a wrong gradient scale would otherwise hide behind the clip and AdamW's scale invariance
        "train.optm_grad_norm_clip=0", "train.ckpt.save_freq=2", "train.ckpt.max_keep=2", "train.log_freq=1", *extra,
    ]


def _metrics(out: Path, key: str) -> list[float]:
    lines = (out / "logs" / "metrics.jsonl").read_text().splitlines()
    return [row[key] for row in map(json.loads, lines) if key in row]


def _torchrun(tmp: Path, nproc: int, overrides: list[str]) -> None:
    script = tmp / "worker.py"
    script.write_text(WORKER)
    # --standalone picks a free port: other test runs may share this machine
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               str(script), json.dumps(overrides)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = run_torchrun(command, env, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, vl_kind) -> dict[str, Path]:
    """Output folders of the single-process reference and of the 2-process tp_size=2 run (same data, same seed)."""
    tmp = tmp_path_factory.mktemp("tp")
    model = save_tiny_model(vl_kind, tmp / "model")
    data = _write_data(tmp / "data")
    folders = {"model": model, "data": data, "one": tmp / "one", "tp2": tmp / "tp2"}
    run_sft(load_config(None, _overrides(model, data, folders["one"], "train.ckpt.export_safetensors=true")))
    _torchrun(tmp, 2, _overrides(model, data, folders["tp2"], "policy.parallelism.tp_size=2",
                                        "train.ckpt.export_safetensors=true"))
    return folders


@pytest.mark.slow
def test_tensor_parallel_matches_one_process_losses_and_grad_norms(runs):
    one_loss, tp_loss = _metrics(runs["one"], "train/loss"), _metrics(runs["tp2"], "train/loss")
    assert len(tp_loss) == STEPS
    assert torch.allclose(torch.tensor(tp_loss), torch.tensor(one_loss), rtol=1e-5, atol=1e-6)
    one_norm, tp_norm = _metrics(runs["one"], "train/grad_norm"), _metrics(runs["tp2"], "train/grad_norm")
    assert torch.allclose(torch.tensor(tp_norm), torch.tensor(one_norm), rtol=1e-4)


@pytest.mark.slow
def test_tensor_parallel_export_gathers_the_same_full_weights(runs):
    one = load_file(runs["one"] / "safetensors" / f"step_{STEPS}" / "model.safetensors")
    tp = load_file(runs["tp2"] / "safetensors" / f"step_{STEPS}" / "model.safetensors")
    assert one.keys() == tp.keys()
    # Adam turns a gradient that is rounding noise (a reduction order apart between 1 process and 2) into a full
    # +-lr step, so a rare element may differ by up to 2 * lr * steps; a gather in the wrong layout or order
    # differs almost everywhere.
    for name, tensor in one.items():
        assert tp[name].shape == tensor.shape, name
        gap = (tensor - tp[name]).abs()
        assert float(gap.max()) <= 2 * LR * STEPS, name
        assert int((gap > 1e-4).sum()) <= max(1, tensor.numel() // 1000), name


@pytest.mark.slow
def test_tensor_parallel_checkpoint_resumes_in_one_process(runs, tmp_path):
    checkpoint = runs["tp2"] / "checkpoints" / "step_2"
    resumed = run_sft(load_config(None, _overrides(runs["model"], runs["data"], tmp_path / "resumed",
                                                   f"train.resume='{checkpoint}'", "train.trust_checkpoint=true",
                                                   "train.ckpt.enable_checkpoint=false")))
    assert torch.allclose(torch.tensor(resumed.losses), torch.tensor(_metrics(runs["one"], "train/loss")[2:]), rtol=1e-5)


@pytest.mark.slow
def test_data_and_tensor_parallel_2d_mesh_resumes_a_single_process_checkpoint(runs, tmp_path):
    out = tmp_path / "dp2tp2"
    checkpoint = runs["one"] / "checkpoints" / "step_2"
    # a clip far above the norm runs the clipping path over both meshes without changing the update
    _torchrun(tmp_path, 4, _overrides(runs["model"], runs["data"], out, "policy.parallelism.tp_size=2",
                                      f"train.resume='{checkpoint}'", "train.trust_checkpoint=true",
                                      "train.ckpt.enable_checkpoint=false", "train.optm_grad_norm_clip=1e6"))
    one_loss, one_norm = _metrics(runs["one"], "train/loss")[2:], _metrics(runs["one"], "train/grad_norm")[2:]
    assert torch.allclose(torch.tensor(_metrics(out, "train/loss")), torch.tensor(one_loss), rtol=1e-5, atol=1e-6)
    assert torch.allclose(torch.tensor(_metrics(out, "train/grad_norm")), torch.tensor(one_norm), rtol=1e-4)
