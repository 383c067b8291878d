"""GRPO policy scoring with shared prompt visuals: the vision tower runs once per distinct visual of a micro-batch.

The reference is the per-row path: the same batch with every row's pixels concatenated into the
transformers model's own keyword arguments, so the tower sees each completion's copy of the pixels.
"""

from __future__ import annotations

import pickle
from dataclasses import replace

import numpy as np
import pytest
import torch

from physreason.config import ModelConfig
from physreason.data.mcq import MCQPrompt
from physreason.engines import Completion
from physreason.errors import PhysReasonError
from physreason.models import loading, parallelize
from physreason.models.family import VisionTokens, read_vision_tokens
from physreason.models.inputs import VisualInputs, concat_visuals, encode_visuals
from physreason.train.policy import CompletionBatch, PolicyScorer, build_completion_batch, share_visuals
from physreason.train.rollout import RolloutSample
from physreason.vision.video import VideoFrames

OPTIONS = {"A": "yes", "B": "no"}


def video(height: int, width: int, frames: int, seed: int) -> VideoFrames:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(frames, height, width, 3), dtype=np.uint8)
    return VideoFrames(
        pixels, [i / 4 for i in range(frames)], list(range(frames)), 4.0, 4.0, frames, frames / 4, (height, width), "-"
    )


def image(height: int, width: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)


def group(
    name: str, visuals: VisualInputs | None, n: int, vision: VisionTokens, seed: int
) -> list[RolloutSample]:
    """n completions of one prompt; every sample holds the same `visuals` object, as a rollout gives them."""
    rng = np.random.default_rng(seed)
    prompt_ids = [int(t) for t in rng.integers(10, 500, size=5)]
    if visuals is not None:
        for token_id, counts in ((vision.image_token_id, visuals.image_token_counts),
                                 (vision.video_token_id, visuals.video_token_counts)):
            for count in counts:
                prompt_ids += [521] + [token_id] * count + [522] + [int(rng.integers(10, 500))]
    samples = []
    for j in range(n):
        length = int(rng.integers(3, 8))
        tokens = [int(t) for t in rng.integers(10, 500, size=length)]
        completion = Completion("-", tokens, [-1.0] * length, "stop")
        prompt = MCQPrompt(name, "Is it falling?", dict(OPTIONS), "A")
        samples.append(RolloutSample(0, prompt, prompt_ids, completion, {"total": 0.0}, visuals, float(j) - n / 2))
    return samples


def per_row(batch: CompletionBatch, samples: list[RolloutSample]) -> CompletionBatch:
    """The same batch as the model's own forward takes it: each row's pixels concatenated in row order."""
    parts = [s.visuals for s in samples if s.visuals is not None]
    pixels = concat_visuals(parts).model_kwargs()
    return replace(batch, model_batch=replace(batch.model_batch, visual_kwargs=pixels), visuals=None)


@pytest.fixture(scope="module")
def vision(tiny_model_dir) -> VisionTokens:
    return read_vision_tokens(loading.load_model_config(ModelConfig(model_name_or_path=str(tiny_model_dir))))


def load(tiny_model_dir) -> torch.nn.Module:
    torch.manual_seed(0)
    return loading.load_model(ModelConfig(model_name_or_path=str(tiny_model_dir), dtype="float32"), dtype=torch.float32)


def count_tower_calls(model: torch.nn.Module) -> list[list[list[int]]]:
    """Record the grid_thw of every vision tower call (one list of [t, h, w] rows per call)."""
    calls: list[list[list[int]]] = []
    model.model.visual.register_forward_hook(
        lambda module, args, kwargs, output: calls.append(kwargs["grid_thw"].tolist()), with_kwargs=True
    )
    return calls


