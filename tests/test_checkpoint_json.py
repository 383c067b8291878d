"""A checkpoint's small JSON files (config.json, preprocessor_config.json, adapter_config.json) are read before any
model loads; a malformed one is one ConfigError naming the file and the key, never a traceback from int() or .get()."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from physreason.errors import ConfigError
from physreason.models.inputs import checkpoint_family, load_processor_params
from physreason.models.lora import read_adapter_config

pytestmark = pytest.mark.timeout(60)


def model_folder(tmp_path: Path, preprocessor: object | None = None, config: object | None = None) -> Path:
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    config = {"model_type": "qwen3_vl", "architectures": ["Qwen3VLForConditionalGeneration"]} if config is None else config
    (folder / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if preprocessor is not None:
        text = preprocessor if isinstance(preprocessor, str) else json.dumps(preprocessor)
        (folder / "preprocessor_config.json").write_text(text)
    return folder


def test_a_well_formed_preprocessor_config_is_read_and_absent_keys_take_the_family_defaults(tmp_path):
    params = load_processor_params(str(model_folder(tmp_path, {"patch_size": 16.0, "image_mean": [0.1, 0.2, 0.3]})))
    assert (params.patch_size, params.merge_size, params.temporal_patch_size) == (16, 2, 2)
    assert params.image_mean == (0.1, 0.2, 0.3) and params.image_std == (0.5, 0.5, 0.5)
    assert params.video_timestamps_as_text  # Qwen3-VL's layout, from config.json


@pytest.mark.parametrize(
    ("preprocessor", "message"),
    [
        ({"patch_size": "16"}, r"patch_size = '16' is not a positive whole number"),
        ({"patch_size": [16]}, r"patch_size = \[16\]"),
        ({"merge_size": 0}, r"merge_size = 0"),
        ({"temporal_patch_size": True}, r"temporal_patch_size = True"),
        ({"patch_size": 1.5}, r"patch_size = 1.5"),
        ({"image_mean": [0.5, 0.5]}, r"image_mean = \[0.5, 0.5\] is not three finite numbers"),
        ({"image_std": [0.5, 0, 0.5]}, r"image_std .* above 0"),
        ({"image_std": "0.5"}, r"image_std = '0.5'"),
        ("[1, 2]", "holds a JSON list, not an object"),
        ('{"patch_size": 16', "is not valid JSON"),
        ("[" * 100_000, "nests deeper"),
    ],
)
def test_a_malformed_preprocessor_config_is_one_error_naming_the_file_and_key(tmp_path, preprocessor, message):
    folder = model_folder(tmp_path, preprocessor)
    with pytest.raises(ConfigError, match=message) as error:
        load_processor_params(str(folder))
    assert "preprocessor_config.json" in str(error.value)


def test_a_preprocessor_config_that_is_not_utf8_is_named(tmp_path):
    folder = model_folder(tmp_path)
    (folder / "preprocessor_config.json").write_bytes(b'{"patch_size": 16, "x": "\xff"}')
    with pytest.raises(ConfigError, match="preprocessor_config.json is not UTF-8"):
        load_processor_params(str(folder))


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("[]", "holds a JSON list, not an object"),
        ('{"model_type": ', "is not valid JSON"),
        ({"model_type": ["qwen3_vl"]}, r"model_type \['qwen3_vl'\] is not a name"),
        ({"model_type": None, "architectures": 7}, "architectures 7 is not a list of class names"),
        ({"model_type": "llama"}, "not a supported model family"),
    ],
)
def test_a_malformed_config_json_is_one_error_naming_the_file(tmp_path, config, message):
    folder = model_folder(tmp_path, config=config)
    with pytest.raises(ConfigError, match=message):
        checkpoint_family(str(folder))
    with pytest.raises(ConfigError, match=message):
        load_processor_params(str(folder))


@pytest.mark.parametrize(
    ("adapter", "message"),
    [
        ("[]", "holds a JSON list, not an object"),
        ('{"peft_type": "LORA", "r": 8', "is not valid JSON"),
        ({"peft_type": "LORA"}, r"the LoRA rank r = None"),
        ({"peft_type": "LORA", "r": "8"}, r"the LoRA rank r = '8'"),
        ({"peft_type": "LORA", "r": 0}, r"the LoRA rank r = 0"),
        ({"peft_type": "IA3", "r": 8}, "describes a 'IA3' adapter"),
    ],
)
def test_a_malformed_adapter_config_is_one_error_naming_the_file(tmp_path, adapter, message):
    (tmp_path / "adapter_config.json").write_text(adapter if isinstance(adapter, str) else json.dumps(adapter))
    with pytest.raises(ConfigError, match=message) as error:
        read_adapter_config(tmp_path)
    assert "adapter_config.json" in str(error.value)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    assert read_adapter_config(tmp_path)["r"] == 8


def test_the_start_up_summary_says_unknown_and_the_prompt_style_error_suggests_setting_it(tmp_path):
    from physreason.config import load_config
    from physreason.models.inputs import prompting_for
    from physreason.startup import describe_family

    folder = model_folder(tmp_path, config={"model_type": ["qwen3_vl"]})
    config = load_config(None, [f'model.model_name_or_path="{folder}"'])
    assert describe_family(config.model) == "unknown"
    with pytest.raises(ConfigError, match=r"is not a name.*set prompt.style"):
        prompting_for(config)
    assert prompting_for(load_config(None, [f'model.model_name_or_path="{folder}"', 'prompt.style="reason2"']))
