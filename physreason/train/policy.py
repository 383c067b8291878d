"""The policy's view of rollouts: prompt + completion batches, and a module that scores completion tokens.

A batch reuses the SFT collation (padding, mrope positions): the completion plays the assistant reply,
so `targets` mark exactly the completion tokens, each at the position that predicts it. Only those
positions reach the lm_head.

The completions of one prompt share its pixels (one `VisualInputs` object per prompt group, see
`rollout.RolloutSample`), so a batch keeps each distinct prompt visual once (`SharedVisuals`): the
vision tower runs once per distinct visual, not once per completion, and its features are repeated
into every row that shows it.

Packed rows (`pack=True`): the completions of one prompt share a single row, the prompt once and then each
completion, with a [L, L] attention mask under which the prompt attends causally to itself and each
completion to the whole prompt and causally to itself only. Each completion keeps the positions (mrope
included) it has in its own padded row, and its first token is predicted by the prompt's last position,
so its log-probs equal the padded row's while the prompt's tokens run once per row instead of once per
completion. Log-probs are gathered from the flattened [rows * L] hidden states, so downstream tensors
stay [samples, T] in both layouts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from physreason.data.collate import SFTBatch, collate_padded
from physreason.data.sft import IGNORE_INDEX, SFTSample
from physreason.errors import ConfigError, PhysReasonError
from physreason.models.context_parallel import ULYSSES, ContextParallel, context_of, sum_over_context
from physreason.models.family import VisionTokens
from physreason.models.inputs import VisualInputs, concat_visuals
from physreason.models.packed_attention import NAME as PACKED_SDPA
from physreason.models.packed_attention import PackedRows, attach, dense_mask, use_packed_attention
from physreason.models.parallelize import dummy_vision_features
from physreason.train import phases
from physreason.train.grpo_loss import entropy_from_logits, token_logprobs
from physreason.train.rollout import RolloutSample


@dataclass
class SharedVisuals:
    """The distinct prompt visuals of a batch, each once, and which of their features fills each placeholder token.

    Feature indexes count the merged vision tokens of the distinct visuals of one kind, concatenated in
    order; placeholders are listed in row-major order, the order in which masked_scatter fills them.
    """

    kwargs: dict[str, torch.Tensor]  # the distinct visuals' pixels and grids, concatenated (VisualInputs.model_kwargs)
    rows: torch.Tensor  # [B] index of each row's visual among the distinct ones, -1 for a row without pixels
    image_index: torch.Tensor  # [n_image_placeholders] feature index of each image placeholder of the batch
    video_index: torch.Tensor  # [n_video_placeholders] feature index of each video placeholder of the batch

    def to(self, device: torch.device | str) -> SharedVisuals:
        """Move every tensor to `device`."""
        return SharedVisuals(
            {name: tensor.to(device, non_blocking=True) for name, tensor in self.kwargs.items()},
            self.rows.to(device),
            self.image_index.to(device),
            self.video_index.to(device),
        )


def _feature_index(rows: list[int], counts: list[int]) -> torch.Tensor:
    """[sum of counts[r] over rows r >= 0] indexes into features laid out as counts, repeated for each row."""
    starts = [0]
    for count in counts:
        starts.append(starts[-1] + count)
    pieces = [torch.arange(starts[r], starts[r + 1]) for r in rows if r >= 0]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


def share_visuals(visuals: list[VisualInputs | None]) -> SharedVisuals | None:
    """Keep each distinct visual of the rows once (rows that hold the same object share it); None without pixels.

    Identity is the test of sameness: a rollout gives all completions of a prompt one VisualInputs
    object, and pickling a list of samples (Ray, multiprocessing) keeps that sharing. Equal pixels in
    different objects are kept twice, which costs time but never mixes up visuals.
    """
    distinct: list[VisualInputs] = []
    slot: dict[int, int] = {}
    rows: list[int] = []
    for visual in visuals:
        if visual is None or not (visual.image_token_counts or visual.video_token_counts):
            rows.append(-1)
            continue
        if id(visual) not in slot:
            slot[id(visual)] = len(distinct)
            distinct.append(visual)
        rows.append(slot[id(visual)])
    if not distinct:
        return None
    return SharedVisuals(
        concat_visuals(distinct).model_kwargs(),
        torch.tensor(rows, dtype=torch.long),
        _feature_index(rows, [sum(v.image_token_counts) for v in distinct]),
        _feature_index(rows, [sum(v.video_token_counts) for v in distinct]),
    )


@dataclass
class CompletionBatch:
    """Rollout samples laid out for one policy forward pass.

    With `visuals` set, `model_batch` holds no pixels (its visual_kwargs are empty): the scorer takes them
    from `visuals`, each distinct visual once. Without it, `model_batch` is everything the model needs.
    """

    model_batch: SFTBatch  # rows [R, L], right-padded: prompt + completion, or (packed) prompt + its completions
    positions: torch.Tensor  # [B, T] index into the flattened [R * L] rows predicting each completion token
    tokens: torch.Tensor  # [B, T] completion token ids (0 on padding)
    mask: torch.Tensor  # [B, T] bool, True on completion tokens
    engine_logprobs: torch.Tensor  # [B, T] the engine's raw-model log-probs of the tokens (0 on padding)
    advantages: torch.Tensor  # [B]
    visuals: SharedVisuals | None = None  # the rows' pixels, each distinct prompt visual once
    attention: torch.Tensor | None = None  # [R, 1, L, L] bool, True where a query may see a key (packed rows only)
    truncated: torch.Tensor | None = None  # [B] bool, True for a completion cut at max_response_length
    packing: PackedRows | None = None  # packed rows: where each prompt and completion lies (the mask, as spans)

    def to(self, device: torch.device) -> CompletionBatch:
        """Move every tensor to `device`."""
        return CompletionBatch(
            self.model_batch.to(device),
            self.positions.to(device),
            self.tokens.to(device),
            self.mask.to(device),
            self.engine_logprobs.to(device),
            self.advantages.to(device),
            self.visuals.to(device) if self.visuals is not None else None,
            self.attention.to(device) if self.attention is not None else None,
            self.truncated.to(device) if self.truncated is not None else None,
            self.packing,
        )

    @property
    def num_tokens(self) -> int:
        """Tokens of the model's forward pass, padding included (rows x longest row)."""
        return self.model_batch.input_ids.numel()


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
        for kind, token_id in (("image", vision.image_token_id), ("video", vision.video_token_id)):
            expected = sum(getattr(visuals, f"{kind}_token_counts")) if visuals else 0
            found = int((input_ids == token_id).sum())
            if found != expected:
                raise PhysReasonError(
                    f"prompt {sample.prompt.id}: the engine's prompt has {found} {kind} tokens but the policy's pixels "
                    f"make {expected}; engine and policy must share vision settings ([vision]) and the processor config"
                )
        positions = vision.positions(input_ids, visuals)
    # The pixels travel once per distinct visual in SharedVisuals, not once per row through the collation.
    return SFTSample(input_ids, labels, positions)


