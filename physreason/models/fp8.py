"""FP8 rollout weights: quantize the policy's language-model linear weights to float8_e4m3fn at each push.

The rollout engine (vLLM) runs these layers with FP8 weights in the layout of a block-quantized FP8 checkpoint
(`quant_method = "fp8"`, `weight_block_size = [128, 128]`, as DeepSeek-V3 ships): next to each weight
`W [out, in]` a float32 `weight_scale_inv [ceil(out / 128), ceil(in / 128)]` such that
`W ~= q * scale_inv` block by block. vLLM's own loaders put q/k/v and gate/up shards into its fused layers,
scales included, so the policy sends them under the Hugging Face names. Everything else (vision tower,
embeddings, norms, biases, lm_head) goes in the model's dtype.

Per-channel scales (one per output row) are also provided for comparison and for engines that take them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from physreason.errors import PhysReasonError

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
BLOCK = 128
SCALE_SUFFIX = "_scale_inv"  # vLLM's block-quantized scale parameter: `<layer>.weight_scale_inv`

# The language model's decoder-block linear layers: these run in FP8. The vision tower's blocks are
# `blocks.N`, never `layers.N`, and its names carry `visual`.
_LANGUAGE_LINEAR = re.compile(r"(^|\.)layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)\.weight$")


def is_fp8_weight(name: str) -> bool:
    """Whether the Hugging Face parameter `name` is a language-model linear weight that FP8 rollouts quantize."""
    return "visual" not in name and _LANGUAGE_LINEAR.search(name) is not None


def _check_finite(weight: torch.Tensor, name: str) -> None:
    if weight.dim() != 2:
        raise PhysReasonError(f"FP8 quantization of {name}: expected a 2-D weight [out, in], got {tuple(weight.shape)}")
    if not bool(torch.isfinite(weight).all()):
        raise PhysReasonError(
            f"FP8 quantization of {name}: the weight holds inf or NaN, which no FP8 scale represents; "
            "the policy has diverged: resume from an earlier checkpoint"
        )


def quantize_fp8_blockwise(
    weight: torch.Tensor, block: int = BLOCK, name: str = "weight"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn [out, in], scale_inv float32 [ceil(out/block), ceil(in/block)]) with W ~= q * scale_inv.

    Each block's scale_inv is amax(|W_block|) / 448 (1 for an all-zero block), so the block's largest entry maps
    to the largest FP8 value. Edge blocks of a shape that is not a multiple of `block` cover what is left.
    """
    _check_finite(weight, name)
    rows, cols = weight.shape
    blocks_r, blocks_c = -(-rows // block), -(-cols // block)
    padded = torch.zeros(blocks_r * block, blocks_c * block, dtype=torch.float32, device=weight.device)
    padded[:rows, :cols] = weight.to(torch.float32)  # zero padding never raises a block's amax
    tiles = padded.view(blocks_r, block, blocks_c, block)  # [Br, block, Bc, block]
    amax = tiles.abs().amax(dim=(1, 3))  # [Br, Bc]
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))  # [Br, Bc]
    scaled = tiles / scale_inv[:, None, :, None]
    q = scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(blocks_r * block, blocks_c * block)[:rows, :cols]
    return q.contiguous(), scale_inv


def quantize_fp8_per_channel(weight: torch.Tensor, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn [out, in], scale float32 [out, 1]) with W ~= q * scale, one scale per output row.

    scale = amax(|W_row|) / 448, 1 for an all-zero row.
    """
    _check_finite(weight, name)
    w = weight.to(torch.float32)
    amax = w.abs().amax(dim=1, keepdim=True)  # [out, 1]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_fp8_blockwise(q: torch.Tensor, scale_inv: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """float32 [out, in] = q * scale_inv expanded over each block (the engine's view of the weight)."""
    rows, cols = q.shape
    expanded = scale_inv.repeat_interleave(block, dim=0).repeat_interleave(block, dim=1)[:rows, :cols]
    return q.to(torch.float32) * expanded


def fp8_rollout_weights(
    named_tensors: Iterable[tuple[str, torch.Tensor]], block: int = BLOCK
) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's (name, tensor) stream as an FP8 engine takes it: selected weights as q + `<name>_scale_inv`.

    Consumes its input one tensor at a time, so a sharded model still gathers one parameter at a time.
    """
    for name, tensor in named_tensors:
        if not is_fp8_weight(name):
            yield name, tensor
            continue
        q, scale_inv = quantize_fp8_blockwise(tensor, block, name)
        yield name, q
        yield name + SCALE_SUFFIX, scale_inv


def vllm_fp8_quantization_config(ignored_layers: Iterable[str], block: int = BLOCK) -> dict[str, Any]:
    """The `quantization_config` of a block-FP8 checkpoint, given to vLLM through hf_overrides.

    ignored_layers: Hugging Face module names of every linear layer that stays in the model's dtype (vision
    tower, merger, lm_head); vLLM maps them to its own module names.
    """
    return {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": [block, block],
        "ignored_layers": sorted(ignored_layers),
    }


def unquantized_linear_names(linear_names: Iterable[str]) -> list[str]:
    """Of a model's nn.Linear module names, those FP8 rollouts keep in the model's dtype (not language-block linears)."""
    return sorted(name for name in linear_names if not is_fp8_weight(f"{name}.weight"))


def expected_fp8_layers(num_hidden_layers: int) -> int:
    """FP8 linear modules vLLM builds for a dense decoder: fused qkv, o, fused gate_up and down per block."""
    return 4 * num_hidden_layers


def fp8_block_misfits(text_config: Any, tensor_parallel_size: int = 1, block: int = BLOCK) -> list[str]:
    """Why a decoder's shapes cannot hold block-FP8 weights in vLLM's fused layers, or [] when they can.

    vLLM fuses q/k/v into one layer and gate/up into another, each with one scale per 128 x 128 block of the fused
    weight; a shard whose rows (per tensor-parallel rank) are not a multiple of the block would need a block that
    straddles two shards, and the load fails deep inside vLLM. Every released Qwen2.5-VL / Qwen3-VL size fits
    (head_dim 128); small test shapes may not.
    """
    heads = int(text_config.num_attention_heads)
    head_dim = int(getattr(text_config, "head_dim", None) or text_config.hidden_size // heads)
    kv_heads = int(getattr(text_config, "num_key_value_heads", None) or heads)
    rows = {
        "q_proj": heads * head_dim,
        "k_proj / v_proj": kv_heads * head_dim,
        "gate_proj / up_proj": int(text_config.intermediate_size),
    }
    tp = max(int(tensor_parallel_size), 1)
    return [
        f"{name} has {count} output rows{f' / {tp} ranks' if tp > 1 else ''}, not a multiple of {block}"
        for name, count in rows.items()
        if count % tp or (count // tp) % block
    ]
