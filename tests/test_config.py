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


def test_a_cosmos_rl_save_mode_ports_and_an_unknown_one_names_the_allowed_ones(tmp_path):
    assert load_config(write(tmp_path, '[train.ckpt]\nsave_mode = "async"\n')).train.ckpt.save_mode == "async"
    with pytest.raises(ConfigError, match=r"train.ckpt.save_mode: Input should be 'sync' or 'async' \(got 'background'\)"):
        load_config(write(tmp_path, '[train.ckpt]\nsave_mode = "background"\n'))


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
        ["train.epoch=5", "train.optm_lr=2e-6", "model.model_name_or_path=/models/x", "logging.logger=['jsonl']"],
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
        ("grpo.reward_function.accuracy.x=1", "grpo.reward_function.accuracy is a value, not a section"),
        ("grpo.reward_function.accuracy=high", r"grpo.reward_function.accuracy: .*number.*'high'"),
        (
            "grpo.reward_functions.accuracy=2",
            r"grpo.reward_functions: unknown key.*Allowed keys in \[grpo\]:.*reward_function",
        ),
    ],
)
def test_bad_override_is_explained(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [override])


def test_dotted_override_changes_one_entry_of_a_dict_field():
    config = load_config(None, ["grpo.reward_function.accuracy=2", "engine.limit_mm_per_prompt.video=2"])
    assert config.grpo.reward_function == {"accuracy": 2.0, "format": 1.0}
    assert config.engine.limit_mm_per_prompt == {"image": 4, "video": 2}


def test_dotted_override_merges_into_the_files_table(tmp_path):
    path = write(tmp_path, "[grpo]\nreward_function = { accuracy = 1.0, format = 0.5 }\n")
    config = load_config(path, ["grpo.reward_function.accuracy=2"])
    assert config.grpo.reward_function == {"accuracy": 2.0, "format": 0.5}


def test_table_replaces_a_dict_field_whole(tmp_path):
    assert load_config(None, ["grpo.reward_function={accuracy = 3}"]).grpo.reward_function == {"accuracy": 3.0}
    path = write(tmp_path, "[grpo.reward_function]\naccuracy = 1.0\n")
    assert load_config(path).grpo.reward_function == {"accuracy": 1.0}
    assert load_config(path, ["grpo.reward_function.format=0.5"]).grpo.reward_function == {
        "accuracy": 1.0,
        "format": 0.5,
    }


@pytest.mark.parametrize(
    "recipe, overrides",
    [
        ("", ["rollout.sampling_config.top_k=5"]),
        ("", ["rollout={sampling_config = {top_k = 5}}"]),
        ("[rollout.sampling_config]\ntop_k = 5\n", []),
    ],
    ids=["dotted-override", "table-override", "file-table"],
)
def test_section_keeps_its_own_defaults_for_keys_not_named(tmp_path, recipe, overrides):
    # rollout.sampling_config's defaults (temperature 1.0, no repetition penalty) are not SamplingConfig's
    # class defaults (0.6, 1.05); naming one key must not swap the others for the class's.
    sampling = load_config(write(tmp_path, recipe), overrides).rollout.sampling_config
    assert (sampling.top_k, sampling.temperature, sampling.top_p, sampling.repetition_penalty) == (5, 1.0, 1.0, 1.0)


def test_override_fills_an_optional_section_left_at_none():
    config = load_config(None, ["data.val_dataset.name=held_out.jsonl"])
    assert config.data.val_dataset is not None
    assert (config.data.val_dataset.name, config.data.val_dataset.split) == ("held_out.jsonl", "train")


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


@pytest.mark.parametrize(
    ("low", "high", "values"),
    [("min_frames", "max_frames", (8, 4)), ("min_pixels", "max_pixels", (5000, 4000)),
     ("image_min_pixels", "image_max_pixels", (5000, 4000))],
)  # fmt: skip
def test_vision_lower_bounds_must_not_exceed_their_upper_bounds(low, high, values):
    with pytest.raises(ConfigError, match=rf"{low} \({values[0]}\) must not exceed {high} \({values[1]}\)"):
        load_config(None, [f"vision.{low}={values[0]}", f"vision.{high}={values[1]}"])
    load_config(None, [f"vision.{low}={values[1]}", f"vision.{high}={values[1]}"])  # equal bounds are allowed


