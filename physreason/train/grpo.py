"""The colocated GRPO loop: the policy (FSDP2 under torchrun, or one process) and the rollout engine share the GPUs.

Each step: draw multiple-choice prompts (options reshuffled per draw), sample `[rollout] n_generation`
completions each with the engine, score them with the configured rewards, compute group advantages,
then update the policy `[grpo] mu_iterations` times over the step's samples in micro-batches of
`[grpo] mini_batch`, and push the weights to the engine every `[train] sync_weight_interval` steps.

Batch layout: `[train] train_batch_per_replica` counts completions per optimizer step (cosmos-rl's
meaning), so one step trains on train_batch_per_replica / n_generation prompt groups, split over the
data-parallel ranks; each rank drives its own engine on its own share of the prompts.

Log-probabilities: the policy recomputes them itself at the one configured temperature
(`[rollout.sampling_config] temperature`); the engine's (raw-model, temperature-1) log-probs are
compared with the policy's temperature-1 log-probs only to report the mismatch. With
`sync_weight_interval > 1` the engine samples with weights up to that many steps old while
"old" log-probs are the current policy's, and the mismatch metric includes that staleness.
Weights are also pushed at every checkpoint, so a resumed run continues with the same engine weights
(a checkpoint is thus a sync point: keep `[train.ckpt] save_freq` a multiple of sync_weight_interval
for a run whose trajectory does not depend on where it saved).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from physreason.config import Config
from physreason.data.mcq import PromptStream, load_mcq_prompts
from physreason.data.structural_tokens import structural_tokens
from physreason.engines import Engine, create_engine
from physreason.errors import ConfigError, PhysReasonError, TrainingDiverged
from physreason.models import loading, parallelize
from physreason.models.family import VisionTokens, read_vision_tokens
from physreason.rewards import check_reward_options
from physreason.train import phases
from physreason.train.build import TrainingModel, build_training_model
from physreason.train.grpo_loss import mask_truncated, masked_sum, policy_loss, truncated_importance_weights
from physreason.train.loop import (
    Checkpointer,
    DivergenceWatch,
    StepLog,
    StopOnSignal,
    TrainingResult,
    checkpoint_due,
    nothing_to_do,
    parameter_counts,
    prepare_output,
    run_summary,
)
from physreason.train.memory_report import check_runtime_memory, prompt_shape, resolve_runtime_checkpoint_every
from physreason.train.out_of_memory import explains_out_of_memory
from physreason.train.policy import CompletionBatch, PolicyScorer, build_micro_batches, first_vision_token
from physreason.train.rollout import (
    RolloutBatch,
    RolloutSample,
    collect_rollouts,
    every_request_failed,
    logged_reward_names,
    rollout_engine_config,
    rollout_settings,
)
from physreason.train.runlock import releases_output_lock
from physreason.train.runtime import Runtime, all_reduce_max, all_reduce_sum, init_runtime, seed_everything
from physreason.train.weight_sync import PolicySync, adapter_push_supported

log = logging.getLogger(__name__)


@dataclass
class GRPOResult(TrainingResult):
    """What a run did: per-step mean total reward (over every scored completion), metrics, final folders."""

    rewards: list[float] = field(default_factory=list)
    metrics: list[dict[str, float]] = field(default_factory=list)


def aggregation_count(mask: torch.Tensor, mode: str) -> float:
    """What `mode` averages over in a [B, T] mask: tokens, sequences with tokens, or sequences.

    A micro-batch's loss times count(micro) / count(step) summed over micro-batches equals the loss
    of the whole step's batch, so gradient accumulation leaves the objective unchanged.
    """
    if mode == "token-mean":
        return float(mask.sum())
    if mode == "seq-mean-token-mean":
        return float(mask.any(dim=-1).sum())
    if mode == "seq-mean-token-sum-norm":
        return float(mask.shape[0])
    raise ConfigError(f"[grpo] loss_agg_mode = {mode!r} is not known")


def groups_per_rank(config: Config, dp_size: int) -> int:
    """Prompt groups each data-parallel rank trains on per step."""
    completions, n = config.train.train_batch_per_replica, config.rollout.n_generation
    if completions % (n * dp_size):
        raise ConfigError(
            f"train.train_batch_per_replica ({completions}) counts completions per step in GRPO: it must be a multiple "
            f"of rollout.n_generation ({n}) x data-parallel size ({dp_size})"
        )
    return completions // (n * dp_size)


class _Stats:
    """Sums of named values over the data-parallel ranks: means, standard deviations and weighted means of a step.

    The ranks of one tensor-parallel group hold the same samples, so summing over every rank would count
    each sample tp_size times; `group` is the data-parallel group (None: all ranks, no tensor parallelism).
    """

    def __init__(self, runtime: Runtime, group: dist.ProcessGroup | None = None) -> None:
        self.runtime = runtime
        self.group = group

    def reduce(self, values: list[float]) -> torch.Tensor:
        t = torch.tensor(values, dtype=torch.float64, device=self.runtime.device)
        if self.runtime.distributed:
            dist.all_reduce(t, group=self.group)
        return t.cpu()

    def mean_std(self, values: list[float]) -> tuple[float, float]:
        n, total, squares = self.reduce([len(values), sum(values), sum(v * v for v in values)]).tolist()
        if n == 0:
            return 0.0, 0.0
        mean = total / n
        return mean, math.sqrt(max(squares / n - mean * mean, 0.0))


def _sleep(engine: Engine) -> None:
    # Engines that can free their GPU memory between rollouts (vLLM sleep mode) expose sleep/wake_up.
    if hasattr(engine, "sleep"):
        engine.sleep()


def _wake(engine: Engine) -> None:
    if hasattr(engine, "wake_up"):
        engine.wake_up()


@dataclass
class UpdateSettings:
    """What one policy update needs to know of the recipe."""

    temperature: float
    mu_iterations: int
    mini_batch: int
    epsilon_low: float
    epsilon_high: float
    dual_clip: float | None
    agg_mode: str
    norm_length: int
    kl_beta: float
    kl_importance_correction: bool
    importance_sampling_level: str
    grad_clip: float
    mini_batch_tokens: int = 0
    pack: bool = False
    mask_truncated: bool = False  # [grpo] mask_truncated_completions
    tis_cap: float | None = None  # truncated importance sampling's cap (grpo.tis_imp_ratio_cap); None = off

    @classmethod
    def from_config(cls, config: Config) -> UpdateSettings:
        grpo = config.grpo
        return cls(
            temperature=config.policy_temperature,
            mu_iterations=grpo.mu_iterations,
            mini_batch=grpo.mini_batch,
            epsilon_low=grpo.epsilon_low,
            epsilon_high=grpo.epsilon_high,
            dual_clip=grpo.dual_clip,
            agg_mode=grpo.loss_agg_mode,
            norm_length=config.rollout.max_response_length,
            kl_beta=grpo.kl_beta,
            kl_importance_correction=grpo.kl_importance_correction,
            importance_sampling_level=grpo.importance_sampling_level,
            grad_clip=config.train.optm_grad_norm_clip,
            mini_batch_tokens=grpo.mini_batch_tokens,
            pack=config.packs_completions,
            mask_truncated=grpo.mask_truncated_completions,
            tis_cap=grpo.tis_imp_ratio_cap if config.tis_enabled else None,
        )

    def micro_batches(
        self, samples: list[RolloutSample], pad_token_id: int, vision: VisionTokens | None, device: torch.device
    ) -> list[CompletionBatch]:
        """The step's samples as policy batches on `device`, sized by mini_batch and mini_batch_tokens.

        No samples (dynamic sampling dropped every group of this rank while other ranks kept some): one silent batch,
        so that this rank's forwards gather FSDP2's shards with theirs (update_policy makes the counts even)."""
        if not samples:
            return [_silent_batch(pad_token_id, vision).to(device)]
        batches = build_micro_batches(samples, pad_token_id, vision, self.mini_batch, self.mini_batch_tokens, self.pack)
        if self.mask_truncated:
            batches = [replace(b, mask=mask_truncated(b.mask, b.truncated)) for b in batches]
        return [batch.to(device) for batch in batches]


def _silent_batch(pad_token_id: int, vision: VisionTokens | None) -> CompletionBatch:
    """A text row of pad tokens with no token in the loss (mask and advantages zero)."""
    from physreason.data.mcq import MCQPrompt
    from physreason.engines.base import Completion

    pads = [pad_token_id] * 2
    completion = Completion("", pads, [0.0] * len(pads), "length")
    sample = RolloutSample(0, MCQPrompt("silent", "", {}, ""), [pad_token_id] * 4, completion, {"total": 0.0}, None)
    return _silenced(build_micro_batches([sample], pad_token_id, vision, 1, 0, False)[0])


def _silenced(batch: CompletionBatch) -> CompletionBatch:
    """`batch` with no token in the loss: mask and advantages zero (counted 0, gradients 0)."""
    return replace(batch, mask=torch.zeros_like(batch.mask), advantages=torch.zeros_like(batch.advantages))


def _even_micro_batches(
    batches: list[CompletionBatch], runtime: Runtime, dp_group: dist.ProcessGroup | None
) -> list[CompletionBatch]:
    """This rank's micro-batches, made as many as the most any data-parallel rank has: every forward gathers FSDP2's
    shards with the other ranks, so a rank with fewer (dynamic sampling, failed requests and token-sized
    micro-batches split ranks unevenly) would wait on them for ever. The extra ones repeat this rank's last
    micro-batch with no token in the loss (mask and advantages zero: counted 0, gradients 0). PhysReasonError on every
    rank when one has none at all to repeat (UpdateSettings.micro_batches gives a rank without samples a silent one)."""
    # both on every rank, before any returns: a collective some ranks skip is itself a hang
    most = int(all_reduce_max(len(batches), runtime, dp_group))
    least = int(-all_reduce_max(-len(batches), runtime, dp_group))
    if least == 0 < most:  # every rank raises, the full ones too
        raise PhysReasonError(
            "a data-parallel rank has no micro-batch to run this step while others have some: every rank must run "
            "as many forwards (give a rank without samples UpdateSettings.micro_batches' silent batch)"
        )
    if most == len(batches):
        return batches
    return batches + [_silenced(batches[-1])] * (most - len(batches))


def update_policy(
    scorer: torch.nn.Module,
    batches: list[CompletionBatch],
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    settings: UpdateSettings,
    runtime: Runtime,
    grad_ranks: int,
    autocast: Any,
    reference: torch.nn.Module | None = None,
    dp_group: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """`mu_iterations` optimizer steps over the micro-batches; returns token-weighted policy metrics.

    Old log-probs are the policy's before the first update (with one iteration, the detached current
    ones: the ratio is 1 and only its gradient counts). Reference log-probs are computed when kl_beta > 0.
    With `settings.tis_cap` each token's policy loss is weighted by min(pi_old / pi_engine, cap), both at
    temperature 1 (the policy's raw log-probs before the update against the engine's).
    grad_ranks: the ranks FSDP2 averages gradients over (data-parallel x context-parallel). dp_group: the
    data-parallel process group (None: all ranks, i.e. no tensor or context parallelism); counts are summed over
    it alone, since the ranks of one tensor- or context-parallel group hold the same micro-batches.
    """
    batches = _even_micro_batches(batches, runtime, dp_group)
    counts = [aggregation_count(b.mask, settings.agg_mode) for b in batches]
    total = max(all_reduce_sum(sum(counts), runtime, dp_group), 1e-12)
    temperature = settings.temperature
    sums: dict[str, float] = {}
    tokens = [float(b.mask.sum()) for b in batches]

    def add(name: str, value: torch.Tensor | float, weight: float) -> None:
        sums[name] = sums.get(name, 0.0) + float(value) * weight

    old: list[torch.Tensor | None] = [None] * len(batches)
    ref: list[torch.Tensor | None] = [None] * len(batches)
    tis: list[torch.Tensor | None] = [None] * len(batches)  # truncated importance weights [B, T], fixed per step
    need_old = settings.mu_iterations > 1
    with torch.no_grad(), autocast:
        for i, batch in enumerate(batches):
            if need_old:
                scores = scorer(batch, temperature, diagnostics=True)
                old[i] = scores.logprobs
                _add_diagnostics(add, scores, batch)
                tis[i] = _tis_weights(scores, batch, settings.tis_cap)
            if reference is not None:
                ref[i] = reference(batch, temperature).logprobs
    # An FSDP2 root keeps its parameters (embedding, lm_head) gathered in param_dtype after a forward
    # until a backward reshards them; the reference never runs one, so it would hold them for good.
    for module in (scorer, reference):
        if isinstance(module, FSDPModule):
            module.reshard()
    # Under FSDP2 every micro-batch's backward reduce-scatters (set_requires_gradient_sync is never
    # turned off): gradients accumulate sharded in the fp32 masters. Skipping the reduction would keep
    # an unsharded fp32 gradient of the whole model on every rank until the last micro-batch, and in
    # torch 2.11 to 2.13 that path raises AttributeError ('FSDPParam' object has no attribute
    # '_unsharded_param') for any block that sat out the forward, e.g. a vision tower under text prompts.
    norms = []
    for iteration in range(settings.mu_iterations):
        for i, batch in enumerate(batches):
            diagnostics = not need_old and iteration == 0
            with autocast:
                scores = scorer(batch, temperature, diagnostics=diagnostics)
            if diagnostics:
                _add_diagnostics(add, scores, batch)
                tis[i] = _tis_weights(scores, batch, settings.tis_cap)
            with phases.phase(phases.LOSS):
                loss, metrics = policy_loss(
                    scores.logprobs,
                    old[i] if need_old else scores.logprobs.detach(),
                    batch.advantages,
                    batch.mask,
                    settings.epsilon_low,
                    settings.epsilon_high,
                    settings.dual_clip,
                    settings.agg_mode,
                    norm_length=settings.norm_length,
                    kl_beta=settings.kl_beta,
                    ref_logprobs=ref[i],
                    kl_importance_correction=settings.kl_importance_correction,
                    importance_sampling_level=settings.importance_sampling_level,
                    tis_weights=tis[i],
                    tis_cap=settings.tis_cap,
                )
            # FSDP averages gradients over its ranks; grad_ranks undoes that so the sum is the global batch's loss (a
            # context-parallel rank's backward holds only its own tokens' part of its batch's gradient).
            with phases.phase(phases.BACKWARD):
                (loss * (counts[i] * grad_ranks / total)).backward()
            add("loss", loss.detach(), counts[i] / total / settings.mu_iterations)
            for name, value in metrics.items():
                if name != "ratio_max":
                    add(f"policy/{name}", value, tokens[i] / settings.mu_iterations)
        # Under tensor parallelism the decoder blocks' gradients live on the (dp, tp) mesh and the rest on
        # dp alone: torch's clip_grad_norm_ cannot stack norms across meshes, parallelize.clip_grad_norm can.
        with phases.phase(phases.OPTIMIZER):
            parameters = [p for p in scorer.parameters() if p.requires_grad]
            norm = parallelize.clip_and_step(parameters, settings.grad_clip, optimizer)
            norms.append(float(norm))
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
    names = sorted(sums)
    reduced = _Stats(runtime, dp_group).reduce([sums[n] for n in names] + [sum(tokens)])
    token_total = max(float(reduced[-1]), 1.0)
    out = {}
    for name, value in zip(names, reduced[:-1].tolist(), strict=True):
        out[name] = value if name == "loss" else value / token_total
    out["policy/grad_norm"] = sum(norms) / len(norms)
    return out


def _add_diagnostics(add, scores, batch: CompletionBatch) -> None:
    mask = batch.mask
    add("policy/entropy_sum", masked_sum(scores.entropy, mask), 1.0)
    gap = (scores.raw_logprobs - batch.engine_logprobs).abs()  # [B, T]
    add("rollout/logprob_mismatch_sum", masked_sum(gap, mask), 1.0)


def _tis_weights(scores, batch: CompletionBatch, cap: float | None) -> torch.Tensor | None:
    """The batch's truncated importance weights from the policy's pre-update raw log-probs, or None when off."""
    if cap is None:
        return None
    return truncated_importance_weights(scores.raw_logprobs, batch.engine_logprobs, batch.mask, cap)


def _rename_diagnostics(metrics: dict[str, float]) -> dict[str, float]:
    # The *_sum entries were divided by the step's token count: they are token means.
    return {name.removesuffix("_sum"): value for name, value in metrics.items()}


def rollout_metrics(
    batch: RolloutBatch, stats: _Stats, reward_names: list[str], vision: VisionTokens | None
) -> dict[str, float]:
    """Reward mean/std per reward (over every scored completion, dropped groups included), lengths, counts."""
    out: dict[str, float] = {}
    for name in reward_names:
        mean, std = stats.mean_std([r[name] for r in batch.scored])
        out[f"reward/{name}_mean"], out[f"reward/{name}_std"] = mean, std
    out["rollout/accuracy"] = out.get("reward/accuracy_mean", 0.0)
    out["rollout/format_rate"] = out.get("reward/format_mean", 0.0)
    lengths = [float(len(s.completion.token_ids)) for s in batch.samples]
    out["rollout/response_length_mean"], _ = stats.mean_std(lengths)
    # Prompt tokens after vision placeholders expand: with the response length, the step's token throughput.
    out["rollout/prompt_length_mean"], _ = stats.mean_std([float(len(s.prompt_ids)) for s in batch.samples])
    truncated = [float(s.completion.finish_reason == "length") for s in batch.samples]
    out["rollout/truncated_frac"], _ = stats.mean_std(truncated)
    cut = [float(first_vision_token(s.completion.token_ids, vision) is not None) for s in batch.samples]
    out["rollout/vision_token_cut_frac"], _ = stats.mean_std(cut)
    keys = ("prompts_drawn", "groups_dropped", "requests_failed", "reward_errors", "rounds")
    summed = stats.reduce([float(batch.counts[k]) for k in keys] + [float(batch.num_groups)]).tolist()
    out.update({f"rollout/{k}": v for k, v in zip(keys, summed[:-1], strict=True)})
    out["rollout/groups_kept"] = summed[-1]
    return out


# Steps in a row in which every rollout request failed before GRPO stops: an engine that refuses every request (a
# model vLLM does not run as a generative one, a broken media path, a context too small for every prompt) would
# otherwise run the whole schedule without an update. One such step alone (an engine's transient out-of-memory)
# passes, as a step whose groups were all dropped does.
FAILING_STEPS_LIMIT = 3


def _check_failing_rollouts(metrics: dict[str, float], rollouts: RolloutBatch, step: int, failing: int) -> int:
    """The number of steps in a row, this one included, in which every request failed (counts summed over ranks, so
    every rank agrees); raise once it reaches FAILING_STEPS_LIMIT."""
    drawn, failed = metrics["rollout/prompts_drawn"], metrics["rollout/requests_failed"]
    failing = failing + 1 if every_request_failed(drawn, failed) else 0
    if failing >= FAILING_STEPS_LIMIT:
        first = step + 2 - failing
        raise PhysReasonError(
            f"GRPO stopped at step {step + 1}: every rollout request failed in steps {first}-{step + 1} "
            f"({int(failed)} of {int(drawn)} this step), so no step could train. First error on this rank: "
            f"{rollouts.first_error or 'not on this rank'}. The checkpoints and metrics written so far are kept; fix "
            "the cause and resume with train.resume=true"
        )
    return failing


def build_policy(config: Config, runtime: Runtime, total_steps: int) -> TrainingModel:
    """The policy (a PolicyScorer) and, when kl_beta > 0, its frozen reference, built for `total_steps` GRPO steps.

    The schedule spans total_steps x mu_iterations optimizer steps.
    """
    grpo_cfg = config.grpo
    if config.engine.lora is not None:
        # The engine would add that fixed adapter on top of every policy version it is sent.
        raise ConfigError(
            f"engine.lora = {config.engine.lora!r} serves a fixed adapter for inference; GRPO sends the engine its own "
            "policy: unset engine.lora (train.lora trains adapters; start from an adapter's merged export as model)"
        )
    reference = None
    if grpo_cfg.kl_beta > 0:
        reference = config.model.model_copy(
            update={"model_name_or_path": grpo_cfg.reference_model_path or config.model.model_name_or_path}
        )
    # Under torchrun the data-parallel ranks may hold different mixes of images, videos and text.
    return build_training_model(
        config,
        runtime,
        lambda model: PolicyScorer(
            model, balance_vision=runtime.balances_vision, packed_attention=grpo_cfg.packed_attention
        ),
        total_steps * grpo_cfg.mu_iterations,
        reference,
    )


def print_grpo_startup(config: Config, prompts: int, steps: int, device: object, world_size: int) -> None:
    """The start-up summary of a GRPO run (colocated or disaggregated): model, family, prompt style and answer type,
    prompts, rollout sampling, policy dtype on its device and processes, steps, output folder."""
    from physreason.engines.factory import resolve_backend
    from physreason.models.inputs import prompting_for
    from physreason.startup import describe_sampling, print_training_startup
    from physreason.train.rollout import rollout_sampling

    rollout = config.rollout
    sampling = (
        f"{describe_sampling(rollout_sampling(config))}; {rollout.n_generation} completions per prompt on the "
        f"{resolve_backend(rollout_engine_config(config))} engine"
    )
    print_training_startup(
        config,
        "grpo",
        prompt=f"{prompting_for(config)[0].style}, answer type {config.grpo.answer_type}",
        data=f"{config.data.dataset.name}: {prompts} prompts",
        steps=str(steps),
        device=device,
        world_size=world_size,
        sampling=sampling,
    )


@releases_output_lock
def run_grpo(
    config: Config, engine: Engine | None = None, on_step: Callable[[int], None] | None = None
) -> GRPOResult:
    """Train config.model with GRPO on the multiple-choice prompts of config.data; returns the run's record.

    `engine` defaults to the recipe's rollout engine (`rollout_engine_config`), which is closed when the run ends;
    pass one to share it (tests, the demo): it stays open for its owner.
    `on_step(step)` is called after each finished step (benchmarks step a profiler with it).
    """
    with contextlib.ExitStack() as owned:
        return _run_grpo(config, engine, on_step, owned)


def _run_grpo(
    config: Config, engine: Engine | None, on_step: Callable[[int], None] | None, owned: contextlib.ExitStack
) -> GRPOResult:
    """run_grpo's body; the engine it builds goes on `owned`, which run_grpo closes however the run ends."""
    # before any model is loaded or engine started: a misspelt reward would otherwise stop the run at its first step
    check_reward_options(config.grpo.reward_function, config.grpo.reward_options)
    runtime = init_runtime()
    train_cfg, grpo_cfg, rollout_cfg = config.train, config.grpo, config.rollout
    seed_everything(train_cfg.seed)
    prepare_output(config, runtime)
    tp, cp = config.policy.parallelism.tp_size, config.policy.parallelism.cp_size
    dp_size, dp_rank = parallelize.check_layout(runtime.world_size, tp, cp), runtime.rank // (tp * cp)
    groups = groups_per_rank(config, dp_size)

    tokenizer = loading.load_tokenizer(config.model)
    hf_config = loading.load_model_config(config.model)
    vision_tokens = read_vision_tokens(hf_config)
    processor_params = None
    if vision_tokens is not None:
        from physreason.models.inputs import load_processor_params

        processor_params = load_processor_params(config.model.model_name_or_path, config.model.revision)
    # a question that writes a turn marker or vision placeholder is refused here, before any model work
    prompts = load_mcq_prompts(config.data.dataset, config.data.max_samples, structural_tokens(tokenizer))
    # prints the plan of these prompts' media and lengths; refuses a start that cannot fit
    shape_of_prompts = prompt_shape(config, prompts, tokenizer)
    config = resolve_runtime_checkpoint_every(config, runtime, "grpo", shape_of_prompts)  # "auto" made a number
    train_cfg = config.train
    plan = check_runtime_memory(config, runtime, "grpo", shape_of_prompts)
    stream = PromptStream(prompts, train_cfg.seed, config.data.shuffle, grpo_cfg.shuffle_options)
    prompts_per_step = groups * dp_size
    if train_cfg.max_steps is None and len(prompts) < prompts_per_step:
        raise ConfigError(
            f"{len(prompts)} prompts do not fill one step of {prompts_per_step} prompt groups "
            f"(train.train_batch_per_replica / rollout.n_generation): lower it, set train.max_steps, or add data"
        )
    total_steps = train_cfg.max_steps or train_cfg.epoch * (len(prompts) // prompts_per_step)
    if runtime.is_main:
        print_grpo_startup(config, len(prompts), total_steps, runtime.device, runtime.world_size)

    lora = train_cfg.lora
    quantization = rollout_cfg.quantization
    if engine is None:
        # With LoRA a vLLM engine gets an adapter slot, so each sync sends the adapter alone (PolicySync); an FP8
        # engine takes merged weights instead.
        wants_slot = lora.enable and adapter_push_supported(lora) and quantization == "none"
        engine = create_engine(
            config.model,
            rollout_engine_config(config),
            lora_rank=lora.rank if wants_slot else None,
            quantization=quantization,
        )
        owned.enter_context(engine)
    if quantization != "none" and getattr(engine, "quantization", None) != quantization:
        raise ConfigError(
            f"rollout.quantization = {quantization!r} but the rollout engine given was built without it: build it "
            "with create_engine(..., quantization=...) or leave rollout.quantization = 'none'"
        )
    policy = build_policy(config, runtime, total_steps)
    model, scorer, reference = policy.model, policy.module, policy.reference
    optimizer, scheduler, autocast = policy.optimizer, policy.scheduler, policy.autocast
    dp_group = policy.dp_group
    engine_dtype = loading.DTYPES.get(config.model.dtype)
    sync = PolicySync(engine, model, policy.peft, lora, engine_dtype, quantization)
    if lora.enable:
        log.info("LoRA policy: the rollout engine gets %s weights at each sync", sync.mode)

    checkpointer = Checkpointer(config, policy)
    divergence = DivergenceWatch(config.train.output_dir)  # which saved steps the losses after them vouch for

    result = GRPOResult()
    step = 0
    resumed = checkpointer.resume()
    if resumed is not None:
        step, stream.cursor = resumed.step, resumed.state["prompt_cursor"]
        log.info("resumed from %s at step %d (prompt draw %d)", resumed.path, step, stream.cursor)
    if resumed is not None or quantization != "none":
        # A quantized engine starts with random weights (vllm_compat.fp8_rollout_kwargs): the policy's go in first.
        sync.push()
    if nothing_to_do(resumed, total_steps):
        sync.close()
        with contextlib.closing(checkpointer):
            checkpointer.finish()  # uploads an earlier process of this run left unfinished
        result.finished_before = result.last_checkpoint = resumed.path
        return result
    _sleep(engine)
    if runtime.is_main:
        trainable, every = parameter_counts(scorer)
        log.info(
            "%s",
            run_summary(
                "Running GRPO",
                {
                    "Num prompts": len(prompts),
                    "Num epochs": f"{total_steps * prompts_per_step / len(prompts):.4g}",
                    "Prompts per step (groups)": prompts_per_step,
                    "Completions per prompt (rollout.n_generation)": rollout_cfg.n_generation,
                    "Effective batch (completions per step)": prompts_per_step * rollout_cfg.n_generation,
                    "Policy updates per step (grpo.mu_iterations)": grpo_cfg.mu_iterations,
                    "Data-parallel processes": dp_size,
                    "Total steps": total_steps,
                    "Starting at step": step,
                    "Trainable parameters": f"{trainable:,} of {every:,} ({100 * trainable / max(every, 1):.2f}%)",
                },
            ),
        )

    settings = rollout_settings(
        config,
        groups_needed=groups,
        prompts_per_round=rollout_cfg.batch_size,
        max_rounds=grpo_cfg.max_dynamic_sampling_rounds,
        processor_params=processor_params,
    )
    sampling = settings.sampling
    if sampling.top_p < 1.0 or sampling.top_k > 0 or sampling.repetition_penalty != 1.0:
        log.warning(
            "rollout.sampling_config has top_p/top_k/repetition_penalty set: completions are then not drawn from the "
            "policy's tempered distribution that the GRPO ratio assumes"
        )
    update = UpdateSettings.from_config(config)
    reward_names = logged_reward_names(config)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    stats = _Stats(runtime, dp_group)

    def all_done(done: bool) -> bool:
        return all_reduce_sum(float(not done), runtime) == 0.0

    with (
        # first in, last out: a step that runs out of memory is explained after the checkpointer has closed
        explains_out_of_memory(config, "grpo", runtime.device, plan.total, lambda: step + 1),
        StepLog(config, total_steps, step, "grpo", enabled=runtime.is_main) as step_log,
        contextlib.closing(checkpointer),
        StopOnSignal(runtime, saves=config.train.ckpt.enable_checkpoint) as stop,
    ):
        failing_steps = 0
        while step < total_steps:
            started = time.perf_counter()
            _wake(engine)
            with phases.phase(phases.GENERATE):
                rollouts = collect_rollouts(engine, stream, settings, step, dp_rank, dp_size, all_done)
            _sleep(engine)
            lr = scheduler.get_last_lr()[0]
            train_started = time.perf_counter()
            samples = rollouts.samples
            metrics = rollout_metrics(rollouts, stats, reward_names, vision_tokens)
            failing_steps = _check_failing_rollouts(metrics, rollouts, step, failing_steps)
            if all_reduce_sum(float(len(samples)), runtime) > 0:
                batches = update.micro_batches(samples, pad_id, vision_tokens, runtime.device)
                metrics.update(
                    _rename_diagnostics(
                        update_policy(
                            scorer,
                            batches,
                            optimizer,
                            scheduler,
                            update,
                            runtime,
                            dp_size * cp,
                            autocast,
                            reference,
                            dp_group,
                        )
                    )
                )
            else:
                # Nothing to learn from (every group dropped or failed): the step passes without an update.
                for _ in range(update.mu_iterations):
                    scheduler.step()
                metrics["rollout/empty_step"] = 1.0
            train_s = time.perf_counter() - train_started
            step += 1
            if "rollout/empty_step" in metrics:
                divergence.no_update(step)
            if "loss" in metrics:  # reduced over ranks: every rank stops, before the weights reach the engine
                try:
                    divergence.check(step, metrics["loss"], metrics["policy/grad_norm"])
                except TrainingDiverged:
                    step_log.log(step, metrics)  # the diverged step's own metrics, to see which went non-finite first
                    raise
            save_now = checkpoint_due(config, step, total_steps)
            sync_s = 0.0
            if step % train_cfg.sync_weight_interval == 0 or save_now:
                sync_started = time.perf_counter()
                _wake(engine)
                with phases.phase(phases.SYNC):
                    sync.push()
                sync_s = time.perf_counter() - sync_started
            elapsed = time.perf_counter() - started
            completions = all_reduce_sum(float(len(samples)), runtime, dp_group)
            metrics.update(
                {
                    "train/lr": lr,
                    "time/generate_s": all_reduce_sum(rollouts.generate_s, runtime) / runtime.world_size,
                    "time/score_s": all_reduce_sum(rollouts.score_s, runtime) / runtime.world_size,
                    "time/train_s": train_s,
                    "time/sync_s": sync_s,
                    "time/step_s": elapsed,
                    "perf/samples_per_s": completions / elapsed,
                }
            )
            result.rewards.append(metrics["reward/total_mean"])
            result.metrics.append(metrics)
            step_log.step(
                step,
                metrics,
                {
                    "reward": f"{metrics['reward/total_mean']:.3f}",
                    "acc": f"{metrics['rollout/accuracy']:.2f}",
                    "len": f"{metrics['rollout/response_length_mean']:.0f}",
                },
            )
            saved = None
            if save_now:
                saved = checkpointer.save(step, {"prompt_cursor": stream.cursor})
                result.last_checkpoint = saved.checkpoint
                if saved.export is not None:
                    result.export_dir = saved.export
            stop.after_step(checkpointer, step, saved, {"prompt_cursor": stream.cursor})
            if on_step is not None:
                on_step(step)
        checkpointer.finish()
    sync.close()
    return result
