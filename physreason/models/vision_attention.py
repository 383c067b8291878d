"""Qwen-VL vision attention without the per-segment loop: one batched kernel call per distinct segment length.

transformers' `Qwen2_5_VLVisionAttention`, unless a flash kernel is configured, splits the packed
sequence at `cu_seqlens` and calls the attention kernel once per window: a 12-frame clip makes
hundreds of tiny SDPA launches per layer. Qwen3-VL's vision attention (`Qwen3VLVisionAttention`, and the
MoE model's copy) has no windows but the same loop over `cu_seqlens`, one segment per frame pair and per
image: a 64-frame clip makes 32 launches per layer, all of one length, which here become one. Here the segments are grouped by length, each group runs
as one [n_segments, heads, length, head_dim] call of the same kernel (sdpa or eager, whichever was
configured), and the outputs go back to sequence order. Attention within each segment is unchanged,
so the result equals transformers' path up to floating-point summation order.

How it is hooked in: an attention function registered with transformers' `AttentionInterface`
under a name containing "flash" and set on the vision tower's config only. The module sends every
implementation whose name contains "flash" (`is_flash_attention_requested`) down its cu_seqlens
branch, which hands the whole packed sequence and `cu_seqlens` to the registered function in one
call. This was chosen over replacing the modules' `forward` because transformers keeps its own
projections, rotary embedding and output projection (a copy of them would drift silently when they
change), the contract relied on (the "flash" substring test, the `cu_seq_lens_q` keyword, [1, heads,
seq, head_dim] in and [1, seq, heads, head_dim] out) is the one transformers' own flash-attention
integration depends on, and it is identical in transformers 5.17 and 5.23. The setting lives in
`_attn_implementation`, which `save_pretrained` never writes, so exported checkpoints are unaffected;
the language model's config keeps its own implementation. Before switching, a probe module built
from the tower's config is run both ways on CPU; if its output differs or transformers does not
take the cu_seqlens branch, the tower keeps transformers' path and a warning is logged.
"""

from __future__ import annotations

import copy
import logging
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)

ATTENTION_CLASSES = ("Qwen2_5_VLVisionAttention", "Qwen3VLVisionAttention", "Qwen3VLMoeVisionAttention")
# Kernels the grouped path wraps; flash kernels take cu_seqlens natively and need no grouping.
WRAPPED_KERNELS = ("sdpa", "eager")


def registered_name(kernel: str) -> str:
    """The AttentionInterface name of the grouped wrapper around `kernel` ("flash" routes to the cu_seqlens branch)."""
    return f"physreason_grouped_{kernel}_flash_branch"


@dataclass(frozen=True)
class SegmentGroups:
    """Segments of a packed sequence grouped by length: group g holds counts[g] segments of lengths[g] tokens."""

    lengths: tuple[int, ...]
    counts: tuple[int, ...]
    order: torch.Tensor | None  # [seq] token positions, group by group; None when sequence order is already grouped
    restore: torch.Tensor | None  # [seq] inverse of order


def group_segments(cu_seqlens: torch.Tensor) -> SegmentGroups:
    """Group the segments delimited by `cu_seqlens` ([n + 1], starting at 0) by length; one host sync."""
    bounds = cu_seqlens.tolist()
    by_length: dict[int, list[int]] = {}
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        if end > start:
            by_length.setdefault(end - start, []).append(start)
    lengths = tuple(by_length)
    starts = [start for length in lengths for start in by_length[length]]
    counts = tuple(len(by_length[length]) for length in lengths)
    if starts == sorted(starts):
        return SegmentGroups(lengths, counts, None, None)
    offsets = torch.arange(max(lengths))
    order = torch.cat(
        [(torch.tensor(by_length[length])[:, None] + offsets[:length]).flatten() for length in lengths]
    )  # [seq]
    restore = torch.empty_like(order)
    restore[order] = torch.arange(order.numel())
    return SegmentGroups(lengths, counts, order.to(cu_seqlens.device), restore.to(cu_seqlens.device))


