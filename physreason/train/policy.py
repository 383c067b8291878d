"""The policy's view of rollouts: prompt + completion batches, and a module that scores completion tokens.

A batch reuses the SFT collation (padding, mrope positions, visual inputs): the completion plays the
assistant reply, so `targets` mark exactly the completion tokens, each at the position that
predicts it. Only those positions reach the lm_head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from physreason.data.collate import SFTBatch, collate_padded
from physreason.data.sft import IGNORE_INDEX, SFTSample, VisionTokens
from physreason.errors import PhysReasonError
from physreason.models.parallelize import dummy_vision_features
from physreason.train.grpo_loss import entropy_from_logits, token_logprobs
from physreason.train.rollout import RolloutSample


@dataclass
class CompletionBatch:
    """Rollout samples laid out for one policy forward pass."""

    model_batch: SFTBatch  # prompt + completion, right-padded [B, L]
    positions: torch.Tensor  # [B, T] sequence position predicting each completion token (0 on padding)
    tokens: torch.Tensor  # [B, T] completion token ids (0 on padding)
    mask: torch.Tensor  # [B, T] bool, True on completion tokens
    engine_logprobs: torch.Tensor  # [B, T] the engine's raw-model log-probs of the tokens (0 on padding)
    advantages: torch.Tensor  # [B]

    def to(self, device: torch.device) -> CompletionBatch:
        """Move every tensor to `device`."""
        return CompletionBatch(
            self.model_batch.to(device),
            self.positions.to(device),
            self.tokens.to(device),
            self.mask.to(device),
            self.engine_logprobs.to(device),
            self.advantages.to(device),
        )


def first_vision_token(token_ids: list[int], vision: VisionTokens | None) -> int | None:
    """Index of the first image/video placeholder token in a completion, or None (always None for text models)."""
    if vision is None:
        return None
    pads = (vision.image_token_id, vision.video_token_id)
    return next((i for i, token in enumerate(token_ids) if token in pads), None)


def _sequence(sample: RolloutSample, vision: VisionTokens | None, pad_token_id: int) -> SFTSample:
    prompt, completion = sample.prompt_ids, list(sample.completion.token_ids)
    if not prompt:
        raise PhysReasonError(f"prompt {sample.prompt.id}: the engine returned no prompt token ids to score against")
    inputs = prompt + completion
    cut = first_vision_token(completion, vision)
    if cut is not None:
        # A sampled placeholder token would make the model look for pixels it was never given. It is
        # scored as a target (so a negative advantage pushes it down) but never fed: the sequence ends
        # there, and the text token put in its place predicts nothing.
        completion = completion[: cut + 1]
        inputs = prompt + completion[:cut] + [pad_token_id]
    input_ids = torch.tensor(inputs, dtype=torch.long)  # [L]
    labels = torch.tensor([IGNORE_INDEX] * len(prompt) + completion, dtype=torch.long)  # [L]
    if vision is None:
        positions = torch.arange(len(input_ids)).expand(3, -1)  # [3, L]
    else:
        visuals = sample.visuals
        expected = sum(visuals.image_token_counts) + sum(visuals.video_token_counts) if visuals else 0
        found = int(((input_ids == vision.image_token_id) | (input_ids == vision.video_token_id)).sum())
        if found != expected:
            raise PhysReasonError(
                f"prompt {sample.prompt.id}: the engine's prompt has {found} visual tokens but the policy's pixels "
                f"make {expected}; engine and policy must share vision settings ([vision]) and the processor config"
            )
        positions = vision.positions(input_ids, visuals)
    return SFTSample(input_ids, labels, positions, sample.visuals)


def build_completion_batch(
    samples: list[RolloutSample], pad_token_id: int, vision: VisionTokens | None
) -> CompletionBatch:
    """Collate rollout samples into one policy batch (see the module docstring).

    A completion that sampled an image/video placeholder token is scored up to that token only.
    """
    sequences = [_sequence(s, vision, pad_token_id) for s in samples]
    model_batch = collate_padded(sequences, pad_token_id, mrope=vision is not None)
    target_mask = model_batch.targets != IGNORE_INDEX  # [B, L]
    longest = max(1, int(target_mask.sum(dim=1).max()))
    batch = len(samples)
    positions = torch.zeros(batch, longest, dtype=torch.long)  # [B, T]
    tokens = torch.zeros(batch, longest, dtype=torch.long)  # [B, T]
    mask = torch.zeros(batch, longest, dtype=torch.bool)  # [B, T]
    engine_logprobs = torch.zeros(batch, longest, dtype=torch.float32)  # [B, T]
    for row, sample in enumerate(samples):
        where = target_mask[row].nonzero().squeeze(-1)  # [n]
        n = len(where)
        positions[row, :n] = where
        tokens[row, :n] = model_batch.targets[row, where]
        mask[row, :n] = True
        engine_logprobs[row, :n] = torch.tensor(sample.completion.logprobs[:n], dtype=torch.float32)
    advantages = torch.tensor([s.advantage for s in samples], dtype=torch.float32)  # [B]
    return CompletionBatch(model_batch, positions, tokens, mask, engine_logprobs, advantages)


@dataclass
class TokenScores:
    """The policy's scores of completion tokens."""

    logprobs: torch.Tensor  # [B, T] at the policy temperature, differentiable when grad is enabled
    entropy: torch.Tensor | None = None  # [B, T] at the policy temperature (detached)
    raw_logprobs: torch.Tensor | None = None  # [B, T] at temperature 1, comparable to engine log-probs (detached)


