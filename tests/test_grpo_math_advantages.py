"""Group-relative advantages: hand-computed values, shapes, and the estimator registry."""

from __future__ import annotations

import math

import pytest
import torch

from physreason.errors import ConfigError
from physreason.train import grpo_advantages
from physreason.train.grpo_advantages import advantage_names, compute_group_advantages, register_advantage


def test_grpo_advantages_divide_by_unbiased_group_std():
    # Group [1, 0, 0, 1]: mean 0.5, unbiased std sqrt((4 * 0.25) / 3) = sqrt(1/3).
    advantages = compute_group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), group_size=4, eps=0.0)
    expected = 0.5 / math.sqrt(1 / 3)
    torch.testing.assert_close(advantages, torch.tensor([expected, -expected, -expected, expected]))


def test_eps_is_added_to_the_std():
    advantages = compute_group_advantages(torch.tensor([2.0, 0.0]), group_size=2, eps=0.5)
    # mean 1, unbiased std sqrt(2); (2 - 1) / (sqrt(2) + 0.5).
    torch.testing.assert_close(advantages, torch.tensor([1 / (math.sqrt(2) + 0.5), -1 / (math.sqrt(2) + 0.5)]))


def test_drgrpo_advantages_only_subtract_the_group_mean():
    advantages = compute_group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0]), group_size=3, mode="drgrpo")
    torch.testing.assert_close(advantages, torch.tensor([2 / 3, -1 / 3, -1 / 3, -2 / 3, 4 / 3, -2 / 3]))


@pytest.mark.parametrize("mode", ["grpo", "drgrpo"])
@pytest.mark.parametrize("value", [0.0, 1.0, 0.1, 0.7])
def test_all_equal_group_rewards_give_exactly_zero_advantages(mode, value):
    rewards = torch.tensor([value] * 3 + [1.0, 0.0, 0.5])
    advantages = compute_group_advantages(rewards, group_size=3, mode=mode)
    assert torch.equal(advantages[:3], torch.zeros(3))
    assert advantages[3:].abs().sum() > 0


def test_groups_are_normalised_independently():
    flat = torch.tensor([1.0, 0.0, 10.0, 30.0])
    advantages = compute_group_advantages(flat, group_size=2, eps=0.0)
    # Each group of two has |r - mean| = std / sqrt(2) whatever its scale.
    torch.testing.assert_close(advantages, torch.tensor([1.0, -1.0, -1.0, 1.0]) / math.sqrt(2))


def test_two_dimensional_rewards_keep_their_shape_and_values():
    rewards = torch.tensor([[1.0, 0.0, 0.5], [0.2, 0.2, 0.9]])
    grouped = compute_group_advantages(rewards, group_size=3)
    assert grouped.shape == (2, 3)
    torch.testing.assert_close(grouped.flatten(), compute_group_advantages(rewards.flatten(), group_size=3))


def test_integer_rewards_give_float_advantages():
    advantages = compute_group_advantages(torch.tensor([1, 0]), group_size=2, eps=0.0)
    assert advantages.dtype == torch.float32
    torch.testing.assert_close(advantages, torch.tensor([1.0, -1.0]) / math.sqrt(2))


def test_group_of_one_has_zero_advantage():
    assert torch.equal(compute_group_advantages(torch.tensor([0.3, 0.9]), group_size=1), torch.zeros(2))


@pytest.mark.parametrize(
    ("shape", "group_size"), [((5,), 2), ((2, 3), 2), ((2, 2, 2), 2)], ids=["not-divisible", "wrong-columns", "3d"]
)
def test_rewards_that_do_not_form_groups_are_rejected(shape, group_size):
    with pytest.raises(ValueError, match="group_size"):
        compute_group_advantages(torch.zeros(shape), group_size=group_size)


def test_unknown_estimator_names_the_config_key_and_the_choices():
    with pytest.raises(ConfigError, match=r"\[grpo\] advantage.*'drgrpo'.*'grpo'"):
        compute_group_advantages(torch.zeros(4), group_size=2, mode="ppo")


def test_a_registered_estimator_is_selectable_by_name(monkeypatch):
    monkeypatch.setattr(grpo_advantages, "_ADVANTAGES", dict(grpo_advantages._ADVANTAGES))

    @register_advantage("rank")
    def rank_advantages(grouped: torch.Tensor, eps: float) -> torch.Tensor:
        return grouped.argsort(dim=1).argsort(dim=1).to(grouped.dtype)

    assert "rank" in advantage_names()
    advantages = compute_group_advantages(torch.tensor([0.3, 0.1, 0.2]), group_size=3, mode="rank")
    torch.testing.assert_close(advantages, torch.tensor([2.0, 0.0, 1.0]))
    with pytest.raises(ValueError, match="already registered"):
        register_advantage("rank")(rank_advantages)
