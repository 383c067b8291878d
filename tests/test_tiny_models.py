"""Tiny random models: real architectures, complete Hugging Face folders, exact save/load round trip."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

from physreason.config import SamplingConfig
from physreason.models.tiny import QWEN_SPECIAL_TOKENS, build_tiny_model, build_tiny_tokenizer


def test_tokenizer_has_qwen_special_tokens_as_single_ids():
    tok = build_tiny_tokenizer()
    for token in QWEN_SPECIAL_TOKENS:
        ids = tok(token, add_special_tokens=False).input_ids
        assert len(ids) == 1 and tok.convert_ids_to_tokens(ids[0]) == token


def test_tokenizer_round_trips_text():
    tok = build_tiny_tokenizer()
    text = "<think>\nThe ball falls, bounces twice and stops.\n</think>\n\n<answer>\nB\n</answer>"
    assert tok.decode(tok(text, add_special_tokens=False).input_ids) == text


def test_chat_template_is_qwen2_5_vl(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Forward or reversed?"}]}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>Forward or reversed?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_vl_folder_is_complete(tiny_model_dir):
    names = {p.name for p in tiny_model_dir.iterdir()}
    expected = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
                "preprocessor_config.json", "video_preprocessor_config.json", "chat_template.jinja"}
    assert expected <= names
    config = json.loads((tiny_model_dir / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert config["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    assert config["video_token_id"] == tok.convert_tokens_to_ids("<|video_pad|>")
    assert config["image_token_id"] == tok.convert_tokens_to_ids("<|image_pad|>")


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "qwen3_moe"])
def test_text_model_round_trip_gives_identical_logits(tiny_model_dirs, kind):
    folder = tiny_model_dirs[kind]
    tok = build_tiny_tokenizer()
    original = build_tiny_model(kind, tok, seed=0)
    loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert AutoConfig.from_pretrained(folder).model_type == kind
    ids = torch.tensor([tok("The ball falls and bounces.").input_ids])
    with torch.no_grad():
        assert torch.equal(original(ids).logits, loaded(ids).logits)


def test_vl_model_round_trip_gives_identical_logits_with_video(tiny_model_dir):
    tok = build_tiny_tokenizer()
    original = build_tiny_model("qwen2_5_vl", tok, seed=0)
    loaded = AutoModelForImageTextToText.from_pretrained(tiny_model_dir).eval()
    grid = torch.tensor([[2, 4, 4]])  # 4 frames -> 2 temporal patches of 4x4 patches (56x56 pixels)
    n_tokens = int(grid.prod()) // 4
    video_pad = tok.convert_tokens_to_ids("<|video_pad|>")
    ids = tok("<|im_start|>user\n<|vision_start|>", add_special_tokens=False).input_ids + [video_pad] * n_tokens
    ids += tok("<|vision_end|>Is it falling?<|im_end|>", add_special_tokens=False).input_ids
    torch.manual_seed(1)
    pixels = torch.randn(int(grid.prod()), 3 * 2 * 14 * 14)
    inputs = dict(input_ids=torch.tensor([ids]), pixel_values_videos=pixels, video_grid_thw=grid)
    with torch.no_grad():
        a = original(**inputs).logits
        b = loaded(**inputs).logits
    assert a.shape == (1, len(ids), len(tok))
    assert torch.equal(a, b)


def test_same_seed_same_weights_different_seed_different():
    tok = build_tiny_tokenizer()
    a = build_tiny_model("qwen2", tok, seed=3).state_dict()
    b = build_tiny_model("qwen2", tok, seed=3).state_dict()
    c = build_tiny_model("qwen2", tok, seed=4).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl"])
def test_a_longer_temporal_patch_reaches_the_processor_the_engine_and_the_policy_positions(kind, tmp_path):
    from media import write_clip

    from physreason.config import EngineConfig, ModelConfig, VisionConfig
    from physreason.engines.hf import HFEngine
    from physreason.infer import build_request
    from physreason.models.family import model_family
    from physreason.models.inputs import load_processor_params, patch_factor
    from physreason.models.tiny import save_tiny_model

    folder = save_tiny_model(kind, tmp_path / kind, temporal_patch_size=4)
    assert load_processor_params(str(folder)).temporal_patch_size == 4
    clip = write_clip(tmp_path / "clip.mp4", n_frames=24)  # 3 s at 8 fps: 12 frames at 4 fps
    vision = VisionConfig(fps=4.0, min_pixels=56 * 84, max_pixels=64 * 96)
    request = build_request("Forward or reversed?", videos=[clip], vision=vision, factor=patch_factor(str(folder)))
    engine = HFEngine(ModelConfig(model_name_or_path=str(folder), dtype="float32"), EngineConfig())
    ids, visuals = engine._encode(request)
    assert visuals.video_grid_thw[0, 0].item() == 3  # 12 frames in temporal patches of 4
    assert visuals.pixel_values_videos.shape[1] == 3 * 4 * engine.model.config.vision_config.patch_size ** 2
    (result,) = engine.generate([request], SamplingConfig(temperature=0.0, max_tokens=3))
    assert result.error is None and len(result.completions[0].token_ids) == 3
    # The policy's positions (SFT and GRPO) are transformers' own for this layout.
    input_ids = torch.tensor(ids)
    ours = model_family(engine.model.config).vision_tokens(engine.model.config).positions(input_ids, visuals)
    theirs, _ = engine.model.model.get_rope_index(
        input_ids[None], video_grid_thw=visuals.video_grid_thw, second_per_grid_ts=visuals.second_per_grid_ts,
        attention_mask=torch.ones_like(input_ids)[None], mm_token_type_ids=engine.mm_token_type_ids(input_ids[None]),
    )
    assert torch.equal(ours, theirs[:, 0])
