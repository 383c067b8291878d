"""Tiny random models with the real architectures, built in-process in seconds for tests and the demo.

Each is saved as an ordinary Hugging Face folder (config, safetensors, tokenizer, processor and
generation config) that `from_pretrained` and vLLM load as they are.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from physreason.models.chat_template import QWEN2_5_VL_CHAT_TEMPLATE, QWEN3_VL_CHAT_TEMPLATE
from physreason.models.kinds import TINY_KINDS, TinyKind

# The Qwen2.5 special tokens, in Qwen's order; their ids in the tiny vocabulary follow the BPE vocab.
QWEN_SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# Text the tiny BPE learns merges from: the words physreason's prompts and answers use most.
_CORPUS = """
You are a helpful assistant. Answer the question in the following format:
<think>
your reasoning
</think>

<answer>
your answer
</answer>
Answer the question with the letter of the correct option. Is the video playing forward or backward?
(A) forward (B) backward (C) left (D) right. The ball falls, bounces on the floor and comes to rest.
The box slides and friction stops it. Which arrangement of the patches is correct? Does the object
disappear behind the occluder and reappear? The robot arm picks up the cup and places it on the table.
The car stops at the red light, then turns left at the intersection. What should the robot do next?
Object permanence, arrow of time, spatial puzzle, gravity, collision, pendulum, rolling, sliding.
0 1 2 3 4 5 6 7 8 9 10 0.25s 1.50s A B C D E F yes no true false first second third last
"""


@functools.lru_cache(maxsize=4)
def _trained_bpe(vocab_size: int) -> str:
    """The trained tokenizer as JSON (training is deterministic; cached per process)."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    tok.add_special_tokens(QWEN_SPECIAL_TOKENS)
    return tok.to_str()


def build_tiny_tokenizer(
    vocab_size: int = 512, chat_template: str = QWEN2_5_VL_CHAT_TEMPLATE
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on an embedded corpus and add the Qwen special tokens and a chat template."""
    fast = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_trained_bpe(vocab_size)),
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = chat_template
    return fast


def _token_ids(tokenizer: PreTrainedTokenizerFast) -> dict[str, int]:
    ids = tokenizer.convert_tokens_to_ids(QWEN_SPECIAL_TOKENS)
    return dict(zip(QWEN_SPECIAL_TOKENS, ids, strict=True))


def text_widths(scale: int) -> dict[str, int]:
    """The language model's widths at `scale` (both families): head_dim stays 32 (mrope sections 4/6/6) at every
    scale; width, depth and heads grow with it."""
    return {
        "hidden_size": 128 * scale,
        "intermediate_size": 256 * scale,
        "num_hidden_layers": 2 * scale,
        "num_attention_heads": 4 * scale,
        "num_key_value_heads": 2 * scale,
        "head_dim": 32,
    }


def _text_dims(vocab_size: int, ids: dict[str, int], scale: int) -> dict:
    widths = {key: value for key, value in text_widths(scale).items() if key != "head_dim"}  # Qwen2.5-VL derives it
    return {
        "vocab_size": vocab_size,
        **widths,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "tie_word_embeddings": False,
    }


def build_tiny_model(
    kind: TinyKind, tokenizer: PreTrainedTokenizerFast, seed: int = 0, scale: int = 1, temporal_patch_size: int = 2
) -> torch.nn.Module:
    """Build a random-weight model of the given architecture (float32); scale 1 is sized for CPU tests.

    `scale` multiplies width, depth and heads (scale 4: hidden 512, 8 layers, vision depth 8), for small
    models trained from scratch on a GPU.
    """
    import transformers

    if scale < 1:
        raise ValueError(f"scale must be >= 1, got {scale}")
    if temporal_patch_size < 1:
        raise ValueError(f"temporal_patch_size must be >= 1, got {temporal_patch_size}")
    ids = _token_ids(tokenizer)
    vocab = len(tokenizer)
    text = _text_dims(vocab, ids, scale)
    torch.manual_seed(seed)
    if kind == "qwen2_5_vl":
        config = transformers.Qwen2_5_VLConfig(
            text_config={
                **text,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [4, 6, 6]},
            },
            vision_config={
                "depth": 2 * scale,
                "hidden_size": 64 * scale,
                "intermediate_size": 128 * scale,
                "num_heads": 4 * scale,
                "out_hidden_size": text["hidden_size"],
                "patch_size": 14,
                "spatial_merge_size": 2,
                "temporal_patch_size": temporal_patch_size,
                "window_size": 112,
                "fullatt_block_indexes": list(range(1, 2 * scale, 2)),
                "tokens_per_second": 2,
            },
            image_token_id=ids["<|image_pad|>"],
            video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"],
            vision_end_token_id=ids["<|vision_end|>"],
            tie_word_embeddings=False,
        )
        model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    elif kind in ("qwen3_vl", "qwen3_vl_moe"):
        model = _tiny_qwen3_vl(kind, text, ids, scale, temporal_patch_size)
    elif kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**text))
    elif kind == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**text, head_dim=32))
    elif kind == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            **text, head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1
        )
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        raise ValueError(f"unknown tiny model kind {kind!r}; choose one of {', '.join(TINY_KINDS)}")
    return model.eval()


def _tiny_qwen3_vl(
    kind: TinyKind, text: dict, ids: dict[str, int], scale: int, temporal_patch_size: int = 2
) -> torch.nn.Module:
    """Qwen3-VL (or its MoE variant): 16-pixel patches, DeepStack taps, interleaved M-RoPE (sections 6/5/5)."""
    import transformers

    text_config = {
        **text,
        "head_dim": 32,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 5000000.0,
            "mrope_section": [6, 5, 5],
            "mrope_interleaved": True,
        },
    }
    if kind == "qwen3_vl_moe":
        text_config.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1)
    vision_config = {
        "depth": 2 * scale,
        "hidden_size": 64 * scale,
        "intermediate_size": 128 * scale,
        "num_heads": 4 * scale,
        "out_hidden_size": text["hidden_size"],
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": temporal_patch_size,
        # a 16 x 16 grid of learned position embeddings, interpolated to each image's grid
        "num_position_embeddings": 256,
        # every vision block feeds one decoder layer (DeepStack), as the first layers do in the real models
        "deepstack_visual_indexes": list(range(min(2 * scale, text["num_hidden_layers"]))),
    }
    common = dict(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    if kind == "qwen3_vl_moe":
        return transformers.Qwen3VLMoeForConditionalGeneration(transformers.Qwen3VLMoeConfig(**common))
    return transformers.Qwen3VLForConditionalGeneration(transformers.Qwen3VLConfig(**common))


def _save_qwen3_vl_processor(folder: Path, temporal_patch_size: int = 2) -> None:
    """Write Qwen3-VL's image and video processor configs (patch 16, mean/std 0.5, its pixel budgets)."""
    common = {
        "patch_size": 16,
        "temporal_patch_size": temporal_patch_size,
        "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
        "processor_class": "Qwen3VLProcessor",
    }
    # Qwen3-VL-Instruct's own budgets: images 64 to 16,384 tokens of 32 x 32 pixels; a video's longest_edge
    # counts the pixels of all its frames together.
    image = {
        **common,
        "image_processor_type": "Qwen2VLImageProcessorFast",
        "size": {"shortest_edge": 65536, "longest_edge": 16777216},
    }
    video = {
        **common,
        "video_processor_type": "Qwen3VLVideoProcessor",
        "size": {"shortest_edge": 4096, "longest_edge": 25165824},
        "fps": 2,
        "min_frames": 4,
        "max_frames": 768,
        "do_sample_frames": False,
    }
    (folder / "preprocessor_config.json").write_text(json.dumps(image, indent=2))
    (folder / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))
    (folder / "chat_template.jinja").write_text(QWEN3_VL_CHAT_TEMPLATE)


