"""The reward registry and the weighted reward sum."""

from __future__ import annotations

import pytest

from physreason.errors import ConfigError, InputError
from physreason.rewards import (
    accuracy_reward,
    check_reward_options,
    compute_rewards,
    format_reward,
    get_reward,
    registry,
)

GOOD = "<think>\nx\n</think>\n\n<answer>\nB\n</answer>"


@pytest.fixture
def isolated_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rewards registered inside a test vanish after it."""
    monkeypatch.setattr(registry, "_REWARDS", dict(registry._REWARDS))


def test_builtin_rewards_are_registered_under_cosmos_rl_names() -> None:
    assert get_reward("format") is format_reward
    assert get_reward("accuracy") is accuracy_reward
    assert get_reward("single_choice") is accuracy_reward


def test_unknown_reward_error_names_it_and_the_registered_ones() -> None:
    registered = "accuracy, box_iou, format, json_format, localization, point_in_box, single_choice"
    with pytest.raises(ConfigError, match=rf"'formatt'.*{registered}"):
        get_reward("formatt")


def test_compute_rewards_reports_each_reward_and_the_weighted_total() -> None:
    values = compute_rewards(GOOD, {"format": 0.5, "accuracy": 2.0}, answer="B")
    assert values == {"format": 1.0, "accuracy": 2.0 / 2.0, "total": 0.5 + 2.0}


def test_compute_rewards_computes_zero_weight_rewards_for_logging() -> None:
    values = compute_rewards(GOOD + " trailing", {"format": 0.0, "accuracy": 1.0}, answer="C")
    assert values == {"format": 0.0, "accuracy": 0.0, "total": 0.0}


def test_compute_rewards_names_a_missing_sample_field() -> None:
    with pytest.raises(InputError, match=r"'accuracy' needs sample field\(s\) \['answer'\]"):
        compute_rewards(GOOD, {"accuracy": 1.0}, options=["a", "b"])


def test_compute_rewards_rejects_unknown_reward_names() -> None:
    with pytest.raises(ConfigError, match="'lenght'"):
        compute_rewards(GOOD, {"lenght": 1.0})


@pytest.mark.usefixtures("isolated_registry")
def test_registered_custom_reward_joins_the_sum() -> None:
    @registry.register_reward("short")
    def short_reward(completion: str, **sample: object) -> float:
        return 1.0 if len(completion) < 100 else 0.0

    assert get_reward("short") is short_reward
    assert compute_rewards(GOOD, {"short": 3.0, "format": 1.0})["total"] == 4.0


@pytest.mark.usefixtures("isolated_registry")
@pytest.mark.parametrize("name", ["format", "total"])
def test_register_reward_refuses_taken_or_reserved_names(name: str) -> None:
    with pytest.raises(ConfigError, match=repr(name)):
        registry.register_reward(name)(format_reward)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_reward_that_returns_a_non_finite_value_is_an_error_naming_it(isolated_registry, bad: float) -> None:
    @registry.register_reward("broken")
    def broken_reward(completion: str, **sample: object) -> float:
        return bad

    with pytest.raises(InputError, match=r"Reward 'broken' \(.*broken_reward\) returned (nan|inf|-inf) for the completion"):
        compute_rewards(GOOD, {"accuracy": 1.0, "broken": 0.5}, answer="B")


@pytest.mark.parametrize(
    ("weights", "options", "message"),
    [
        ({"localization": 1.0}, {"localizaton": {"hit_weight": 1.0}}, r"Unknown reward 'localizaton'"),
        ({"box_iou": 1.0}, {"localization": {"hit_weight": 1.0}}, r"reward 'localization', which .* \(box_iou\)"),
        ({"format": 1.0}, {"format": {"hit_weight": 1.0}}, r"reward_options.format: reward 'format' takes no options"),
        ({"localization": 1.0}, {"localization": {"hit_wieght": 1.0}}, r"\['hit_wieght'\]; .* hit_threshold, hit_weight"),
        ({"localization": 1.0}, {"localization": {"hit_weight": 2.0}}, r"hit_weight = 2.0: give a value in \[0, 1\]"),
    ],
)
def test_check_reward_options_names_the_reward_and_the_option_at_fault(weights, options, message) -> None:
    with pytest.raises(ConfigError, match=message):
        check_reward_options(weights, options)


def test_check_reward_options_accepts_the_iou_rewards_options() -> None:
    check_reward_options({"localization": 1.0, "json_format": 0.1}, {"localization": {"hit_weight": 0.5}})
    check_reward_options({"accuracy": 1.0}, {})


@pytest.mark.usefixtures("isolated_registry")
def test_register_reward_refuses_options_its_function_does_not_take_with_the_same_default() -> None:
    def shaping(*, bonus: float = 0.0) -> None:
        """Validator of the option `bonus`."""

    with pytest.raises(ConfigError, match=r"option 'bonus' must be a keyword-only parameter .* default 0.0"):
        registry.register_reward("no_bonus", options=shaping)(lambda completion, **sample: 1.0)

    def other_default(completion: str, *, bonus: float = 1.0, **sample: object) -> float:
        return bonus

    with pytest.raises(ConfigError, match="'bonus'"):
        registry.register_reward("other_default", options=shaping)(other_default)

    def with_bonus(completion: str, *, bonus: float = 0.0, **sample: object) -> float:
        return bonus

    registry.register_reward("with_bonus", options=shaping)(with_bonus)
    assert compute_rewards(GOOD, {"with_bonus": 2.0}, {"with_bonus": {"bonus": 0.25}})["total"] == 0.5
    # a sample field must not pass for an option
    with pytest.raises(InputError, match=r"'with_bonus': sample field\(s\) \['bonus'\]"):
        compute_rewards(GOOD, {"with_bonus": 1.0}, {"with_bonus": {"bonus": 0.25}}, bonus=0.5)


def test_a_sample_field_named_as_a_reward_option_or_completion_is_refused_not_applied() -> None:
    """Options are the run's: a sample's `hit_threshold` must not rescore that one sample, whether or not the
    recipe sets the option; a `completion` field would make every reward raise (multiple values) and score 0."""
    box = '[{"box_2d": [0, 0, 100, 100]}]'
    half = '[{"box_2d": [0, 0, 100, 50]}]'
    assert compute_rewards(half, {"box_iou": 1.0}, answer=box)["box_iou"] == pytest.approx(0.5)
    with pytest.raises(InputError, match=r"'box_iou'.*\['hit_threshold'\].*grpo.reward_options"):
        compute_rewards(half, {"box_iou": 1.0}, answer=box, hit_threshold=0.1)
    with pytest.raises(InputError, match="named 'completion'"):
        compute_rewards(GOOD, {"accuracy": 1.0}, answer="B", completion="B")
    # a reward without options still gets any other field
    assert compute_rewards(GOOD, {"accuracy": 1.0}, answer="B", hit_threshold=0.1)["accuracy"] == 1.0
