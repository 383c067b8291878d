"""The memory plan: FSDP2 shard arithmetic against gloo ranks, activation coefficients against saved tensors, and the
Qwen3-VL-32B layouts (config.json in tests/fixtures/qwen3_vl_32b, hyper-parameters of the published Qwen3-VL-32B)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from setups import free_port, run_torchrun
from transformers import AutoConfig

from physreason.models.sizes import shape_from_hf_config
from physreason.models.tiny import save_tiny_model
from physreason.train.memory import (
    GIB,
    H100_80GB_GIB,
    Layout,
    Workload,
    activation_bytes_per_token,
    fitting_layouts,
    layout_overrides,
    plan_memory,
    shard_numel,
    usable_bytes,
    vision_activation_bytes_per_patch,
)

ROOT = Path(__file__).resolve().parents[1]
QWEN3_VL_32B = ROOT / "tests" / "fixtures" / "qwen3_vl_32b"
H100 = int(H100_80GB_GIB * GIB)


@pytest.fixture(scope="module")
def shape_32b():
    return shape_from_hf_config(AutoConfig.from_pretrained(QWEN3_VL_32B))


def test_shard_numel_cuts_rows_like_torch_chunk():
    for rows, dp in [(10, 4), (7, 2), (3, 4), (1, 8), (4096, 8)]:
        chunks = torch.arange(rows * 3).reshape(rows, 3).chunk(dp)
        expected = [c.numel() for c in chunks] + [0] * (dp - len(chunks))
        assert [shard_numel((rows, 3), dp, r) for r in range(dp)] == expected


def test_qwen3_vl_32b_shape_counts_the_published_parameters(shape_32b):
    assert 33.0e9 < shape_32b.total_params < 33.6e9  # "Qwen3-VL-32B": 33.4 B with its vision tower
    assert (shape_32b.hidden, shape_32b.layers, shape_32b.intermediate) == (5120, 64, 25600)


def _issue_workload() -> Workload:
    # cosmos-reason2#54: 32B SFT, batch 1 and 1,024 tokens, out of memory on 8 x H100
    return Workload(seq_len=1024, vision_tokens=1024, lora_targets=("q_proj", "k_proj", "v_proj", "o_proj",
                                                                    "gate_proj", "up_proj", "down_proj"))


def test_qwen3_vl_32b_full_sft_is_at_the_edge_of_8_h100_and_fits_with_offload_or_bf16_state(shape_32b):
    default = Layout(gpus=8)
    plan = plan_memory(shape_32b, default, _issue_workload())
    assert abs(plan.total - usable_bytes(H100)) < 0.02 * usable_bytes(H100)  # fp32 state: no room to spare
    # fp32 masters + gradients + two fp32 moments: 16 bytes a parameter, over 8 ranks
    sharded = plan.parts["parameters"] + plan.parts["gradients"] + plan.parts["optimizer state"]
    assert abs(sharded - 16 * shape_32b.total_params / 8) < 0.01 * sharded
    assert plan_memory(shape_32b, replace(default, optimizer_state_dtype="bfloat16"), _issue_workload()).fits(H100)
    offload = plan_memory(shape_32b, replace(default, cpu_offload=True), _issue_workload())
    assert offload.fits(H100) and offload.parts["parameters"] == 0 and offload.host_bytes > 60 * GIB
    fitting = fitting_layouts(shape_32b, default, _issue_workload(), H100)
    assert fitting and not fitting[0].layout.lora  # full fine-tuning fits without falling back to LoRA


def test_qwen3_vl_32b_lora_fits_one_h100_with_offload(shape_32b):
    plain = Layout(gpus=1, distributed=False, lora=True)
    assert not plan_memory(shape_32b, plain, _issue_workload()).fits(H100)  # the fp32 frozen base alone is 124 GiB
    fitting = fitting_layouts(shape_32b, plain, _issue_workload(), H100)
    assert fitting and all(p.layout.lora and p.layout.cpu_offload for p in fitting)


def test_context_parallel_divides_row_activations_and_the_plan_offers_it(shape_32b):
    long_video = Workload(seq_len=65536, vision_tokens=32768)  # a few minutes of video at Reason2's budgets
    one = plan_memory(shape_32b, Layout(gpus=8), long_video)
    split = plan_memory(shape_32b, Layout(gpus=8, cp=8), long_video)
    assert split.parts["parameters"] == one.parts["parameters"]  # FSDP2 shards over dp x cp: the same 8 ranks
    embeddings = 65536 * shape_32b.hidden * 2  # every rank keeps the whole row's bf16 embeddings
    assert split.parts["activations"] - embeddings == one.parts["activations"] // 8
    assert split.parts["logits / loss"] == one.parts["logits / loss"] // 8
    assert split.parts["vision activations"] == one.parts["vision activations"] // 8
    recipe = Layout(gpus=8)
    fitting = fitting_layouts(shape_32b, recipe, long_video, H100)
    assert not one.fits(H100) and fitting and fitting[0].layout.cp > 1
    assert f"policy.parallelism.cp_size={fitting[0].layout.cp}" in layout_overrides(recipe, fitting[0].layout)


def test_plan_command_refuses_a_recipe_that_cannot_fit_in_one_line(tmp_path):
    recipe = tmp_path / "sft32b.toml"
    # 4,096-token rows: with fp32 AdamW state 32B full SFT then needs more than an H100 on each of 8 ranks
    recipe.write_text(f'[model]\nmodel_name_or_path = "{QWEN3_VL_32B}"\nmodel_max_length = 4096\n')
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    done = subprocess.run([sys.executable, "-m", "physreason", "plan", str(recipe), "--gpus", "8"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert "optimizer state" in done.stdout and "layouts that fit on 8 GPU(s)" in done.stdout
    assert "train.optimizer_state_dtype='bfloat16'" in done.stdout
    error = done.stderr.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("error: memory plan:") and "GiB per GPU" in error[0]
    assert "--set train.optimizer_state_dtype='bfloat16'" in error[0] and "train.skip_memory_check" in error[0]
    assert "Traceback" not in done.stderr


def _saved_bytes(block: torch.nn.Module, inputs, skip: set[int], compiled: bool) -> int:
    """Bytes of the tensors `block(*args, **kwargs)` saves for backward, storages in `skip` (weights, shared
    inputs) left out; compiled: torch.compile'd first, the saving counted on a second call (the first compiles)."""
    run = torch.compile(block) if compiled else block
    if compiled:
        torch._dynamo.reset()
        args, kwargs = inputs()
        run(*args, **kwargs)
    skip = skip | {p.untyped_storage().data_ptr() for p in block.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in skip:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    args, kwargs = inputs()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run(*args, **kwargs)
    return sum(saved.values())


def _saved_bytes_per_token(
    hidden: int, heads: int, kv_heads: int, head_dim: int, mlp: int, tokens: int, dtype: torch.dtype = torch.bfloat16
) -> float:
    """Bytes that one Qwen3-VL decoder block in `dtype` saves for backward, per token (saved-tensor hooks, no weights)."""
    from transformers import Qwen3VLForConditionalGeneration
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLConfig

    section = [head_dim // 2 - 2 * (head_dim // 8), head_dim // 8, head_dim // 8]
    config = Qwen3VLConfig(
        text_config={"hidden_size": hidden, "num_hidden_layers": 1, "num_attention_heads": heads,
                     "num_key_value_heads": kv_heads, "head_dim": head_dim, "intermediate_size": mlp, "vocab_size": 64,
                     "rope_scaling": {"mrope_section": section, "rope_type": "default", "mrope_interleaved": True}},
        vision_config={"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": hidden,
                       "deepstack_visual_indexes": []},
    )
    config._attn_implementation = config.text_config._attn_implementation = "sdpa"
    model = Qwen3VLForConditionalGeneration(config).to(dtype)
    block = model.model.language_model.layers[0]
    x = torch.randn(1, tokens, hidden, dtype=dtype, requires_grad=True)
    cos_sin = model.model.language_model.rotary_emb(x, torch.arange(tokens)[None].expand(3, 1, tokens))
    skip = {x.untyped_storage().data_ptr()} | {t.untyped_storage().data_ptr() for t in cos_sin}  # cos_sin: shared
    kwargs = {"position_embeddings": cos_sin, "attention_mask": None, "position_ids": None}
    return _saved_bytes(block, lambda: ((x,), kwargs), skip, compiled=False) / tokens


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dims", [(384, 6, 2, 64, 1536), (256, 8, 8, 32, 704)])
def test_activation_coefficients_match_the_tensors_a_block_saves(dims, dtype):
    # float32: train.param_dtype='float32' (the small from-scratch models' recipe); the RMSNorms' fp32 copies are then
    # the activations themselves: a hidden unit costs 20 bytes, not twice bf16's 16
    hidden, heads, kv_heads, head_dim, mlp = dims
    measured = _saved_bytes_per_token(hidden, heads, kv_heads, head_dim, mlp, tokens=256, dtype=dtype)
    planned = activation_bytes_per_token(hidden, heads * head_dim, kv_heads * head_dim, mlp, dtype.itemsize)
    assert abs(planned - measured) <= 0.05 * measured, (planned, measured)


def _qwen3_vl_text_block(hidden: int, heads: int, kv_heads: int, head_dim: int, mlp: int):
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextDecoderLayer, Qwen3VLTextRotaryEmbedding

    section = [head_dim // 2 - 2 * (head_dim // 8), head_dim // 8, head_dim // 8]
    config = Qwen3VLTextConfig(hidden_size=hidden, num_hidden_layers=1, num_attention_heads=heads,
                               num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=mlp, vocab_size=64,
                               rope_scaling={"mrope_section": section, "rope_type": "default", "mrope_interleaved": True})  # fmt: skip
    config._attn_implementation = "sdpa"
    return Qwen3VLTextDecoderLayer(config, 0).to(torch.bfloat16), Qwen3VLTextRotaryEmbedding(config=config)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dims", [(384, 6, 2, 64, 1536), (256, 4, 4, 128, 1024)])
def test_compiled_decoder_coefficients_match_what_a_compiled_block_saves(dims):
    """train.compile: the partitioner recomputes norms and elementwise products in backward, so a compiled block keeps
    about two thirds of an eager one's bytes; the plan priced compiled blocks as eager ones (2026-11-29, the video
    row's peaks)."""
    hidden, heads, kv_heads, head_dim, mlp = dims
    tokens = 128
    block, rotary = _qwen3_vl_text_block(hidden, heads, kv_heads, head_dim, mlp)
    x = torch.randn(1, tokens, hidden, dtype=torch.bfloat16)
    cos_sin = rotary(x, torch.arange(tokens)[None].expand(3, 1, tokens))
    shared = {t.untyped_storage().data_ptr() for t in cos_sin}

    def inputs():
        return (x.clone().requires_grad_(),), {"position_embeddings": cos_sin, "attention_mask": None}

    eager, compiled = (_saved_bytes(block, inputs, shared, c) / tokens for c in (False, True))
    query, kv = heads * head_dim, kv_heads * head_dim
    assert abs(activation_bytes_per_token(hidden, query, kv, mlp, 2, compiled=True) - compiled) <= 0.05 * compiled
    assert abs(activation_bytes_per_token(hidden, query, kv, mlp, 2) - eager) <= 0.05 * eager
    assert compiled < 0.8 * eager


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["qwen3_vl", "qwen2_5_vl"])
@pytest.mark.parametrize("compiled", [False, True])
def test_vision_coefficients_match_what_each_familys_vision_block_saves(family, compiled):
    """Qwen3-VL's vision blocks (LayerNorm, GELU MLP) keep far less than a decoder block of their width: the plan
    priced them with the decoder's coefficients, 1.76x too high at Reason2's tower (2026-11-29); Qwen2.5-VL's
    (RMSNorm, SwiGLU) keep more. Both eager and compiled (train.compile_vision), within 5%."""
    hidden, heads, mlp, patches = 256, 4, 704, 128
    if family == "qwen3_vl":
        from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionBlock as Block

        config = Qwen3VLVisionConfig(depth=1, hidden_size=hidden, num_heads=heads, intermediate_size=mlp)
    else:
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLVisionBlock as Block

        config = Qwen2_5_VLVisionConfig(depth=1, hidden_size=hidden, num_heads=heads, intermediate_size=mlp)
    config._attn_implementation = "sdpa"
    block = Block(config).to(torch.bfloat16)
    angles = torch.randn(patches, hidden // heads, dtype=torch.bfloat16)
    cos_sin = (angles.cos(), angles.sin())
    cu_seqlens = torch.tensor([0, patches], dtype=torch.int32)
    shared = {t.untyped_storage().data_ptr() for t in cos_sin}

    def inputs():
        x = torch.randn(patches, hidden, dtype=torch.bfloat16, requires_grad=True)
        return (x,), {"cu_seqlens": cu_seqlens, "position_embeddings": cos_sin}

    measured = _saved_bytes(block, inputs, shared, compiled) / patches
    planned = vision_activation_bytes_per_patch(hidden, mlp, 2, gated=family == "qwen2_5_vl", compiled=compiled)
    assert abs(planned - measured) <= 0.05 * measured, (planned, measured)


def test_plan_prices_compiled_blocks_from_the_recipe_and_knows_each_towers_kind(tmp_path):
    from physreason.config import load_config
    from physreason.train.memory_report import recipe_workload

    shapes = {}
    for family in ("qwen3_vl", "qwen2_5_vl"):
        folder = save_tiny_model(family, tmp_path / family)
        shapes[family] = shape_from_hf_config(AutoConfig.from_pretrained(folder))
    assert not shapes["qwen3_vl"].vision_gated and shapes["qwen2_5_vl"].vision_gated
    folder = tmp_path / "qwen3_vl"
    totals = {}
    for keys in ((), ("train.compile=true",), ("train.compile_vision=true",)):
        config = load_config(None, [f"model.model_name_or_path='{folder}'", "model.model_max_length=4096", *keys])
        workload = recipe_workload(config, shapes["qwen3_vl"], "sft", 80 * 2**30)
        assert (workload.compiled, workload.compiled_vision) == ("train.compile=true" in keys, "train.compile_vision=true" in keys)
        plan = plan_memory(shapes["qwen3_vl"], Layout(gpus=1, distributed=False, gradient_checkpointing=False), workload)
        totals[keys] = (plan.parts["activations"], plan.parts["vision activations"])
    eager = totals[()]
    assert totals[("train.compile=true",)][0] < eager[0] and totals[("train.compile=true",)][1] == eager[1]
    assert totals[("train.compile_vision=true",)][1] < eager[1] and totals[("train.compile_vision=true",)][0] == eager[0]


@pytest.mark.cpu_only
@pytest.mark.parametrize("offload", [False, True])
def test_plan_shard_bytes_equal_each_gloo_ranks_fsdp2_shards(tmp_path, offload):
    model = save_tiny_model("qwen3_vl", tmp_path / "model")
    overrides = [f"model.model_name_or_path='{model}'", "train.freeze_vision_tower=true", "train.param_dtype='float32'",
                 f"train.cpu_offload={str(offload).lower()}"]
    out = tmp_path / "held"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(free_port()), str(ROOT / "tests" / "memory_worker.py"), json.dumps(overrides), str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = run_torchrun(command, env)
    assert done.returncode == 0, done.stderr[-4000:]
    shape = shape_from_hf_config(AutoConfig.from_pretrained(model))
    workload = Workload(seq_len=6, train_vision=False)
    for rank in range(2):
        held = json.loads(Path(f"{out}.rank{rank}.json").read_text())
        assert all(torch.isfinite(torch.tensor(held["losses"])))
        for state in ("float32", "bfloat16"):
            layout = Layout(gpus=2, optimizer_state_dtype=state, cpu_offload=offload)
            plan = plan_memory(shape, layout, workload, rank=rank)
            sharded = {part: held[state][part] for part in ("parameters", "gradients", "optimizer state")}
            if offload:
                assert plan.host_bytes == sum(sharded.values())
                assert plan.parts["parameters"] == plan.parts["gradients"] == plan.parts["optimizer state"] == 0
            else:
                assert {part: plan.parts[part] for part in sharded} == sharded


def test_start_up_check_refuses_a_plan_over_the_gpu_unless_told_to_skip(tmp_path):
    from physreason.config import load_config
    from physreason.errors import ConfigError
    from physreason.train.memory_report import check_memory

    model = save_tiny_model("qwen3_vl", tmp_path / "model")
    config = load_config(None, [f"model.model_name_or_path='{model}'", "model.model_max_length=512"])
    plan = check_memory(config, 2, True, "sft", None)  # no GPU: planned, never refused
    small = plan.total // 2
    with pytest.raises(ConfigError, match=r"memory plan: .* GiB per GPU .*train.skip_memory_check"):
        check_memory(config, 2, True, "sft", small)
    config.train.skip_memory_check = True
    assert check_memory(config, 2, True, "sft", small).total == plan.total
    assert check_memory(config, 2, True, "sft", 4 * plan.total).fits(4 * plan.total)


def test_the_total_adds_the_larger_of_the_forward_and_backward_peaks_to_what_lives_through_the_step(shape_32b):
    plan = plan_memory(shape_32b, Layout(gpus=8), _issue_workload())
    p = plan.parts
    whole = p["parameters"] + p["optimizer state"] + p["reference model"] + p["rollout engine"] + p["runtime overhead"]
    forward = p["activations"] + p["logits / loss"] + p["vision activations"]
    backward = p["gradients"] + p["activations"]  # checkpointed: the block inputs stay small
    assert backward > forward  # full fine-tuning: the gradients are the larger peak
    assert plan.total == whole + p["gathered weights"] + backward < sum(p.values())
    # every part is counted in one of the groups: a new part must be placed, not dropped
    grouped = {"parameters", "optimizer state", "reference model", "rollout engine", "runtime overhead",
               "gathered weights", "activations", "logits / loss", "vision activations", "gradients"}  # fmt: skip
    assert set(p) == grouped
    lora = plan_memory(shape_32b, Layout(gpus=8, lora=True), replace(_issue_workload(), seq_len=8192))
    q = lora.parts  # LoRA: tiny gradients, so the end of forward (logits of 8,192 tokens) is the peak
    assert q["logits / loss"] + q["activations"] + q["vision activations"] > q["gradients"] + q["activations"]
    assert lora.total == (q["parameters"] + q["optimizer state"] + q["runtime overhead"] + q["gathered weights"]
                          + q["activations"] + q["logits / loss"] + q["vision activations"])  # fmt: skip


def test_plan_command_plans_a_grpo_recipe_as_grpo_without_being_told(tmp_path, tiny_model_dir):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    grpo = tmp_path / "grpo.toml"
    grpo.write_text(f'[model]\nmodel_name_or_path = "{tiny_model_dir}"\n\n[grpo]\nkl_beta = 0.04\n')
    sft = tmp_path / "sft.toml"
    sft.write_text(f'[model]\nmodel_name_or_path = "{tiny_model_dir}"\n')
    done = {name: subprocess.run([sys.executable, "-m", "physreason", "plan", str(path), *extra], env=env,
                                 capture_output=True, text=True, timeout=300)
            for name, path, extra in [("grpo", grpo, []), ("sft", sft, []), ("forced", grpo, ["--job", "sft"])]}
    assert all(result.returncode == 0 for result in done.values()), {k: v.stderr for k, v in done.items()}
    assert "(grpo job)" in done["grpo"].stdout and "rollout engine" in done["grpo"].stdout
    assert "reference model" in done["grpo"].stdout
    assert "(sft job)" in done["sft"].stdout and "rollout engine" not in done["sft"].stdout
    assert "(sft job)" in done["forced"].stdout and "rollout engine" not in done["forced"].stdout
    # a tiny model's count is readable, not "0.00 B"
    assert re.search(r": [\d,]+ parameters", done["sft"].stdout), done["sft"].stdout


def test_plan_says_which_layers_float8_converts_and_when_it_cannot_pay(tiny_model_dir, tmp_path):
    """[train.fp8] leaves the layers too small to pay in bf16 and says so; plan prints what it converts, or that the
    model trains in bf16, and when float8 is expected to be slower (uncompiled blocks, few tokens)."""
    from physreason.models.float8 import float8_outlook

    def block(hidden, intermediate, kv):
        return [("q_proj", hidden, hidden), ("k_proj", hidden, kv), ("v_proj", hidden, kv), ("o_proj", hidden, hidden),
                ("gate_proj", hidden, intermediate), ("up_proj", hidden, intermediate), ("down_proj", intermediate, hidden)]  # fmt: skip

    eight_b = float8_outlook(block(4096, 12288, 1024), tokens=8192, recipe="tensorwise")
    assert eight_b.startswith("float8 tensorwise runs q_proj, o_proj, gate_proj, up_proj, down_proj of each decoder block")
    assert "k_proj (4,096x1,024: too small to pay), v_proj (4,096x1,024: too small to pay) stay in bf16" in eight_b
    assert "expected to be slower" not in eight_b and "bench/fp8.py sft" in eight_b
    three_b = float8_outlook(block(2048, 11008, 256), tokens=4096, recipe="rowwise")
    assert three_b.startswith("float8 rowwise runs gate_proj, up_proj of each decoder block")
    assert "q_proj (2,048x2,048: too small to pay)" in three_b
    # rowwise broke even on one H100 (docs/fp8.md): the line points at the recipe that paid
    assert "rowwise measured 0.99-1.00x of bf16" in three_b and "quant_recipe = 'tensorwise'" in three_b
    uncompiled = float8_outlook(block(4096, 12288, 1024), tokens=2048, recipe="tensorwise", compiled=False)
    assert "float8 is expected to be slower than bf16 here: train.compile = false" in uncompiled
    assert "2,048 tokens per micro-batch is under 4,096" in uncompiled
    tiny = float8_outlook(block(64, 128, 32), tokens=4096, recipe="tensorwise")
    assert tiny.startswith("no linear layer of this model is large enough for float8 tensorwise to beat bf16")
    assert "train.fp8.skip_small_linears = false" in tiny
    recipe = tmp_path / "fp8.toml"
    recipe.write_text(f'[model]\nmodel_name_or_path = "{tiny_model_dir}"\n[train.fp8]\nenable_fp8 = true\n')
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "400"}
    done = subprocess.run([sys.executable, "-m", "physreason", "plan", str(recipe)], env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "[train.fp8] no linear layer of this model is large enough for float8 rowwise" in done.stdout


def _plan(*args: str):
    from typer.testing import CliRunner

    from physreason.cli import app

    result = CliRunner().invoke(app, ["plan", *args], env={"COLUMNS": "400"})
    return result.exit_code, " ".join(result.output.split())


@pytest.mark.parametrize(
    "recipe, gpus",
    [("cosmos-reason2-8b-sft.toml", 8), ("cosmos-reason2-8b-sft.toml", 2), ("cosmos-reason1-7b-sft.toml", 4),
     ("cosmos-reason2-2b-sft.toml", 2)],
)  # fmt: skip
def test_plan_offers_no_tensor_parallel_layout_for_shipped_recipes_that_fsdp_alone_fits(recipe, gpus):
    """TP ran at 0.46x-0.57x of FSDP alone at the 3B shape: plan lists no TP row where FSDP fits, and says why."""
    code, out = _plan(str(ROOT / "configs" / recipe), "--gpus", str(gpus))
    assert "layouts that fit" in out, out
    assert "tensor parallel: not recommended: FSDP alone fits" in out and "0.46x" in out, out
    assert "TP 1" in out and not re.search(r"TP [2-8]", out), out
    assert "tp_size=" not in out, out


def test_plan_tells_a_tensor_parallel_recipe_that_fsdp_alone_fits():
    recipe = str(ROOT / "configs" / "cosmos-reason2-8b-sft.toml")
    code, out = _plan(recipe, "--gpus", "8", "--set", "policy.parallelism.tp_size=2")
    assert code == 0, out  # the recipe fits: only advice
    assert "tensor parallel: not needed: FSDP alone fits on 8 GPU(s) (set policy.parallelism.tp_size=1" in out, out
    assert "policy.parallelism.tp_size=1" in out and not re.search(r"FSDP \d x TP [2-8]", out.split("layouts that fit")[1])


def test_plan_offers_tensor_parallel_where_fsdp_alone_cannot_fit(shape_32b):
    """A shape whose gathered block is what does not fit (4 blocks of a 204,800-wide MLP, 2 x 40 GiB GPUs): only TP,
    which gathers a 1/tp share of each block, fits without LoRA; FSDP's offload alone does not."""
    from physreason.train.memory import tp_degrees
    from physreason.train.memory_report import tensor_parallel_note

    config = AutoConfig.from_pretrained(QWEN3_VL_32B)
    config.text_config.intermediate_size, config.text_config.num_hidden_layers = 204800, 4
    wide = shape_from_hf_config(config)
    recipe, work, gpu = Layout(gpus=2), Workload(seq_len=4096, vision_tokens=1024), 40 * GIB
    fitting = fitting_layouts(wide, recipe, work, gpu)
    full = [plan for plan in fitting if not plan.layout.lora]
    assert full and all(plan.layout.tp == 2 for plan in full)  # no full FSDP-only layout fits; TP 2 does
    assert not plan_memory(wide, replace(full[0].layout, tp=1), work).fits(gpu)
    note = tensor_parallel_note(wide, recipe, fitting)
    assert note.startswith("tensor parallel: offered (TP > 1 rows below) only where FSDP alone cannot fit on 2 GPU(s)")
    # and where FSDP alone fits the same model, TP rows go: the 32B shape on 8 H100s
    eight = fitting_layouts(shape_32b, Layout(gpus=8), _issue_workload(), H100)
    assert eight and max(tp_degrees(shape_32b, 8)) == 8 and all(plan.layout.tp == 1 for plan in eight)


# Peaks measured on one H200 (bench/RESULTS.md, 2026-11-29, "the video row with fewer blocks recomputed"): Reason2's
# video row (10,540 visual tokens in 12,288), the Qwen3-VL-8B shape cut to 14 decoder blocks, tower trained, both stacks
# compiled, one process (train.one_rank_precision = "cast"), chunked loss; torch.cuda.max_memory_allocated in GiB.
VIDEO_ROW_PEAKS = {(1, 1): 69.6, (1, 2): 89.1, (1, 0): 110.1, (2, 2): 96.5, (2, 1): 76.9, None: 127.9}


@pytest.mark.parametrize("recompute", list(VIDEO_ROW_PEAKS))
def test_plan_of_the_video_row_is_within_its_measured_peak_less_two_percent_and_ten_percent_above(recompute):
    """The plan had priced these rows 17-63% above their peaks (160 GiB for one measured at 110: refused on the H200
    it ran on): vision blocks at the decoder's coefficients, compiled blocks at eager ones, the one-process weight
    copies kept through the backward and the kept blocks' activations beside every gradient."""
    from transformers import Qwen3VLConfig

    rope = {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20], "mrope_interleaved": True}
    config = Qwen3VLConfig(
        text_config=dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=14,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_parameters=rope,
                         tie_word_embeddings=False),
        vision_config=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096,
                           patch_size=16, num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24]),
        tie_word_embeddings=False,
    )  # fmt: skip
    shape = shape_from_hf_config(config)
    workload = Workload(seq_len=12288, loss_chunk_size=1024, vision_tokens=10540, compiled=True, compiled_vision=True)
    every = recompute or (1, 1)
    layout = Layout(gpus=1, distributed=False, gradient_checkpointing=recompute is not None, checkpoint_every=every[0],
                    vision_checkpoint_every=every[1])  # fmt: skip
    plan = plan_memory(shape, layout, workload)
    planned = (plan.total - plan.parts["runtime overhead"]) / 2**30  # max_memory_allocated sees tensors only
    assert 0.98 <= planned / VIDEO_ROW_PEAKS[recompute] <= 1.10, (planned, VIDEO_ROW_PEAKS[recompute])