def build_completion_batch(
    samples: list[RolloutSample], pad_token_id: int, vision: VisionTokens | None, pack: bool = False
) -> CompletionBatch:
    """Collate rollout samples into one policy batch (see the module docstring): one row each, or packed rows.

    A completion that sampled an image/video placeholder token is scored up to that token only.
    Samples holding the same `visuals` object (the completions of one prompt) share its pixels.
    pack: consecutive samples of the same prompt (same ids, same visuals object) share one row.
    """
    sequences = [_sequence(s, vision, pad_token_id) for s in samples]
    if pack:
        return _packed_batch(samples, sequences, pad_token_id, vision)
    model_batch = collate_padded(sequences, pad_token_id, mrope=vision is not None)
    target_mask = model_batch.targets != IGNORE_INDEX  # [B, L]
    width = model_batch.targets.shape[1]
    where = [target_mask[row].nonzero().squeeze(-1) + row * width for row in range(len(samples))]
    targets = [model_batch.targets[row, w - row * width] for row, w in enumerate(where)]
    visuals = share_visuals([s.visuals for s in samples]) if vision is not None else None
    return _completion_batch(model_batch, samples, where, targets, visuals)


def _completion_batch(
    model_batch: SFTBatch,
    samples: list[RolloutSample],
    where: list[torch.Tensor],
    targets: list[torch.Tensor],
    visuals: SharedVisuals | None,
    attention: torch.Tensor | None = None,
    packing: PackedRows | None = None,
) -> CompletionBatch:
    """Lay out each sample's predicting indexes `where` and target tokens as [B, T] tensors around the rows."""
    longest = max([1, *(len(w) for w in where)])
    batch = len(samples)
    positions = torch.zeros(batch, longest, dtype=torch.long)  # [B, T]
    tokens = torch.zeros(batch, longest, dtype=torch.long)  # [B, T]
    mask = torch.zeros(batch, longest, dtype=torch.bool)  # [B, T]
    engine_logprobs = torch.zeros(batch, longest, dtype=torch.float32)  # [B, T]
    for row, sample in enumerate(samples):
        n = len(where[row])
        positions[row, :n] = where[row]
        tokens[row, :n] = targets[row]
        mask[row, :n] = True
        engine_logprobs[row, :n] = torch.tensor(sample.completion.logprobs[:n], dtype=torch.float32)
    advantages = torch.tensor([s.advantage for s in samples], dtype=torch.float32)  # [B]
    truncated = torch.tensor([s.completion.finish_reason == "length" for s in samples], dtype=torch.bool)  # [B]
    return CompletionBatch(
        model_batch, positions, tokens, mask, engine_logprobs, advantages, visuals, attention, truncated, packing
    )


