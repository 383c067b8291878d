"""The supervised fine-tuning loop: one process, or many under torchrun with FSDP2 (and optional TP).

Loss: token-mean cross-entropy over every assistant token of the global batch (all micro-batches and
ranks), so gradient accumulation, packing and the process count leave the objective unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from physreason.chat.prompts import REASON2_SYSTEM_PROMPT
from physreason.chat.style import resolve_prompting
from physreason.config import Config, DatasetConfig
from physreason.cpu import apply_cpu_share
from physreason.data.collate import SFTBatch, collate_padded
from physreason.data.loaders import load_located_records, unusable_records_error
from physreason.data.packing import collate_packed
from physreason.data.sampler import StepSampler
from physreason.data.sft import SFTDataset
from physreason.errors import ConfigError
from physreason.models import loading, parallelize
from physreason.models.family import model_family, read_vision_tokens
from physreason.train import phases
from physreason.train.build import build_training_model
from physreason.train.host_step import OverlappedHostStep, settled
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
from physreason.train.memory_report import check_runtime_memory, resolve_runtime_checkpoint_every
from physreason.train.model import CausalLMLoss
from physreason.train.out_of_memory import explains_out_of_memory
from physreason.train.runlock import releases_output_lock
from physreason.train.runtime import (
    Runtime,
    all_reduce_max,
    all_reduce_sum,
    all_reduce_sums,
    gathered_counts,
    init_runtime,
    seed_everything,
)

log = logging.getLogger(__name__)


@dataclass
class SFTResult(TrainingResult):
    """What a run did: per-step training losses, validation losses, skip counts, final folders."""

    losses: list[float] = field(default_factory=list)
    val_losses: dict[int, float] = field(default_factory=dict)
    skipped: Counter = field(default_factory=Counter)
    empty_steps: list[int] = field(default_factory=list)  # steps whose every sample was skipped (loss nan, no update)
    truncated: int = 0  # samples cut at model_max_length that trained on what was left (all data-parallel ranks)


def run_state(result: SFTResult) -> dict[str, Any]:
    """What a checkpoint keeps of the run's bookkeeping, for a resume to carry on with: skip reasons, cut samples,
    the steps that had every sample skipped."""
    return {"skipped": dict(result.skipped), "truncated": result.truncated, "empty_steps": list(result.empty_steps)}


def data_counts(result: SFTResult) -> dict[str, float]:
    """The metrics of the run's data so far: skipped samples by reason, and the samples cut at model_max_length."""
    counts = {f"skipped/{k}": float(v) for k, v in result.skipped.items()}
    if result.truncated:
        counts["truncated/samples"] = float(result.truncated)
    return counts


def sft_system_prompt(config: Config, hf_config: Any) -> str | None:
    """The system turn given to SFT records that bring none: the prompt style's, as inference sends it.

    reason2: "You are a helpful assistant." (Qwen3-VL's template adds no system turn itself); reason1: None,
    Qwen2.5-VL's template inserts that same default. `[prompt] system_prompt` replaces either; "" adds none.
    """
    prompting = resolve_prompting(config, model_family(hf_config).name)
    if prompting.system_prompt is not None:
        return prompting.system_prompt or None
    return REASON2_SYSTEM_PROMPT if prompting.style == "reason2" else None


def warn_reason1_layout(config: Config, hf_config: Any, train: SFTDataset) -> None:
    """One warning line when a model prompted in Reason2's style would learn Reason1's <answer> tags from the data."""
    from physreason.data.convert import count_reason1_records

    if resolve_prompting(config, model_family(hf_config).name).style != "reason2":
        return
    count = count_reason1_records(train.records, train.column)
    if count:
        log.warning(
            "%d of %d records of %s answer in Cosmos-Reason1's layout (<answer> tags) but %s is prompted in "
            "Cosmos-Reason2's (the answer right after </think>), so it would learn to write the tags: convert them "
            "with `physreason data convert --style reason2 IN OUT`, or set prompt.style = \"reason1\" to train that "
            "layout on purpose",
            count, len(train), config.data.dataset.name, config.model.model_name_or_path,
        )


