"""Compiled vision blocks (train.compile_vision) on clips of many patch grids: torch.compile marks the sizes dynamic
after the first recompiles, so new grids of the same layout reuse the graphs instead of compiling again."""

from __future__ import annotations

import pytest
import torch

from physreason.models.parallelize import enable_activation_checkpointing
from physreason.models.tiny import build_tiny_model, build_tiny_tokenizer
from physreason.models.vision_attention import use_grouped_vision_attention
from physreason.train.build import compile_blocks

pytestmark = pytest.mark.timeout(600)


def test_new_patch_grids_reuse_the_compiled_vision_graphs():
    from torch._dynamo.utils import counters

    model = build_tiny_model("qwen3_vl", build_tiny_tokenizer())
    model.model.visual.config._attn_implementation = "sdpa"
    assert use_grouped_vision_attention(model)
    enable_activation_checkpointing(model)
    compile_blocks(model, decoder=False, vision=True)
    tower = model.model.visual.train()
    values = 3 * 2 * tower.config.patch_size**2
    torch._dynamo.reset()
    counters.clear()
    graphs = []
    try:
        # video grids [frames / 2, height, width] in patches: lengths and frame counts all differ
        for grid in ([2, 10, 14], [4, 10, 14], [2, 12, 16], [6, 12, 16], [2, 8, 20], [8, 14, 10]):
            grid_thw = torch.tensor([grid])
            tower(torch.randn(int(grid_thw.prod()), values), grid_thw=grid_thw).pooler_output.sum().backward()
            graphs.append(counters["stats"]["unique_graphs"])
    finally:
        torch._dynamo.reset()
    assert graphs[0] >= 1  # compiled, not run eagerly
    assert graphs[-1] == graphs[-3], graphs  # the last grids compiled nothing new
    assert graphs[-1] <= 8, graphs