def prompt_rows(samples: list[RolloutSample]) -> list[list[int]]:
    """Indexes of the samples each packed row holds: runs of consecutive samples of one group (the same prompt and
    visuals). Two groups of the same text prompt drawn one after the other stay two rows: a row holds at most one
    group's completions, as the memory plan counts them."""
    rows: list[list[int]] = []
    for index, sample in enumerate(samples):
        if rows:
            first = samples[rows[-1][0]]
            same_ids = first.prompt_ids is sample.prompt_ids or first.prompt_ids == sample.prompt_ids
            if first.group == sample.group and same_ids and first.visuals is sample.visuals:
                rows[-1].append(index)
                continue
        rows.append([index])
    return rows


def _packed_batch(
    samples: list[RolloutSample], sequences: list[SFTSample], pad_token_id: int, vision: VisionTokens | None
) -> CompletionBatch:
    """One row per prompt: the prompt, then each completion, with the attention mask of the module docstring."""
    rows = prompt_rows(samples)
    pieces = []  # per row: (input ids [L], positions [3, L], completion spans)
    for members in rows:
        prompt = len(samples[members[0]].prompt_ids)
        head = sequences[members[0]]
        ids, places, spans = [head.input_ids[:prompt]], [head.position_ids[:, :prompt]], []
        start = prompt
        for index in members:
            sequence = sequences[index]
            ids.append(sequence.input_ids[prompt:])
            places.append(sequence.position_ids[:, prompt:])
            spans.append((index, start, sequence.labels[prompt:]))
            start += len(sequence.input_ids) - prompt
        pieces.append((torch.cat(ids), torch.cat(places, dim=1), prompt, spans))
    width = max(len(ids) for ids, _, _, _ in pieces)
    count = len(rows)
    input_ids = torch.full((count, width), pad_token_id, dtype=torch.long)  # [R, L]
    position_ids = torch.zeros(3, count, width, dtype=torch.long)  # [3, R, L]
    where: list[torch.Tensor] = [torch.zeros(0, dtype=torch.long)] * len(samples)
    targets: list[torch.Tensor] = [torch.zeros(0, dtype=torch.long)] * len(samples)
    for row, (ids, places, prompt, spans) in enumerate(pieces):
        input_ids[row, : len(ids)] = ids
        position_ids[:, row, : len(ids)] = places
        for index, start, labels in spans:
            end = start + len(labels)
            # Token k of the completion is predicted by the prompt's last position (k = 0) or by token k - 1.
            # an empty completion predicts nothing (an engine may return no token)
            predicting = torch.cat([torch.tensor([prompt - 1]), torch.arange(start, max(start, end - 1))])[: end - start]
            where[index] = predicting + row * width
            targets[index] = labels
    model_batch = SFTBatch(
        input_ids,
        torch.full_like(input_ids, IGNORE_INDEX),  # unused: the completion tokens travel in CompletionBatch.tokens
        position_ids if vision is not None else position_ids[0],
        None,
        {},
        len(samples),
    )
    visuals = share_visuals([samples[members[0]].visuals for members in rows]) if vision is not None else None
    packing = PackedRows(
        tuple((prompt, tuple((start, len(labels)) for _, start, labels in spans)) for _, _, prompt, spans in pieces),
        width,
    )
    # [R, 1, L, L]: every query sees at least itself (padding included), so no softmax row is empty
    attention = dense_mask(packing)
    return _completion_batch(model_batch, samples, where, targets, visuals, attention, packing)


