"""Packing: several samples in one row give the same loss as the same samples padded in a batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from physreason.data.collate import collate_padded
from physreason.data.packing import collate_packed
from physreason.data.sft import IGNORE_INDEX, SFTSample
from physreason.models.family import model_family, read_vision_tokens
from physreason.models.tiny import build_tiny_model, build_tiny_tokenizer
from physreason.train.model import CausalLMLoss


@pytest.fixture(scope="module")
def tiny(vl_kind):
    tokenizer = build_tiny_tokenizer()
    return tokenizer, build_tiny_model(vl_kind, tokenizer)


def _text_sample(ids: list[int], n_prompt: int) -> SFTSample:
    input_ids = torch.tensor(ids)
    labels = input_ids.clone()
    labels[:n_prompt] = IGNORE_INDEX
    return SFTSample(input_ids, labels, torch.arange(len(ids)).expand(3, -1))


def _image_sample(model, ids_before: list[int], ids_after: list[int], n_prompt_after: int) -> SFTSample:
    from physreason.models.inputs import encode_visuals

    params = model_family(model.config).processor
    side = 2 * params.factor  # a 2 x 2 grid of visual tokens (56 px for Qwen2.5-VL, 64 px for Qwen3-VL)
    image = np.random.default_rng(0).integers(0, 255, (side, side, 3), dtype=np.uint8)
    visuals = encode_visuals([image], [], params)
    spec = read_vision_tokens(model.config)
    ids = ids_before + [spec.image_token_id] * visuals.image_token_counts[0] + ids_after
    input_ids = torch.tensor(ids)
    labels = input_ids.clone()
    labels[: len(ids) - len(ids_after) + n_prompt_after] = IGNORE_INDEX
    positions = spec.positions(input_ids, visuals)
    return SFTSample(input_ids, labels, positions, visuals)


def test_packed_loss_equals_unpacked_loss(tiny):
    tokenizer, model = tiny
    module = CausalLMLoss(model)
    samples = [_text_sample(list(range(10, 40)), 12), _text_sample(list(range(50, 62)), 4), _text_sample(list(range(70, 95)), 20)]
    padded = collate_padded(samples, tokenizer.pad_token_id, mrope=True)
    packed = collate_packed(samples, mrope=True)
    assert packed.input_ids.shape == (1, 30 + 12 + 25)
    assert packed.num_targets == padded.num_targets
    with torch.no_grad():
        assert torch.allclose(module(packed), module(padded), rtol=1e-5)
        separate = sum(module(collate_padded([s], tokenizer.pad_token_id, mrope=True)) for s in samples)
        assert torch.allclose(module(packed), separate, rtol=1e-5)


def test_packed_samples_with_images_restart_mrope_positions(tiny):
    tokenizer, model = tiny
    pytest.importorskip("physreason.vision")
    module = CausalLMLoss(model)
    samples = [_image_sample(model, [1, 2, 3], list(range(20, 35)), 3), _image_sample(model, [4, 5], list(range(40, 52)), 2)]
    packed = collate_packed(samples, mrope=True)
    first = len(samples[0].input_ids)
    assert packed.position_ids.shape == (4, 1, packed.input_ids.shape[1])
    assert packed.position_ids[0, 0, first] == 0 and packed.position_ids[1:, 0, first].eq(0).all()
    padded = collate_padded(samples, tokenizer.pad_token_id, mrope=True)
    with torch.no_grad():
        assert torch.allclose(module(packed), module(padded), rtol=1e-5)


def test_rows_rounded_to_sixteen_tokens_for_float8_keep_the_loss(tiny):
    """[train.fp8] rounds a batch's token count up to a multiple of 16 (torch._scaled_mm refuses 138 tokens in the
    weight gradient, as an H100 run of physreason gpu-check found); the padding changes no loss and no target count."""
    tokenizer, model = tiny
    module = CausalLMLoss(model)
    samples = [_text_sample(list(range(10, 40)), 12), _text_sample(list(range(50, 62)), 4), _text_sample(list(range(70, 95)), 20)]
    padded, padded16 = (collate_padded(samples, tokenizer.pad_token_id, mrope=True, pad_multiple=m) for m in (1, 16))
    packed, packed16 = (collate_packed(samples, mrope=True, pad_multiple=m, pad_token_id=tokenizer.pad_token_id)
                        for m in (1, 16))  # fmt: skip
    assert padded.input_ids.shape == (3, 30) and padded16.input_ids.shape == (3, 32)
    assert packed.input_ids.shape == (1, 67) and packed16.input_ids.shape == (1, 80)
    assert packed16.position_ids.shape == (4, 1, 80) and packed16.position_ids[:, 0, 67].eq(0).all()  # its own segment
    assert padded16.num_targets == padded.num_targets == packed16.num_targets
    with torch.no_grad():
        assert torch.allclose(module(padded16), module(padded), rtol=1e-5)
        assert torch.allclose(module(packed16), module(packed), rtol=1e-5)
