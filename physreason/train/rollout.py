"""GRPO rollouts: draw prompts, sample a group of completions each with the engine, score them, compute advantages.

Groups are kept whole and in order (completion `j` of group `i` at flat index `i * n + j`), which is
the layout `compute_group_advantages` expects. With dynamic sampling (DAPO) a group whose rewards
are all equal carries no gradient and is dropped; more prompts are drawn until the step is full or
`max_rounds` rollout batches were tried.
"""

from __future__ import annotations

import logging
import random
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from physreason.chat.mcq import AnswerType
from physreason.chat.style import StyleName, coord_space
from physreason.config import Config, EngineConfig, SamplingConfig, VisionConfig
from physreason.cpu import decode_ahead_threads
from physreason.data.mcq import MCQPrompt, PromptStream
from physreason.engines import Completion, Engine, GenerationRequest
from physreason.errors import ConfigError, InputError
from physreason.models.inputs import ProcessorParams, VisualInputs, encode_visuals, prompting_for
from physreason.parallel import map_in_threads
from physreason.rewards import check_reward_options, compute_rewards
from physreason.train.grpo_advantages import compute_group_advantages
from physreason.train.grpo_loss import soft_overlong_penalty
from physreason.vision import load_image, load_video
from physreason.vision.resize import PATCH_FACTOR

log = logging.getLogger(__name__)

# Rewards computed for every completion whatever the configured weights (at weight 0 they leave the
# total unchanged), so accuracy and format rate are always logged.
DIAGNOSTIC_REWARDS = ("accuracy", "format")
# The soft overlong punishment's entry in a completion's rewards (already part of its "total").
OVERLONG_REWARD = "overlong"


@dataclass
class RolloutSample:
    """One sampled completion with what scoring and the policy update need."""

    group: int
    prompt: MCQPrompt
    prompt_ids: list[int]
    completion: Completion
    rewards: dict[str, float]  # per reward name, and "total"
    visuals: VisualInputs | None  # the prompt's pixels, for the policy forward (None for text-only models)
    advantage: float = 0.0


@dataclass
class RolloutBatch:
    """The groups of one training step and how they were obtained."""

    samples: list[RolloutSample] = field(default_factory=list)
    scored: list[dict[str, float]] = field(default_factory=list)  # rewards of every completion, dropped groups too
    counts: Counter = field(default_factory=Counter)  # prompts_drawn, groups_dropped, requests_failed, rounds
    generate_s: float = 0.0
    score_s: float = 0.0
    first_error: str | None = None  # the first failed request's error, for a step in which every request failed

    @property
    def num_groups(self) -> int:
        return len({s.group for s in self.samples})


def every_request_failed(drawn: float, failed: float) -> bool:
    """Whether a step's (or a generate call's) prompts all failed: what stops GRPO when it repeats (grpo.py)."""
    return drawn > 0 and failed >= drawn


def mcq_request(
    prompt: MCQPrompt,
    vision: VisionConfig,
    answer_type: AnswerType = "grpo",
    factor: int = PATCH_FACTOR,
    style: StyleName = "reason1",
) -> GenerationRequest:
    """Decode the prompt's media (sides multiples of the model's patch factor) and build its chat request (a 2D
    grounding question on the style's coordinate grid for the frame as decoded)."""
    clip = vision.model_copy(update=prompt.video_range)  # the record's own video_start / video_end
    videos = [load_video(path, clip, factor) for path in prompt.videos]
    images = [load_image(path, vision, factor) for path in prompt.images]
    request = GenerationRequest(messages=[], images=images, videos=videos, request_id=prompt.id)
    request.messages = prompt.messages(answer_type, style, request.frame_size())
    return request


