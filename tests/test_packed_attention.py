"""physreason/models/packed_attention.py: packed rows' attention from their spans equals sdpa under their [L, L] mask."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from unittest import mock

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from physreason.models import packed_attention
from physreason.models.packed_attention import PackedRows, attach, dense_mask, layout_of, packed_sdpa_attention


def test_spans_give_the_masked_attention_forward_and_backward_with_grouped_heads():
    # row 0: a prompt of 5 and completions of 3 and 4 (unequal); row 1: a prompt of 3 and one of 2, then padding
    layout = PackedRows(((5, ((5, 3), (8, 4))), (3, ((3, 2),))), width=12)
    real = torch.zeros(2, 12, dtype=torch.bool)
    real[0, :12] = True
    real[1, :5] = True
    generator = torch.Generator().manual_seed(0)
    module = SimpleNamespace(num_key_value_groups=2, is_causal=True)
    leaves = [torch.randn(2, heads, 12, 8, generator=generator, requires_grad=True) for heads in (4, 2, 2)]
    weights = torch.randn(2, 12, 4, 8, generator=generator)
    results = []
    for mask in (dense_mask(layout), attach(dense_mask(layout), layout)):
        out, _ = (sdpa_attention_forward if layout_of(mask) is None else packed_sdpa_attention)(
            module, *leaves, mask, scaling=0.3
        )  # [R, L, H, D]
        (out * weights * real[:, :, None, None]).sum().backward()
        results.append((out.detach(), [leaf.grad.clone() for leaf in leaves]))
        for leaf in leaves:
            leaf.grad = None
    (want, want_grads), (got, got_grads) = results
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-6)
    assert torch.equal(got[~real], torch.zeros_like(got[~real]))  # padding: zeros, read by nothing
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_calls_without_spans_are_transformers_sdpa_and_the_switch_is_once(tiny_model_dirs):
    from physreason.config import ModelConfig
    from physreason.models.loading import load_model

    generator = torch.Generator().manual_seed(1)
    module = SimpleNamespace(num_key_value_groups=1, is_causal=True)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=generator) for _ in range(3))
    want, _ = sdpa_attention_forward(module, q, k, v, None, scaling=0.5)
    got, _ = packed_sdpa_attention(module, q, k, v, None, scaling=0.5)
    assert torch.equal(got, want)

    model = load_model(ModelConfig(model_name_or_path=str(tiny_model_dirs["qwen2"])), dtype=torch.float32).eval()
    # a left-padded batch (as generation pads): the same hidden states before and after the switch, padding honoured
    ids = torch.randint(3, 100, (2, 7), generator=generator)
    padding = torch.ones(2, 7, dtype=torch.long)
    padding[1, :3] = 0
    with torch.no_grad():
        before = model.model(input_ids=ids, attention_mask=padding).last_hidden_state
        assert packed_attention.use_packed_attention(model) and packed_attention.use_packed_attention(model)
        after = model.model(input_ids=ids, attention_mask=padding).last_hidden_state
        unpadded = model.model(input_ids=ids[1:, 3:]).last_hidden_state
    assert model.config.get_text_config()._attn_implementation == packed_attention.NAME
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    torch.testing.assert_close(after[1, 3:], unpadded[0], rtol=1e-5, atol=1e-5)
    eager = load_model(
        ModelConfig(model_name_or_path=str(tiny_model_dirs["qwen2"]), attn_implementation="eager"), dtype=torch.float32
    )
    assert not packed_attention.use_packed_attention(eager)  # other kernels are left alone
    assert eager.config.get_text_config()._attn_implementation == "eager"


def test_the_variable_length_sequences_of_packed_rows():
    """Per row the prompt (queries = keys), then each completion (its queries; the prompt's keys, then its own), as
    flat positions row * L + column; the cumulative lengths the flash kernel takes."""
    layout = PackedRows(((2, ((2, 2), (4, 1))), (1, ((1, 2),))), width=5)
    plan = packed_attention._plan(layout, torch.device("cpu"))
    assert plan.queries.tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert plan.keys.tolist() == [0, 1, 0, 1, 2, 3, 0, 1, 4, 5, 5, 6, 7]
    assert plan.cu_q.tolist() == [0, 2, 4, 5, 6, 8] and plan.cu_q.dtype == torch.int32
    assert plan.cu_k.tolist() == [0, 2, 6, 9, 10, 13] and plan.cu_k.dtype == torch.int32
    assert plan.bounds == ((0, 2, 0, 2), (2, 4, 2, 6), (4, 5, 6, 9), (5, 6, 9, 10), (6, 8, 10, 13))
    assert packed_attention._plan(layout, torch.device("cpu")) is plan  # made once per batch and device
    assert packed_attention._plan_of(attach(torch.ones(2, 1, 5, 5, dtype=torch.bool), layout)) is plan
    # a mask of another width (a context-parallel shard's) or without a layout: no plan, transformers' sdpa
    assert packed_attention._plan_of(attach(torch.ones(2, 1, 5, 3, dtype=torch.bool), layout)) is None
    assert packed_attention._plan_of(torch.ones(2, 1, 5, 5, dtype=torch.bool)) is None


def test_the_gpu_check_of_the_spans_path_runs_on_cpu_and_fails_a_wrong_kernel(monkeypatch):
    """gpu-check packed-attention-spans (flash's kernel against the mask on CUDA) as a dry run: the reference loop in
    float32 passes; a kernel that ignores the prompt fails it."""
    import pytest

    from physreason.gpu_check import check_packed_attention

    assert check_packed_attention("cpu", "float32").startswith("float32 relative gaps to float32: output")
    reference = packed_attention._reference

    def without_prompt(query, key, value, bounds, scale):  # each sequence's last len(q) keys only
        index = torch.cat([torch.arange(k1 - (q1 - q0), k1) for q0, q1, _, k1 in bounds])
        return reference(query, key[index], value[index], tuple((q0, q1, q0, q1) for q0, q1, _, _ in bounds), scale)

    monkeypatch.setattr(packed_attention, "_reference", without_prompt)
    with pytest.raises(AssertionError, match="spans"):
        check_packed_attention("cpu", "float32")


def test_compiled_checkpointed_layers_trace_the_spans_path_and_match_eager(tiny_model_dirs):
    """Decoder layers compiled under activation checkpointing (train.compile with recompute): the packed rows' plan
    comes from each layer's pre-hook, so dynamo traces the checkpointed layer with the spans path inside (reading the
    layout off the mask or a cache inside torch.utils.checkpoint would run the layer eagerly); same log-probs and
    gradients as eager."""
    import sys
    from pathlib import Path

    from torch._dynamo.utils import counters

    sys.path.insert(0, str(Path(__file__).parent))
    from test_policy_shared_vision import group

    from physreason.config import ModelConfig
    from physreason.models import loading
    from physreason.models.parallelize import enable_activation_checkpointing
    from physreason.train.build import compile_blocks
    from physreason.train.policy import PolicyScorer, build_completion_batch

    batch = build_completion_batch(group("a", None, 3, None, seed=0) + group("b", None, 2, None, seed=1), 0, None, pack=True)

    def run(compiled: bool):
        torch.manual_seed(0)
        model = loading.load_model(
            ModelConfig(model_name_or_path=str(tiny_model_dirs["qwen2"]), dtype="float32"), dtype=torch.float32
        ).train()
        enable_activation_checkpointing(model)
        if compiled:
            torch._dynamo.reset()
            counters.clear()
            compile_blocks(model)
        # counted in the eager run only (dynamo does not trace into a mock)
        with mock.patch.object(packed_attention, "_varlen", wraps=packed_attention._varlen) if not compiled else (
            contextlib.nullcontext(mock.Mock(call_count=0))
        ) as calls:
            logprobs = PolicyScorer(model, packed_attention="spans")(batch, 0.7).logprobs
            (logprobs * batch.mask).sum().backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        return logprobs.detach(), grads, calls.call_count

    want, want_grads, eager_calls = run(False)
    got, got_grads, _ = run(True)
    assert eager_calls >= 2  # the spans path ran (two layers)
    # one break, on purpose, before the checkpoint (the pre-hook's lookup); none inside it
    reasons = " ".join(counters["graph_break"])
    assert "HOP" not in reasons and "checkpoint" not in reasons, reasons
    assert counters["stats"]["unique_graphs"] >= 1
    torch.testing.assert_close(got[batch.mask], want[batch.mask], rtol=1e-5, atol=2e-6)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)