def _row_logprobs(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = hidden @ weight.t()  # [1, T, V]
    return token_logprobs(logits, tokens, temperature)


class PolicyScorer(nn.Module):
    """forward(batch, temperature) -> TokenScores of the completion tokens of a CompletionBatch.

    Wrapping the transformers model keeps every parameter behind one forward, so FSDP2's root hooks
    gather the embedding and lm_head. The lm_head runs one sequence at a time under activation
    checkpointing when gradients are needed, so at most one sequence's [T, V] logits exist at once.
    The recompute in backward may use the gathered lm_head weight: FSDP2 never reshards its root
    after forward, only once the backward is done.

    balance_vision: run the vision tower on a dummy input for each visual kind the batch lacks, so that
    every FSDP2 data-parallel rank makes the same collectives (see parallelize.dummy_vision_features).
    Needed under torchrun, where one rank's prompts may be text-only while another's carry images; off in
    one process, where it would only cost time. The log-probs are unchanged (0 x the dummy outputs).
    """

    def __init__(self, model: nn.Module, balance_vision: bool = False) -> None:
        super().__init__()
        self.model = model
        self.balance_vision = balance_vision

    def forward(self, batch: CompletionBatch, temperature: float, diagnostics: bool = False) -> TokenScores:
        inputs = batch.model_batch.model_inputs()
        device = batch.tokens.device
        dummies = dummy_vision_features(self.model, inputs, device) if self.balance_vision else []
        hidden = self.model.model(**inputs, use_cache=False).last_hidden_state  # [B, L, H]
        index = batch.positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])  # [B, T, H]
        selected = hidden.gather(1, index)  # [B, T, H]
        weight = self.model.lm_head.weight  # [V, H]
        rows, entropies, raws = [], [], []
        for b in range(selected.shape[0]):
            piece, tokens = selected[b : b + 1], batch.tokens[b : b + 1]  # [1, T, H], [1, T]
            if torch.is_grad_enabled():
                rows.append(
                    torch.utils.checkpoint.checkpoint(
                        _row_logprobs, piece, weight, tokens, temperature, use_reentrant=False
                    )
                )
            else:
                rows.append(_row_logprobs(piece, weight, tokens, temperature))
            if diagnostics:
                with torch.no_grad():
                    logits = piece.detach() @ weight.detach().t()  # [1, T, V]
                    entropies.append(entropy_from_logits(logits, temperature))
                    raws.append(token_logprobs(logits, tokens, 1.0))
        logprobs = torch.cat(rows)  # [B, T]
        for features in dummies:
            # Ties the dummy outputs into the graph, so the backward reduce-scatters the tower on every rank too.
            logprobs = logprobs + 0.0 * features.sum()
        return TokenScores(
            logprobs,
            torch.cat(entropies) if diagnostics else None,
            torch.cat(raws) if diagnostics else None,
        )
