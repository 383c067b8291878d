"""The language model's attention over packed GRPO rows, computed from their spans instead of their [L, L] mask.

A packed row (train/policy.py) holds a prompt once and then each of its completions; the prompt attends causally to
itself, each completion to the whole prompt and causally to itself. As a [R, 1, L, L] boolean mask, sdpa cannot use
its flash kernel and computes every one of the L x L scores, most of them masked (a 580-token prompt with 8
completions of 256: 6.9 M scores a head and layer, 1.6 M of them needed). Here the batch becomes variable-length
sequences and one attention call a layer: per row the prompt (queries and keys: the prompt, causal), then each
completion (queries: its tokens; keys: the prompt's, then its own), causal aligned to the bottom right (query t of a
completion sees the whole prompt and its tokens 0..t). On CUDA in bf16/fp16 that is flash attention's variable-length
kernel (`torch.ops.aten._flash_attention_forward` with cumulative lengths, the kernel under
`torch.nn.attention.varlen`; grouped key/value heads as they are, no repeat), else a reference loop of sdpa calls that
reads the same cumulative lengths. The keys hold the prompt once per completion and once for itself (key/value heads
only); the scores computed are the needed ones.

grpo.packed_attention chooses it ("spans"; "mask", the default, is sdpa under the mask). The layout travels on the
mask tensor itself (`attach`), which transformers hands to every attention call of the language model unchanged (a 4D
mask is taken as prepared), recomputed blocks included; calls without it (the vision tower's own config, a plain
causal batch, a padded batch's mask, which transformers builds as for sdpa) run transformers' sdpa exactly as before.
Padding positions of a row come out as zeros (the dense path gave each the value at its own position): nothing reads
them.

A row-by-row version (two sdpa calls a row, the prompt's keys copied with every query head) was 0.8x the mask path's
training time on an H200 (bench/RESULTS.md, 2026-11-28): host-bound, a loop of small kernels in every layer.
"""

from __future__ import annotations

import functools
import itertools
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


def dense_mask(layout: PackedRows, device: torch.device | str = "cpu") -> torch.Tensor:
    """The [R, 1, L, L] boolean mask of packed rows (train/policy.py's; padding attends to itself)."""
    mask = torch.eye(layout.width, dtype=torch.bool, device=device).repeat(len(layout.rows), 1, 1, 1)
    for row, (prompt, completions) in enumerate(layout.rows):
        mask[row, 0, :prompt, :prompt] = torch.ones(prompt, prompt, dtype=torch.bool, device=device).tril()
        for start, length in completions:
            mask[row, 0, start : start + length, :prompt] = True
            mask[row, 0, start : start + length, start : start + length] = torch.ones(
                length, length, dtype=torch.bool, device=device
            ).tril()
    return mask


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
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    plan = kwargs.pop(PLAN_KEYWORD, None)  # from the decoder layer's pre-hook (_plan_before_the_layer)
    if plan is None:
        plan = _plan_of(attention_mask)
    if plan is None or dropout or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    rows, heads, width, dim = query.shape
    flat_q = query.transpose(1, 2).reshape(rows * width, heads, dim)  # [R * L, H, D]
    flat_k = key.transpose(1, 2).reshape(rows * width, key.shape[1], dim)  # [R * L, H_kv, D]
    flat_v = value.transpose(1, 2).reshape(rows * width, value.shape[1], dim)
    out = _varlen(
        flat_q.index_select(0, plan.queries), flat_k.index_select(0, plan.keys), flat_v.index_select(0, plan.keys),
        plan, scaling, width,
    )  # [T_q, H, D]
    full = out.new_zeros(rows * width, heads, dim).index_copy(0, plan.queries, out)
    return full.view(rows, width, heads, dim), None


@dataclass(frozen=True)
class _Plan:
    """The variable-length sequences of a batch of packed rows, as flat positions (row * L + column)."""

    queries: torch.Tensor  # [T_q] every real token, sequence by sequence (each row's own order)
    keys: torch.Tensor  # [T_k] each sequence's keys: the prompt's; a completion's: the prompt's, then its own
    cu_q: torch.Tensor  # [N + 1] int32 cumulative query lengths
    cu_k: torch.Tensor  # [N + 1] int32 cumulative key lengths
    bounds: tuple[tuple[int, int, int, int], ...]  # per sequence (q start, q end, k start, k end): the reference's


