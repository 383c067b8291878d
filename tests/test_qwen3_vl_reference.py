"""Qwen3-VL inputs against transformers' own code: image pixels, video patch layout, the timestamped video
text, the 3D positions (get_rope_index) and the log-probabilities of a video prompt.

transformers' Qwen3-VL video processor needs torchvision (absent on CPU) to resize and normalise, so videos
are checked piece by piece with transformers' own functions: its patchify on the same normalised frames, its
processor's `replace_video_token` + `get_text_with_replacements` for the prompt text (the processor is built
with the class check that wants torchvision switched off), and the model's forward for positions and
log-probabilities.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from fixtures.vision.media import frame_pattern
from media import write_clip
from PIL import Image

from physreason.config import ModelConfig, VisionConfig
from physreason.data.sft import SFTDataset
from physreason.models import loading
from physreason.models.family import read_vision_tokens
from physreason.models.inputs import encode_visuals, load_processor_params
from physreason.models.qwen3_vl import frame_group_seconds, qwen3_vl_position_ids
from physreason.vision import load_image, load_video, patchify


@pytest.fixture(scope="module")
def qwen3_dir(tiny_model_dirs) -> Path:
    return tiny_model_dirs["qwen3_vl"]


@pytest.fixture(scope="module")
def params(qwen3_dir):
    return load_processor_params(str(qwen3_dir))


@pytest.fixture(scope="module")
def hf_processor(qwen3_dir, params):
    """transformers' Qwen3VLProcessor around the tiny model's tokenizer and processors (no torchvision needed)."""
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.processing_utils import ProcessorMixin

    tokenizer = AutoTokenizer.from_pretrained(qwen3_dir)
    image_processor = AutoImageProcessor.from_pretrained(qwen3_dir)
    video_processor = Qwen3VLVideoProcessor(
        patch_size=params.patch_size, image_mean=list(params.image_mean), image_std=list(params.image_std)
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, argument: None)
        return Qwen3VLProcessor(image_processor, tokenizer, video_processor, chat_template=tokenizer.chat_template)


def test_tiny_qwen3_vl_declares_its_family_in_config_and_processor(qwen3_dir, params):
    config = loading.load_model_config(ModelConfig(model_name_or_path=str(qwen3_dir)))
    assert config.model_type == "qwen3_vl"
    assert (params.patch_size, params.merge_size, params.temporal_patch_size) == (16, 2, 2)
    assert params.image_mean == (0.5, 0.5, 0.5) and params.video_timestamps_as_text
    assert params.factor == 32


@pytest.mark.parametrize(("height", "width", "min_tokens", "max_tokens"), [(333, 517, 4, 64), (40, 60, 16, 64)])
def test_image_pixel_values_identical_to_transformers_processor(
    tmp_path: Path, params, height: int, width: int, min_tokens: int, max_tokens: int
):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    path = tmp_path / "photo.png"
    Image.fromarray(frame_pattern(3, height, width)).save(path)
    min_pixels, max_pixels = min_tokens * 32 * 32, max_tokens * 32 * 32
    config = VisionConfig(image_min_pixels=min_pixels, image_max_pixels=max_pixels)
    pixels, grid = patchify(load_image(path, config, params.factor), 16, mean=params.image_mean, std=params.image_std)

    reference = Qwen2VLImageProcessorPil(
        patch_size=16, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3, min_pixels=min_pixels, max_pixels=max_pixels
    )
    with Image.open(path) as original:
        expected = reference(images=[original], return_tensors="pt")
    assert list(grid) == expected["image_grid_thw"][0].tolist()
    assert torch.equal(pixels, expected["pixel_values"])


def test_image_defaults_are_qwen_vl_utils_budgets_at_patch_factor_32(tmp_path: Path, params):
    path = tmp_path / "big.png"
    Image.fromarray(frame_pattern(1, 4000, 4000)).save(path)
    image = load_image(path, VisionConfig(), params.factor)
    assert image.shape[0] % 32 == 0 and image.shape[1] % 32 == 0
    assert image.shape[0] * image.shape[1] <= 16384 * 32 * 32


def test_video_patches_match_transformers_patchify(tmp_path: Path, params, hf_processor):
    clip = write_clip(tmp_path / "clip.mp4", n_frames=12, fps=6, size=(100, 150))
    video = load_video(clip, VisionConfig(fps=3, min_pixels=4 * 32 * 32, max_pixels=12 * 32 * 32), params.factor)
    assert video.frames.shape[1] % 32 == 0 and video.frames.shape[2] % 32 == 0
    visuals = encode_visuals(videos=[video], params=params)

    frames = torch.from_numpy(video.frames).permute(0, 3, 1, 2)[None].float()  # [1, T, 3, H, W]
    normalised = (frames / 255 - 0.5) / 0.5
    expected, grid_t, grid_h, grid_w = hf_processor.video_processor.patchify(normalised, 16, 2, 2)
    assert visuals.video_grid_thw[0].tolist() == [grid_t, grid_h, grid_w]
    torch.testing.assert_close(visuals.pixel_values_videos, expected[0], rtol=0, atol=1e-6)
    assert visuals.second_per_grid_ts is None  # Qwen3-VL's forward takes no seconds: time is in the text


def test_frame_group_seconds_follow_transformers_timestamps(hf_processor):
    indices = [0, 7, 15, 22, 30]  # odd count: padded with the last index, as the processor does
    expected = hf_processor._calculate_timestamps(list(indices), 29.97, 2)
    assert frame_group_seconds(indices, 29.97, 2) == pytest.approx(expected)


def test_video_prompt_text_identical_to_transformers_processor(tmp_path: Path, params, hf_processor):
    from transformers.video_utils import VideoMetadata

    clip = write_clip(tmp_path / "clip.mp4", n_frames=20, fps=8, size=(64, 96))
    video = load_video(clip, VisionConfig(fps=3, min_pixels=4 * 32 * 32, max_pixels=8 * 32 * 32), params.factor)
    image = np.asarray(Image.fromarray(frame_pattern(2, 64, 64)))
    visuals = encode_visuals(images=[image], videos=[video], params=params)
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": [{"type": "video"}, {"type": "image"}, {"type": "text", "text": "What falls?"}]},
    ]
    text = hf_processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    metadata = VideoMetadata(
        total_num_frames=video.source_num_frames, fps=video.source_fps, frames_indices=list(video.indices)
    )
    video_inputs = {"video_grid_thw": visuals.video_grid_thw, "video_metadata": [metadata]}
    image_inputs = {"image_grid_thw": visuals.image_grid_thw}
    replacements = (
        [hf_processor.replace_image_token(image_inputs, 0)],
        [hf_processor.replace_video_token(video_inputs, 0)],
    )
    (expected,), _ = hf_processor.get_text_with_replacements([text], *replacements)

    ours = visuals.expand(text)
    assert ours == expected
    assert ours.count("seconds>") == video.frames.shape[0] // 2


@pytest.fixture(scope="module")
def model(qwen3_dir):
    return loading.load_model(ModelConfig(model_name_or_path=str(qwen3_dir), dtype="float32")).eval()


def _video_sample(tmp_path: Path, qwen3_dir: Path, params) -> tuple:
    """One SFT sample with a video and an image, through physreason's data pipeline."""
    from transformers import AutoTokenizer

    write_clip(tmp_path / "clip.mp4", n_frames=16, fps=8, size=(64, 96))
    Image.fromarray(frame_pattern(4, 64, 96)).save(tmp_path / "photo.png")
    record = {
        "conversations": [
            {"role": "user", "content": "<video>\n<image>\nWhat happens to the ball?"},
            {"role": "assistant", "content": "<think>\nit falls\n</think>\n\n<answer>\nfalls\n</answer>"},
        ],
        "video": "clip.mp4",
        "image": "photo.png",
    }
    tokenizer = AutoTokenizer.from_pretrained(qwen3_dir)
    config = loading.load_model_config(ModelConfig(model_name_or_path=str(qwen3_dir)))
    vision = read_vision_tokens(config)
    dataset = SFTDataset(
        [record],
        tmp_path,
        tokenizer,
        max_length=4096,
        vision_tokens=vision,
        vision_config=VisionConfig(fps=4, min_pixels=4 * 32 * 32, max_pixels=6 * 32 * 32, image_max_pixels=6 * 32 * 32),
        processor_params=params,
    )
    return dataset[0], vision, config


