"""Truncated importance sampling in the GRPO loss, on hand-computed tensors."""

from __future__ import annotations

import math

import pytest
import torch

from physreason.train.grpo_loss import policy_loss, truncated_importance_weights

MASK = torch.tensor([[True, True, True], [True, False, False]])


def test_weights_are_the_capped_ratio_of_old_to_rollout_probabilities_and_one_on_padding():
    old = torch.tensor([[math.log(0.5), math.log(0.2), math.log(0.9)], [math.log(0.3), 0.0, 0.0]])
    rollout = torch.tensor([[math.log(0.25), math.log(0.4), math.log(0.1)], [math.log(0.3), -50.0, float("nan")]])
    weights = truncated_importance_weights(old, rollout, MASK, cap=2.0)
    # 0.5/0.25 = 2 (at the cap), 0.2/0.4 = 0.5, 0.9/0.1 = 9 -> 2, 0.3/0.3 = 1; padding -> 1 whatever it holds
    expected = torch.tensor([[2.0, 0.5, 2.0], [1.0, 1.0, 1.0]])
    assert torch.allclose(weights, expected, atol=1e-6)
    assert not weights.requires_grad


def test_weights_never_carry_gradient_to_either_log_prob():
    old = torch.zeros(2, 3, requires_grad=True)
    rollout = torch.zeros(2, 3, requires_grad=True)
    assert not truncated_importance_weights(old, rollout, MASK, 2.0).requires_grad


def test_a_non_positive_cap_is_refused():
    with pytest.raises(ValueError, match="cap must be positive"):
        truncated_importance_weights(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), 0.0)


def test_equal_log_probs_give_the_uncorrected_loss_and_gradient():
    torch.manual_seed(0)
    logprobs = (torch.randn(2, 3) - 2.0).requires_grad_(True)
    old = logprobs.detach() + 0.1 * torch.randn(2, 3)
    advantages = torch.tensor([1.5, -0.5])
    weights = truncated_importance_weights(old, old, MASK, cap=2.0)
    plain, _ = policy_loss(logprobs, old, advantages, MASK)
    (grad_plain,) = torch.autograd.grad(plain, logprobs)
    corrected, metrics = policy_loss(logprobs, old, advantages, MASK, tis_weights=weights, tis_cap=2.0)
    (grad_corrected,) = torch.autograd.grad(corrected, logprobs)
    assert torch.equal(corrected, plain) and torch.equal(grad_corrected, grad_plain)
    assert float(metrics["tis_weight_mean"]) == 1.0 and float(metrics["tis_capped_frac"]) == 0.0


def test_each_tokens_clipped_loss_is_multiplied_by_its_weight():
    # One iteration: old = current, ratio 1, token loss -A; token-mean over 4 counted tokens.
    logprobs = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -3.0, -3.0]], requires_grad=True)
    advantages = torch.tensor([2.0, -1.0])
    weights = torch.tensor([[2.0, 0.5, 1.0], [0.25, 7.0, 7.0]])  # padding's 7 must not count
    loss, metrics = policy_loss(logprobs, logprobs.detach(), advantages, MASK, tis_weights=weights, tis_cap=2.0)
    # tokens: -2*2, -2*0.5, -2*1, +1*0.25 -> (-4 - 1 - 2 + 0.25) / 4
    assert float(loss.detach()) == pytest.approx((-4.0 - 1.0 - 2.0 + 0.25) / 4)
    (grad,) = torch.autograd.grad(loss, logprobs)
    # d(-r A w)/d lp = -A w r with r = 1, over 4 tokens
    expected = torch.tensor([[-4.0, -1.0, -2.0], [0.25, 0.0, 0.0]]) / 4
    assert torch.allclose(grad, expected)
    assert float(metrics["tis_weight_mean"]) == pytest.approx((2.0 + 0.5 + 1.0 + 0.25) / 4)
    assert float(metrics["tis_capped_frac"]) == pytest.approx(1 / 4)


def test_the_kl_term_is_not_weighted():
    logprobs = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, 0.0, 0.0]])
    ref = torch.tensor([[-1.2, -1.0, -0.7], [-1.0, 0.0, 0.0]])
    advantages = torch.zeros(2)  # no policy term: the loss is the KL term alone
    plain, _ = policy_loss(logprobs, logprobs, advantages, MASK, kl_beta=0.1, ref_logprobs=ref)
    weights = torch.full((2, 3), 2.0)
    corrected, _ = policy_loss(logprobs, logprobs, advantages, MASK, kl_beta=0.1, ref_logprobs=ref, tis_weights=weights)
    assert torch.equal(corrected, plain) and float(plain) > 0
