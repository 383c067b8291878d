"""Rewards layer: the one answer extractor, format and accuracy rewards, and a reward registry.

Importing the package registers the built-in rewards ("format", "accuracy" alias "single_choice") and the
structured-answer rewards of `localization` ("box_iou", "point_in_box", "temporal_iou",
"localization", "json_format"). The IoU rewards take options (grpo.reward_options): a hit bonus at an IoU threshold
(`localization.IoUShaping`).
"""

from physreason.rewards import localization
from physreason.rewards.extract import ExtractedAnswer, answer_region, extract, extract_answer, normalize_answer
from physreason.rewards.registry import (
    check_reward_options,
    compute_rewards,
    get_reward,
    register_reward,
    registered_rewards,
)
from physreason.rewards.rules import accuracy_reward, format_reward

__all__ = [
    "ExtractedAnswer",
    "accuracy_reward",
    "answer_region",
    "check_reward_options",
    "compute_rewards",
    "extract",
    "extract_answer",
    "format_reward",
    "get_reward",
    "localization",
    "normalize_answer",
    "register_reward",
    "registered_rewards",
]
