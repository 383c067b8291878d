"""Config loading: strict keys, typed values, overrides, and every shipped recipe."""

from __future__ import annotations

from pathlib import Path

import pytest

from physreason.config import Config, dump_config, load_config, parse_override
from physreason.errors import ConfigError

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.toml"))


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "recipe.toml"
    path.write_text(text)
    return path


def test_defaults_are_cosmos_reason1_sampling():
    config = load_config()
    assert (config.generation.temperature, config.generation.top_p) == (0.6, 0.95)
    assert (config.generation.repetition_penalty, config.generation.max_tokens) == (1.05, 4096)
    assert config.vision.fps == 4.0


def test_unknown_key_names_file_key_and_allowed_keys(tmp_path):
    path = write(tmp_path, "[train]\noptm_lr = 1e-5\noptim_lr = 2e-5\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert str(path) in message
    assert "train.optim_lr: unknown key" in message
    assert "optm_lr" in message and "[train]" in message


def test_unknown_section_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="redis: unknown key"):
        load_config(write(tmp_path, 'redis = "12800"\n'))


def test_cosmos_rl_key_points_to_its_new_home(tmp_path):
    path = write(tmp_path, '[policy]\nmodel_name_or_path = "x"\n')
    with pytest.raises(ConfigError, match="policy.model_name_or_path is called model.model_name_or_path here"):
        load_config(path)


def test_wrong_type_names_key_and_value(tmp_path):
    with pytest.raises(ConfigError, match=r"train.optm_lr: .*number.*'fast'"):
        load_config(write(tmp_path, '[train]\noptm_lr = "fast"\n'))


def test_out_of_range_value_is_rejected(tmp_path):
    with pytest.raises(ConfigError, match="generation.top_p"):
        load_config(write(tmp_path, "[generation]\ntop_p = 1.5\n"))


def test_invalid_toml_names_the_file(tmp_path):
    path = write(tmp_path, "[train\n")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_config(path)


def test_missing_file_says_so(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")


def test_overrides_are_typed_and_nested(tmp_path):
    config = load_config(
        write(tmp_path, "[train]\nepoch = 2\n"),
        ["train.epoch=5", "train.optm_lr=2e-6", 'model.model_name_or_path=/models/x', "logging.logger=['jsonl']"],
    )
    assert config.train.epoch == 5
    assert config.train.optm_lr == pytest.approx(2e-6)
    assert config.model.model_name_or_path == "/models/x"
    assert config.logging.logger == ["jsonl"]


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("train.epoch", "has no '='"),
        ("train..epoch=1", "empty key"),
        ("train.epoch.x=1", "is a value, not a section"),
        ("train.epoch=many", r"train.epoch: .*integer"),
        ("train.nope=1", "train.nope: unknown key"),
    ],
)
def test_bad_override_is_explained(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [override])


def test_one_temperature_serves_rollout_and_policy():
    config = load_config(None, ["rollout.sampling_config.temperature=0.9"])
    assert config.policy_temperature == 0.9
    with pytest.raises(ConfigError, match="train.train_policy.temperature.*rollout.sampling_config.temperature"):
        load_config(None, ["train.train_policy.temperature=0.7"])
    with pytest.raises(ConfigError, match="must be > 0"):
        load_config(None, ["rollout.sampling_config.temperature=0"])


def test_eval_gpus_must_divide_into_shards():
    with pytest.raises(ConfigError, match="multiple of tp_size"):
        load_config(None, ["eval.num_gpus=3", "eval.tp_size=2"])


def test_parse_override_keeps_bare_words_as_strings():
    assert parse_override("model.dtype=float32") == (["model", "dtype"], "float32")
    assert parse_override("train.resume=true") == (["train", "resume"], True)


def test_dump_then_load_round_trips(tmp_path):
    config = load_config(None, ["train.optm_lr=3e-6", "grpo.kl_beta=0.01"])
    dump_config(config, tmp_path / "resolved.toml")
    assert load_config(tmp_path / "resolved.toml") == config


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_recipe_loads(path):
    assert isinstance(load_config(path), Config)


def test_recipes_are_shipped():
    assert len(CONFIGS) >= 2