def _print_startup(
    config: Config, runtime: Runtime, hf_config: Any, train_set: SFTDataset, val_set: SFTDataset | None, steps: int
) -> None:
    """The start-up summary of an SFT run: model, family, prompt style and default system turn, data format."""
    from physreason.startup import print_training_startup

    prompting = resolve_prompting(config, model_family(hf_config).name)
    system = sft_system_prompt(config, hf_config)
    prompt = f"{prompting.style}; records without a system turn get " + (
        f"{system!r}" if system is not None else "the chat template's default"
    )
    held_out = f", {len(val_set)} held out" if val_set is not None else ""
    data = f"{config.data.dataset.name}: {len(train_set)} records{held_out}; {train_set.layout()}"
    print_training_startup(
        config, "sft", prompt=prompt, data=data, steps=str(steps), device=runtime.device, world_size=runtime.world_size
    )


def build_datasets(config: Config, tokenizer: Any, hf_config: Any) -> tuple[SFTDataset, SFTDataset | None]:
    """Train and validation sets (a held-out fraction of train when no val_dataset is given).

    Every record's layout and media paths are checked here, before any model is built (InputError names
    the file and line of each bad record, all of them counted in one message).
    """
    unreadable: list[str] = []  # lines or list items that are not readable records, each named by file and line
    records, root, where = load_located_records(config.data.dataset, unreadable=unreadable)
    if config.data.max_samples:
        records, where = records[: config.data.max_samples], where[: config.data.max_samples]
    val_records: list[dict] = []
    val_where: list[str] = []
    val_root = root
    if config.data.val_dataset is not None:
        val_records, val_root, val_where = load_located_records(config.data.val_dataset, unreadable=unreadable)
    elif config.data.val_fraction > 0:
        order = torch.randperm(len(records), generator=torch.Generator().manual_seed(config.train.seed)).tolist()
        n_val = max(1, int(len(records) * config.data.val_fraction))
        val_records, val_where = [records[i] for i in order[-n_val:]], [where[i] for i in order[-n_val:]]
        records, where = [records[i] for i in order[:-n_val]], [where[i] for i in order[:-n_val]]
    vision_tokens = read_vision_tokens(hf_config)
    params = None
    if vision_tokens is not None:
        from physreason.models.inputs import load_processor_params

        params = load_processor_params(config.model.model_name_or_path, config.model.revision)
    make = functools.partial(
        SFTDataset,
        tokenizer=tokenizer,
        max_length=config.model.model_max_length,
        vision_tokens=vision_tokens,
        vision_config=config.vision,
        processor_params=params,
        conversation_column=config.data.conversation_column_name,
        default_system_prompt=sft_system_prompt(config, hf_config),
        prompt_style=resolve_prompting(config, model_family(hf_config).name).style,
    )
    train = make(records, root, source=config.data.dataset.name, locations=where)
    val_name = (config.data.val_dataset or DatasetConfig(name=f"{config.data.dataset.name} (held out)")).name
    val = make(val_records, val_root, source=val_name, locations=val_where) if val_records else None
    problems = unreadable + [p for dataset in (train, val) if dataset is not None for p in dataset.record_problems()]
    if problems:  # before the layout warning, which reads every record's conversation
        raise unusable_records_error(problems, len(records) + len(val_records) + len(unreadable), "SFT records")
    warn_reason1_layout(config, hf_config, train)
    return train, val


def batch_layout(config: Config, world_size: int, tp_size: int, cp_size: int = 1) -> tuple[int, int]:
    """(samples per rank per step, micro-batches per step) from the global batch and mini_batch."""
    dp = parallelize.check_layout(world_size, tp_size, cp_size)
    global_batch, mini = config.train.train_batch_per_replica, config.train.mini_batch
    if global_batch % (dp * mini):
        raise ConfigError(
            f"train.train_batch_per_replica ({global_batch}) must be a multiple of data-parallel size ({dp}) "
            f"x train.mini_batch ({mini})"
        )
    per_rank = global_batch // dp
    return per_rank, per_rank // mini


