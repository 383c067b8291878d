"""Overlong handling: DAPO's soft punishment on rewards and TRL's masking of truncated completions, on the tensors."""

from __future__ import annotations

import pytest
import torch

from physreason.config import load_config
from physreason.errors import ConfigError
from physreason.train.grpo import UpdateSettings
from physreason.train.grpo_loss import mask_truncated, policy_loss, soft_overlong_penalty
from physreason.train.rollout import logged_reward_names, rollout_settings


def test_soft_overlong_penalty_is_zero_then_linear_then_the_full_factor():
    lengths = torch.tensor([10, 80, 90, 95, 100, 130])
    penalty = soft_overlong_penalty(lengths, max_length=100, buffer_length=20, penalty_factor=0.5)
    assert torch.allclose(penalty, torch.tensor([0.0, 0.0, -0.25, -0.375, -0.5, -0.5]))
    assert torch.equal(soft_overlong_penalty(lengths, 100, 0), torch.zeros(6))  # buffer 0: off
    with pytest.raises(ValueError):
        soft_overlong_penalty(lengths, 100, 200)


def test_masking_truncated_completions_removes_their_tokens_from_the_loss():
    torch.manual_seed(0)
    logprobs = torch.randn(3, 4, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    advantages = torch.tensor([1.0, -2.0, 0.5])
    truncated = torch.tensor([False, True, False])
    masked = mask_truncated(mask, truncated)
    assert masked[1].sum() == 0 and torch.equal(masked[[0, 2]], mask[[0, 2]])
    loss, _ = policy_loss(logprobs, logprobs.detach(), advantages, masked)
    # The same as the loss of the two kept completions alone, and no gradient reaches the truncated one.
    kept, _ = policy_loss(logprobs[[0, 2]], logprobs[[0, 2]].detach(), advantages[[0, 2]], mask[[0, 2]])
    assert torch.allclose(loss, kept)
    loss.backward()
    assert torch.count_nonzero(logprobs.grad[1]) == 0 and torch.count_nonzero(logprobs.grad[0]) > 0
    # Without the mask the truncated completion's negative advantage moves the loss.
    unmasked, _ = policy_loss(logprobs, logprobs.detach(), advantages, mask)
    assert not torch.allclose(unmasked, kept)


def test_settings_reach_the_update_and_the_rollout_and_are_checked():
    config = load_config(
        None,
        values={
            "rollout.max_response_length": 64,
            "grpo.mask_truncated_completions": True,
            "grpo.overlong_buffer_length": 16,
            "grpo.overlong_penalty_factor": 0.5,
        },
    )
    assert UpdateSettings.from_config(config).mask_truncated
    settings = rollout_settings(config, groups_needed=1, prompts_per_round=1, max_rounds=1, processor_params=None)
    assert (settings.overlong_buffer_length, settings.overlong_penalty_factor) == (16, 0.5)
    assert "overlong" in logged_reward_names(config)
    too_long = config.model_copy(update={"grpo": config.grpo.model_copy(update={"overlong_buffer_length": 65})})
    with pytest.raises(ConfigError, match="overlong_buffer_length"):
        rollout_settings(too_long, groups_needed=1, prompts_per_round=1, max_rounds=1, processor_params=None)
    assert "overlong" not in logged_reward_names(load_config(None))
