"""The GRPO objective as pure tensor functions: token log-probs, masked reductions, clipped policy loss, k3 KL.

Shapes: B sequences (completions), T completion positions, V vocabulary. ``mask`` [B, T] is 1 (or
True) on completion tokens that count and 0 on padding. Every function here is a function of its
tensors only, so it is testable without a model and runs the same on any device.

Loss aggregation (``agg_mode``, the names verl uses):

- ``token-mean``: sum of token losses / number of tokens. Every token weighs the same (DAPO);
  TRL calls this ``bnpo`` (and ``dapo`` when the token count is the global one).
- ``seq-mean-token-mean``: mean over tokens inside each sequence, then over sequences (the original
  GRPO; TRL's ``grpo``). Sequences with no counted token are left out of the outer mean.
- ``seq-mean-token-sum-norm``: sum of token losses / (B * norm_length) (Dr. GRPO; TRL's
  ``dr_grpo``). ``norm_length`` should be a constant, the configured ``[rollout]
  max_response_length``, so that a sequence's weight does not depend on its length nor on the
  batch's padding; it defaults to T. verl divides by T only, without B, which makes the loss scale
  with the micro-batch size; dividing by B keeps it a mean like the two other modes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from physreason.errors import ConfigError

AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
ImportanceSamplingLevel = Literal["token", "sequence"]

# Rows of the vocabulary processed at once in float32: bounds the temporary memory of log-softmax
# and entropy to about 256 MiB whatever B * T is (a 152k-token vocabulary gives 440 rows).
_CHUNK_ELEMENTS = 1 << 26


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is set (over ``dim``, or all); masked entries may hold inf or NaN."""
    selected = torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))
    return selected.sum() if dim is None else selected.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is set (over ``dim``, or all); 0 where nothing is set."""
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def _token_mean(loss_mat: torch.Tensor, mask: torch.Tensor, norm_length: int | None) -> torch.Tensor:
    return masked_mean(loss_mat, mask)


def _seq_mean_token_mean(loss_mat: torch.Tensor, mask: torch.Tensor, norm_length: int | None) -> torch.Tensor:
    seq_loss = masked_mean(loss_mat, mask, dim=-1)  # [B]
    has_tokens = mask.bool().any(dim=-1)  # [B]
    return masked_mean(seq_loss, has_tokens)


def _seq_mean_token_sum_norm(loss_mat: torch.Tensor, mask: torch.Tensor, norm_length: int | None) -> torch.Tensor:
    length = mask.shape[-1] if norm_length is None else norm_length
    return masked_sum(loss_mat, mask) / (mask.shape[0] * length)


_AGGREGATIONS: dict[str, Callable[[torch.Tensor, torch.Tensor, int | None], torch.Tensor]] = {
    "token-mean": _token_mean,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}


def aggregate_loss(
    loss_mat: torch.Tensor, mask: torch.Tensor, mode: AggMode = "token-mean", norm_length: int | None = None
) -> torch.Tensor:
    """Reduce token losses [B, T] under ``mask`` [B, T] to a scalar by ``mode`` (see the module docstring)."""
    if mode not in _AGGREGATIONS:
        raise ConfigError(f"[grpo] loss_agg_mode = {mode!r} is not known; use one of {sorted(_AGGREGATIONS)}.")
    if norm_length is not None and norm_length <= 0:
        raise ValueError(f"norm_length must be positive, got {norm_length}")
    return _AGGREGATIONS[mode](loss_mat, mask, norm_length)


def soft_overlong_penalty(
    lengths: torch.Tensor, max_length: int, buffer_length: int, penalty_factor: float = 1.0
) -> torch.Tensor:
    """DAPO's soft overlong punishment [B] (<= 0) of completion lengths [B], added to each completion's reward.

    0 up to max_length - buffer_length tokens, then falling linearly to -penalty_factor at max_length (and
    -penalty_factor beyond it): (max_length - buffer_length - length) / buffer_length * penalty_factor.
    buffer_length 0 turns it off. verl's reward_model.overlong_buffer (len, penalty_factor) and TRL's
    get_soft_overlong_punishment (soft_punish_cache) compute the same.
    """
    if buffer_length < 0 or buffer_length > max_length or penalty_factor < 0:
        raise ValueError(
            f"need 0 <= buffer_length <= max_length and penalty_factor >= 0, got {buffer_length}, {max_length}, "
            f"{penalty_factor}"
        )
    if buffer_length == 0:
        return torch.zeros(lengths.shape, dtype=torch.float32)
    excess = (lengths.to(torch.float32) - (max_length - buffer_length)).clamp(min=0.0, max=float(buffer_length))
    return -penalty_factor * excess / buffer_length


def mask_truncated(mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """The loss mask [B, T] with every token of a truncated completion (truncated [B] True) cleared.

    A completion cut at max_response_length has no answer to be judged by; TRL's mask_truncated_completions
    (DAPO's overlong filtering) leaves it out of the loss, while it still counts in its group's advantages.
    """
    return mask.bool() & ~truncated.bool().unsqueeze(-1)


def truncated_importance_weights(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, cap: float
) -> torch.Tensor:
    """Truncated importance weights [B, T] = min(exp(old - rollout), cap) on counted tokens, 1 on padding (detached).

    old_logprobs: the policy's before the update; rollout_logprobs: the engine's own log-probs of the tokens it
    sampled (both at the same temperature). Tokens were drawn from the engine's distribution, not the policy's;
    the weight moves the policy-gradient estimate back to the policy, and the cap bounds its variance (Yao et al.
    2025; verl's tis_imp_ratio_cap).
    """
    if cap <= 0:
        raise ValueError(f"the truncation cap must be positive, got {cap}")
    mask = mask.bool()
    log_ratio = (old_logprobs.detach() - rollout_logprobs.detach()).masked_fill(~mask, 0.0)  # [B, T]
    return torch.exp(log_ratio).clamp(max=cap)


# Bounds of a token's log-ratio before exp and of its k3 KL (verl's): a token the policy finds far less likely than the
# reference (a stale or FP8-sampled one) would otherwise give a KL of 5e8 at a gap of 20, a gradient that sets the whole
# clipped step's direction, and inf (then NaN weights) at a gap of 89.
LOG_RATIO_BOUND = 20.0
KL_BOUND = 10.0


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(policy || reference): exp(ref - lp) - (ref - lp) - 1, never negative; the gap is
    clamped to +-LOG_RATIO_BOUND and the estimate to KL_BOUND (no gradient from a token past them)."""
    delta = (ref_logprobs - logprobs).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)  # [B, T]
    return (torch.exp(delta) - delta - 1.0).clamp(max=KL_BOUND)


@dataclass(frozen=True)
class ClipSettings:
    """Settings of the clipped surrogate; a registered policy loss reads what it needs."""

    epsilon_low: float = 0.2
    """The ratio is clipped below at 1 - epsilon_low."""
    epsilon_high: float = 0.2
    """The ratio is clipped above at 1 + epsilon_high (DAPO's clip-higher when > epsilon_low)."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1: for negative advantages the token loss is at most c * |A|; None = off."""
    importance_sampling_level: ImportanceSamplingLevel = "token"
    """'token': one ratio per token (GRPO); 'sequence': exp(mean log-ratio) per sequence (GSPO)."""


# (logprobs [B, T], old_logprobs [B, T], advantages [B, 1] or [B, T], mask [B, T] bool, settings)
#   -> (token losses [B, T], indicators: name -> [B, T] or [B, 1] bool, averaged over the mask as metrics)
PolicyLossFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, ClipSettings],
    tuple[torch.Tensor, dict[str, torch.Tensor]],
]

_POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Register a policy loss ``fn(lp, old_lp, adv, mask, settings) -> (token_loss [B, T], indicators)``."""

    def decorate(fn: PolicyLossFn) -> PolicyLossFn:
        if name in _POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        _POLICY_LOSSES[name] = fn
        return fn

    return decorate


def get_policy_loss(name: str) -> PolicyLossFn:
    """Return the policy loss registered as ``name``, or raise ConfigError listing the known names."""
    if name not in _POLICY_LOSSES:
        raise ConfigError(f"policy loss {name!r} is not known; use one of {sorted(_POLICY_LOSSES)}.")
    return _POLICY_LOSSES[name]


def policy_loss_names() -> list[str]:
    """Names of every registered policy loss, sorted."""
    return sorted(_POLICY_LOSSES)


def _log_importance_weights(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor, level: ImportanceSamplingLevel
) -> torch.Tensor:
    """log(pi / pi_old) per token [B, T], or its masked mean per sequence [B, 1] (GSPO)."""
    # Zeroed on padding before any exp: padded positions may hold arbitrary log-probs, and an inf
    # there would turn into NaN gradients even behind a mask.
    log_ratio = (logprobs - old_logprobs).masked_fill(~mask, 0.0).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)  # [B, T]
    if level == "token":
        return log_ratio
    if level == "sequence":
        return masked_mean(log_ratio, mask, dim=-1).unsqueeze(-1)  # [B, 1]
    raise ConfigError(f"importance_sampling_level = {level!r} is not known; use 'token' or 'sequence'.")


@register_policy_loss("clip")
def clipped_surrogate(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    settings: ClipSettings,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), optionally dual-clipped."""
    ratio = torch.exp(_log_importance_weights(logprobs, old_logprobs, mask, settings.importance_sampling_level))
    clipped_ratio = ratio.clamp(1.0 - settings.epsilon_low, 1.0 + settings.epsilon_high)
    token_loss = torch.maximum(-ratio * advantages, -clipped_ratio * advantages)  # [B, T] or [B, 1]
    indicators = {
        # Tokens where the clip is active, so their gradient is zero (the same test as TRL's clip_ratio).
        "clip_frac_low": (ratio < 1.0 - settings.epsilon_low) & (advantages < 0),
        "clip_frac_high": (ratio > 1.0 + settings.epsilon_high) & (advantages > 0),
    }
    if settings.dual_clip is not None:
        # Ye et al. 2020: with A < 0 a huge ratio makes -r A unbounded; cap the loss at c * |A|.
        bound = -settings.dual_clip * advantages
        dual_active = (advantages < 0) & (token_loss > bound)
        token_loss = torch.where(advantages < 0, torch.minimum(token_loss, bound), token_loss)
        indicators["dual_clip_frac"] = dual_active
    return token_loss.expand(mask.shape), indicators


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    dual_clip: float | None = None,
    agg_mode: AggMode = "token-mean",
    *,
    norm_length: int | None = None,
    kl_beta: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    kl_importance_correction: bool = False,
    importance_sampling_level: ImportanceSamplingLevel = "token",
    loss_name: str = "clip",
    tis_weights: torch.Tensor | None = None,
    tis_cap: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO loss scalar = agg(policy token loss + kl_beta * k3(ref)) and detached metrics (0-dim tensors).

    ``logprobs`` [B, T] carry the gradient; ``old_logprobs`` [B, T] are those of the sampling policy
    (detached here), ``advantages`` [B] (one per completion) or [B, T]. ``ref_logprobs`` is needed
    only when ``kl_beta > 0``; ``kl_importance_correction`` multiplies each token's k3 by its ratio
    pi / pi_old, since the tokens were drawn from pi_old (TRL's ``use_bias_correction_kl``).
    Metrics: ``pg_loss``; ``clip_frac_low`` / ``clip_frac_high`` (and ``dual_clip_frac`` with dual
    clip), fractions of counted tokens, also at the sequence level where TRL counts sequences;
    ``ratio_mean`` / ``ratio_max`` of the token ratio; ``approx_kl`` (k3 of KL(old || new), sampled
    under old); and ``kl_ref``, the mean KL term, when ``kl_beta > 0``.
    ``tis_weights`` [B, T] (``truncated_importance_weights``) multiply each token's policy loss after clipping, as
    verl applies them; the KL term is not weighted. With them come ``tis_weight_mean`` and, given ``tis_cap``,
    ``tis_capped_frac`` (tokens whose weight the cap cut).
    Metrics stay tensors so logging them costs no device sync until the caller asks.
    """
    if kl_beta < 0:
        raise ValueError(f"kl_beta must be >= 0, got {kl_beta}")
    if kl_beta > 0 and ref_logprobs is None:
        raise ValueError("kl_beta > 0 needs ref_logprobs (the reference model's token log-probs)")
    mask = mask.bool()  # [B, T]
    old_logprobs = old_logprobs.detach()
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)  # [B, 1]
    advantages = advantages.detach()
    settings = ClipSettings(epsilon_low, epsilon_high, dual_clip, importance_sampling_level)

    token_loss, indicators = get_policy_loss(loss_name)(logprobs, old_logprobs, advantages, mask, settings)
    if tis_weights is not None:
        token_loss = token_loss * tis_weights.detach()  # [B, T]
    pg_loss = aggregate_loss(token_loss, mask, agg_mode, norm_length)
    loss = pg_loss

    metrics: dict[str, torch.Tensor] = {"pg_loss": pg_loss.detach()}
    if kl_beta > 0:
        assert ref_logprobs is not None  # checked above; narrows the type
        # Zeroed on padding, like the ratio, so no exp of garbage log-probs reaches the gradient.
        kl = kl_k3(logprobs.masked_fill(~mask, 0.0), ref_logprobs.detach().masked_fill(~mask, 0.0))  # [B, T]
        if kl_importance_correction:
            kl = kl * torch.exp((logprobs - old_logprobs).masked_fill(~mask, 0.0).clamp(max=LOG_RATIO_BOUND))
        loss = loss + kl_beta * aggregate_loss(kl, mask, agg_mode, norm_length)
        metrics["kl_ref"] = masked_mean(kl.detach(), mask)

    with torch.no_grad():
        for name, flag in indicators.items():
            metrics[name] = masked_mean(flag.expand(mask.shape).to(torch.float32), mask)
        log_ratio = (logprobs - old_logprobs).masked_fill(~mask, 0.0)  # [B, T]
        ratio = torch.exp(log_ratio)
        metrics["ratio_mean"] = masked_mean(ratio, mask)
        metrics["ratio_max"] = ratio.masked_fill(~mask, float("-inf")).amax() if mask.any() else ratio.new_ones(())
        # k3 of KL(old || new) under samples of old: r - 1 - log r with r = new / old.
        metrics["approx_kl"] = masked_mean(ratio - 1.0 - log_ratio, mask)
        if tis_weights is not None:
            metrics["tis_weight_mean"] = masked_mean(tis_weights.to(torch.float32), mask)
            if tis_cap is not None:
                metrics["tis_capped_frac"] = masked_mean((tis_weights >= tis_cap).to(torch.float32), mask)
    return loss, metrics


def _chunk_rows(vocab_size: int) -> int:
    return max(1, _CHUNK_ELEMENTS // vocab_size)


def _compute_dtype(logits: torch.Tensor) -> torch.dtype:
    """float32 for half-precision logits, float64 stays float64 (gradient checks need it)."""
    return torch.promote_types(logits.dtype, torch.float32)


class _TokenLogprobs(torch.autograd.Function):
    """log_softmax(logits / temperature) at the chosen tokens, one float32 chunk of rows at a time.

    Autograd through a plain ``log_softmax(logits.float())`` keeps a float32 copy of all logits
    [B, T, V] for the backward pass (5 GB for 8k tokens of a 152k vocabulary). Here forward keeps
    only the log-normaliser [B, T], and backward rebuilds the softmax chunk by chunk.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
        batch, length, vocab = logits.shape
        rows = _chunk_rows(vocab)
        compute = _compute_dtype(logits)
        flat, picks = logits.reshape(-1, vocab), tokens.reshape(-1, 1)  # [B * T, V], [B * T, 1]
        logprobs = torch.empty(batch * length, dtype=compute, device=logits.device)  # [B * T]
        log_norm = torch.empty_like(logprobs)  # [B * T]
        # Chunks of rows of the flattened [B * T] positions: each row's values are those of row-by-row chunks (every
        # op is per position), in one chunk for a small vocabulary instead of one per sequence.
        for start in range(0, batch * length, rows):
            end = min(start + rows, batch * length)
            scaled = flat[start:end].to(compute) / temperature  # [n, V]
            lse = torch.logsumexp(scaled, dim=-1)  # [n]
            logprobs[start:end] = scaled.gather(-1, picks[start:end]).squeeze(-1) - lse
            log_norm[start:end] = lse
        ctx.save_for_backward(logits, tokens, log_norm)
        ctx.temperature = temperature
        return logprobs.view(batch, length)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        logits, tokens, log_norm = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None
        batch, length, vocab = logits.shape
        rows = _chunk_rows(vocab)
        flat, picks, upstreams = logits.reshape(-1, vocab), tokens.reshape(-1, 1), grad_out.reshape(-1)
        grad_logits = torch.empty(batch * length, vocab, dtype=logits.dtype, device=logits.device)  # [B * T, V]
        for start in range(0, batch * length, rows):
            end = min(start + rows, batch * length)
            scaled = flat[start:end].to(log_norm.dtype) / ctx.temperature  # [n, V]
            probs = torch.exp(scaled - log_norm[start:end].unsqueeze(-1))  # [n, V]
            upstream = upstreams[start:end].to(log_norm.dtype).unsqueeze(-1)  # [n, 1]
            # d logp(k) / d x_j = 1[j = k] - p_j, and x = logits / temperature.
            grad = -probs * upstream
            grad.scatter_add_(-1, picks[start:end], upstream)
            grad_logits[start:end] = (grad / ctx.temperature).to(grad_logits.dtype)
        return grad_logits.view(batch, length, vocab), None, None


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probs [B, T] of ``tokens`` [B, T] under softmax(``logits`` [B, T, V] / temperature), in float32.

    float64 logits give float64 (for gradient checks); half-precision logits are upcast one chunk
    at a time. ``logits[:, t]`` must be the prediction for ``tokens[:, t]`` (shift before calling). The
    temperature is the rollout's sampling temperature, so the policy scores tokens under the
    distribution they were drawn from. Differentiable in ``logits``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if logits.shape[:-1] != tokens.shape or logits.dim() != 3:
        raise ValueError(f"logits {tuple(logits.shape)} and tokens {tuple(tokens.shape)} must be [B, T, V] and [B, T]")
    return _TokenLogprobs.apply(logits, tokens.long(), float(temperature))


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy in nats [B, T] of softmax(``logits`` [B, T, V] / temperature), in float32, chunk by chunk.

    Meant for metrics (call under ``torch.no_grad()``); with gradients enabled autograd keeps each
    float32 chunk for backward.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    batch, length, vocab = logits.shape
    rows = _chunk_rows(vocab)
    flat = logits.reshape(-1, vocab)  # [B * T, V]: chunks of positions, one chunk for a small vocabulary
    chunks = []
    for start in range(0, batch * length, rows):
        scaled = flat[start : start + rows].to(_compute_dtype(logits)) / temperature  # [n, V]
        log_p = torch.log_softmax(scaled, dim=-1)  # [n, V]
        chunks.append(-(log_p.exp() * log_p).sum(dim=-1))  # [n]
    if not chunks:
        return logits.new_zeros(batch, length, dtype=_compute_dtype(logits))
    return torch.cat(chunks).view(batch, length)
