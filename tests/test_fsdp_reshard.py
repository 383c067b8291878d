"""apply_fsdp2's reshard choice: which blocks keep their gathered parameters from forward to backward."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from physreason.models import parallelize
from physreason.models.loading import decoder_layers


@pytest.mark.parametrize("reshard, kept", [("all", []), ("all-but-last", [1]), ("none", [0, 1])])
def test_blocks_hold_their_gathered_parameters_after_forward_as_chosen(world_of_one, tiny_model_dir, reshard, kept):
    from transformers import AutoModelForImageTextToText

    from physreason.data.collate import collate_padded
    from physreason.data.sft import SFTSample
    from physreason.train.model import CausalLMLoss

    model = AutoModelForImageTextToText.from_pretrained(tiny_model_dir, dtype=torch.float32)
    wrapper = CausalLMLoss(model)
    parallelize.apply_fsdp2(wrapper, model, world_of_one, torch.float32, torch.float32, reshard=reshard)
    ids = torch.randint(0, 100, (8,))
    wrapper(collate_padded([SFTSample(ids, ids.clone(), torch.arange(8).expand(3, -1))], 0, mrope=True))
    # A resharded block registers its sharded DTensor parameters again; a kept one its gathered plain tensors.
    gathered = [i for i, block in enumerate(decoder_layers(model)) if not isinstance(block.mlp.up_proj.weight, DTensor)]
    assert gathered == kept
    with pytest.raises(ValueError, match="reshard must be one of"):
        parallelize.apply_fsdp2(wrapper, model, world_of_one, reshard="some")


def test_reduced_grad_norm_hooks_one_rank_units_and_falls_back_without_fsdp_state(world_of_one, monkeypatch):
    """ReducedGradNorm reads FSDP2's private unit state: where a torch release lacks it, attach gives None (the host
    norm) and hooks nothing, instead of failing the run."""
    from torch import nn
    from torch.distributed.fsdp import FSDPModule, fully_shard

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(model[0], mesh=world_of_one)
    fully_shard(model, mesh=world_of_one)
    tracker = parallelize.ReducedGradNorm.attach(model)
    assert tracker is not None and sorted(set(tracker.owner.values())) == [0, 1]
    hooked: list[FSDPModule] = []
    monkeypatch.setattr(FSDPModule, "_get_fsdp_state", lambda self: object())
    monkeypatch.setattr(FSDPModule, "set_all_reduce_hook", lambda self, hook, **kw: hooked.append(self))
    assert parallelize.ReducedGradNorm.attach(model) is None
    assert hooked == []


def test_reduced_grad_norm_reads_the_one_group_layout_of_torch_2_11(world_of_one, monkeypatch):
    """torch 2.11 (the GPU image) keeps one `_fsdp_param_group` a unit (None without parameters of its own) where later
    releases keep a `_fsdp_param_groups` list: attach hooks the units under either layout (under 2.11 it once fell
    back to the host norm on every GPU run)."""
    from types import SimpleNamespace

    from torch import nn
    from torch.distributed.fsdp import FSDPModule, fully_shard

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(model[0], mesh=world_of_one)
    fully_shard(model[1], mesh=world_of_one)
    fully_shard(model, mesh=world_of_one)  # the root holds no parameter of its own
    real = FSDPModule._get_fsdp_state

    def old_layout(self):
        groups = real(self)._fsdp_param_groups
        return SimpleNamespace(_fsdp_param_group=groups[0] if groups else None)

    hooked: list[FSDPModule] = []
    monkeypatch.setattr(FSDPModule, "_get_fsdp_state", old_layout)
    monkeypatch.setattr(FSDPModule, "set_all_reduce_hook", lambda self, hook, **kw: hooked.append(self))
    tracker = parallelize.ReducedGradNorm.attach(model)
    assert tracker is not None and sorted(set(tracker.owner.values())) == [0, 1]
    assert len(hooked) == 3
