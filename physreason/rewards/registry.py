"""A registry of reward functions by name, and the weighted sum a training step uses."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any

from physreason.errors import ConfigError, InputError

# A reward: `fn(completion, **sample_fields) -> float`. Rewards declare the fields they need as
# required keyword-only parameters (accuracy needs `answer`), which a Protocol cannot express.
RewardFn = Callable[..., float]

_REWARDS: dict[str, RewardFn] = {}
# The key compute_rewards adds for the weighted sum, so no reward may take its name.
TOTAL_KEY = "total"


def register_reward(name: str, *, aliases: tuple[str, ...] = ()) -> Callable[[RewardFn], RewardFn]:
    """Decorator: register a reward function under `name` (and `aliases`) for configs to name.

    Raises ConfigError when a name is taken, or is "total".
    """

    def decorate(fn: RewardFn) -> RewardFn:
        for key in (name, *aliases):
            if key == TOTAL_KEY:
                raise ConfigError(f"A reward cannot be named {TOTAL_KEY!r}: compute_rewards uses that key for the sum.")
            if key in _REWARDS:
                raise ConfigError(f"Reward name {key!r} is already registered; choose another name.")
            _REWARDS[key] = fn
        return fn

    return decorate


def registered_rewards() -> list[str]:
    """Return the names of all registered rewards, aliases included, sorted."""
    return sorted(_REWARDS)


def get_reward(name: str) -> RewardFn:
    """Return the reward registered as `name`; ConfigError naming the registered ones if there is none."""
    try:
        return _REWARDS[name]
    except KeyError:
        raise ConfigError(f"Unknown reward {name!r}. Registered rewards: {', '.join(registered_rewards())}.") from None


def compute_rewards(completion: str, weights: Mapping[str, float], **sample: Any) -> dict[str, float]:
    """Return each named reward of `completion` and their weighted sum under the key "total".

    Every reward in `weights` is computed, zero weights included, so logs show it. The sample's
    fields go to every reward as keywords; InputError names a field a reward needs and lacks, or a
    reward that returned NaN or infinity.
    """
    values: dict[str, float] = {}
    for name in weights:
        fn = get_reward(name)
        missing = _missing_fields(fn, sample)
        if missing:
            raise InputError(
                f"Reward {name!r} needs sample field(s) {missing}; the sample has {sorted(sample)}. "
                "Add them to the data records or drop the reward from the weights."
            )
        value = float(fn(completion, **sample))
        if not math.isfinite(value):
            # One NaN would turn its whole group's advantages, and then the loss, into NaN.
            raise InputError(
                f"Reward {name!r} ({fn.__module__}.{fn.__qualname__}) returned {value} for the completion "
                f"{_preview(completion)}; a reward must return a finite number: fix the reward function"
            )
        values[name] = value
    values[TOTAL_KEY] = sum(weights[name] * values[name] for name in weights)
    return values


def _preview(text: str, limit: int = 80) -> str:
    """The start of a completion, quoted, for error messages."""
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _missing_fields(fn: RewardFn, sample: Mapping[str, Any]) -> list[str]:
    """Required keyword-only parameters of `fn` that `sample` does not provide."""
    return [
        param.name
        for param in inspect.signature(fn).parameters.values()
        if param.kind is inspect.Parameter.KEYWORD_ONLY
        and param.default is inspect.Parameter.empty
        and param.name not in sample
    ]