# Float8 matmuls (torch._scaled_mm) need every side a multiple of 16, the batch's token count included.
FLOAT8_TOKEN_MULTIPLE = 16


def _collate_fn(config: Config, pad_id: int, mrope: bool):
    multiple = FLOAT8_TOKEN_MULTIPLE if config.train.fp8.enable_fp8 else 1
    if config.data.packing:
        return functools.partial(collate_packed, mrope=mrope, pad_multiple=multiple, pad_token_id=pad_id)
    return functools.partial(collate_padded, pad_token_id=pad_id, mrope=mrope, pad_multiple=multiple)


def _filler_batch(collate: Callable[[list], SFTBatch], pad_id: int, length: int = 16) -> SFTBatch:
    """A text row of `length` pad tokens without a target (loss 0): the forward a short data-parallel rank runs so
    that every rank gathers FSDP2's shards as often as the others (train_step, validation_loss)."""
    from physreason.data.collate import IGNORE_INDEX
    from physreason.data.sft import SFTSample

    ids = torch.full((length,), pad_id, dtype=torch.long)
    return collate([SFTSample(ids, torch.full_like(ids, IGNORE_INDEX), torch.arange(length).expand(3, -1))])


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _loader_worker_init(_worker_id: int) -> None:
    """In each loader worker: leave stop signals to the trainer, and end the process at exit before the interpreter
    finalises.

    Ctrl-C, GNU timeout and a scheduler stopping a job signal the whole process group. A worker ended by the signal
    makes torch's SIGCHLD handler raise "DataLoader worker is killed by signal" in the trainer wherever it is, mid-step:
    the step is not finished, nothing is saved and the run fails instead of stopping. So workers ignore SIGINT and
    SIGTERM (they were started with both blocked, see MicroBatches._open, so one sent while this process still imported
    torch waits and is discarded here) and the trainer decides: it finishes its step and closes the loader, which ends
    them. Were the trainer killed outright, torch's watchdog in each worker ends it within seconds.

    A worker stopped while its result queue's feeder thread is still sending a prefetched batch (torch shares the
    tensor's storage with the GIL released) is torn down mid-send: PyTorch's worker loop does not wait for that
    thread, the finalising interpreter force-unwinds it through C++ frames, and the worker dies by SIGABRT
    ("terminate called without an active exception", then a RuntimeError in the trainer's process). The batch in
    flight is one nobody will read; exiting here, after flushing output, ends the worker before that race.
    """
    import atexit
    import os
    import sys

    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)

    def leave() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    atexit.register(leave)


@contextlib.contextmanager
def _stop_signals_held() -> Iterator[None]:
    """Hold SIGINT and SIGTERM back from this thread for the block: processes started in it begin with both blocked
    (a signal mask survives fork and exec) until they choose what to do with them; signals that come meanwhile are
    delivered here when the block ends."""
    from multiprocessing import resource_tracker

    # The first spawned process starts multiprocessing's resource tracker, and that start unblocks both signals
    # (rather than restoring the mask it found): start it before holding them.
    resource_tracker.ensure_running()
    held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