@functools.lru_cache(maxsize=8)
def _plan(layout: PackedRows, device: torch.device) -> _Plan:
    """Made once per batch and device (a layout is hashable), not in each layer and its recomputation again."""
    queries, keys, q_lengths, k_lengths = [], [], [], []
    for row, (prompt, completions) in enumerate(layout.rows):
        base = row * layout.width
        prompt_positions = list(range(base, base + prompt))
        if prompt:
            queries += prompt_positions
            keys += prompt_positions
            q_lengths.append(prompt)
            k_lengths.append(prompt)
        for start, length in completions:
            own = list(range(base + start, base + start + length))
            queries += own
            keys += prompt_positions + own
            q_lengths.append(length)
            k_lengths.append(prompt + length)

    q_bounds, k_bounds = [0, *itertools.accumulate(q_lengths)], [0, *itertools.accumulate(k_lengths)]
    return _Plan(
        torch.tensor(queries, dtype=torch.long, device=device),
        torch.tensor(keys, dtype=torch.long, device=device),
        torch.tensor(q_bounds, dtype=torch.int32, device=device),
        torch.tensor(k_bounds, dtype=torch.int32, device=device),
        tuple(zip(q_bounds, q_bounds[1:], k_bounds, k_bounds[1:], strict=False)),
    )


def _varlen(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: _Plan, scale: float | None, width: int
) -> torch.Tensor:
    """Causal (bottom-right) attention of each sequence `plan` delimits: [T_q, H, D] queries, [T_k, H_kv, D] keys and
    values -> [T_q, H, D]. `width` (the rows' L, at least any sequence's query or key count) bounds the sequences for
    the kernel's launch: a bound from the tensors' shape, not the batch's own maxima, keeps one compiled graph for
    every batch (torch.compile would specialise on plain integers and recompile for each new maximum); each
    sequence's blocks past its own length exit at once."""
    if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16):
        # flash attention's causal mask is aligned to the bottom right of each sequence's (q, k) block
        out = torch.ops.aten._flash_attention_forward(
            query, key, value, plan.cu_q, plan.cu_k, width, width, 0.0, True, False, scale=scale
        )
        return out[0]
    return _reference(query, key, value, plan.bounds, scale)


def _reference(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: tuple[tuple[int, int, int, int], ...],
    scale: float | None,
) -> torch.Tensor:
    """What the flash call computes, one sdpa call a sequence (CPU, float32; the tests' path)."""
    groups = query.shape[1] // key.shape[1]
    pieces = []
    for q0, q1, k0, k1 in bounds:
        q = query[q0:q1].transpose(0, 1)[None]  # [1, H, n, D]
        k = key[k0:k1].transpose(0, 1).repeat_interleave(groups, 0)[None]  # [1, H, m, D]
        v = value[k0:k1].transpose(0, 1).repeat_interleave(groups, 0)[None]
        # bottom-right causal: query i of n sees keys 0 .. m - n + i of m
        mask = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool, device=query.device).tril(k1 - k0 - (q1 - q0))
        pieces.append(torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)[0].transpose(0, 1))
    return torch.cat(pieces) if pieces else query.new_zeros(query.shape)


PLAN_KEYWORD = "physreason_packed_plan"  # the keyword the pre-hook adds; decoder layers pass it to attention


def _plan_before_the_layer(layer: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Forward pre-hook of a decoder layer: the packed rows' plan (cached per batch), made before the layer's forward.

    Made inside the forward, which activation checkpointing wraps, reading the layout off the mask and the cache would
    stop torch.compile from tracing the checkpointed layer (dynamo runs a checkpointed region eagerly when it cannot
    trace all of it); in the hook it runs before the checkpoint and the forward receives the plan as an argument.
    """
    if PLAN_KEYWORD in kwargs:
        return None
    plan = _plan_of(kwargs.get("attention_mask"))
    return None if plan is None else (args, {**kwargs, PLAN_KEYWORD: plan})


@torch.compiler.disable  # an attribute of the mask and a cache: run as Python, before the traced forward
def _plan_of(mask: object) -> _Plan | None:
    """The plan of the rows `mask` carries; None without a layout or for a mask of another width (a context-parallel
    shard's)."""
    layout = layout_of(mask)
    if layout is None or mask.shape[-1] != layout.width:
        return None
    return _plan(layout, mask.device)


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
    from physreason.models.loading import decoder_layers

    for layer in decoder_layers(model):
        layer.register_forward_pre_hook(_plan_before_the_layer, with_kwargs=True)
    return True
