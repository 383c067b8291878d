"""Group-relative advantages for GRPO: one reward per completion in, one advantage per completion out.

A rollout batch holds ``num_groups`` prompts with ``group_size`` completions each, laid out group by
group (completion ``j`` of prompt ``i`` at flat index ``i * group_size + j``), which is how
``[rollout] n_generation`` samples are returned. An estimator is a function of the grouped rewards
``[num_groups, group_size]``; ``register_advantage`` adds one under a name that ``[grpo] advantage``
can select.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from physreason.errors import ConfigError

# grouped rewards [num_groups, group_size] (float32), eps -> advantages [num_groups, group_size]
AdvantageFn = Callable[[torch.Tensor, float], torch.Tensor]

_ADVANTAGES: dict[str, AdvantageFn] = {}


def register_advantage(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Register ``fn(grouped_rewards [G_n, G], eps) -> advantages [G_n, G]`` under ``name``; names are unique."""

    def decorate(fn: AdvantageFn) -> AdvantageFn:
        if name in _ADVANTAGES:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        _ADVANTAGES[name] = fn
        return fn

    return decorate


def get_advantage(name: str) -> AdvantageFn:
    """Return the estimator registered as ``name``, or raise ConfigError listing the known names."""
    if name not in _ADVANTAGES:
        raise ConfigError(
            f"[grpo] advantage = {name!r} is not a known advantage estimator; use one of {sorted(_ADVANTAGES)}."
        )
    return _ADVANTAGES[name]


def advantage_names() -> list[str]:
    """Names of every registered advantage estimator, sorted."""
    return sorted(_ADVANTAGES)


@register_advantage("grpo")
def grpo_advantages(grouped: torch.Tensor, eps: float) -> torch.Tensor:
    """(r - group mean) / (group std + eps), std with Bessel's correction (n - 1), as TRL's ``nanstd``."""
    if grouped.shape[1] == 1:
        # A group of one has no spread (its unbiased std is undefined): it carries no signal.
        return torch.zeros_like(grouped)
    centered = grouped - grouped.mean(dim=1, keepdim=True)  # [G_n, G]
    std = grouped.std(dim=1, correction=1, keepdim=True)  # [G_n, 1]
    return centered / (std + eps)


@register_advantage("drgrpo")
def drgrpo_advantages(grouped: torch.Tensor, eps: float) -> torch.Tensor:
    """r - group mean (Dr. GRPO, Liu et al. 2025): no division by the std, so eps is unused."""
    del eps  # the shared estimator signature passes it; Dr. GRPO removes the std and with it the eps
    return grouped - grouped.mean(dim=1, keepdim=True)


def compute_group_advantages(
    rewards: torch.Tensor, group_size: int, mode: str = "grpo", eps: float = 1e-6
) -> torch.Tensor:
    """Advantages of the same shape as ``rewards`` ([B * G] or [B, G]), each relative to its own group.

    ``mode`` names a registered estimator ("grpo", "drgrpo", ...). Groups whose rewards are all
    equal get exactly zero: the float residue of ``r - mean`` (e.g. three rewards of 0.1) would
    otherwise be divided by ``std + eps ~ eps`` and turn into a spurious advantage of order one.
    TRL uses ``eps = 1e-4``; pass that to reproduce its numbers.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if rewards.dim() == 2 and rewards.shape[1] != group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not have group_size={group_size} columns")
    if rewards.dim() not in (1, 2) or rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards must be [B * group_size] or [B, group_size]; got shape {tuple(rewards.shape)}"
            f" with group_size={group_size}"
        )
    estimator = get_advantage(mode)
    grouped = rewards.reshape(-1, group_size).to(torch.float32)  # [B, G]
    advantages = estimator(grouped, eps)  # [B, G]
    all_equal = grouped.amax(dim=1, keepdim=True) == grouped.amin(dim=1, keepdim=True)  # [B, 1]
    advantages = advantages.masked_fill(all_equal, 0.0)
    return advantages.reshape(rewards.shape)
