"""A registry of reward functions by name, their options, and the weighted sum a training step uses.

A reward may take options (a recipe's `grpo.reward_options`, e.g. how an IoU becomes a reward): keyword-only
parameters with defaults, declared at registration by a validator whose keyword parameters are their names and whose
call checks their values (a dataclass does both).
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

from physreason.errors import ConfigError, InputError, PhysReasonError

log = logging.getLogger(__name__)
# A reward: `fn(completion, **sample_fields) -> float`. Rewards declare the fields they need as
# required keyword-only parameters (accuracy needs `answer`), which a Protocol cannot express.
RewardFn = Callable[..., float]

_REWARDS: dict[str, RewardFn] = {}
_OPTIONS: dict[str, Callable[..., Any]] = {}  # reward name -> the validator of its options
_WARNED: set[tuple[str, str]] = set()  # (reward, exception type) already logged in this process
# The key compute_rewards adds for the weighted sum, so no reward may take its name.
TOTAL_KEY = "total"
# Names physreason gives the rewards itself: the completion scored, the layout its prompt asked for, the coordinate
# grid of its frame (train.rollout.completion_rewards). A data record's own field of one of these names is not a
# reward's input (data.mcq leaves it out).
PHYSREASON_FIELDS = ("completion", "prompt_style", "reasoning", "coords")


def register_reward(
    name: str, *, aliases: tuple[str, ...] = (), options: Callable[..., Any] | None = None
) -> Callable[[RewardFn], RewardFn]:
    """Decorator: register a reward function under `name` (and `aliases`) for configs to name.

    `options` validates the reward's options: called with them as keywords, it raises ConfigError for a bad value;
    its keyword parameters name them, and each must be a keyword-only parameter of the reward with the same default.
    Raises ConfigError when a name is taken, or is "total", or an option is not such a parameter.
    """

    def decorate(fn: RewardFn) -> RewardFn:
        if options is not None:
            _check_option_parameters(name, fn, options)
        for key in (name, *aliases):
            if key == TOTAL_KEY:
                raise ConfigError(f"A reward cannot be named {TOTAL_KEY!r}: compute_rewards uses that key for the sum.")
            if key in _REWARDS:
                raise ConfigError(f"Reward name {key!r} is already registered; choose another name.")
            _REWARDS[key] = fn
            if options is not None:
                _OPTIONS[key] = options
        return fn

    return decorate


def _option_defaults(validator: Callable[..., Any]) -> dict[str, Any]:
    """The option names a validator takes as keywords, with their defaults."""
    return {param.name: param.default for param in inspect.signature(validator).parameters.values()}


def _check_option_parameters(name: str, fn: RewardFn, validator: Callable[..., Any]) -> None:
    """Each option must reach `fn` as a keyword-only parameter whose default is the validator's (one meaning of an
    unset option)."""
    params = inspect.signature(fn).parameters
    for option, default in _option_defaults(validator).items():
        param = params.get(option)
        if param is None or param.kind is not inspect.Parameter.KEYWORD_ONLY or param.default != default:
            raise ConfigError(
                f"Reward {name!r}: option {option!r} must be a keyword-only parameter of {fn.__qualname__} with "
                f"default {default!r}, as its options validator declares"
            )


def check_reward_options(weights: Mapping[str, float], reward_options: Mapping[str, Mapping[str, Any]]) -> None:
    """Refuse unknown reward names, options for a reward that `weights` does not name or that takes none, unknown
    option names, and values the reward's validator rejects; ConfigError names the reward, the option and what it
    takes."""
    for name in weights:
        try:
            get_reward(name)
        except ConfigError as exc:
            raise ConfigError(f"grpo.reward_function: {exc}") from None
    for name, values in reward_options.items():
        get_reward(name)  # an unknown name: the error lists the registered ones
        if name not in weights:
            raise ConfigError(
                f"grpo.reward_options has options for reward {name!r}, which grpo.reward_function does not name "
                f"({', '.join(weights) or 'none'}): add it there or drop its options"
            )
        validator = _OPTIONS.get(name)
        if validator is None:
            raise ConfigError(f"grpo.reward_options.{name}: reward {name!r} takes no options; drop them")
        allowed = _option_defaults(validator)
        unknown = sorted(set(values) - set(allowed))
        if unknown:
            raise ConfigError(
                f"grpo.reward_options.{name}: unknown option(s) {unknown}; reward {name!r} takes "
                f"{', '.join(sorted(allowed))}"
            )
        try:
            validator(**values)
        except ConfigError as exc:
            raise ConfigError(f"grpo.reward_options.{name}: {exc}") from None


def reward_option_names() -> dict[str, list[str]]:
    """Each option name any registered reward takes (grpo.reward_options), with the rewards that take it."""
    names: dict[str, list[str]] = {}
    for reward, validator in sorted(_OPTIONS.items()):
        for option in _option_defaults(validator):
            names.setdefault(option, []).append(reward)
    return names


def registered_rewards() -> list[str]:
    """Return the names of all registered rewards, aliases included, sorted."""
    return sorted(_REWARDS)


def get_reward(name: str) -> RewardFn:
    """Return the reward registered as `name`; ConfigError naming the registered ones if there is none."""
    try:
        return _REWARDS[name]
    except KeyError:
        raise ConfigError(f"Unknown reward {name!r}. Registered rewards: {', '.join(registered_rewards())}.") from None


def compute_rewards(
    completion: str,
    weights: Mapping[str, float],
    reward_options: Mapping[str, Mapping[str, Any]] | None = None,
    failed: list[str] | None = None,
    /,
    **sample: Any,
) -> dict[str, float]:
    """Return each named reward of `completion` and their weighted sum under the key "total".

    Every reward in `weights` is computed, zero weights included, so logs show it. The sample's
    fields go to every reward as keywords, and a reward's `reward_options` (checked by check_reward_options)
    to it alone; InputError names a field a reward needs and lacks, a field that shadows an option, or a
    reward that returned NaN or infinity. A PhysReasonError a reward raises (the sample's reference is bad) goes
    on. Any other exception is the completion's doing (model output is untrusted) and never stops a step: that
    reward is 0 for this completion, its name is appended to `failed`, and the first such error of each reward
    and exception type is logged as a warning.
    """
    # The first three parameters are positional-only so that a sample field of any name (multiple-choice
    # samples carry `options`) lands in `sample`.
    reward_options = reward_options or {}
    if "completion" in sample:
        raise InputError(
            "a sample field is named 'completion', the name of the text each reward scores; rename it in the data "
            "records"
        )
    values: dict[str, float] = {}
    for name in weights:
        fn = get_reward(name)
        missing = _missing_fields(fn, sample)
        if missing:
            raise InputError(
                f"Reward {name!r} needs sample field(s) {missing}; the sample has {sorted(sample)}. "
                "Add them to the data records or drop the reward from the weights."
            )
        options = reward_options.get(name, {})
        validator = _OPTIONS.get(name)
        # An option is the run's (grpo.reward_options), never a sample's: a sample field of an option's name would
        # change how this one sample is scored, set or not in the recipe.
        shadowed = sorted(set(_option_defaults(validator) if validator else options) & set(sample))
        if shadowed:
            raise InputError(
                f"Reward {name!r}: sample field(s) {shadowed} have the names of its options, which only "
                "grpo.reward_options sets; rename or remove those fields in the data records"
            )
        try:
            value = float(fn(completion, **sample, **options))
        except PhysReasonError:
            raise
        except Exception as exc:
            value = 0.0
            if failed is not None:
                failed.append(name)
            if (name, type(exc).__name__) not in _WARNED:
                _WARNED.add((name, type(exc).__name__))
                log.warning(
                    "reward %r raised %s: %s on the completion %s; it scores 0 (later errors like it are counted, "
                    "not logged)",
                    name,
                    type(exc).__name__,
                    _preview(str(exc), 200),
                    _preview(completion),
                )
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
