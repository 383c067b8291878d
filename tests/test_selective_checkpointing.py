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


FIXTURE_32B = __import__("pathlib").Path(__file__).resolve().parent / "fixtures" / "qwen3_vl_32b"


def _auto_config(*extra: str):
    return load_config(None, [f'model.model_name_or_path="{FIXTURE_32B}"', "model.model_max_length=16384",
                              'train.checkpoint_every="auto"', *extra])  # fmt: skip


def test_auto_recomputes_the_fewest_decoder_blocks_whose_plan_leaves_a_tenth_of_the_gpu_free():
    """train.checkpoint_every = "auto": the largest n whose plan fits 90% of the GPU, found among every n; a GPU where
    only some fit gets one strictly between every block and one block, and a larger GPU fewer recomputed blocks."""
    from dataclasses import replace

    from rich.console import Console

    from physreason.models.sizes import read_model_shape
    from physreason.train.memory_report import (
        AUTO_RECOMPUTE_FREE,
        recipe_layout,
        recipe_workload,
        resolve_checkpoint_every,
    )

    config = _auto_config()
    shape = read_model_shape(config.model)
    every_block = load_config(None, [f'model.model_name_or_path="{FIXTURE_32B}"', "model.model_max_length=16384"])
    recipe = recipe_layout(every_block, 8, True, "sft")
    workload = recipe_workload(every_block, shape, "sft", 0)
    totals = {n: plan_memory(shape, replace(recipe, checkpoint_every=n), workload).total for n in range(1, shape.layers + 1)}
    assert totals[1] < totals[4] < totals[shape.layers]  # fewer recomputed blocks, more memory
    chosen = {}
    for share in (4, 16):
        gpu = int(totals[share] / (1 - AUTO_RECOMPUTE_FREE)) + 1
        expected = max(n for n, total in totals.items() if total <= gpu * (1 - AUTO_RECOMPUTE_FREE))
        assert 1 < expected < shape.layers
        console = Console(record=True, width=200)
        resolved = resolve_checkpoint_every(config, 8, True, "sft", gpu, console=console)
        assert resolved.train.checkpoint_every == expected and config.train.checkpoint_every == "auto"
        assert f"train.checkpoint_every = auto -> {expected} (" in console.export_text()
        chosen[share] = expected
    assert chosen[16] > chosen[4]
    # a GPU where even every block recomputed does not fit 90%: every block (the start-up check then decides)
    assert resolve_checkpoint_every(config, 8, True, "sft", int(totals[1] * 0.95)).train.checkpoint_every == 1


def test_auto_without_a_gpu_or_without_checkpointing_is_every_block_and_numbers_stay():
    from physreason.train.memory_report import resolve_checkpoint_every

    assert resolve_checkpoint_every(_auto_config(), 8, True, "sft", None).train.checkpoint_every == 1
    off = _auto_config("train.gradient_checkpointing=false")
    assert resolve_checkpoint_every(off, 8, True, "sft", 10**12).train.checkpoint_every == 1
    fixed = load_config(None, [f'model.model_name_or_path="{FIXTURE_32B}"', "train.checkpoint_every=3"])
    assert resolve_checkpoint_every(fixed, 8, True, "sft", 10**12) is fixed
    with pytest.raises(Exception, match="checkpoint_every"):
        load_config(None, ['train.checkpoint_every="sometimes"'])


def test_an_unresolved_auto_reaching_the_model_recomputes_every_block(tiny_model_dir, caplog):
    from physreason.train.build import load_trainable

    config = load_config(None, [f'model.model_name_or_path="{tiny_model_dir}"', 'train.checkpoint_every="auto"'])
    with caplog.at_level("WARNING"):
        model, _ = load_trainable(config.model, config.train)
    assert all(b.gradient_checkpointing for b in decoder_layers(model))
    assert "was not resolved" in caplog.text


