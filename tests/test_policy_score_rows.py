"""The policy scores a small vocabulary's rows in one lm_head call (issue 45: a from-scratch model's GRPO step): the
same log-probs, entropies, raw log-probs and gradients as one row at a time, the path a 152k vocabulary keeps."""

from __future__ import annotations

import pytest
import torch
from test_policy_shared_vision import group, load, video

from physreason.config import ModelConfig
from physreason.models import loading
from physreason.models.family import read_vision_tokens
from physreason.models.inputs import encode_visuals
from physreason.train import policy
from physreason.train.policy import PolicyScorer, build_completion_batch, score_rows_at_once


def test_rows_at_once_fit_the_logit_budget():
    assert score_rows_at_once(128, 526) == policy.SCORE_LOGIT_ELEMENTS // (128 * 526)  # a from-scratch model: ~1000
    assert score_rows_at_once(1024, 151_936) == 1  # a released model: one row at a time, as before
    assert score_rows_at_once(0, 526) >= 1


def score(model, batch, calls: list[int]):
    model.zero_grad(set_to_none=True)
    scores = PolicyScorer(model)(batch, 0.7, diagnostics=True)
    weights = torch.randn(batch.mask.shape, generator=torch.Generator().manual_seed(1))  # [B, T]
    (scores.logprobs * weights * batch.mask).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return scores, grads


@pytest.mark.parametrize("budget_rows", [1, 3])
def test_scoring_rows_together_matches_one_row_at_a_time(tiny_model_dir, monkeypatch, budget_rows):
    vision = read_vision_tokens(loading.load_model_config(ModelConfig(model_name_or_path=str(tiny_model_dir))))
    model = load(tiny_model_dir).train()
    samples = group("v0", encode_visuals(videos=[video(56, 84, 4, seed=0)]), 4, vision, seed=0)
    samples += group("v1", encode_visuals(videos=[video(56, 84, 4, seed=1)]), 3, vision, seed=1)
    batch = build_completion_batch(samples, 0, vision)
    calls: list[int] = []
    real = policy._score_row
    monkeypatch.setattr(policy, "_score_row", lambda piece, *a: calls.append(piece.shape[0]) or real(piece, *a))
    together, together_grads = score(model, batch, calls)
    assert calls == [7]  # the whole micro-batch in one lm_head call
    calls.clear()
    length, vocab = batch.tokens.shape[1], model.lm_head.weight.shape[0]
    monkeypatch.setattr(policy, "SCORE_LOGIT_ELEMENTS", budget_rows * length * vocab)
    alone, alone_grads = score(model, batch, calls)
    assert calls == [budget_rows] * (7 // budget_rows) + ([7 % budget_rows] if 7 % budget_rows else [])
    mask = batch.mask
    # A few float32 ulps: the lm_head matmul of 7 rows and of 1 round differently on some CPUs (2.4e-6 on a log-prob
    # of -6.2, 3 ulps, on an AMD EPYC; bit-equal on the Xeons before); a wrong row or shift differs by whole units.
    for got, want in ((together.logprobs, alone.logprobs), (together.entropy, alone.entropy),
                      (together.raw_logprobs, alone.raw_logprobs)):  # fmt: skip
        torch.testing.assert_close(got[mask], want[mask], rtol=1e-6, atol=1e-6)
    assert set(together_grads) == set(alone_grads)
    for name, want in alone_grads.items():  # each element within a millionth of its tensor's largest (as above)
        atol = 1e-6 * float(want.abs().max())
        torch.testing.assert_close(together_grads[name], want, rtol=1e-5, atol=atol, msg=name)
