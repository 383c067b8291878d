"""Selective activation checkpointing (train.checkpoint_every, train.vision_checkpoint_every): which blocks recompute
their forward in backward, the same gradients whichever do, and what the memory plan charges for the rest."""

from __future__ import annotations

import copy

import pytest
import torch
from test_vision_attention import features_and_grads

from physreason.config import load_config
from physreason.models.loading import decoder_layers
from physreason.models.parallelize import enable_activation_checkpointing
from physreason.models.tiny import build_tiny_model, build_tiny_tokenizer
from physreason.train.memory import Layout, plan_memory, stack_activation_bytes
from physreason.train.memory_report import describe

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def tiny_vl(vl_kind) -> torch.nn.Module:
    return build_tiny_model(vl_kind, build_tiny_tokenizer(), scale=2)  # 4 vision blocks


def forward_calls(tower: torch.nn.Module) -> tuple[list[int], dict[str, torch.Tensor]]:
    """Forward calls of each vision block during one forward and backward (counted inside the block: its own hooks stay
    outside the checkpoint), and the gradients."""
    calls = [0] * len(tower.blocks)
    hooks = [
        block.mlp.register_forward_pre_hook(lambda module, args, i=i: calls.__setitem__(i, calls[i] + 1))
        for i, block in enumerate(tower.blocks)
    ]
    try:
        _, grads = features_and_grads(tower)
    finally:
        for hook in hooks:
            hook.remove()
    return calls, grads


def test_vision_blocks_recompute_as_vision_checkpoint_every_says_with_the_same_gradients(tiny_vl):
    runs = {}
    for every, vision_every in ((1, 1), (2, 2), (1, 0), (3, 3)):
        model = copy.deepcopy(tiny_vl)
        enable_activation_checkpointing(model, every, vision_every)
        assert [block.gradient_checkpointing for block in decoder_layers(model)] == [
            i % every == 0 for i in range(len(decoder_layers(model)))
        ]
        runs[vision_every] = forward_calls(model.model.visual.train())
    assert runs[1][0] == [2, 2, 2, 2]  # every block's forward runs again in backward
    assert runs[2][0] == [2, 1, 2, 1]
    assert runs[0][0] == [1, 1, 1, 1]  # none: the tower keeps its activations
    assert runs[3][0] == [2, 1, 1, 2]
    for vision_every in (0, 2, 3):
        for name, grad in runs[1][1].items():
            torch.testing.assert_close(runs[vision_every][1][name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_the_keys_reach_the_model_and_bad_values_are_refused(tiny_model_dir):
    from physreason.errors import ConfigError
    from physreason.train.build import load_trainable

    config = load_config(None, [f'model.model_name_or_path="{tiny_model_dir}"', "train.checkpoint_every=2",
                                "train.vision_checkpoint_every=0"])  # fmt: skip
    model, _ = load_trainable(config.model, config.train)
    assert [b.gradient_checkpointing for b in decoder_layers(model)] == [True, False]
    assert not any(block.gradient_checkpointing for block in model.model.visual.blocks)
    for bad in ("train.checkpoint_every=0", "train.vision_checkpoint_every=-1"):
        with pytest.raises(ConfigError, match=bad.split("=")[0].split(".")[1]):
            load_config(None, [bad])


def test_the_memory_plan_charges_the_blocks_that_keep_their_activations():
    tokens, per_token, hidden, dtype = 1000, 40, 8, 2
    every_block = stack_activation_bytes(tokens, 6, per_token, hidden, dtype, True)
    assert every_block == 6 * tokens * hidden * dtype + tokens * per_token
    assert stack_activation_bytes(tokens, 6, per_token, hidden, dtype, True, 1) == every_block
    # every 2nd of 6: 3 recomputed keep their inputs, 3 keep everything, plus the one being recomputed
    assert stack_activation_bytes(tokens, 6, per_token, hidden, dtype, True, 2) == (
        3 * tokens * hidden * dtype + 4 * tokens * per_token
    )
    assert stack_activation_bytes(tokens, 6, per_token, hidden, dtype, True, 0) == 6 * tokens * per_token
    assert stack_activation_bytes(tokens, 6, per_token, hidden, dtype, False, 2) == 6 * tokens * per_token

    from pathlib import Path

    from transformers import AutoConfig

    from physreason.models.sizes import shape_from_hf_config
    from physreason.train.memory import Workload

    fixture = Path(__file__).resolve().parent / "fixtures" / "qwen3_vl_32b"
    shape = shape_from_hf_config(AutoConfig.from_pretrained(fixture))
    workload = Workload(seq_len=4096, vision_tokens=3000)
    plans = {
        key: plan_memory(shape, Layout(gpus=1, distributed=False, checkpoint_every=key[0], vision_checkpoint_every=key[1]),
                         workload).parts  # fmt: skip
        for key in ((1, 1), (2, 1), (1, 2), (1, 0))
    }
    assert plans[(2, 1)]["activations"] > plans[(1, 1)]["activations"]
    assert plans[(2, 1)]["vision activations"] == plans[(1, 1)]["vision activations"]
    assert plans[(1, 1)]["vision activations"] < plans[(1, 2)]["vision activations"] < plans[(1, 0)]["vision activations"]
    assert "recomputing 1 in 2 decoder blocks and no vision block" in describe(
        Layout(gpus=1, checkpoint_every=2, vision_checkpoint_every=0)
    )
    assert describe(Layout(gpus=1)).count("checkpointing") == 1
    assert "recomputing every decoder block and 1 in 2 vision blocks" in describe(Layout(gpus=1, vision_checkpoint_every=2))


def test_plan_offers_recomputing_every_block_before_offload_or_context_parallel_when_that_fits():
    """A recipe recomputing 1 block in 2 that does not fit: the nearest layout that fits recomputes every block again
    (the recipe's speed lever undone), and its --set overrides say so."""
    from dataclasses import replace
    from pathlib import Path

    from transformers import AutoConfig

    from physreason.models.sizes import shape_from_hf_config
    from physreason.train.memory import GIB, Workload, fitting_layouts, layout_overrides

    shape = shape_from_hf_config(AutoConfig.from_pretrained(Path(__file__).resolve().parent / "fixtures" / "qwen3_vl_32b"))
    workload = Workload(seq_len=16384)
    everything = Layout(gpus=8)
    selective = replace(everything, checkpoint_every=2)
    every_plan = plan_memory(shape, everything, workload)
    selective_plan = plan_memory(shape, selective, workload)
    budget = (every_plan.total + selective_plan.total) // 2  # fits recomputing every block, not 1 in 2
    assert every_plan.total < budget < selective_plan.total, (every_plan.total / GIB, selective_plan.total / GIB)
    best = fitting_layouts(shape, selective, workload, budget)[0]
    assert layout_overrides(selective, best.layout) == ["train.checkpoint_every=1"]