def completion_rewards(
    text: str,
    prompt: MCQPrompt,
    weights: Mapping[str, float],
    style: StyleName = "reason1",
    reward_options: Mapping[str, Mapping[str, float]] | None = None,
    answer_type: AnswerType = "grpo",
    failed: list[str] | None = None,
    frame_size: tuple[int, int] | None = None,
) -> dict[str, float]:
    """Each configured reward and the diagnostic ones for one completion, plus the weighted "total".

    A reward that raises on the completion scores 0 and its name is appended to `failed` (compute_rewards).

    Rewards also get `prompt_style` and `reasoning`, the layout the prompt asked for (`MCQPrompt.layout`), which
    the format reward checks, their `reward_options` ([grpo] reward_options), and for a 2D grounding question
    `coords`, the grid the style's model writes coordinates on for the frame of `frame_size` (height, width) it saw
    (request.frame_size()).
    """
    every = {name: 0.0 for name in DIAGNOSTIC_REWARDS} | dict(weights)
    asked_style, reasoning = prompt.layout(answer_type, style)
    # The layout is physreason's to give (data.mcq leaves a record's own "reasoning" or "prompt_style" out).
    fields = prompt.reward_fields() | {"prompt_style": asked_style, "reasoning": reasoning}
    try:
        if prompt.grounding_2d:
            fields["coords"] = coord_space(style, frame_size)
        return compute_rewards(text, every, reward_options, failed, **fields)
    except InputError as exc:
        raise InputError(f"sample {prompt.id!r}: {exc}") from exc


def logged_reward_names(config: Config) -> list[str]:
    """Names of every reward a step logs: the configured ones, the diagnostic ones, the overlong punishment, "total"."""
    shaped = {OVERLONG_REWARD} if config.grpo.overlong_buffer_length else set()
    return sorted(set(config.grpo.reward_function) | set(DIAGNOSTIC_REWARDS) | shaped) + ["total"]


def rollout_seed(base: int, step: int, round_index: int, rank: int) -> int:
    """A sampling seed for one generate call, distinct per step, round and rank, the same on resume."""
    return random.Random(f"{base}:{step}:{round_index}:{rank}").getrandbits(31)


@dataclass
class RolloutSettings:
    """How one step's rollouts are drawn and scored."""

    groups_needed: int  # groups this rank trains on per step
    prompts_per_round: int  # prompts per generate call ([rollout] batch_size)
    sampling: SamplingConfig  # n = group size, max_tokens = max_response_length
    vision: VisionConfig
    reward_weights: dict[str, float]
    reward_options: dict[str, dict[str, float]] = field(default_factory=dict)  # [grpo] reward_options, checked
    advantage: str = "grpo"
    dynamic_sampling: bool = False
    max_rounds: int = 8
    processor_params: ProcessorParams | None = None  # set for vision-language policies
    seed: int = 0
    answer_type: AnswerType = "grpo"  # prompt wording: the RL recipe's, or the benchmark's reasoning/letter
    prompt_style: StyleName = "reason1"  # the checkpoint's generation ([prompt] style, 'auto' from its family)
    overlong_buffer_length: int = 0  # DAPO's soft overlong punishment (grpo_loss.soft_overlong_penalty); 0 = off
    overlong_penalty_factor: float = 1.0
    decode_workers: int = 1  # threads that decode and patchify a round's clips (rollout_settings: this process's CPUs)


def rollout_sampling(config: Config) -> SamplingConfig:
    """The rollout's sampling: [rollout.sampling_config] with n = [rollout] n_generation, max_tokens = max_response_length."""
    rollout = config.rollout
    return SamplingConfig(
        **rollout.sampling_config.model_dump(), n=rollout.n_generation, max_tokens=rollout.max_response_length
    )