def test_physreason_plan_resolves_auto_for_the_gpu_it_plans(tmp_path):
    from typer.testing import CliRunner

    from physreason.cli import app

    recipe = tmp_path / "sft.toml"
    recipe.write_text('[train]\ncheckpoint_every = "auto"\n')
    args = ["plan", str(recipe), "--model", str(FIXTURE_32B), "--gpus", "8", "--set", "model.model_max_length=2048",
            "--set", "train.optimizer_state_dtype='bfloat16'"]  # fmt: skip
    small = CliRunner().invoke(app, [*args, "--gpu-memory", "80"])
    large = CliRunner().invoke(app, [*args, "--gpu-memory", "141"])
    numbers = []
    for result in (small, large):
        assert result.exit_code == 0, result.output
        line = next(line for line in result.output.splitlines() if "checkpoint_every = auto ->" in line)
        numbers.append(int(line.split("->")[1].split()[0]))
    assert numbers == [1, 64]  # 80 GiB: every block of the 64; 141 GiB: one block


@pytest.mark.parametrize("job", ["sft", "grpo"])
def test_trainers_build_the_model_with_the_number_auto_chose(tiny_model_dir, tmp_path, monkeypatch, job):
    """sft and grpo resolve "auto" before the model is built, and the model recomputes what was chosen (here a GPU
    large enough for the fewest: one of the tiny model's two decoder blocks)."""
    from setups import grpo_recipe, sft_recipe, write_chat_records, write_mcq_file

    import physreason.train.build as build
    from physreason.train import grpo as grpo_module
    from physreason.train import memory_report
    from physreason.train import sft as sft_module

    module = sft_module if job == "sft" else grpo_module

    def on_a_large_gpu(config, runtime, job, prompts=None):
        return memory_report.resolve_checkpoint_every(config, 1, False, job, 10**12, prompts)

    monkeypatch.setattr(module, "resolve_runtime_checkpoint_every", on_a_large_gpu)
    seen = []
    real = build.parallelize.enable_activation_checkpointing

    def recording(model, every=1, vision_every=1):
        seen.append(every)
        return real(model, every, vision_every)

    monkeypatch.setattr(build.parallelize, "enable_activation_checkpointing", recording)
    settings = ['train.checkpoint_every="auto"', "train.max_steps=1", "train.ckpt.enable_checkpoint=false"]
    if job == "sft":
        config = sft_recipe(tiny_model_dir, write_chat_records(tmp_path), tmp_path / "out", *settings, lr="1e-4",
                            logger="['jsonl']")  # fmt: skip
        sft_module.run_sft(config)
    else:
        config = grpo_recipe(tiny_model_dir, write_mcq_file(tmp_path), tmp_path / "out", *settings, lr="1e-4")
        grpo_module.run_grpo(config)
    assert seen and seen[0] == 2  # the tiny model's 2 blocks: only block 0 recomputed


def test_every_process_takes_the_smallest_auto_choice(monkeypatch, capsys):
    """Processes that chose different n (another GPU kind, an image header one rank could not read) all take the
    smallest: under TP or CP a recomputed block repeats its collectives, so ranks recomputing different blocks hang."""
    import torch

    from physreason.train import memory_report
    from physreason.train.runtime import Runtime

    def others_chose_three(tensor, op=None, group=None):
        assert op == torch.distributed.ReduceOp.MIN
        tensor.fill_(min(int(tensor.item()), 3))

    monkeypatch.setattr(memory_report, "choose_checkpoint_every", lambda *args, **kwargs: (7, "planned"))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "all_reduce", others_chose_three)
    runtime = Runtime(rank=0, world_size=2, device=torch.device("cpu"), distributed=True)
    resolved = memory_report.resolve_runtime_checkpoint_every(_auto_config(), runtime, "sft")
    assert resolved.train.checkpoint_every == 3
    assert "auto -> 3 (another process's choice, the smallest; this one's: 7, planned)" in capsys.readouterr().err
    alone = Runtime(rank=0, world_size=1, device=torch.device("cpu"))
    assert memory_report.resolve_runtime_checkpoint_every(_auto_config(), alone, "sft").train.checkpoint_every == 7


def test_plans_of_an_unresolved_auto_recompute_every_block():
    """recipe_layout (check_memory, bench/memory_plan.py) plans an unresolved "auto" as every block recomputed: the
    most recompute, the least memory it could choose; it raised a TypeError in the plan's arithmetic."""
    from physreason.train.memory_report import check_memory, recipe_layout

    assert recipe_layout(_auto_config(), 8, True, "sft").checkpoint_every == 1
    assert check_memory(_auto_config(), 8, True, "sft", None).layout.checkpoint_every == 1