def test_parse_override_keeps_bare_words_as_strings():
    assert parse_override("model.dtype=float32") == (["model", "dtype"], "float32")
    assert parse_override("train.resume=true") == (["train", "resume"], True)
    # JSON reads these too, but only a JSON table or list is taken as JSON
    for word in ("null", "NaN", "Infinity"):
        assert parse_override(f"model.revision={word}") == (["model", "revision"], word)
    assert parse_override('grpo.reward_function={"accuracy": 1.0}') == (["grpo", "reward_function"], {"accuracy": 1.0})
    assert parse_override('data.tasks=["a", "b"]') == (["data", "tasks"], ["a", "b"])


def test_dump_then_load_round_trips(tmp_path):
    config = load_config(None, ["train.optm_lr=3e-6", "grpo.kl_beta=0.01"])
    dump_config(config, tmp_path / "resolved.toml")
    assert load_config(tmp_path / "resolved.toml") == config


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_recipe_loads(path):
    assert isinstance(load_config(path), Config)


def test_recipes_are_shipped():
    assert len(CONFIGS) >= 2


def test_typed_values_reach_the_config_without_a_round_trip_through_text():
    # A path outside the Basic Multilingual Plane: as a JSON-escaped "k=v" string it was not valid TOML
    # and reached the config with its quotes and escapes.
    path = "/data/models/run-\U0001f680/ckpt"
    config = load_config(None, ["train.optm_lr=2e-6"], {"model.model_name_or_path": path, "eval.datasets": ["a b", "c"]})
    assert config.model.model_name_or_path == path
    assert config.eval.datasets == ["a b", "c"] and config.train.optm_lr == 2e-6


def test_a_bad_typed_value_names_its_key():
    with pytest.raises(ConfigError, match="eval.num_gpus"):
        load_config(None, values={"eval.num_gpus": 0})


def test_packed_policy_rows_need_an_attention_kernel_that_takes_a_mask():
    packed = load_config(None, ["grpo.pack_completions=true", "grpo.mini_batch_tokens=4096"])
    assert packed.grpo.pack_completions and packed.grpo.mini_batch_tokens == 4096
    with pytest.raises(ConfigError, match="pack_completions needs a 4D attention mask.*flash_attention_2"):
        load_config(None, ["grpo.pack_completions=true", "model.attn_implementation='flash_attention_2'"])


def test_policy_rows_are_packed_unless_the_kernel_is_flash_or_packing_is_turned_off():
    assert load_config(None).packs_completions  # the default: sdpa, packed rows
    # A flash recipe (the SFT ones) still loads; its GRPO update, if any, uses padded rows.
    assert not load_config(None, ["model.attn_implementation='flash_attention_2'"]).packs_completions
    assert not load_config(None, ["grpo.pack_completions=false"]).packs_completions
    assert load_config(None, ["grpo.pack_completions=true", "model.attn_implementation='eager'"]).packs_completions


def test_kv_cache_memory_is_profiled_unless_a_positive_size_is_given():
    assert load_config(None).engine.kv_cache_memory_gib is None
    assert load_config(None, ["engine.kv_cache_memory_gib=2"]).engine.kv_cache_memory_gib == 2.0
    with pytest.raises(ConfigError, match="engine.kv_cache_memory_gib"):
        load_config(None, ["engine.kv_cache_memory_gib=0"])


def test_kv_cache_dtype_is_auto_unless_set_and_a_bad_value_names_the_key_and_the_choices(tmp_path):
    assert load_config(None).engine.kv_cache_dtype == "auto"
    assert load_config(write(tmp_path, '[engine]\nkv_cache_dtype = "fp8"\n')).engine.kv_cache_dtype == "fp8"
    with pytest.raises(ConfigError) as error:
        load_config(None, ["engine.kv_cache_dtype=fp16"])
    message = str(error.value)
    assert "\n" not in message and "engine.kv_cache_dtype: Input should be 'auto' or 'fp8' (got 'fp16')" in message


def test_dump_config_stopped_mid_write_leaves_the_old_file_whole(tmp_path, monkeypatch):
    # A resumed eval compares its settings with the stored config.toml: a kill while it is rewritten must not cut it.
    path = tmp_path / "config.toml"
    dump_config(load_config(None, ["generation.max_tokens=9"]), path)
    before = path.read_text()

    def killed(fd: int) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("os.fsync", killed)
    with pytest.raises(KeyboardInterrupt):
        dump_config(load_config(None), path)
    assert path.read_text() == before
    assert load_config(path).generation.max_tokens == 9


def test_a_recipe_saved_with_a_byte_order_mark_loads(tmp_path):
    path = tmp_path / "recipe.toml"
    path.write_text("\ufeff[train]\noptm_lr = 3e-6\n", encoding="utf-8")
    assert load_config(path).train.optm_lr == 3e-6
