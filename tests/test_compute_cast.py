"""One rank without FSDP2 (parallelize.apply_compute_cast): bf16 compute from fp32 masters, FSDP2's numerics on one rank.

The reference is the same model cast to bf16 whole: the cast path must compute the same loss bit for bit and give
each fp32 master the bf16 gradient, cast to fp32 (what FSDP2 with MixedPrecisionPolicy(bf16, reduce fp32) gives on
one rank), with and without recomputed blocks, and put the fp32 Parameters back after every forward and backward.
"""

from __future__ import annotations

import copy

import pytest
import torch
from setups import load_bench
from torch import nn

from physreason.config import Config
from physreason.models.parallelize import apply_compute_cast, enable_activation_checkpointing
from physreason.train.build import compute_cast
from physreason.train.model import CausalLMLoss
from physreason.train.runtime import Runtime

shapes = load_bench("shapes")


@pytest.fixture(scope="module")
def tied_config():
    """The tiny stand-in of the Qwen2.5-VL-3B shape: its embedding and lm_head are one tensor, as the 3B's are."""
    config = shapes.qwen25_vl_3b(True)
    config.text_config._attn_implementation = "sdpa"
    return config


def _pair(config, every: int) -> tuple[nn.Module, nn.Module]:
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(copy.deepcopy(config))
    reference = copy.deepcopy(model)
    for parameter in reference.parameters():  # parameters only: FSDP2 leaves buffers (rotary frequencies) in fp32
        parameter.data = parameter.data.to(torch.bfloat16)
    for each in (model, reference):
        if every:
            enable_activation_checkpointing(each, every)
    ours, theirs = CausalLMLoss(model, loss_chunk_size=16), CausalLMLoss(reference, loss_chunk_size=16)
    apply_compute_cast(ours, model, torch.bfloat16)
    return ours.train(), theirs.train()


def _slots_hold_fp32_parameters(module: nn.Module) -> bool:
    return all(
        type(value) is nn.Parameter and value.dtype == torch.float32
        for owner in module.modules()
        for value in owner._parameters.values()
        if value is not None
    )


@pytest.mark.parametrize("every", [0, 1, 2], ids=["no-recompute", "every-block", "every-second-block"])
def test_the_cast_path_computes_as_the_bf16_model_and_accumulates_its_gradients_in_fp32(tied_config, every):
    ours, reference = _pair(tied_config, every)
    model = ours.model
    assert model.lm_head.weight is model.model.language_model.embed_tokens.weight  # tied: one copy, one gradient
    batch = shapes.make_batch(tied_config, 32, 2, False, torch.device("cpu"))
    for _ in range(2):  # the second backward accumulates into the fp32 gradients, as micro-batches do
        loss, expected = ours(batch), reference(batch)
        assert _slots_hold_fp32_parameters(ours)
        assert torch.equal(loss, expected)
        loss.backward()
        expected.backward()
        assert _slots_hold_fp32_parameters(ours)  # recomputed blocks gave their bf16 copies back too
    named = dict(reference.named_parameters())
    for name, parameter in ours.named_parameters():
        if named[name].grad is None:  # the vision tower on text rows
            assert parameter.grad is None, name
            continue
        assert parameter.grad.dtype == torch.float32, name
        # two bf16 gradients, each cast to fp32 and added there; the bf16 model added them in bf16
        assert torch.allclose(parameter.grad, named[name].grad.float(), rtol=1e-2, atol=1e-6), name


def test_one_backward_gives_each_master_exactly_the_bf16_gradient(tied_config):
    ours, reference = _pair(tied_config, 1)
    batch = shapes.make_batch(tied_config, 32, 2, False, torch.device("cpu"))
    ours(batch).backward()
    reference(batch).backward()
    named = dict(reference.named_parameters())
    for name, parameter in ours.named_parameters():
        if named[name].grad is None:
            assert parameter.grad is None, name
        else:
            assert torch.equal(parameter.grad, named[name].grad.float()), name


@pytest.mark.timeout(300)
def test_the_compiled_widening_of_the_gradients_is_exact(tied_config, monkeypatch):
    """parallelize.WIDEN = "cuda" widens each bf16 gradient with a compiled kernel on GPUs; "always" runs that same
    compiled function here: every master's gradient equals torch's own cast bit for bit, with recomputed blocks."""
    import physreason.models.parallelize as parallelize
    from physreason.models.lazy_compile import LazyCompiled

    grads = {}
    for mode in ("never", "always"):
        monkeypatch.setattr(parallelize, "WIDEN", mode)
        fresh = LazyCompiled(parallelize._to_float32, dynamic=True)
        monkeypatch.setattr(parallelize, "_compiled_widen", fresh)
        ours, _ = _pair(tied_config, 2)
        batch = shapes.make_batch(tied_config, 32, 2, False, torch.device("cpu"))
        for _ in range(2):  # the second backward adds into the fp32 gradients
            ours(batch).backward()
        grads[mode] = {name: p.grad for name, p in ours.named_parameters() if p.grad is not None}
        assert (fresh.compiled is not None) == (mode == "always") and fresh.failed is None
    assert grads["never"].keys() == grads["always"].keys() and grads["never"]
    for name, grad in grads["never"].items():
        assert grads["always"][name].dtype == torch.float32
        assert torch.equal(grads["always"][name], grad), name


def test_a_forward_that_raises_puts_the_fp32_parameters_back(tied_config):
    ours, _ = _pair(tied_config, 1)
    block = ours.model.model.language_model.layers[1]

    def fail(*_):
        raise RuntimeError("stop in the mlp")

    block.mlp.register_forward_hook(fail)
    with pytest.raises(RuntimeError, match="stop in the mlp"):
        ours(shapes.make_batch(tied_config, 32, 1, False, torch.device("cpu")))
    assert _slots_hold_fp32_parameters(ours)


@pytest.mark.parametrize(
    ("world", "settings", "expected"),
    [
        (1, [], True),
        (1, ["train.one_rank_precision='legacy'"], False),
        (1, ["train.param_dtype='float32'"], True),  # a plain module: nothing to cast, nothing to gather
        (1, ["train.fp8.enable_fp8=true"], True),  # float8 layers cast the bf16 copies
        (1, ["train.fp8.enable_fp8=true", "train.one_rank_precision='legacy'"], False),
        (1, ["train.cpu_offload=true"], False),
        (2, [], False),
    ],
)
def test_one_process_takes_the_cast_path_unless_offload_or_legacy_need_fsdp2(world, settings, expected):
    from physreason.config import load_config

    config: Config = load_config(None, settings)
    assert compute_cast(config, Runtime(0, world, torch.device("cpu"), distributed=True)) is expected


@pytest.mark.parametrize(("world", "distributed", "expected"), [(1, False, False), (1, True, False), (2, True, True)])
def test_only_several_ranks_run_the_vision_tower_on_a_dummy_input_for_text_batches(world, distributed, expected):
    """torchrun with one process used to pay the dummy vision pass on every text batch, with no rank to keep in step."""
    assert Runtime(0, world, torch.device("cpu"), distributed=distributed).balances_vision is expected