def rollout_settings(
    config: Config,
    *,
    groups_needed: int,
    prompts_per_round: int,
    max_rounds: int,
    processor_params: ProcessorParams | None,
) -> RolloutSettings:
    """The settings `collect_rollouts` runs with, read from the recipe; both GRPO modes build theirs here.

    The callers decide only how many groups one call must return, how many prompts one generate call
    takes and how many rounds dynamic sampling may try.
    """
    sampling = rollout_sampling(config)
    grpo = config.grpo
    if grpo.overlong_buffer_length > config.rollout.max_response_length:
        raise ConfigError(
            f"grpo.overlong_buffer_length ({grpo.overlong_buffer_length}) exceeds rollout.max_response_length "
            f"({config.rollout.max_response_length}): the punishment starts that many tokens before the limit"
        )
    check_reward_options(grpo.reward_function, grpo.reward_options)
    return RolloutSettings(
        groups_needed=groups_needed,
        prompts_per_round=prompts_per_round,
        sampling=sampling,
        vision=config.vision,
        reward_weights=dict(grpo.reward_function),
        reward_options={name: dict(options) for name, options in grpo.reward_options.items()},
        advantage=grpo.advantage,
        dynamic_sampling=grpo.dynamic_sampling,
        max_rounds=max_rounds,
        processor_params=processor_params,
        seed=sampling.seed if sampling.seed is not None else config.train.seed,
        answer_type=grpo.answer_type,
        prompt_style=prompting_for(config)[0].style,
        overlong_buffer_length=grpo.overlong_buffer_length,
        overlong_penalty_factor=grpo.overlong_penalty_factor,
        decode_workers=decode_ahead_threads(),
    )


def rollout_engine_config(config: Config) -> EngineConfig:
    """The rollout engine's settings: [engine] with [rollout.parallelism] tp_size GPUs per engine.

    Raises ConfigError when engine.tensor_parallel_size says otherwise (left at 1 it defers to the rollout's).
    With engine.cuda_graph_sizes = "batch" a vLLM engine's graphs are sized by a round's generate call, which sends
    rollout.batch_size prompts x rollout.n_generation completions at once (not engine.batch_size requests): that
    many and the powers of two below it, a handful of graphs instead of vLLM's ~50 (an FP8 engine captured each of
    those in 1-3 s on an H200). An hf engine keeps its engine.batch_size.
    """
    update: dict[str, object] = {}
    if config.engine.cuda_graph_sizes == "batch":
        from physreason.engines.factory import resolve_backend

        if resolve_backend(config.engine) == "vllm":
            update["batch_size"] = config.rollout.batch_size * config.rollout.n_generation
    tp = config.rollout.parallelism.tp_size
    if config.engine.tensor_parallel_size not in (1, tp):
        raise ConfigError(
            f"engine.tensor_parallel_size = {config.engine.tensor_parallel_size} but rollout.parallelism.tp_size = {tp}: "
            "GRPO sizes its rollout engines by rollout.parallelism.tp_size; set that key and leave "
            "engine.tensor_parallel_size at 1"
        )
    return config.engine.model_copy(update={**update, "tensor_parallel_size": tp})


def collect_rollouts(
    engine: Engine,
    stream: PromptStream,
    settings: RolloutSettings,
    step: int,
    rank: int = 0,
    world_size: int = 1,
    all_done: Callable[[bool], bool] = lambda done: done,
) -> RolloutBatch:
    """Sample, score and keep groups until this rank has `groups_needed` (see the module docstring).

    Every rank draws the same global prompt sequence and takes its own slice, so prompts never
    repeat across ranks; `all_done` (an all-reduce in distributed runs) keeps ranks drawing in step.
    """
    batch = RolloutBatch()
    round_index = 0
    drawn_per_rank = 0
    while True:
        missing = settings.groups_needed - batch.num_groups
        if settings.dynamic_sampling:
            finished = missing <= 0 or round_index >= settings.max_rounds
            count = settings.prompts_per_round
        else:
            # Exactly groups_needed prompts, no retries: a failed request leaves its step a group short.
            finished = drawn_per_rank >= settings.groups_needed
            count = min(settings.prompts_per_round, settings.groups_needed - drawn_per_rank)
        if all_done(finished):
            break
        # Every rank draws the same number of prompts so the shared stream stays aligned.
        drawn = stream.draw(count * world_size)
        drawn_per_rank += count
        mine = drawn[rank * count : (rank + 1) * count] if missing > 0 else []
        _rollout_round(engine, mine, settings, rollout_seed(settings.seed, step, round_index, rank), batch)
        batch.counts["rounds"] += 1
        round_index += 1
    kept_groups = sorted({s.group for s in batch.samples})[: settings.groups_needed]
    batch.samples = [s for s in batch.samples if s.group in kept_groups]
    renumber = {group: i for i, group in enumerate(kept_groups)}
    for sample in batch.samples:
        sample.group = renumber[sample.group]
    return batch