def test_packed_grpo_rows_with_selective_recompute_leave_the_kept_blocks_out_of_the_backward_term(tmp_path):
    """The packed branch reused the name of the kept blocks' bytes for a block count, so packed GRPO rows got almost
    no backward credit for selective recompute (found in review, 2026-11-29)."""
    from physreason.train.memory import stack_activation_bytes

    shape = shape_from_hf_config(AutoConfig.from_pretrained(save_tiny_model("qwen3_vl", tmp_path / "m")))
    workload = Workload(seq_len=2048, completions_per_prompt=8, prompt_tokens=512, response_tokens=256, packed=True,
                        completions_per_step=64, train_vision=False)  # fmt: skip
    layout = Layout(gpus=1, distributed=False, mini_batch=8, checkpoint_every=2)
    plan = plan_memory(shape, layout, workload)
    tokens = 512 + 8 * 256  # one packed row: the prompt, then its 8 completions
    per_token = activation_bytes_per_token(shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim,
                                           shape.intermediate, 2)  # fmt: skip
    kept = stack_activation_bytes(tokens, shape.layers, per_token, shape.hidden, 2, True, 2) - stack_activation_bytes(
        tokens, shape.layers, per_token, shape.hidden, 2, True, 1
    )
    assert kept > 0 and plan.parts["activations"] - plan.backward_activations == kept


@pytest.mark.parametrize(("precision", "offload", "distributed"), [("cast", False, False), ("legacy", False, True),
                                                                   ("cast", True, True)])  # fmt: skip
def test_one_torchrun_process_is_planned_on_the_path_it_takes(tmp_path, precision, offload, distributed):
    """torchrun --nproc-per-node 1 takes the one-process cast path (train/build.py compute_cast) unless the recipe asks
    for the legacy FSDP2 one or CPU offload; the plan had used FSDP2's formula for it."""
    from physreason.config import load_config
    from physreason.train.memory_report import recipe_layout

    model = save_tiny_model("qwen3_vl", tmp_path / "m")
    config = load_config(None, [f"model.model_name_or_path='{model}'", f"train.one_rank_precision='{precision}'",
                                f"train.cpu_offload={str(offload).lower()}"])  # fmt: skip
    assert recipe_layout(config, 1, True, "sft").distributed is distributed
    assert recipe_layout(config, 2, True, "sft").distributed is True
