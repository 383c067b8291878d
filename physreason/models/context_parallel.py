"""Context (sequence) parallelism for the language model: Ulysses all-to-all attention over a group of ranks.

Why Ulysses and not ring attention: every layer but attention acts on each token alone, so with the sequence
split over `cp` ranks only attention needs the other ranks' tokens. Ulysses swaps the split before attention
(one all-to-all: each rank gets the whole sequence for heads / cp of the heads) and back after it (a second
all-to-all), so the attention kernel itself is the ordinary one, padding, packing and GRPO's packed-completion
masks included. Ring attention would need a kernel that merges partial softmaxes block by block, and causal
masks leave its ranks unevenly loaded. The price: cp must divide the query heads (Qwen2.5-VL-7B 28, Qwen3-VL-8B
32, per tensor-parallel rank); where it does not, `check_heads` refuses with the divisors that work. Key/value
heads that cp does not divide (4 KV heads with cp 8) are repeated first, each copy serving the same query heads
it served before, so the result is unchanged.

What a rank does (`ContextParallel.install`):
- The vision tower's work is split by temporal patches (one image, or one frame pair of a video): Qwen-VL vision
  attention never crosses them (its cu_seqlens restart at each), nor do its rotary and learned position
  embeddings or the 2x2 merger, so each rank encodes a contiguous share of the patches and the merged features
  (and Qwen3-VL's DeepStack features) are all-gathered. Backward sums each feature's gradient over the ranks.
- Embedding lookup, the placement of visual features and the M-RoPE positions stay on the full sequence (the
  positions come from the data pipeline), then a pre-hook on the language model pads the sequence to a multiple
  of cp and keeps this rank's contiguous slice of the embeddings, positions and DeepStack rows. Positions are
  those of one process, sliced, never recomputed.
- The attention mask of the full sequence (causal, or causal within packed samples, with padding) goes to every
  layer as a 4D mask; a plain causal sequence needs none (the kernel's causal flag). Padding added for cp is
  never a key, and each query may see itself, so no softmax row is empty.
- The language model returns this rank's slice of the hidden states. Callers keep the positions they own
  (`SequenceShard`) and sum over the group with `sum_over_context`, whose backward passes the gradient through
  unchanged: each rank then back-propagates only its own tokens' terms, the all-to-alls carry the cross-rank
  parts, and FSDP2's reduction over the dp x cp ranks adds the pieces into one process's gradient.

The attention runs through transformers' AttentionInterface under its own name, set on the text config only
(`_attn_implementation` is never saved, so exports are unaffected); transformers' projections, norms and rotary
stay its own. The local kernel is torch's scaled_dot_product_attention, for configs that asked for sdpa or eager.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from physreason.errors import ConfigError
from physreason.models.packed_attention import NAME as PACKED_SDPA

ULYSSES = "physreason_ulysses_sdpa"
# Language-model attention implementations whose math the Ulysses kernel reproduces.
SUPPORTED_KERNELS = ("sdpa", "eager", ULYSSES, PACKED_SDPA)  # packed_attention's: sdpa with a fast path


@dataclass(frozen=True)
class SequenceShard:
    """This rank's contiguous slice [start, stop) of a sequence of `length` tokens padded to `padded` (a multiple of cp)."""

    length: int
    padded: int
    start: int
    stop: int

    @classmethod
    def of(cls, length: int, size: int, rank: int) -> SequenceShard:
        """The slice rank `rank` of `size` holds of a `length`-token sequence."""
        padded = -(-length // size) * size
        chunk = padded // size
        return cls(length, padded, rank * chunk, (rank + 1) * chunk)

    def take(self, tensor: torch.Tensor, dim: int, fill: float | int | bool = 0) -> torch.Tensor:
        """Pad `tensor` along `dim` from `length` to `padded` with `fill`, then keep [start, stop) of it."""
        if self.padded > self.length:
            shape = list(tensor.shape)
            shape[dim] = self.padded - self.length
            tensor = torch.cat([tensor, tensor.new_full(shape, fill)], dim=dim)
        return tensor.narrow(dim, self.start, self.stop - self.start)

    def owned(self, columns: torch.Tensor) -> torch.Tensor:
        """Bool mask of the sequence positions `columns` (any shape) that fall in this rank's slice."""
        return (columns >= self.start) & (columns < self.stop)


class _SeqToHeads(torch.autograd.Function):
    """[B, H, L / cp, D] sequence-split -> [B, H / cp, L, D] head-split (all-to-all); backward the inverse."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _heads_to_seq(grad.contiguous(), ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    """[B, H / cp, L, D] head-split -> [B, H, L / cp, D] sequence-split (all-to-all); backward the inverse."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _seq_to_heads(grad.contiguous(), ctx.group), None


def _seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    size = dist.get_world_size(group)
    b, h, n, d = x.shape
    send = x.reshape(b, size, h // size, n, d).permute(1, 0, 2, 3, 4).contiguous()  # [cp, B, H/cp, L/cp, D]
    received = torch.empty_like(send)  # [cp (sequence chunks), B, H/cp, L/cp, D]
    dist.all_to_all_single(received, send, group=group)
    return received.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * n, d)


def _heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    size = dist.get_world_size(group)
    b, h, n, d = x.shape
    send = x.reshape(b, h, size, n // size, d).permute(2, 0, 1, 3, 4).contiguous()  # [cp, B, H/cp, L/cp, D]
    received = torch.empty_like(send)  # [cp (head chunks), B, H/cp, L/cp, D]
    dist.all_to_all_single(received, send, group=group)
    return received.permute(1, 0, 2, 3, 4).reshape(b, size * h, n // size, d)


class _SumOverContext(torch.autograd.Function):
    """Forward: sum over the group. Backward: the gradient unchanged (each rank back-propagates its own part)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        total = x.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def sum_over_context(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum of each rank's partial `x` over the context-parallel group; backward leaves each rank its own gradient.

    For values every rank then uses identically (the loss, the completion log-probs): each rank's backward seeds
    only the terms it computed, and the gradient reduction over the ranks adds them up once.
    """
    return _SumOverContext.apply(x, group)


class _GatherRows(torch.autograd.Function):
    """All-gather rows of unequal counts in rank order; backward sums the gradient over ranks and keeps own rows."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, counts: list[int], group: dist.ProcessGroup) -> torch.Tensor:
        rank = dist.get_rank(group)
        ctx.group, ctx.counts, ctx.rank = group, counts, rank
        widest = max(counts)
        padded = torch.zeros(widest, *x.shape[1:], dtype=x.dtype, device=x.device)
        padded[: x.shape[0]] = x
        pieces = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(pieces, padded.contiguous(), group=group)
        return torch.cat([piece[:count] for piece, count in zip(pieces, counts, strict=True)])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)  # every rank used the gathered rows; gloo has no reduce-scatter
        start = sum(ctx.counts[: ctx.rank])
        return total[start : start + ctx.counts[ctx.rank]], None, None


def split_patch_units(grid_thw: torch.Tensor, size: int) -> list[tuple[int, int]]:
    """Contiguous shares of the temporal patches of `grid_thw` ([n, 3]) for `size` ranks: (first, end) unit indexes.

    A unit is one temporal patch (t = 1 slice) of one image or video, h x w patches; shares are cut where the
    running patch count first reaches each rank's even share, so they are balanced up to one unit.
    """
    units = [int(h * w) for t, h, w in grid_thw.tolist() for _ in range(int(t))]
    total = sum(units)
    bounds, running, rank = [0], 0, 1
    for index, count in enumerate(units):
        running += count
        while rank < size and running * size >= rank * total:
            bounds.append(index + 1)
            rank += 1
    bounds += [len(units)] * (size + 1 - len(bounds))
    return [(bounds[r], bounds[r + 1]) for r in range(size)]


def _local_grid(grid_thw: torch.Tensor, first: int, end: int) -> tuple[torch.Tensor, int, int]:
    """The grid rows of units [first, end) (consecutive units of one item merged) and their patch rows [start, stop)."""
    rows: list[list[int]] = []  # [t, h, w, item]
    unit = patch = 0
    start = stop = 0
    for item, (t, h, w) in enumerate(grid_thw.tolist()):
        for _ in range(int(t)):
            if first <= unit < end:
                if not rows:
                    start = patch
                if rows and rows[-1][3] == item:
                    rows[-1][0] += 1
                else:
                    rows.append([1, h, w, item])
                stop = patch + h * w
            unit += 1
            patch += h * w
    grid = torch.tensor([r[:3] for r in rows], dtype=grid_thw.dtype).reshape(-1, 3).to(grid_thw.device)
    return grid, start, stop


def check_heads(heads: int, kv_heads: int, cp_size: int, tp_size: int = 1) -> None:
    """Raise ConfigError unless cp_size divides the query heads each tensor-parallel rank holds (Ulysses' one limit)."""
    local = heads // tp_size
    if local % cp_size:
        working = [n for n in range(1, local + 1) if local % n == 0]
        raise ConfigError(
            f"policy.parallelism.cp_size = {cp_size} must divide the language model's {local} query heads per "
            f"tensor-parallel rank ({heads} heads / tp_size {tp_size}): Ulysses context parallelism splits heads; "
            f"use cp_size in {working}"
        )
    del kv_heads  # key/value heads that cp does not divide are repeated (see the module docstring)


def ulysses_attention(group: dist.ProcessGroup):
    """An AttentionInterface function: all-to-all to whole sequences of heads / cp heads, sdpa, all-to-all back."""

    def attention(
        module: nn.Module,
        query: torch.Tensor,  # [B, H, L / cp, D]
        key: torch.Tensor,  # [B, H_kv, L / cp, D]
        value: torch.Tensor,  # [B, H_kv, L / cp, D]
        attention_mask: torch.Tensor | None,  # [B, 1, L, L] bool over the full (padded) sequence, None: causal
        dropout: float = 0.0,
        scaling: float | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        size = dist.get_world_size(group)
        heads, kv_heads = query.shape[1], key.shape[1]
        if heads % size:
            raise ConfigError(f"context parallel size {size} does not divide the {heads} attention heads of this rank")
        if kv_heads % size:
            # Each copy keeps serving the query heads its original served: copy j is head j // repeat.
            repeat = size // math.gcd(kv_heads, size)
            key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
        q, k, v = (_SeqToHeads.apply(t.contiguous(), group) for t in (query, key, value))  # [B, H / cp, L, D]
        out = F.scaled_dot_product_attention(
            q, k, v,
            attn_mask=attention_mask,
            is_causal=attention_mask is None,
            dropout_p=dropout if module.training else 0.0,
            scale=scaling,
            enable_gqa=q.shape[1] != k.shape[1],
        )  # [B, H / cp, L, D]
        out = _HeadsToSeq.apply(out.contiguous(), group)  # [B, H, L / cp, D]
        return out.transpose(1, 2).contiguous(), None  # [B, L / cp, H, D], as transformers' kernels return

    return attention


def full_attention_mask(
    attention_mask: torch.Tensor | None,  # [B, L] padding, [B, 1, L, L] bool, or None
    text_positions: torch.Tensor | None,  # [B, L] text positions (restarts mark packed samples), or None
    batch: int,
    shard: SequenceShard,
    device: torch.device,
) -> torch.Tensor | None:
    """[B, 1, P, P] bool (True = may attend) over the cp-padded sequence, or None when plain causal attention is exact.

    Mirrors transformers' masks: causal; a 2D mask hides padded keys; without one, text positions that do not
    advance by 1 start a new packed sample. cp's padding comes last, so causal attention never reaches it from
    a real token; each query may see itself, so no row is empty.
    """
    length, padded = shard.length, shard.padded
    if attention_mask is not None and attention_mask.ndim == 4:
        allowed = attention_mask.to(device=device, dtype=torch.bool)
        if padded > length:
            allowed = F.pad(allowed, (0, padded - length, 0, padded - length), value=False)
    else:
        valid = attention_mask.to(device=device, dtype=torch.bool) if attention_mask is not None else None  # [B, L]
        segments = None
        if attention_mask is None and text_positions is not None:
            positions = text_positions.to(device).expand(batch, -1)
            starts = torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1) != 1
            segments = starts.long().cumsum(-1)  # [B, L]
            if not bool(segments.any()):
                segments = None
        if segments is None and (valid is None or bool(valid.all())):
            return None
        causal = torch.ones(padded, padded, dtype=torch.bool, device=device).tril()
        allowed = causal.expand(batch, padded, padded).clone()  # [B, P, P]
        if valid is not None:
            allowed &= F.pad(valid, (0, padded - length), value=False)[:, None, :]
        if segments is not None:
            segments = F.pad(segments, (0, padded - length), value=-1)  # cp's padding: a segment of its own
            allowed &= segments[:, :, None] == segments[:, None, :]
        allowed = allowed[:, None]
    return allowed | torch.eye(padded, dtype=torch.bool, device=device)


def language_model(model: nn.Module) -> nn.Module:
    """The decoder stack a transformers model runs on embeddings (the VL models' language_model, else model.model)."""
    inner = model.model
    return getattr(inner, "language_model", inner)


class ContextParallel:
    """Splits one model's language-model sequence and vision-tower patches over a process group (module docstring)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._tower_counts: list[int] | None = None  # merged feature rows per rank of the tower call in flight

    def shard(self, length: int) -> SequenceShard:
        """This rank's slice of a `length`-token sequence."""
        return SequenceShard.of(length, self.size, self.rank)

    def install(self, model: nn.Module, tp_size: int = 1) -> None:
        """Hook the language model and the vision tower of `model` and switch its text attention to Ulysses."""
        from transformers import AttentionInterface

        text = model.config.get_text_config()
        if text._attn_implementation not in SUPPORTED_KERNELS:
            raise ConfigError(
                f"policy.parallelism.cp_size = {self.size} runs attention through sdpa, but the model is set to "
                f"{text._attn_implementation!r}: set model.attn_implementation = 'sdpa' (or 'eager')"
            )
        check_heads(text.num_attention_heads, text.num_key_value_heads, self.size, tp_size)
        AttentionInterface.register(ULYSSES, ulysses_attention(self.group))
        text._attn_implementation = ULYSSES
        language_model(model).register_forward_pre_hook(self._shard_sequence, with_kwargs=True)
        model.context_parallel = self
        tower = getattr(model.model, "visual", None)
        if tower is not None:
            self._merge = tower.spatial_merge_size**2
            tower.register_forward_pre_hook(self._split_patches, with_kwargs=True)
            tower.register_forward_hook(self._gather_features)

    def _shard_sequence(self, _module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        """Pre-hook: the full mask for attention, then this rank's slice of embeddings, positions, DeepStack rows."""
        if args:
            raise TypeError("context parallel expects the language model to be called with keyword arguments")
        embeds, ids = kwargs.get("inputs_embeds"), kwargs.get("input_ids")
        source = embeds if embeds is not None else ids
        batch, length = source.shape[:2]
        shard = self.shard(length)
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = torch.arange(length, device=source.device).expand(batch, -1)  # [B, L]
        text_positions = positions if positions.ndim == 2 else positions[0] if positions.shape[0] == 4 else None
        kwargs["attention_mask"] = full_attention_mask(
            kwargs.get("attention_mask"), text_positions, batch, shard, source.device
        )
        kwargs["position_ids"] = shard.take(positions, dim=-1)
        if embeds is not None:
            kwargs["inputs_embeds"] = shard.take(embeds, dim=1)
        else:
            kwargs["input_ids"] = shard.take(ids, dim=1)
        visual = kwargs.get("visual_pos_masks")
        if visual is not None and kwargs.get("deepstack_visual_embeds") is not None:
            order = visual.flatten().long().cumsum(0).reshape(visual.shape) - 1  # [B, L] row of each visual token
            local = shard.take(visual, dim=1, fill=False)  # [B, L / cp]
            rows = shard.take(order, dim=1)[local]  # [local visual tokens]
            kwargs["visual_pos_masks"] = local
            kwargs["deepstack_visual_embeds"] = [e.index_select(0, rows.to(e.device)) for e in kwargs["deepstack_visual_embeds"]]
        return args, kwargs

    def _split_patches(self, _module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        """Tower pre-hook: keep this rank's contiguous share of temporal patches (one unit when it has none)."""
        pixels = args[0] if args else kwargs.pop("hidden_states")
        grid = kwargs["grid_thw"] if "grid_thw" in kwargs else args[1]
        shares = split_patch_units(grid, self.size)
        patches = [int(h * w) for t, h, w in grid.tolist() for _ in range(int(t))]
        self._tower_counts = [sum(patches[a:b]) // self._merge for a, b in shares]
        first, end = shares[self.rank]
        if first == end:  # more ranks than patches: encode one unit anyway (FSDP2 needs the same collectives), drop it
            first, end = 0, 1
        local_grid, start, stop = _local_grid(grid, first, end)
        kwargs["grid_thw"] = local_grid
        return (pixels[start:stop], *args[2:]), kwargs

    def _gather_features(self, _module: nn.Module, _args: tuple, output: Any) -> Any:
        """Tower hook: all-gather the merged (and DeepStack) features of every rank's share, in patch order."""
        counts, self._tower_counts = self._tower_counts, None
        own = counts[self.rank]
        output.pooler_output = _GatherRows.apply(output.pooler_output[:own], counts, self.group)
        deepstack = getattr(output, "deepstack_features", None)
        if deepstack:
            output.deepstack_features = [_GatherRows.apply(f[:own], counts, self.group) for f in deepstack]
        output.last_hidden_state = None  # this rank's patches only: nothing downstream may read it
        return output


def context_of(model: nn.Module) -> ContextParallel | None:
    """The ContextParallel installed on a transformers model, or None when its sequence is not split."""
    return getattr(model, "context_parallel", None)