def _rollout_round(
    engine: Engine, prompts: list[MCQPrompt], settings: RolloutSettings, seed: int, batch: RolloutBatch
) -> None:
    """Generate, score and group one round of prompts into `batch` (dropping what cannot train)."""
    if not prompts:
        return
    started = time.perf_counter()
    params = settings.processor_params
    factor = params.factor if params is not None else PATCH_FACTOR

    def build(prompt: MCQPrompt) -> GenerationRequest:
        request = mcq_request(prompt, settings.vision, settings.answer_type, factor, settings.prompt_style)
        if params is not None:  # patchified once: the engine takes these, and the policy's forward later
            request.encoded = (params, encode_visuals(request.images, request.videos, params))
        return request

    requests = map_in_threads(build, prompts, settings.decode_workers)
    results = engine.generate(requests, settings.sampling.model_copy(update={"seed": seed}))
    batch.generate_s += time.perf_counter() - started
    started = time.perf_counter()
    batch.counts["prompts_drawn"] += len(prompts)
    next_group = max((s.group for s in batch.samples), default=-1) + 1
    for prompt, request, result in zip(prompts, requests, results, strict=True):
        if result.error is not None or len(result.completions) != settings.sampling.n:
            # A prompt longer than the context, unreadable media, out of memory: this group is lost, not the run.
            batch.counts["requests_failed"] += 1
            reason = result.error or "incomplete group of completions"
            if batch.first_error is None:
                batch.first_error = reason if str(prompt.id) in reason else f"prompt {prompt.id}: {reason}"
            log.warning("rollout: prompt %s skipped: %s", prompt.id, reason)
            continue
        failed: list[str] = []
        rewards = [
            completion_rewards(
                c.text,
                prompt,
                settings.reward_weights,
                settings.prompt_style,
                settings.reward_options,
                settings.answer_type,
                failed,
                request.frame_size(),
            )
            for c in result.completions
        ]
        batch.counts["reward_errors"] += len(failed)  # a reward that raised on a completion: scored 0, logged once
        if settings.overlong_buffer_length:
            lengths = torch.tensor([len(c.token_ids) for c in result.completions])  # [n]
            penalties = soft_overlong_penalty(
                lengths, settings.sampling.max_tokens, settings.overlong_buffer_length, settings.overlong_penalty_factor
            )
            for reward, penalty in zip(rewards, penalties.tolist(), strict=True):
                reward[OVERLONG_REWARD] = penalty
                reward["total"] += penalty
        batch.scored += rewards
        totals = torch.tensor([r["total"] for r in rewards], dtype=torch.float32)  # [n]
        if settings.dynamic_sampling and bool((totals == totals[0]).all()) and settings.sampling.n > 1:
            batch.counts["groups_dropped"] += 1
            continue
        advantages = compute_group_advantages(totals, settings.sampling.n, settings.advantage)  # [n]
        visuals = request.encoded[1] if request.encoded is not None else None
        for completion, reward, advantage in zip(result.completions, rewards, advantages.tolist(), strict=True):
            batch.samples.append(
                RolloutSample(next_group, prompt, list(result.prompt_token_ids), completion, reward, visuals, advantage)
            )
        next_group += 1
    batch.score_s += time.perf_counter() - started