class _GroupsCache:
    """The SegmentGroups of the last few cu_seqlens tensors, by identity (all window layers of a forward share one)."""

    def __init__(self, size: int = 8) -> None:
        self.size = size
        self.entries: list[tuple[weakref.ref[torch.Tensor], SegmentGroups]] = []

    def get(self, cu_seqlens: torch.Tensor) -> SegmentGroups:
        # Identity through weak references: a freed tensor's id or address can be reused by a new one.
        self.entries = [(ref, groups) for ref, groups in self.entries if ref() is not None]
        for ref, groups in self.entries:
            if ref() is cu_seqlens:
                return groups
        groups = group_segments(cu_seqlens)
        self.entries = [*self.entries[-(self.size - 1) :], (weakref.ref(cu_seqlens), groups)]
        return groups


_CACHE = _GroupsCache()
# The keyword a vision block's pre-hook adds to its call: the SegmentGroups of its cu_seqlens, which transformers'
# block and attention pass on to the attention function with their other keywords.
GROUPS_KEYWORD = "physreason_segment_groups"


def _groups_before_the_block(block: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Forward pre-hook of a vision block: the segment groups of its cu_seqlens, found before the block's forward.

    Finding them reads cu_seqlens on the host (one sync; cached by tensor for the blocks after). Inside the forward,
    which activation checkpointing wraps, that read would stop torch.compile from tracing the checkpointed block (a
    graph break, and a cache write, inside torch.utils.checkpoint make dynamo run the whole block eagerly); in the
    hook it runs before the checkpoint, and the forward receives the groups as a plain argument.
    """
    cu_seqlens = kwargs.get("cu_seqlens", args[1] if len(args) > 1 else None)
    if not isinstance(cu_seqlens, torch.Tensor) or GROUPS_KEYWORD in kwargs:
        return None
    return args, {**kwargs, GROUPS_KEYWORD: _groups_of(cu_seqlens)}


@torch.compiler.disable  # a host read and weak references: run as Python, before the traced forward
def _groups_of(cu_seqlens: torch.Tensor) -> SegmentGroups:
    return _CACHE.get(cu_seqlens)


def grouped_attention(
    kernel: Callable[..., tuple[torch.Tensor, Any]],
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    groups: SegmentGroups,
    **kwargs: Any,
) -> torch.Tensor:
    """Attention within each segment of packed [1, heads, seq, head_dim] q/k/v, one `kernel` call per length.

    Returns [1, seq, heads, head_dim] in sequence order, as transformers' attention functions do.
    """
    # [seq, heads, head_dim] views, permuted into group order when segments of one length are not adjacent
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    if groups.order is not None:
        q, k, v = (t.index_select(0, groups.order) for t in (q, k, v))
    outputs = []
    offset = 0
    for length, count in zip(groups.lengths, groups.counts, strict=True):
        size = length * count
        batch = [t[offset : offset + size].unflatten(0, (count, length)).transpose(1, 2) for t in (q, k, v)]
        out = kernel(module, *batch, attention_mask=None, **kwargs)[0]  # [count, length, heads, head_dim]
        outputs.append(out.flatten(0, 1))
        offset += size
    if not outputs:  # an empty sequence
        return query.transpose(1, 2)
    out = torch.cat(outputs) if len(outputs) > 1 else outputs[0]  # [seq, heads, head_dim]
    if groups.restore is not None:
        out = out.index_select(0, groups.restore)
    return out.unsqueeze(0)


def _wrapper(kernel: Callable[..., tuple[torch.Tensor, Any]]) -> Callable[..., tuple[torch.Tensor, None]]:
    """An AttentionInterface function for the cu_seqlens branch that runs `kernel` grouped by segment length."""

    def attention(
        module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any, **kwargs
    ) -> tuple[torch.Tensor, None]:
        cu_seqlens = kwargs.pop("cu_seq_lens_q", None)
        if cu_seqlens is None or attention_mask is not None:
            # Registered for the vision tower's cu_seqlens branch only; anything else means transformers changed.
            raise RuntimeError(
                "grouped vision attention expects cu_seq_lens_q and no attention mask (the Qwen2.5-VL vision "
                "tower's cu_seqlens branch); this transformers version calls it differently"
            )
        for name in ("cu_seq_lens_k", "max_length_q", "max_length_k"):
            kwargs.pop(name, None)
        groups = kwargs.pop(GROUPS_KEYWORD, None)  # from the block's pre-hook (_groups_before_the_block)
        if groups is None:
            groups = _CACHE.get(cu_seqlens)
        return grouped_attention(kernel, module, query, key, value, groups, **kwargs), None

    return attention


def _kernel(attention: nn.Module, name: str) -> Callable[..., tuple[torch.Tensor, Any]]:
    """The function transformers' module itself calls for implementation `name` (eager lives in its modeling file)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager = sys.modules[type(attention).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS.get_interface(name, eager)


def _probe_matches(attention: nn.Module, native: str, grouped: str) -> bool:
    """Run a fresh module of `attention`'s class (float32, CPU) with both implementations on windows of unequal length."""
    config = copy.deepcopy(attention.config)
    # CPU even inside a default-device context; the caller's random stream is left where it was
    with torch.device("cpu"), torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(0)
        probe = type(attention)(config).float().eval()
        head_dim = config.hidden_size // config.num_heads
        hidden = torch.randn(10, config.hidden_size)  # [seq, hidden]
        rotary = (torch.randn(10, head_dim), torch.randn(10, head_dim))  # cos, sin: [seq, head_dim]
        cu_seqlens = torch.tensor([0, 3, 7, 10], dtype=torch.int32)  # lengths 3, 4, 3: groups out of sequence order
        outputs = []
        for name in (native, grouped):
            config._attn_implementation = name
            outputs.append(probe(hidden, cu_seqlens=cu_seqlens, position_embeddings=rotary, max_seqlen=4))
    return torch.allclose(outputs[0], outputs[1], rtol=1e-5, atol=1e-5)


def use_grouped_vision_attention(model: nn.Module) -> bool:
    """Switch a Qwen2.5-VL or Qwen3-VL model's (or bare vision tower's) sdpa/eager vision attention to the grouped path.

    Returns True when the vision attention now runs grouped (also when it already did); False, leaving the
    model untouched, for models without such vision attention, flash or other kernels, and (with a
    warning) when this transformers version's module does not behave as expected.
    """
    attentions = [m for m in model.modules() if type(m).__name__ in ATTENTION_CLASSES]
    if not attentions:
        return False
    configs = list({id(m.config): m.config for m in attentions}.values())
    current = {c._attn_implementation for c in configs}
    if current <= {registered_name(kernel) for kernel in WRAPPED_KERNELS}:
        return True
    if len(current) != 1 or not current <= set(WRAPPED_KERNELS):
        log.info("vision attention %s left as it is (grouping applies to %s)", sorted(current), WRAPPED_KERNELS)
        return False
    native = current.pop()
    grouped = registered_name(native)
    from transformers import AttentionInterface

    try:
        AttentionInterface.register(grouped, _wrapper(_kernel(attentions[0], native)))
        matches = _probe_matches(attentions[0], native, grouped)
    except Exception as exc:  # any failure means this transformers version's module is not the one understood here
        log.warning("grouped vision attention not applied (transformers' %s path kept): probe failed: %r", native, exc)
        return False
    if not matches:
        log.warning("grouped vision attention not applied (transformers' %s path kept): probe output differs", native)
        return False
    for config in configs:
        config._attn_implementation = grouped
    attention_ids = {id(m) for m in attentions}
    for block in model.modules():
        if any(id(child) in attention_ids for child in block.children()) and not getattr(block, "_physreason_groups_hook", False):
            block.register_forward_pre_hook(_groups_before_the_block, with_kwargs=True)
            block._physreason_groups_hook = True
    return True