def _save_processor(folder: Path, tokenizer: PreTrainedTokenizerFast, temporal_patch_size: int = 2) -> None:
    """Write image/video processor configs the Qwen2.5-VL processor classes read (no torchvision needed)."""
    import transformers

    # The PIL class writes the same preprocessor_config.json; asking for the torchvision one on a machine
    # without torchvision makes transformers warn about a fallback users need not care about.
    image_processor = getattr(transformers, "Qwen2VLImageProcessorPil", None) or transformers.Qwen2VLImageProcessor

    common = {
        "patch_size": 14,
        "temporal_patch_size": temporal_patch_size,
        "merge_size": 2,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
    }
    image = image_processor(min_pixels=4 * 28 * 28, max_pixels=16384 * 28 * 28, **common)
    image.save_pretrained(folder)
    video = {
        **common,
        "video_processor_type": "Qwen2VLVideoProcessor",
        "processor_class": "Qwen2_5_VLProcessor",
        "min_pixels": 128 * 28 * 28,
        "max_pixels": 768 * 28 * 28,
        "size": {"shortest_edge": 128 * 28 * 28, "longest_edge": 768 * 28 * 28},
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
        "do_sample_frames": False,
    }
    (folder / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))
    preprocessor = json.loads((folder / "preprocessor_config.json").read_text())
    preprocessor["processor_class"] = "Qwen2_5_VLProcessor"
    (folder / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
    (folder / "chat_template.jinja").write_text(QWEN2_5_VL_CHAT_TEMPLATE)


def save_tiny_model(
    kind: TinyKind, folder: str | Path, seed: int = 0, scale: int = 1, temporal_patch_size: int = 2
) -> Path:
    """Build a tiny model and save it as a complete Hugging Face folder; returns the folder.

    `temporal_patch_size`: frames per temporal patch of the vision tower (2 in every released Qwen-VL); larger
    values let one patch see motion over more frames (the intuitive-physics bench's from-scratch models).
    """
    from transformers import GenerationConfig

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    qwen3_vl = kind in ("qwen3_vl", "qwen3_vl_moe")
    tokenizer = build_tiny_tokenizer(chat_template=QWEN3_VL_CHAT_TEMPLATE if qwen3_vl else QWEN2_5_VL_CHAT_TEMPLATE)
    model = build_tiny_model(kind, tokenizer, seed=seed, scale=scale, temporal_patch_size=temporal_patch_size)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    # Name Qwen's own tokenizer class, so loaders that special-case Qwen (vLLM) treat it as one.
    tok_config_path = folder / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text())
    tok_config["tokenizer_class"] = "Qwen2Tokenizer"
    tok_config_path.write_text(json.dumps(tok_config, indent=2))
    ids = _token_ids(tokenizer)
    GenerationConfig(
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
        pad_token_id=ids["<|endoftext|>"],
        do_sample=True,
        temperature=0.6,
        top_p=0.95,
        repetition_penalty=1.05,
    ).save_pretrained(folder)
    if kind == "qwen2_5_vl":
        _save_processor(folder, tokenizer, temporal_patch_size)
    elif qwen3_vl:
        _save_qwen3_vl_processor(folder, temporal_patch_size)
    return folder