def test_positions_identical_to_transformers_get_rope_index(tmp_path: Path, qwen3_dir, params, model):
    sample, vision, config = _video_sample(tmp_path, qwen3_dir, params)
    visuals = sample.visuals
    assert visuals.video_grid_thw[0, 0] >= 2  # several frame groups, each its own span
    ids = sample.input_ids[None]  # [1, L]
    types = torch.zeros_like(ids)
    types[ids == config.image_token_id] = 1
    types[ids == config.video_token_id] = 2
    expected, _ = model.model.get_rope_index(
        ids, types, image_grid_thw=visuals.image_grid_thw, video_grid_thw=visuals.video_grid_thw
    )
    assert torch.equal(sample.position_ids, expected[:, 0])
    direct = qwen3_vl_position_ids(
        sample.input_ids, config.image_token_id, config.video_token_id, visuals.image_grid_thw, visuals.video_grid_thw
    )
    assert torch.equal(direct, sample.position_ids)


def test_video_prompt_logprobs_match_transformers_forward(tmp_path: Path, qwen3_dir, params, model):
    """physreason's training forward (its positions, its pixels) gives transformers' own log-probabilities."""
    sample, vision, config = _video_sample(tmp_path, qwen3_dir, params)
    ids = sample.input_ids[None]  # [1, L]
    visual = sample.visuals.model_kwargs()
    types = torch.zeros_like(ids)
    types[ids == config.image_token_id] = 1
    types[ids == config.video_token_id] = 2
    with torch.no_grad():
        model.model.rope_deltas = None
        reference = model(input_ids=ids, mm_token_type_ids=types, **visual).logits  # transformers' own positions
        ours = model(input_ids=ids, position_ids=sample.position_ids[:, None], **visual).logits
        flat = model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None], **visual).logits
    targets = ids[0, 1:]
    def logprobs(logits):
        return torch.log_softmax(logits[0, :-1].float(), -1).gather(-1, targets[:, None])[:, 0]
    torch.testing.assert_close(logprobs(ours), logprobs(reference), rtol=0, atol=1e-5)
    # the positions matter: 1D positions give other log-probabilities on the text after the video
    assert (logprobs(flat) - logprobs(reference)).abs().max() > 1e-3
