"""full_named_parameters gathers an FSDP2 policy one all-gather per unit, with the per-parameter gather's values.

tests/gather_worker.py runs the tiny Qwen2.5-VL and Qwen3-VL on 2 gloo ranks, sharded as a run shards them (float32
masters, CausalLMLoss as the FSDP2 root); the in-process tests below pin the fallbacks on a world of one.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from setups import free_port, run_torchrun
from torch import nn
from torch.distributed.tensor import DTensor

from physreason.train.weight_sync import full_named_parameters

WORKER = Path(__file__).with_name("gather_worker.py")
KINDS = ["qwen2_5_vl", "qwen3_vl"]


@pytest.fixture(scope="module")
def walks(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gather") / "walks.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(free_port()), str(WORKER), ",".join(KINDS), str(out)]  # fmt: skip
    done = run_torchrun(command, env, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.cpu_only
@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_fsdp2_walk_is_one_gather_per_unit_with_the_per_parameter_values(walks, kind):
    result = walks[kind]["bf16"]
    assert result["blocks"] >= 2 and result["root_params"] >= 2 and result["units"] == result["blocks"] + 1
    # Same names, order, dtypes (bf16) and bits as the whole model cast and as one gather per parameter.
    assert result["same"] and result["same_before_forward"]
    # After the first forward every unit, the root around the model included, is one all-gather.
    assert result["gathers"] == result["units"] < result["params"]
    # Before it the root is not reachable from the model: its parameters are gathered one by one, the blocks whole.
    assert result["gathers_before_forward"] == result["blocks"] + result["root_params"]
    # the loss wrapper given as fsdp_root (the policy worker's publish): the root is one gather from the first push
    assert result["gathers_before_forward_root_given"] == result["units"]
    assert result["same_before_forward_root_given"] and result["sharded_after_walk_root_given"]
    # The root stays gathered through the walk; at most one block beside it.
    assert result["most_gathered_at_once"] == 2 and result["gathered_mid_walk"] == 2


@pytest.mark.cpu_only
@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_fsdp2_walk_leaves_the_model_sharded_and_trainable(walks, kind):
    result = walks[kind]["bf16"]
    assert result["sharded_after_walk_before_forward"] and result["sharded_after_backward"]
    assert result["sharded_after_walk"]
    assert result["same_prefix_before_close"] and result["sharded_after_close"]
    assert result["raised"] == "the consumer failed" and result["sharded_after_exception"]
    # the forward/backward after the walks is the one before them, bit for bit
    assert result["loss_after"] == result["loss_before"]
    assert result["grads_equal"] and result["grads"] == result["params"]
    # a root a no-grad forward left gathered is read as it is, and left so
    assert result["same_with_root_left_gathered"]
    assert (
        result["gathered_before_walk_after_nograd_forward"] == result["gathered_after_walk_after_nograd_forward"] == 1
    )


@pytest.mark.cpu_only
@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_fsdp2_walk_gathers_units_only_where_their_param_dtype_keeps_the_values(walks, kind):
    bf16 = walks[kind]["bf16"]
    # bf16 param_dtype, float32 push: a bf16 gather would round the masters; one gather per parameter, in float32
    fp32_push = walks[kind]["fp32_push"]
    assert fp32_push["same"] and fp32_push["sharded_after_walk"]
    assert fp32_push["gathers"] == bf16["params"]
    # float32 param_dtype, bf16 push: the blocks gather whole in float32 and are cast after, to the same bits
    fp32_compute = walks[kind]["fp32_compute"]
    assert fp32_compute["same"] and fp32_compute["sharded_after_walk"]
    assert fp32_compute["gathers"] == bf16["blocks"] + bf16["root_params"]


@pytest.mark.cpu_only
@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_tensor_parallel_parameters_are_gathered_over_tp_after_their_unit_unshards(walks, kind):
    tp2 = walks[kind]["tp2"]
    assert tp2["same"] and tp2["sharded_after_walk"]


def _sharded_pair(mesh) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A root with a parameter of its own around two fully_shard'd blocks, and its weights in bf16 before sharding."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 3))
    expected = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[1], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, expected


def _walk_counting_unshards(model: nn.Module, monkeypatch) -> tuple[list[tuple[str, torch.Tensor]], int]:
    from torch.distributed.fsdp import FSDPModule

    calls: list[nn.Module] = []
    real = FSDPModule.unshard
    monkeypatch.setattr(FSDPModule, "unshard", lambda self, *a, **k: calls.append(self) or real(self, *a, **k))
    return list(full_named_parameters(model, torch.bfloat16)), len(calls)


def _assert_pushed(pushed: list[tuple[str, torch.Tensor]], expected: dict[str, torch.Tensor]) -> None:
    assert [n for n, _ in pushed] == list(expected)
    for name, tensor in pushed:
        assert (
            not isinstance(tensor, DTensor) and tensor.dtype == torch.bfloat16 and torch.equal(tensor, expected[name])
        )


def test_each_fsdp2_unit_is_unsharded_once_and_its_tensors_outlive_the_reshard(world_of_one, monkeypatch):
    model, expected = _sharded_pair(world_of_one)
    pushed, unshards = _walk_counting_unshards(model, monkeypatch)
    assert unshards == 3  # the two blocks and the root (the model itself: reachable before any forward)
    _assert_pushed(pushed, expected)  # copies: the units' gathered buffers were freed at their reshard
    assert all(isinstance(p, DTensor) for p in model.parameters())


def test_walk_gathers_one_parameter_at_a_time_without_fsdp2_state(world_of_one, monkeypatch):
    """FSDP2's unit state is private: where a torch release lacks what the walk reads, it gathers per parameter."""
    from torch.distributed.fsdp import FSDPModule

    model, expected = _sharded_pair(world_of_one)
    monkeypatch.setattr(FSDPModule, "_get_fsdp_state", lambda self: object())
    pushed, unshards = _walk_counting_unshards(model, monkeypatch)
    assert unshards == 0
    _assert_pushed(pushed, expected)
