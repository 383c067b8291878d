"""The language model's attention over packed GRPO rows, computed without their [L, L] mask.

A packed row (train/policy.py) holds a prompt once and then each of its completions; the prompt attends causally to
itself, each completion to the whole prompt and causally to itself. As a [R, 1, L, L] boolean mask, sdpa cannot use
its flash kernel and computes every one of the L x L scores, most of them masked (a 580-token prompt with 8
completions of 256: 6.9 M scores a head and layer, 1.6 M of them needed). Here each row is two sdpa calls on the
flash-eligible path: the prompt, causal; and the row's completions as a batch, each completion's queries against the
prompt's keys and values followed by its own, under a causal mask aligned to the bottom right (query t of a
completion sees the whole prompt and its own tokens 0..t: `torch.nn.attention.bias.causal_lower_right`). The scores
computed are the needed ones plus the padding of the row's shorter completions to its longest.

The layout travels on the mask tensor itself (`attach`), which transformers hands to every attention call of the
language model unchanged (a 4D mask is taken as prepared), recomputed blocks included; calls without it (the vision
tower's own config, a plain causal batch, a padded batch's mask, which transformers builds as for sdpa) run
transformers' sdpa exactly as before. Padding positions of a row come out as zeros (the dense path gave each the
value at its own position): nothing reads them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

NAME = "physreason_packed_sdpa"
_ATTRIBUTE = "physreason_packed_rows"


@dataclass(frozen=True)
class PackedRows:
    """Per row: the prompt's length and the (start, length) of each completion after it, in order; `width` = L."""

    rows: tuple[tuple[int, tuple[tuple[int, int], ...]], ...]
    width: int


def attach(mask: torch.Tensor, layout: PackedRows) -> torch.Tensor:
    """Return `mask` carrying `layout` for the attention calls it reaches."""
    setattr(mask, _ATTRIBUTE, layout)
    return mask


def layout_of(mask: object) -> PackedRows | None:
    """The layout `attach` put on `mask`, or None."""
    return getattr(mask, _ATTRIBUTE, None)


def packed_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [R, H, L, D]
    key: torch.Tensor,  # [R, H_kv, L, D]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; returns ([R, L, H, D] output, None)."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    layout = layout_of(attention_mask)
    if layout is None or dropout or query.shape[2] != layout.width or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    from torch.nn.attention.bias import causal_lower_right

    groups = getattr(module, "num_key_value_groups", 1)
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    outputs = []
    for row, (prompt, completions) in enumerate(layout.rows):
        pieces = [sdpa(query[row : row + 1, :, :prompt], key[row : row + 1, :, :prompt], value[row : row + 1, :, :prompt],
                       is_causal=True, scale=scaling)[0]]  # fmt: skip
        if completions:
            index = _indexes(layout, query.device)[row]  # [n * longest]
            count = len(completions)
            longest = index.numel() // count
            keys = torch.cat([key[row : row + 1, :, :prompt].expand(count, -1, -1, -1), _gather(key[row], index, count)],
                             dim=2)  # fmt: skip
            values = torch.cat([value[row : row + 1, :, :prompt].expand(count, -1, -1, -1),
                                _gather(value[row], index, count)], dim=2)  # fmt: skip
            mask = causal_lower_right(longest, prompt + longest)
            answered = sdpa(_gather(query[row], index, count), keys, values, attn_mask=mask, scale=scaling)
            pieces += [answered[i, :, :length] for i, (_, length) in enumerate(completions)]
        used = prompt + sum(length for _, length in completions)
        if used < layout.width:
            pieces.append(query.new_zeros(query.shape[1], layout.width - used, query.shape[3]))
        outputs.append(torch.cat(pieces, dim=1))  # [H, L, D]
    return torch.stack(outputs).transpose(1, 2).contiguous(), None


@functools.lru_cache(maxsize=8)
def _indexes(layout: PackedRows, device: torch.device) -> tuple[torch.Tensor | None, ...]:
    """Per row, each completion's positions, its last one repeated to the row's longest (the repeats come after every
    real token, so under the bottom-right causal mask no real query reaches them); made once per batch and device,
    not in each layer (and its recomputation) again."""
    indexes = []
    for _, completions in layout.rows:
        if not completions:
            indexes.append(None)
            continue
        longest = max(length for _, length in completions)
        steps = torch.arange(longest)
        index = torch.stack([start + steps.clamp(max=length - 1) for start, length in completions]).reshape(-1)
        indexes.append(index.to(device))
    return tuple(indexes)


def _gather(tensor: torch.Tensor, index: torch.Tensor, count: int) -> torch.Tensor:
    """[H, L, D] of one row -> [count, H, longest, D]: the positions `index` lists, completion by completion."""
    heads, _, dim = tensor.shape
    return tensor.index_select(1, index).reshape(heads, count, -1, dim).transpose(0, 1)


def use_packed_attention(model: torch.nn.Module) -> bool:
    """Switch the language model of `model` from sdpa to `packed_sdpa_attention` (the same as sdpa on every call that
    carries no PackedRows). True when it now runs it; False, leaving the model as it is, for other kernels (eager,
    flash, context parallel's)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    text = model.config.get_text_config()
    if text._attn_implementation == NAME:
        return True
    if text._attn_implementation != "sdpa":
        return False
    AttentionInterface.register(NAME, packed_sdpa_attention)
    # transformers builds masks per kernel name and builds none for a name it does not know (a left-padded batch
    # would lose its padding): the masks are sdpa's
    AttentionMaskInterface.register(NAME, sdpa_mask)
    text._attn_implementation = NAME
    return True