class MicroBatches:
    """Endless stream of micro-batches for this rank, positioned by optimizer step (resumable)."""

    def __init__(self, dataset: SFTDataset, sampler: StepSampler, mini_batch: int, collate, workers: int) -> None:
        self.dataset, self.sampler, self.mini_batch, self.collate, self.workers = dataset, sampler, mini_batch, collate, workers
        self._loader: DataLoader | None = None
        self._iterator: Iterator[SFTBatch] | None = None

    def seek(self, step: int) -> None:
        """Make the next micro-batch the first of global step `step`."""
        per_epoch = self.sampler.steps_per_epoch
        self.sampler.set_position(step // per_epoch, step % per_epoch)
        self._iterator = None

    def _open(self) -> Iterator[SFTBatch]:
        """A new pass over the sampler's current position; worker processes are started once and kept."""
        if self._loader is None:
            workers: dict[str, Any] = {}
            if self.workers > 0:
                # Spawned, not forked: a forked worker inherits the parent's thread pools (OpenMP, FFmpeg) in
                # whatever state they were, and on a 16-core GPU machine 14 forked workers hung in their first
                # frame resize after an evaluation had decoded videos in the parent. Persistent, so the start-up
                # (importing torch in each worker) is paid once, not every epoch.
                workers = {
                    "multiprocessing_context": "spawn",
                    "persistent_workers": True,
                    "worker_init_fn": _loader_worker_init,
                }
            # Each new iterator draws its workers' base seed from `generator`; from the global generator that draw
            # would shift the training RNG (LoRA dropout) whenever a resumed run opens its first pass mid-epoch.
            self._loader = DataLoader(
                self.dataset,
                batch_size=self.mini_batch,
                sampler=self.sampler,
                collate_fn=self.collate,
                num_workers=self.workers,
                generator=torch.Generator().manual_seed(self.sampler.seed),
                **workers,
            )
        # The first pass starts the worker processes; without workers there is nothing to hold the signals back from
        # (nor a resource tracker process to start for it).
        with _stop_signals_held() if self.workers > 0 else contextlib.nullcontext():
            return iter(self._loader)

    def close(self) -> None:
        """Stop the worker processes now: persistent workers otherwise live, prefetching, until the garbage collector
        reaches the loader, which can be in the middle of a later stage of the same process."""
        self._iterator = None
        self._loader = None  # the last reference to the persistent iterator: its workers are shut down here

    def take(self, count: int) -> list[SFTBatch]:
        """The next `count` micro-batches, crossing into the next epoch when one ends."""
        batches: list[SFTBatch] = []
        while len(batches) < count:
            if self._iterator is None:
                self._iterator = self._open()
            try:
                batches.append(next(self._iterator))
            except StopIteration:
                self.sampler.set_position(self.sampler.epoch + 1, 0)
                self._iterator = None
        return batches


def train_step(
    module: torch.nn.Module,
    micro_batches: list[SFTBatch],
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    runtime: Runtime,
    grad_ranks: int,
    clip: float,
    autocast: Any,
    dp_group: dist.ProcessGroup | None = None,
    reduced_norm: parallelize.ReducedGradNorm | None = None,
    overlap: OverlappedHostStep | None = None,
    filler: SFTBatch | None = None,
    targets: float | None = None,
) -> tuple[float, float]:
    """One optimizer step over the micro-batches; returns (global token-mean loss, grad norm).

    filler: a batch without targets. With several data-parallel ranks every rank must run as many forwards (each
    gathers FSDP2's shards with the others): a rank whose micro-batches held only skipped samples runs the filler
    as often as it is short, its loss times 0 (without it those ranks would wait on each other for ever).

    grad_ranks: the ranks FSDP2 averages gradients over (data-parallel x context-parallel). dp_group: the
    data-parallel process group (None: all ranks, i.e. no tensor or context parallelism). reduced_norm: the training
    model's (train.cpu_offload on one rank), for the gradient norm from the GPU. overlap: the training model's
    (train.cpu_offload_overlap): the optimizer step is still running when this returns, and the next step's forward
    waits for each unit's update; whatever else reads the weights calls overlap.wait() first.
    """
    if targets is None:  # the caller's global count of target tokens, when it has it (the SFT loop does)
        targets = all_reduce_sum(sum(b.num_targets for b in micro_batches), runtime, dp_group)
    # FSDP averages gradients over its ranks; multiplying by grad_ranks makes the result the gradient of (sum of
    # token losses / all target tokens of the global batch). A context-parallel rank's backward holds only its own
    # tokens' part of its batch's gradient, so the average over dp x cp ranks times grad_ranks is that sum too.
    scale = grad_ranks / max(targets, 1.0)
    loss_sum = 0.0
    # Gradient sync stays on for every micro-batch: FSDP2's sync-off accumulation path fails on groups that
    # took no part in the forward (a VL model's vision blocks on text-only batches) when param and reduce
    # dtypes differ, and it would hold a full unsharded fp32 gradient per rank until the last micro-batch.
    usable = [b for b in micro_batches if b.num_samples]
    weights = [scale] * len(usable)
    if filler is not None:
        short = int(all_reduce_max(len(usable), runtime, dp_group)) - len(usable)
        usable, weights = usable + [filler] * short, weights + [0.0] * short
    for batch, weight in zip(usable, weights, strict=True):
        with autocast:
            loss = module(batch.to(runtime.device))
        if overlap is not None:
            overlap.wait()  # the last step's update of units this forward did not run, before their gradients
        with phases.phase(phases.BACKWARD):
            (loss * weight).backward()
        loss_sum += float(loss.detach()) if weight else 0.0
    with phases.phase(phases.OPTIMIZER):
        # on the host (train.cpu_offload) the clip coefficient rides in the fused AdamW: no pass of its own
        parameters = [p for p in module.parameters() if p.requires_grad]
        if overlap is None:
            norm = parallelize.clip_and_step(parameters, clip, optimizer, reduced=reduced_norm)
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        else:
            # the step starts in the background with this step's lr (the schedule moves on below); each unit's
            # gradients are released once it is stepped
            norm = parallelize.clip_and_step(parameters, clip, optimizer, reduced=reduced_norm, step=overlap.start)
            scheduler.step()
    return all_reduce_sum(loss_sum, runtime, dp_group) / max(targets, 1.0), float(norm)


@torch.no_grad()
def validation_loss(
    module: torch.nn.Module,
    dataset: SFTDataset,
    collate,
    runtime: Runtime,
    mini_batch: int,
    autocast,
    replica_size: int = 1,
    dp_group: dist.ProcessGroup | None = None,
    filler: SFTBatch | None = None,
) -> float:
    """Token-mean loss over the whole validation set, split over data-parallel ranks.

    replica_size: consecutive ranks that share one batch (tp_size x cp_size). filler: as train_step's; a rank with
    fewer usable batches (the set does not split evenly, or its samples were skipped) runs it until all ranks ran as
    many forwards.
    """
    module.eval()
    dp_rank, dp_size = runtime.rank // replica_size, runtime.world_size // replica_size
    indices = list(range(dp_rank, len(dataset), dp_size))
    loader = DataLoader(dataset, batch_size=mini_batch, sampler=indices, collate_fn=collate)
    total, count, forwards = 0.0, 0, 0
    for batch in loader:
        if batch.num_samples:
            with autocast:
                total += float(module(batch.to(runtime.device)))
            count += batch.num_targets
            forwards += 1
    if filler is not None:
        for _ in range(int(all_reduce_max(forwards, runtime, dp_group)) - forwards):
            with autocast:
                module(filler.to(runtime.device))
    module.train()
    return all_reduce_sum(total, runtime, dp_group) / max(all_reduce_sum(count, runtime, dp_group), 1.0)


@releases_output_lock
def run_sft(config: Config, on_step: Callable[[int], None] | None = None) -> SFTResult:
    """Fine-tune config.model on config.data as configured in config.train; returns the run's record.

    `on_step(step)` is called after each finished step (to step a physreason.train.profiling.Profiled window).
    """
    runtime = init_runtime()
    train_cfg = config.train
    seed_everything(train_cfg.seed)
    prepare_output(config, runtime)

    tokenizer = loading.load_tokenizer(config.model)
    hf_config = loading.load_model_config(config.model)
    config = resolve_runtime_checkpoint_every(config, runtime, "sft")  # train.checkpoint_every = "auto" made a number
    train_cfg = config.train
    plan = check_runtime_memory(config, runtime, "sft")  # prints the plan; refuses a start that cannot fit
    train_set, val_set = build_datasets(config, tokenizer, hf_config)
    tp, cp = config.policy.parallelism.tp_size, config.policy.parallelism.cp_size
    per_rank, accumulation = batch_layout(config, runtime.world_size, tp, cp)
    dp_size = runtime.world_size // (tp * cp)
    dp_rank = runtime.rank // (tp * cp)
    sampler = StepSampler(len(train_set), train_cfg.train_batch_per_replica, dp_rank, dp_size, train_cfg.seed, config.data.shuffle)
    if sampler.steps_per_epoch == 0:
        raise ConfigError(
            f"{len(train_set)} training samples do not fill one batch of train.train_batch_per_replica = "
            f"{train_cfg.train_batch_per_replica}: lower it or add data"
        )
    total_steps = train_cfg.max_steps or train_cfg.epoch * sampler.steps_per_epoch
    if runtime.is_main:
        _print_startup(config, runtime, hf_config, train_set, val_set, total_steps)
    mrope = read_vision_tokens(hf_config) is not None
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    collate = _collate_fn(config, pad_id, mrope)
    filler = _filler_batch(collate, pad_id) if runtime.distributed and runtime.world_size > 1 else None
    workers = apply_cpu_share().loader_workers(config.data.num_workers)  # within this process's share of the host
    if workers < config.data.num_workers:
        log.info("data.num_workers %d: %d loader workers within this process's CPU share", config.data.num_workers, workers)
    stream = MicroBatches(train_set, sampler, train_cfg.mini_batch, collate, workers)

    # Data-parallel ranks may see different mixes of images, videos and text (CausalLMLoss.balance_vision).
    trained = build_training_model(
        config,
        runtime,
        lambda model: CausalLMLoss(model, train_cfg.loss_chunk_size, balance_vision=runtime.balances_vision),
        total_steps,
        overlaps_step=True,
    )
    module, optimizer, scheduler = trained.module, trained.optimizer, trained.scheduler
    autocast, dp_group = trained.autocast, trained.dp_group
    checkpointer = Checkpointer(config, trained)
    divergence = DivergenceWatch(config.train.output_dir)  # which saved steps the losses after them vouch for

    result = SFTResult()
    step = 0
    resumed = checkpointer.resume()
    if resumed is not None:
        step = resumed.step
        result.skipped.update(resumed.state.get("skipped", {}))
        truncated = resumed.state.get("truncated", 0)
        result.truncated = truncated if isinstance(truncated, int) and truncated >= 0 else 0
        empty = resumed.state.get("empty_steps", [])
        result.empty_steps = [s for s in empty if isinstance(s, int) and 0 < s <= step] if isinstance(empty, list) else []
        log.info("resumed from %s at step %d", resumed.path, step)
    if nothing_to_do(resumed, total_steps):
        stream.close()
        with contextlib.closing(checkpointer):
            checkpointer.finish()  # uploads an earlier process of this run left unfinished
        result.finished_before = result.last_checkpoint = resumed.path
        return result
    stream.seek(step)
    if runtime.is_main:
        trainable, every = parameter_counts(module)
        log.info(
            "%s",
            run_summary(
                "Running SFT",
                {
                    "Num examples": len(train_set),
                    "Num validation examples": len(val_set) if val_set is not None else 0,
                    "Num epochs": f"{total_steps / sampler.steps_per_epoch:.4g}",
                    "Micro batch per process": train_cfg.mini_batch,
                    "Gradient accumulation steps": accumulation,
                    "Data-parallel processes": dp_size,
                    "Effective batch (samples per optimizer step)": train_cfg.train_batch_per_replica * dp_size,
                    "Total optimization steps": total_steps,
                    "Starting at step": step,
                    "Trainable parameters": f"{trainable:,} of {every:,} ({100 * trainable / max(every, 1):.2f}%)",
                },
            ),
        )

    # closing: the loader's worker processes stop when training ends or fails, not when the garbage collector gets there
    with (
        # first in, last out: a step that runs out of memory is explained after the checkpoint in flight completes
        explains_out_of_memory(config, "sft", runtime.device, plan.total, lambda: step + 1),
        StepLog(config, total_steps, step, "sft", enabled=runtime.is_main) as step_log,
        contextlib.closing(stream),
        contextlib.closing(checkpointer),
        StopOnSignal(runtime, saves=config.train.ckpt.enable_checkpoint) as stop,
        settled(trained.overlap),  # leaving (done or failed): the step in flight has finished first
    ):
        while step < total_steps:
            started = time.perf_counter()
            micro = stream.take(accumulation)
            step_skips = sum((b.skipped for b in micro), Counter())
            lr = scheduler.get_last_lr()[0]
            # the global batch's tokens, target tokens, cut and skipped samples (every data-parallel rank's), in one
            # collective: the empty-step test below is then the same on every rank, and the log, the summary and the
            # checkpointed counts are the run's, not one rank's share
            tokens, targets, cut, skips = all_reduce_sums(
                [sum(b.num_tokens for b in micro if b.num_samples), sum(b.num_targets for b in micro if b.num_samples),
                 sum(b.truncated for b in micro), sum(step_skips.values())],
                runtime, dp_group,
            )  # fmt: skip
            result.truncated += int(cut)
            if skips:  # some rank skipped samples: every rank's reasons (a second collective, only at such steps)
                step_skips = gathered_counts(step_skips, runtime, dp_group)
            result.skipped.update(step_skips)
            if targets == 0:
                # every sample of the global batch was skipped: no forward, no optimizer step (AdamW would still move
                # the weights by its momentum and weight decay), the schedule keeps its place; logged as such, not
                # as a loss of 0
                scheduler.step()
                step += 1
                result.empty_steps.append(step)
                result.losses.append(math.nan)
                divergence.no_update(step)
                skipped = data_counts(result)
                step_log.step(
                    step, {"train/lr": lr, "train/empty_steps": float(len(result.empty_steps)), **skipped},
                    {"loss": "-", "lr": f"{lr:.2e}", "tok_s": "0"},
                )  # fmt: skip
                if runtime.is_main:
                    log.warning("step %d: every sample of its batch was skipped (%s); no update", step, dict(step_skips))
            else:
                loss, norm = train_step(
                    module, micro, optimizer, scheduler, runtime, dp_size * cp, train_cfg.optm_grad_norm_clip, autocast,
                    dp_group, trained.reduced_norm, trained.overlap, filler, targets,
                )
                step += 1
                elapsed = time.perf_counter() - started
                result.losses.append(loss)
                skipped = data_counts(result)
                step_log.step(
                    step,
                    {"train/loss": loss, "train/lr": lr, "train/grad_norm": norm, "train/tokens_per_s": tokens / elapsed,
                     **skipped},
                    {"loss": f"{loss:.4f}", "lr": f"{lr:.2e}", "tok_s": f"{tokens / elapsed:,.0f}"},
                )
                divergence.check(step, loss, norm)  # every rank: loss and norm are global
            if val_set is not None and (step % train_cfg.validation_freq == 0 or step == total_steps):
                trained.wait_for_step()
                result.val_losses[step] = validation_loss(
                    module, val_set, collate, runtime, train_cfg.mini_batch, autocast, tp * cp, dp_group, filler
                )
                step_log.log(step, {"val/loss": result.val_losses[step]})
            saved = None
            if checkpoint_due(config, step, total_steps):
                saved = checkpointer.save(step, run_state(result))
                result.last_checkpoint = saved.checkpoint
                if saved.export is not None:
                    result.export_dir = saved.export
            stop.after_step(checkpointer, step, saved, run_state(result))
            if on_step is not None:
                on_step(step)
        trained.wait_for_step()
        checkpointer.finish()
    if result.skipped and runtime.is_main:
        log.warning("skipped samples: %s", dict(result.skipped))
    if result.truncated and runtime.is_main:
        log.warning(
            "%d samples were longer than model.model_max_length=%d and trained on their first %d tokens only (the "
            "rest of their answers did not train); raise model.model_max_length (`physreason plan` prices it) to "
            "train them whole",
            result.truncated, config.model.model_max_length, config.model.model_max_length,
        )  # fmt: skip
    return result