def scores_and_grads(
    model: torch.nn.Module, batch: CompletionBatch, weights: torch.Tensor, balance: bool = False
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logprobs = PolicyScorer(model, balance_vision=balance)(batch, 0.7).logprobs  # [B, T]
    (logprobs * weights * batch.mask).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return logprobs.detach(), grads


def assert_same_scores_and_grads(
    model, shared: CompletionBatch, reference: CompletionBatch, unused: tuple[str, ...] = ()
) -> None:
    """Scores and every gradient equal; every tower parameter but those named in `unused` (prefixes) gets a gradient."""
    weights = torch.randn(shared.mask.shape, generator=torch.Generator().manual_seed(1))  # [B, T]
    got, got_grads = scores_and_grads(model, shared, weights)
    want, want_grads = scores_and_grads(model, reference, weights)
    mask = shared.mask
    assert torch.allclose(got[mask], want[mask], rtol=0, atol=1e-6)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert set(got_grads) == set(want_grads) == trainable
    for name, want_grad in want_grads.items():
        scale = float(want_grad.abs().max()) + 1e-12
        assert float((got_grads[name] - want_grad).abs().max()) <= 1e-5 * scale, name
    tower = [name for name in want_grads if name.startswith("model.visual.")]
    zero = [name for name in tower if float(want_grads[name].abs().max()) == 0 and not name.startswith(unused)]
    assert tower and not zero, zero


@pytest.mark.parametrize("checkpointing", [False, True])
def test_two_video_prompts_match_the_per_row_path_in_scores_and_every_gradient(tiny_model_dir, vision, checkpointing):
    model = load(tiny_model_dir).train()
    if checkpointing:
        parallelize.enable_activation_checkpointing(model)
    first = encode_visuals(videos=[video(56, 84, 4, seed=0)])
    second = encode_visuals(videos=[video(112, 140, 4, seed=1)])
    samples = group("v0", first, 4, vision, seed=0) + group("v1", second, 4, vision, seed=1)
    batch = build_completion_batch(samples, 0, vision)
    assert batch.visuals is not None and batch.model_batch.visual_kwargs == {}
    assert batch.visuals.rows.tolist() == [0] * 4 + [1] * 4
    assert_same_scores_and_grads(model, batch, per_row(batch, samples))


def test_image_prompts_and_a_text_only_row_match_the_per_row_path(tiny_model_dir, vision):
    model = load(tiny_model_dir).train()
    first = encode_visuals(images=[image(84, 112, seed=0)])
    both = encode_visuals(images=[image(56, 56, seed=1)], videos=[video(56, 84, 4, seed=2)])
    text = encode_visuals()  # what a rollout gives a text prompt on a vision-language model
    samples = group("i0", first, 3, vision, 0) + group("t", text, 2, vision, 1) + group("iv", both, 3, vision, 2)
    batch = build_completion_batch(samples, 0, vision)
    assert batch.visuals.rows.tolist() == [0, 0, 0, -1, -1, 1, 1, 1]
    assert_same_scores_and_grads(model, batch, per_row(batch, samples))


def test_vision_tower_runs_once_per_distinct_visual(tiny_model_dir, vision):
    model = load(tiny_model_dir).train()
    calls = count_tower_calls(model)
    first = encode_visuals(videos=[video(56, 84, 4, seed=0)])
    second = encode_visuals(videos=[video(112, 140, 4, seed=1)])
    samples = group("v0", first, 8, vision, seed=0) + group("v1", second, 8, vision, seed=1)
    batch = build_completion_batch(samples, 0, vision)
    weights = torch.ones(batch.mask.shape)
    scores_and_grads(model, batch, weights)
    assert calls == [[[2, 4, 6], [2, 8, 10]]]  # one call, each distinct video once
    calls.clear()
    scores_and_grads(model, per_row(batch, samples), weights)
    assert calls == [[[2, 4, 6]] * 8 + [[2, 8, 10]] * 8]  # the per-row path: one copy per completion


def test_pickled_samples_still_share_their_prompt_visuals(vision):
    first = encode_visuals(videos=[video(56, 84, 4, seed=0)])
    second = encode_visuals(images=[image(56, 56, seed=1)])
    samples = pickle.loads(pickle.dumps(group("v", first, 3, vision, 0) + group("i", second, 2, vision, 1)))
    batch = build_completion_batch(samples, 0, vision)
    assert batch.visuals.rows.tolist() == [0, 0, 0, 1, 1]
    assert batch.visuals.kwargs["pixel_values_videos"].shape == first.pixel_values_videos.shape


def test_feature_indexes_repeat_each_visual_for_every_row_that_shows_it():
    one = VisualInputs(image_token_counts=[2, 1], video_token_counts=[3])
    two = VisualInputs(video_token_counts=[2])
    shared = share_visuals([one, None, two, one, VisualInputs()])
    assert shared.rows.tolist() == [0, -1, 1, 0, -1]
    assert shared.image_index.tolist() == [0, 1, 2, 0, 1, 2]
    assert shared.video_index.tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert share_visuals([None, VisualInputs()]) is None


def test_balanced_scorer_adds_only_the_missing_kind_to_a_shared_image_batch(tiny_model_dir, vision):
    model = load(tiny_model_dir).eval()
    calls = count_tower_calls(model)
    samples = group("i", encode_visuals(images=[image(84, 112, seed=0)]), 4, vision, seed=0)
    batch = build_completion_batch(samples, 0, vision)
    with torch.no_grad():
        plain = PolicyScorer(model)(batch, 1.0).logprobs
        calls.clear()
        balanced = PolicyScorer(model, balance_vision=True)(batch, 1.0).logprobs
    assert calls == [[[1, 2, 2]], [[1, 6, 8]]]  # the dummy video, then the one distinct image
    assert torch.equal(plain, balanced)


def test_text_model_batches_take_the_plain_path(tiny_model_dirs):
    model = loading.load_model(
        ModelConfig(model_name_or_path=str(tiny_model_dirs["qwen2"]), dtype="float32"), dtype=torch.float32
    )
    samples = group("t", None, 3, None, seed=0)
    batch = build_completion_batch(samples, 0, None)
    assert batch.visuals is None
    with torch.no_grad():
        scores = PolicyScorer(model)(batch, 1.0).logprobs
    assert scores.shape == batch.mask.shape and bool(torch.isfinite(scores[batch.mask]).all())


def test_placeholders_of_the_wrong_kind_are_refused_with_the_prompt_named(vision):
    pictured = encode_visuals(images=[image(56, 56, seed=0)])
    (sample,) = group("swapped", pictured, 1, vision, seed=0)
    sample.prompt_ids = [vision.video_token_id if t == vision.image_token_id else t for t in sample.prompt_ids]
    with pytest.raises(PhysReasonError, match="prompt swapped: the engine's prompt has 0 image tokens"):
        build_completion_batch([sample], 0, vision)


def test_qwen3_vl_shared_visuals_keep_deepstack_and_match_the_per_row_path(tiny_model_dirs):
    """Qwen3-VL's DeepStack features (added to the visual positions of its first decoder layers) reach the shared
    path too: images and videos in one batch, scores and every gradient equal to the model's own forward."""
    from physreason.models.inputs import load_processor_params

    folder = tiny_model_dirs["qwen3_vl"]
    vision = read_vision_tokens(loading.load_model_config(ModelConfig(model_name_or_path=str(folder))))
    params = load_processor_params(str(folder))
    model = load(folder).train()
    assert model.config.vision_config.deepstack_visual_indexes  # the tiny model has DeepStack layers
    first = encode_visuals(images=[image(64, 96, seed=0)], params=params)
    both = encode_visuals(images=[image(64, 64, seed=1)], videos=[video(64, 96, 2, seed=2)], params=params)
    samples = group("i0", first, 3, vision, 0) + group("iv", both, 3, vision, 2)
    batch = build_completion_batch(samples, 0, vision)
    assert batch.visuals is not None
    # The i-th DeepStack feature is added to the visual positions after decoder layer i; added after the last layer,
    # it reaches no completion token (the tiny model has 2 decoder layers), so its merger gets no gradient.
    last = model.config.text_config.num_hidden_layers - 1
    indexes = model.config.vision_config.deepstack_visual_indexes
    unused = tuple(f"model.visual.deepstack_merger_list.{i}." for i in range(len(indexes)) if i >= last)
    assert len(unused) < len(indexes)  # at least one DeepStack merger is checked
    assert_same_scores_and_grads(model, batch, per_row(batch, samples), unused)
