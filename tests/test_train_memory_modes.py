"""Smaller optimizer state and CPU offload: the bf16-moment AdamW steps like torch's, and runs resume bit for bit."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from setups import free_port, run_torchrun

from physreason.config import load_config
from physreason.errors import ConfigError
from physreason.models.tiny import save_tiny_model
from physreason.train.adamw import AdamWBF16State
from physreason.train.sft import run_sft

ANSWER = "<think>\nthe ball falls\n</think>\n\n<answer>\nyes\n</answer>"


def test_bf16_state_adamw_first_step_equals_torch_adamw_and_stores_bf16_moments():
    torch.manual_seed(0)
    start = torch.randn(64, 32)
    grads = [torch.randn(64, 32) for _ in range(3)]
    ours, reference = start.clone().requires_grad_(), start.clone().requires_grad_()
    mine = AdamWBF16State([ours], lr=1e-2, weight_decay=0.1)
    theirs = torch.optim.AdamW([reference], lr=1e-2, weight_decay=0.1, foreach=False)
    for index, grad in enumerate(grads):
        ours.grad, reference.grad = grad.clone(), grad.clone()
        mine.step()
        theirs.step()
        if index == 0:  # the moments start at zero, so the first update uses the same float32 values
            assert torch.equal(ours, reference)
    assert mine.state[ours]["exp_avg"].dtype == torch.bfloat16 and mine.state[ours]["exp_avg_sq"].dtype == torch.bfloat16
    assert not torch.equal(ours, reference)  # later steps read rounded moments
    assert torch.allclose(ours, reference, atol=1e-3)
    again = AdamWBF16State([ours], lr=1e-2, weight_decay=0.1)
    again.load_state_dict(mine.state_dict())  # torch's loader would cast the moments to the parameter's float32
    assert again.state[ours]["exp_avg"].dtype == torch.bfloat16
    assert torch.equal(again.state[ours]["exp_avg_sq"], mine.state[ours]["exp_avg_sq"])


def _records(folder: Path) -> Path:
    path = folder / "train.jsonl"
    path.write_text("\n".join(json.dumps({"conversations": [
        {"role": "user", "content": f"Does the box slide {i}?"}, {"role": "assistant", "content": ANSWER}]}) for i in range(8)))
    return path


def _overrides(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return [f"model.model_name_or_path='{model}'", f"data.dataset.name='{data}'", f"train.output_dir='{out}'",
            "train.train_batch_per_replica=4", "train.mini_batch=2", "train.optm_lr=2e-3", "train.param_dtype='float32'",
            "model.dtype='float32'", "data.num_workers=0", "logging.logger=['jsonl']", "train.ckpt.save_freq=2", *extra]


def test_bf16_state_run_resumed_at_step_2_equals_4_steps_straight(tmp_path):
    model = save_tiny_model("qwen3_vl", tmp_path / "model")
    data = _records(tmp_path)
    bf16 = "train.optimizer_state_dtype='bfloat16'"
    straight = run_sft(load_config(None, _overrides(model, data, tmp_path / "a", "train.max_steps=4", bf16)))
    # A fresh run from the step-2 checkpoint (same schedule: the schedule spans train.max_steps).
    step_2 = tmp_path / "a" / "checkpoints" / "step_2"
    resumed = run_sft(load_config(None, _overrides(model, data, tmp_path / "b", "train.max_steps=4", bf16,
                                                   f"train.resume='{step_2}'", "train.trust_checkpoint=true")))
    assert resumed.losses == straight.losses[2:]
    final = [load_file(run / "safetensors" / "step_4" / "model.safetensors") for run in (tmp_path / "a", tmp_path / "b")]
    assert final[0].keys() == final[1].keys()
    assert all(torch.equal(final[0][name], final[1][name]) for name in final[0])


def test_cpu_offload_outside_torchrun_is_refused_naming_the_key(tmp_path):
    model = save_tiny_model("qwen3_vl", tmp_path / "model")
    config = load_config(None, _overrides(model, _records(tmp_path), tmp_path / "out", "train.max_steps=1",
                                          "train.cpu_offload=true"))
    with pytest.raises(ConfigError, match="train.cpu_offload"):
        run_sft(config)


WORKER = textwrap.dedent(
    """
    import json, sys
    import torch.distributed as dist
    from physreason.config import load_config
    from physreason.train.sft import run_sft
    result = run_sft(load_config(None, json.loads(sys.argv[1])))
    if dist.get_rank() == 0:
        json.dump(result.losses, open(sys.argv[2], "w"))
    dist.destroy_process_group()
    """
)


@pytest.mark.slow
@pytest.mark.cpu_only
def test_cpu_offload_on_two_gloo_processes_trains_and_resumes_exactly(tmp_path):
    model = save_tiny_model("qwen3_vl", tmp_path / "model")
    data = _records(tmp_path)
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}

    def launch(out: str, *extra: str) -> list[float]:
        losses = tmp_path / f"{out}-{len(extra)}.json"
        overrides = _overrides(model, data, tmp_path / out, "train.cpu_offload=true", *extra)
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
                   str(script), json.dumps(overrides), str(losses)]
        done = run_torchrun(command, env, clean=[tmp_path / out])
        assert done.returncode == 0, done.stderr[-4000:]
        return json.loads(losses.read_text())

    straight = launch("a", "train.max_steps=4")
    resumed = launch("b", "train.max_steps=4", f"train.resume='{tmp_path / 'a' / 'checkpoints' / 'step_2'}'",
                     "train.trust_checkpoint=true")
    assert len(straight) == 4 and straight[-1] < straight[0]
    assert resumed == straight[2:]
    # train.cpu_offload_overlap on two ranks (the gradient norm reduced over them on the host, before the background
    # step starts): the serial run's losses and final weights, bit for bit
    overlapped = launch("c", "train.max_steps=4", "train.cpu_offload_overlap=true")
    assert overlapped == straight
    final = [load_file(tmp_path / run / "safetensors" / "step_4" / "model.safetensors") for run in ("a", "c")]
    assert final[0].keys() == final[1].keys() and all(torch.equal(final[0][k], final[1][k]) for k in final[0])


def test_the_fused_gpu_update_computes_the_eager_bf16_state_step():
    """adamw_bf16_update (compiled on a GPU) against the eager CPU step it replaces there, over three steps."""
    from physreason.train.adamw import _scalar_tensors, adamw_bf16_update

    torch.manual_seed(0)
    start = torch.randn(64, 32)
    ours, eager = start.clone().requires_grad_(), start.clone().requires_grad_()
    reference = AdamWBF16State([eager], lr=1e-2, weight_decay=0.1)
    m, v = torch.zeros(64, 32, dtype=torch.bfloat16), torch.zeros(64, 32, dtype=torch.bfloat16)
    for step in range(1, 4):
        grad = torch.randn(64, 32)
        eager.grad = grad.clone()
        reference.step()
        scalars = (1e-2, 0.9, 0.999, 1e-8, 0.1, 1 - 0.9**step, (1 - 0.999**step) ** 0.5)
        with torch.no_grad():
            adamw_bf16_update(ours, grad, m, v, *_scalar_tensors(scalars, ours.device))
        # Same math; the float32 rounding order differs, which can move a bf16 moment by one unit in its last place
        # (2**-8 relative): the weights then differ by at most lr x 2**-8, a wrong formula by about lr.
        assert torch.allclose(ours, eager, rtol=0, atol=1e-2 * 2**-7)
        assert torch.allclose(m.float(), reference.state[eager]["exp_avg"].float(), rtol=2**-7, atol=1e-6)
        assert torch.allclose(v.float(), reference.state[eager]["exp_avg_sq"].float(), rtol=2**-7, atol=1e-9)


@pytest.mark.parametrize("clip", [1e-3, 1e3])
def test_offloaded_shards_step_with_the_fused_host_adamw_and_train_as_without_offload(world_of_one, tmp_path, clip):
    """train.cpu_offload under torchrun (one rank): the AdamW over the host's DTensor shards is torch's fused kernel,
    not its default single-tensor loop (a dozen DTensor-dispatched passes over memory per parameter), and the run's
    losses and weights equal those of the same run without offload, whose clipping multiplies the gradients. With
    clipping active (1e-3: the gradients shrink to where AdamW's eps counts, so a coefficient applied twice or not at
    all moves the weights) the offloaded step takes the coefficient as the fused kernel's grad_scale; inactive (1e3),
    it takes none. The gradient norm of a one-micro-batch step comes from FSDP2's reduce outputs (ReducedGradNorm),
    that of a two-micro-batch step (gradients added on the host) from the host gradients; both equal the plain run's."""
    from torch.distributed.tensor import DTensor

    from physreason.models import loading
    from physreason.train.build import build_training_model
    from physreason.train.model import CausalLMLoss
    from physreason.train.runtime import Runtime
    from physreason.train.sft import _collate_fn, build_datasets, train_step

    model = save_tiny_model("qwen2_5_vl", tmp_path / "model")
    data = _records(tmp_path)
    runtime = Runtime(rank=0, world_size=1, device=torch.device("cpu"), distributed=True)
    runs, norms_of = {}, {}
    for offload in (True, False):
        config = load_config(None, _overrides(model, data, tmp_path / str(offload), f"train.cpu_offload={str(offload).lower()}"))
        torch.manual_seed(0)
        trained = build_training_model(config, runtime, CausalLMLoss, 4)
        if offload:
            shards = [p for p in trained.module.parameters() if p.requires_grad]
            assert shards and all(isinstance(p, DTensor) and p.device.type == "cpu" for p in shards)
            assert trained.optimizer.defaults["fused"] is True
        assert (trained.reduced_norm is not None) == offload
        taken: list[bool] = []  # whether each step's norm came from the reduce outputs
        if offload:
            take = trained.reduced_norm.take

            def counted(parameters, take=take, taken=taken):
                norm = take(parameters)
                taken.append(norm is not None)
                return norm

            trained.reduced_norm.take = counted
        tokenizer = loading.load_tokenizer(config.model)
        train_set, _ = build_datasets(config, tokenizer, loading.load_model_config(config.model))
        batch = _collate_fn(config, tokenizer.pad_token_id, mrope=True)([train_set[i] for i in range(2)])
        scales: list[torch.Tensor | None] = []  # the grad_scale each step ran with

        def seen(optimizer, *_, scales=scales):
            scales.append(getattr(optimizer, "grad_scale", None))

        trained.optimizer.register_step_pre_hook(seen)
        results = [train_step(trained.module, micro, trained.optimizer, trained.scheduler, runtime, 1, clip,
                              trained.autocast, reduced_norm=trained.reduced_norm)
                   for micro in ([batch], [batch], [batch, batch])]  # fmt: skip
        losses, norms = [loss for loss, _ in results], [norm for _, norm in results]
        assert all((norm > clip) == (clip < 1) for norm in norms)
        assert taken == ([True, True, False] if offload else [])
        folded = offload and clip < 1
        assert [scale is not None for scale in scales] == [folded] * 3
        if folded:
            assert [float(scale) for scale in scales] == [pytest.approx(norm / clip, rel=1e-5) for norm in norms]
        weights = {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                   for name, p in trained.module.named_parameters()}  # fmt: skip
        runs[offload] = losses, weights
        norms_of[offload] = norms
    (offloaded, offloaded_weights), (plain, plain_weights) = runs[True], runs[False]
    assert norms_of[True] == pytest.approx(norms_of[False], rel=1e-5)
    assert offloaded[-1] < offloaded[0]
    # fused and single-tensor AdamW round in a different order: equal to float32 rounding, not bit for bit
    assert offloaded == pytest.approx(plain, rel=1e-5)
    assert offloaded_weights.keys() == plain_weights.keys()
    # k_proj's bias gets a gradient of rounding noise only (attention is invariant to it), and AdamW normalises that
    # noise to steps of about lr: 2e-6 apart here, a wrong update would be lr = 2e-3 apart.
    for name, weight in offloaded_weights.items():
        torch.testing.assert_close(weight, plain_weights[name], rtol=1e-5, atol=1e-5, msg=name)
