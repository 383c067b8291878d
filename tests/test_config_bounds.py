"""Every number a recipe sets is bounded: a value no setting can take is one line naming its key (exit 2), whether it
comes from a TOML file or --set, never a traceback or a run that fails later (OverflowError, RecursionError)."""

from __future__ import annotations

import sys
import typing

import pytest
from pydantic import BaseModel

from physreason.cli.app import main
from physreason.config import Config, load_config
from physreason.errors import ConfigError

DIGITS_5000 = "9" * 5000
DIGITS_400 = "9" * 400
NESTED_1000 = "[" * 1000 + "]" * 1000


def run_main(monkeypatch, capsys, *args: str) -> tuple[int, str]:
    """`physreason ARGS` as typed, in this process: (exit code, stderr)."""
    monkeypatch.setattr(sys, "argv", ["physreason", *args])
    with pytest.raises(SystemExit) as exited:
        main()
    return exited.value.code, capsys.readouterr().err


@pytest.fixture
def recipe(tmp_path):
    path = tmp_path / "recipe.toml"
    path.write_text('[model]\nmodel_name_or_path = "nowhere/model"\n')
    return path


@pytest.mark.parametrize(
    ("override", "key", "why"),
    [
        (f"train.max_steps={DIGITS_5000}", "train.max_steps", "a number of more than 4300 digits"),
        ('grpo.reward_function={"a": ' + DIGITS_5000 + "}", "grpo.reward_function", "more than 4300 digits"),
        (f"train.max_steps={DIGITS_400}", "train.max_steps", "integers here must lie between -(2**63 - 1) and 2**63 - 1"),
        ("train.optm_lr=Infinity", "train.optm_lr", "Input should be a finite number"),
        ("train.optm_lr=inf", "train.optm_lr", "Input should be a finite number"),
        (f"grpo.reward_function={NESTED_1000}", "grpo.reward_function", "nested more than 32 deep"),
        ("grpo.reward_function=" + '{"a": ' * 1000 + "1" + "}" * 1000, "grpo.reward_function", "nested more than 32"),
        ("train.seed=-1", "train.seed", "greater than or equal to 0"),
    ],
)
@pytest.mark.parametrize("command", ["config show", "sft --config"])
def test_an_unusable_number_given_with_set_is_one_line_naming_the_key(monkeypatch, capsys, recipe, command, override,
                                                                       key, why):
    args = [*command.split(), *([str(recipe)] if command.endswith("--config") else []), "--set", override]
    code, err = run_main(monkeypatch, capsys, *args)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err
    assert f"{key}: " in err or f"{key} holds" in err
    assert why in err and len(err) < 600


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        (f"[train]\nmax_steps = {DIGITS_400}\n", "train.max_steps: integers here must lie between"),
        (f"[train]\n\nmax_steps = {DIGITS_5000}\n", "recipe.toml at line 3 holds a number of more than 4300 digits"),
        ("[train]\noptm_lr = inf\n", "train.optm_lr: Input should be a finite number (got inf)"),
        ("[train]\noptm_lr = nan\n", "train.optm_lr: Input should be a finite number (got nan)"),
        (f"[grpo]\nreward_function = {NESTED_1000}\n", "recipe.toml at line 2 holds lists or tables nested more than 32"),
        ("[grpo]\nreward_function = " + "[" * 40 + "]" * 40 + "\n", "recipe.toml: grpo.reward_function holds lists"),
    ],
)
@pytest.mark.parametrize("command", ["config show", "sft --config"])
def test_an_unusable_number_in_a_toml_recipe_is_one_line_naming_the_key(monkeypatch, capsys, tmp_path, command, toml,
                                                                        message):
    path = tmp_path / "recipe.toml"
    path.write_text(toml)
    code, err = run_main(monkeypatch, capsys, *command.split(), str(path))
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err and len(err) < 600


def _numeric_settings(model: type[BaseModel], prefix: str = "") -> list[tuple[str, object]]:
    """(dotted key, a value past every bound) for each number-valued setting of the schema."""
    found = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        types = [field.annotation, *typing.get_args(field.annotation)]
        section = next((t for t in types if isinstance(t, type) and issubclass(t, BaseModel)), None)
        if section is not None:
            found += _numeric_settings(section, f"{key}.")
        elif float in types:
            found.append((key, float("inf")))
        elif int in types:
            found.append((key, 2**63))
        elif typing.get_origin(field.annotation) is tuple:
            found.append((key, (0.5, float("inf"))))
        elif typing.get_origin(field.annotation) is dict:
            inner = typing.get_args(field.annotation)[1]
            value = {"x": 2**63} if inner is int else {"x": float("inf")} if inner is float else {"x": {"y": float("inf")}}
            found.append((key, value))
    return found


def test_every_numeric_setting_refuses_an_overflowing_or_infinite_value():
    settings = _numeric_settings(Config)
    assert {"train.max_steps", "train.optm_lr", "train.optm_betas", "engine.limit_mm_per_prompt",
            "grpo.reward_options", "vision.fps", "train.ckpt.upload_wait_s"} <= {key for key, _ in settings}
    for key, value in settings:
        with pytest.raises(ConfigError, match=rf"{key}(\.\w+)*: ") as refused:
            load_config(None, values={key: value})
        assert "\n" not in str(refused.value)


def test_the_largest_64_bit_values_still_load():
    config = load_config(None, [f"train.max_steps={2**63 - 1}", "train.optm_lr=1e30", f"train.seed={2**32 - 1}"])
    assert config.train.max_steps == 2**63 - 1 and config.train.optm_lr == 1e30