def build_micro_batches(
    samples: list[RolloutSample],
    pad_token_id: int,
    vision: VisionTokens | None,
    mini_batch: int,
    mini_batch_tokens: int = 0,
    pack: bool = False,
) -> list[CompletionBatch]:
    """Split a step's samples, in order, into policy batches of at most `mini_batch` completions each and, when
    `mini_batch_tokens` > 0, at most that many tokens per forward pass (rows x longest row, padding included).

    A row (one completion, or with `pack` a prompt and as many of its completions as fit) that alone exceeds
    the token budget gets a batch of its own. Batches are built on the CPU; move them with `.to(device)`.
    """
    if mini_batch < 1 or mini_batch_tokens < 0:
        raise ValueError(f"mini_batch must be >= 1 and mini_batch_tokens >= 0, got {mini_batch}, {mini_batch_tokens}")
    budget = mini_batch_tokens or None

    def length(indexes: list[int]) -> int:  # tokens of one row holding these samples (one prompt, their completions)
        return len(samples[indexes[0]].prompt_ids) + sum(len(samples[i].completion.token_ids) for i in indexes)

    rows: list[list[int]] = []
    groups = prompt_rows(samples) if pack else [[i] for i in range(len(samples))]
    for members in groups:
        row: list[int] = []
        for index in members:
            if row and (len(row) == mini_batch or (budget and length([*row, index]) > budget)):
                rows.append(row)
                row = []
            row.append(index)
        rows.append(row)
    batches: list[list[int]] = []
    current: list[list[int]] = []
    for row in rows:
        widest = max([length(r) for r in current] + [length(row)])
        too_many = sum(len(r) for r in current) + len(row) > mini_batch
        too_long = budget is not None and widest * (len(current) + 1) > budget
        if current and (too_many or too_long):
            batches.append([i for r in current for i in r])
            current = []
        current.append(row)
    if current:
        batches.append([i for r in current for i in r])
    return [build_completion_batch([samples[i] for i in b], pad_token_id, vision, pack) for b in batches]


@dataclass
class TokenScores:
    """The policy's scores of completion tokens."""

    logprobs: torch.Tensor  # [B, T] at the policy temperature, differentiable when grad is enabled
    entropy: torch.Tensor | None = None  # [B, T] at the policy temperature (detached)
    raw_logprobs: torch.Tensor | None = None  # [B, T] at temperature 1, comparable to engine log-probs (detached)


