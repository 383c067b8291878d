"""The model shapes the benchmarks measure, by name, and the builders of their random-weight models.

Shapes ("flavors"): the architectures of Qwen2.5-VL-3B/7B-Instruct (Cosmos-Reason1 is the 7B) and Qwen3-VL-8B-Instruct
(Cosmos-Reason2-8B) as transformers configs, each with a tiny stand-in (`tiny=True`) that checks a script on CPU;
`DECODER_SHAPES` holds the decoders alone as causal-LM config.json contents, for engines that never run the vision
tower. Every bench that needs one of these shapes, its training FLOPs or a model folder of it takes them from here.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

PEAK_BF16_FLOPS = 989e12  # H100/H200 SXM dense bf16, the MFU convention of DESIGN.md's anchors

# The tiny stand-ins share one decoder and one Qwen2.5-VL vision tower (Qwen3-VL's needs its own head_dim and fields).
_TINY_TEXT = dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)  # fmt: skip
_TINY_QWEN25_VISION = dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=128,
                           fullatt_block_indexes=[0])  # fmt: skip


def _qwen25_vl(text: dict[str, Any], out_hidden_size: int, tiny: bool, layers: int | None = None):
    """A Qwen2.5-VL config: `text` over the shared decoder fields, the 32-block vision tower of both sizes.

    layers: decoder layers instead of the shape's (tiny too), given before the config derives its per-layer fields.
    """
    from transformers import Qwen2_5_VLConfig

    rope = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]}
    text = dict(max_position_embeddings=128000, rms_norm_eps=1e-6, rope_parameters=rope, **text)
    vision = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=out_hidden_size,
                  fullatt_block_indexes=[7, 15, 23, 31])  # fmt: skip
    if tiny:
        text.update(_TINY_TEXT, rope_parameters={**rope, "mrope_section": [4, 6, 6]})
        vision.update(_TINY_QWEN25_VISION)
    if layers is not None:
        text["num_hidden_layers"] = layers
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=text["tie_word_embeddings"])


def qwen25_vl_3b(tiny: bool):
    """The Qwen2.5-VL-3B-Instruct architecture (or a tiny stand-in to check a script on CPU)."""
    text = dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                num_attention_heads=16, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
    return _qwen25_vl(text, 2048, tiny)


def qwen25_vl_7b(tiny: bool, layers: int | None = None):
    """The Qwen2.5-VL-7B-Instruct architecture with `layers` decoder layers (None: its 28), or a tiny stand-in."""
    text = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False)  # fmt: skip
    config = _qwen25_vl(text, 3584, tiny, layers)
    config.text_config._attn_implementation = "sdpa"
    return config


def qwen3_vl_8b(tiny: bool):
    """The Qwen3-VL-8B-Instruct architecture (Cosmos-Reason2-8B), or a tiny stand-in to check a script on CPU."""
    from transformers import Qwen3VLConfig

    rope = {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20], "mrope_interleaved": True}
    text = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=262144,
                rms_norm_eps=1e-6, tie_word_embeddings=False, rope_parameters=rope)  # fmt: skip
    vision = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096, patch_size=16,
                  num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24])  # fmt: skip
    if tiny:
        text.update(_TINY_TEXT, head_dim=32, rope_parameters={**rope, "mrope_section": [6, 5, 5]})
        vision.update(depth=1, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=128,
                      num_position_embeddings=256, deepstack_visual_indexes=[0])  # fmt: skip
    return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)


SHAPES: dict[str, Callable[[bool], Any]] = {
    "qwen2.5-vl-3b": qwen25_vl_3b,
    "qwen2.5-vl-7b": qwen25_vl_7b,
    "qwen3-vl-8b": qwen3_vl_8b,
}

# The decoders alone as causal-LM config.json contents (same blocks; decode never runs the vision tower).
DECODER_SHAPES = {
    "qwen2.5-vl-7b": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
        "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
        "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "hidden_act": "silu", "bos_token_id": 151643, "eos_token_id": 151645,
    },
    "qwen3-vl-8b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
        "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 151936, "max_position_embeddings": 262144, "rope_theta": 5000000.0, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu", "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
}  # fmt: skip


def train_flops_per_token(config, seq_len: int) -> float:
    """6 x matmul parameters of the language model (lm_head included) + causal attention score/value flops."""
    t = config.text_config
    head_dim = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
    q, kv = t.num_attention_heads * head_dim, t.num_key_value_heads * head_dim
    per_layer = t.hidden_size * (q + 2 * kv) + q * t.hidden_size + 3 * t.hidden_size * t.intermediate_size
    matmul_params = t.num_hidden_layers * per_layer + t.vocab_size * t.hidden_size
    attention = 6 * t.num_hidden_layers * seq_len * t.hidden_size  # 12 * L * s * d, halved by causality
    return 6 * matmul_params + attention


def make_batch(config, seq_len: int, rows: int, packing: bool, device):
    """`rows` rows of seq_len tokens each: one sample per row, or (packing) four samples packed into one row."""
    from physreason.data.collate import collate_padded
    from physreason.data.packing import collate_packed
    from physreason.data.sft import SFTSample

    if packing and rows != 1:
        raise ValueError("--packing builds one packed row; use --batch 1 with it")
    generator = torch.Generator().manual_seed(0)
    parts = 4 if packing else rows
    length = seq_len // 4 if packing else seq_len
    samples = []
    for _ in range(parts):
        ids = torch.randint(0, config.text_config.vocab_size, (length,), generator=generator)
        samples.append(SFTSample(ids, ids.clone(), torch.arange(length).expand(3, -1)))
    batch = collate_packed(samples, mrope=True) if packing else collate_padded(samples, 0, mrope=True)
    return batch.to(device)


def build_model_folder(folder: Path, shape: str, tiny: bool, weights: bool = True) -> Path:
    """A Qwen2.5-VL folder, written once: the tiny model's tokenizer/processor files and `shape`'s random weights in bf16.

    The vocabulary (and so the lm_head) is the tiny tokenizer's: the real model's 151,936-row lm_head is left out.
    tiny: the tiny model itself. The weights are initialised on the GPU when there is one.
    weights False: `shape`'s config without weight files (for vLLM's load_format="dummy").
    """
    from transformers import Qwen2_5_VLForConditionalGeneration

    from physreason.models.tiny import save_tiny_model

    if (folder / "DONE").is_file():
        return folder
    save_tiny_model("qwen2_5_vl", folder)
    if not tiny:
        small = json.loads((folder / "config.json").read_text())
        config = SHAPES[shape](False)
        config.text_config.vocab_size = small["text_config"]["vocab_size"]
        for key in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
            setattr(config, key, small[key])
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            setattr(config.text_config, key, small["text_config"][key])
        if not weights:
            for stale in folder.glob("*.safetensors*"):  # the tiny model's, of another shape
                stale.unlink()
            config.dtype = "bfloat16"
            # what model.save_pretrained writes: without it vLLM does not resolve the model as a generative one
            config.architectures = [Qwen2_5_VLForConditionalGeneration.__name__]
            config.save_pretrained(folder)
        else:
            with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
                model = Qwen2_5_VLForConditionalGeneration(config).to(torch.bfloat16)
            model.save_pretrained(folder, safe_serialization=True)
            del model
            if torch.cuda.is_available():
                # Hand the cached blocks back: the callers then start engines in child processes, and a 7B shape's
                # build left 28.6 GiB reserved in the parent (vLLM refused to start on 2026-11-28: 111 of 139.8 free).
                torch.cuda.empty_cache()
    (folder / "DONE").write_text("ok")
    return folder
