"""Model families are read from the checkpoint's config (model_type, else architectures), never from its name."""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoConfig, Qwen2Config

from physreason.config import ModelConfig
from physreason.errors import ConfigError
from physreason.models import loading
from physreason.models.family import FAMILIES, VisionTokens, model_family, read_vision_tokens
from physreason.models.kinds import TINY_KINDS, VISION_LANGUAGE_KINDS


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_every_tiny_architecture_is_a_supported_family(tiny_model_dirs, kind):
    family = model_family(AutoConfig.from_pretrained(tiny_model_dirs[kind]))
    assert family.name == kind
    assert family.is_vision_language == (kind in VISION_LANGUAGE_KINDS)


def test_qwen3_vl_family_writes_video_time_as_text(tiny_model_dirs):
    for kind in ("qwen3_vl", "qwen3_vl_moe"):
        tokens = read_vision_tokens(AutoConfig.from_pretrained(tiny_model_dirs[kind]))
        assert tokens.video_frame_spans
        assert model_family(AutoConfig.from_pretrained(tiny_model_dirs[kind])).processor.patch_size == 16
    assert not read_vision_tokens(AutoConfig.from_pretrained(tiny_model_dirs["qwen2_5_vl"])).video_frame_spans


def test_vision_tokens_are_the_configs_ids_and_merge_size(tiny_model_dir):
    config = AutoConfig.from_pretrained(tiny_model_dir)
    tokens = read_vision_tokens(config)
    assert tokens == VisionTokens(
        config.image_token_id, config.video_token_id, config.vision_config.spatial_merge_size,
        float(config.vision_config.tokens_per_second),
    )


def test_text_family_has_no_vision_tokens(tiny_model_dirs):
    assert read_vision_tokens(AutoConfig.from_pretrained(tiny_model_dirs["qwen3"])) is None


def test_family_ignores_the_checkpoint_name(tiny_model_dirs, tmp_path):
    # A folder named like a vision-language model is still the text model its config says it is.
    folder = shutil.copytree(tiny_model_dirs["qwen2"], tmp_path / "Cosmos-Reason1-7B-VL")
    family = model_family(loading.load_model_config(ModelConfig(model_name_or_path=str(folder))))
    assert family.name == "qwen2" and not family.is_vision_language


def test_architectures_name_the_family_when_model_type_is_unknown():
    config = Qwen2Config()
    config.model_type = "my_finetune"
    config.architectures = ["Qwen2ForCausalLM"]
    assert model_family(config).name == "qwen2"


def test_unsupported_architecture_names_itself_and_the_supported_families(tiny_model_dirs, tmp_path):
    folder = shutil.copytree(tiny_model_dirs["qwen2"], tmp_path / "llama")
    raw = json.loads((folder / "config.json").read_text())
    raw.update(model_type="llama", architectures=["LlamaForCausalLM"])
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as error:
        loading.load_model(ModelConfig(model_name_or_path=str(folder), dtype="float32"))
    message = str(error.value)
    assert "'llama'" in message and "LlamaForCausalLM" in message and str(folder) in message
    assert all(family.name in message for family in FAMILIES)