def visual_features(output: Any) -> torch.Tensor:
    """[tokens, H] merged vision features from get_image_features / get_video_features, whichever form they take.

    transformers 5.x returns a model output whose pooler_output is one tensor per image/video; older
    releases return those tensors themselves.
    """
    pooled = getattr(output, "pooler_output", output)
    return torch.cat(list(pooled)) if isinstance(pooled, (tuple, list)) else pooled


# Logit elements (rows x tokens x vocabulary) the lm_head makes at once when scoring completions: one row of a 152k
# vocabulary already passes it at 512 tokens, so a real model scores one row at a time; a from-scratch model's
# small vocabulary scores a whole micro-batch in one matmul instead of one launch sequence a row (issue 45).
SCORE_LOGIT_ELEMENTS = 1 << 26


def score_rows_at_once(length: int, vocab: int) -> int:
    """Rows whose [rows, length, vocab] logits fit SCORE_LOGIT_ELEMENTS (at least one)."""
    return max(1, SCORE_LOGIT_ELEMENTS // max(1, length * vocab))


def _row_logprobs(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = hidden @ weight.t()  # [1, T, V]
    return token_logprobs(logits, tokens, temperature)


def _score_row(
    piece: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, temperature: float, diagnostics: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """[k, T] log-probs of k rows' tokens from their [k, T, H] hidden states (and, with diagnostics, detached
    entropy and temperature-1 log-probs). Under grad the lm_head runs checkpointed: its [k, T, V] logits are not
    kept."""
    if torch.is_grad_enabled():
        logprobs = torch.utils.checkpoint.checkpoint(_row_logprobs, piece, weight, tokens, temperature, use_reentrant=False)
    else:
        logprobs = _row_logprobs(piece, weight, tokens, temperature)
    if not diagnostics:
        return logprobs, None, None
    with torch.no_grad():
        logits = piece.detach() @ weight.detach().t()  # [1, T, V]
        return logprobs, entropy_from_logits(logits, temperature), token_logprobs(logits, tokens, 1.0)


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

    packed_attention: "spans" switches the language model's sdpa to models/packed_attention.py's, which runs
    packed rows as variable-length sequences (grpo.packed_attention); "mask" keeps sdpa under the rows' mask.

    A batch with SharedVisuals runs the vision tower once per distinct visual (one call for the images, one
    for the videos, as transformers does), repeats the features into the rows' placeholders and calls the
    model on inputs_embeds. Autograd sums the rows' feature gradients before the tower's backward, which is
    the per-row path's gradient at a fraction of the tower's cost.
    """

    def __init__(self, model: nn.Module, balance_vision: bool = False, packed_attention: str = "mask") -> None:
        super().__init__()
        self.model = model
        self.balance_vision = balance_vision
        phases.mark_vision_tower(model)
        if packed_attention == "spans":
            # sdpa becomes packed_attention's: the same on every call but packed rows', which skip their [L, L] mask
            use_packed_attention(model)

    def forward(self, batch: CompletionBatch, temperature: float, diagnostics: bool = False) -> TokenScores:
        model_batch, shared = batch.model_batch, batch.visuals
        device = batch.tokens.device
        pixels = shared.kwargs if shared is not None else model_batch.visual_kwargs
        dummies = dummy_vision_features(self.model, pixels, device) if self.balance_vision else []
        attention = model_batch.attention_mask if batch.attention is None else self._packed_mask(batch)
        with phases.phase(phases.LANGUAGE_MODEL):
            hidden = self._hidden(model_batch, shared, attention)  # [R, L, H]
        with phases.phase(phases.LOSS):
            return self._token_scores(hidden, batch, temperature, diagnostics, dummies)

    def _hidden(self, model_batch: SFTBatch, shared: SharedVisuals | None, attention: Any) -> torch.Tensor:
        """[R, L, H] final hidden states of the rows."""
        if shared is None:
            inputs = model_batch.model_inputs()
            if attention is not None:
                inputs["attention_mask"] = attention
            return self.model.model(**inputs, use_cache=False).last_hidden_state
        embeds, deepstack = self._embed_with_shared_visuals(model_batch.input_ids, shared)
        # Qwen3-VL adds its DeepStack features to the visual positions of its first decoder layers; its model's forward
        # makes them from pixels only, so with features made here the language model is called with them directly.
        core = self.model.model.language_model if deepstack else self.model.model
        return core(
            inputs_embeds=embeds,
            position_ids=model_batch.position_ids,
            attention_mask=attention,
            use_cache=False,
            **deepstack,
        ).last_hidden_state

    def _token_scores(
        self, hidden: torch.Tensor, batch: CompletionBatch, temperature: float, diagnostics: bool, dummies: list
    ) -> TokenScores:
        """TokenScores of the completion tokens from the rows' hidden states (this rank's slice of them under cp)."""
        weight = self.model.lm_head.weight  # [V, H]
        context = context_of(self.model)
        if context is not None:
            logprobs, entropy, raw = self._split_scores(hidden, weight, batch, temperature, diagnostics, context)
        else:
            logprobs, entropy, raw = self._scores(hidden, weight, batch, temperature, diagnostics)
        for features in dummies:
            # Ties the dummy outputs into the graph, so the backward reduce-scatters the tower on every rank too.
            logprobs = logprobs + 0.0 * features.sum()
        return TokenScores(logprobs, entropy, raw)

    def _scores(
        self, hidden: torch.Tensor, weight: torch.Tensor, batch: CompletionBatch, temperature: float, diagnostics: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """([B, T] log-probs, entropy, raw log-probs) of the completion tokens from the [R, L, H] hidden states."""
        selected = hidden.reshape(-1, hidden.shape[-1])[batch.positions]  # [B, T, H]
        rows, entropies, raws = [], [], []
        step = score_rows_at_once(selected.shape[1], weight.shape[0])
        for b in range(0, selected.shape[0], step):
            piece, tokens = selected[b : b + step], batch.tokens[b : b + step]  # [k, T, H], [k, T]
            row, entropy, raw = _score_row(piece, weight, tokens, temperature, diagnostics)
            rows.append(row)
            entropies.append(entropy)
            raws.append(raw)
        return torch.cat(rows), torch.cat(entropies) if diagnostics else None, torch.cat(raws) if diagnostics else None

    def _split_scores(
        self,
        hidden: torch.Tensor,  # [R, L / cp, H]: this rank's slice of every row
        weight: torch.Tensor,
        batch: CompletionBatch,
        temperature: float,
        diagnostics: bool,
        context: ContextParallel,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The scores of `_scores` under context parallelism: each rank scores the tokens its slice predicts and the
        [B, T] results are summed over the group (every rank ends with all of them; each back-propagates its own)."""
        width = batch.model_batch.input_ids.shape[1]
        shard = context.shard(width)
        local = shard.stop - shard.start
        rows_of, columns = batch.positions // width, batch.positions % width  # [B, T]
        owned = shard.owned(columns) & batch.mask  # [B, T]
        index = rows_of * local + (columns - shard.start)  # [B, T] into the flattened local rows where owned
        flat = hidden.reshape(-1, hidden.shape[-1])  # [R * L / cp, H]
        count, longest = batch.tokens.shape
        outputs = [hidden.new_zeros(count, longest, dtype=torch.float32) for _ in range(3 if diagnostics else 1)]
        for b in range(count):
            keep = owned[b].nonzero().squeeze(-1)  # [n]
            if keep.numel() == 0:
                continue
            piece, tokens = flat[index[b, keep]][None], batch.tokens[b, keep][None]  # [1, n, H], [1, n]
            for output, value in zip(outputs, _score_row(piece, weight, tokens, temperature, diagnostics), strict=False):
                output[b] = output[b].index_put((keep,), value[0].float())
        # Every rank back-propagates through its whole slice and the lm_head, scored tokens or not: the all-to-alls
        # and FSDP2's reductions are collective.
        outputs[0] = outputs[0] + 0.0 * (hidden.sum() + weight.sum())
        summed = [sum_over_context(output, context.group) for output in outputs]
        if not diagnostics:
            return summed[0], None, None
        return summed[0], summed[1].detach(), summed[2].detach()

    def _packed_mask(self, batch: CompletionBatch) -> torch.Tensor:
        """The [R, 1, L, L] mask of packed rows in the form the language model's attention takes it.

        transformers passes a 4D mask through unchanged: sdpa reads booleans (True = attend), eager adds it
        to the scores; packed_attention's sdpa reads the rows' spans the mask carries instead. Flash-attention
        kernels take no such mask.
        """
        allowed = batch.attention
        kind = self.model.config.get_text_config()._attn_implementation
        if kind == PACKED_SDPA and batch.packing is not None:
            return attach(allowed, batch.packing)
        if kind in ("sdpa", PACKED_SDPA, ULYSSES):  # context parallel's attention pads and shards a boolean mask itself
            return allowed
        if kind == "eager":
            blocked = torch.finfo(torch.float32).min
            return torch.zeros(allowed.shape, device=allowed.device).masked_fill(~allowed, blocked)
        raise ConfigError(
            f"[grpo] pack_completions needs sdpa or eager attention, but the model runs {kind!r}: set "
            "model.attn_implementation = 'sdpa' or grpo.pack_completions = false"
        )

    def _embed_with_shared_visuals(
        self, input_ids: torch.Tensor, shared: SharedVisuals
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """[B, L, H] token embeddings with each placeholder replaced by its visual's feature (tower run once each), and
        the DeepStack inputs of a Qwen3-VL (visual_pos_masks [B, L], deepstack_visual_embeds: per layer [visual
        tokens, H] in position order, as its model's forward builds them; empty for other families)."""
        core = self.model.model
        embeds = core.get_input_embeddings()(input_ids)  # [B, L, H]
        config = self.model.config
        masks, layers = [], []
        for pixels_name, grid_name, token_id, index in (
            ("pixel_values", "image_grid_thw", config.image_token_id, shared.image_index),
            ("pixel_values_videos", "video_grid_thw", config.video_token_id, shared.video_index),
        ):
            pixels = shared.kwargs.get(pixels_name)
            if pixels is None:
                continue
            encode = core.get_image_features if pixels_name == "pixel_values" else core.get_video_features
            output = encode(pixels, shared.kwargs[grid_name], return_dict=True)
            placed = visual_features(output).index_select(0, index).to(embeds.device, embeds.dtype)  # [placeholders, H]
            where = input_ids == token_id  # [B, L]
            embeds = embeds.masked_scatter(where.unsqueeze(-1).expand_as(embeds), placed)
            deep = getattr(output, "deepstack_features", None)
            if deep:
                masks.append(where)
                layers.append([visual_features(layer).index_select(0, index).to(embeds.device, embeds.dtype) for layer in deep])
        if not masks:
            return embeds, {}
        visual = masks[0] if len(masks) == 1 else masks[0] | masks[1]  # [B, L]
        if len(masks) == 1:
            joint = layers[0]
        else:  # images and videos in one batch: each layer's features in position order
            joint = []
            for image_layer, video_layer in zip(*layers, strict=True):
                merged = image_layer.new_zeros(int(visual.sum()), image_layer.shape[-1])  # [visual tokens, H]
                merged = merged.index_put((masks[0][visual].nonzero().squeeze(-1),), image_layer)
                joint.append(merged.index_put((masks[1][visual].nonzero().squeeze(-1),), video_layer))
        return embeds, {"visual_pos_masks": visual, "deepstack_visual_embeds": joint}
