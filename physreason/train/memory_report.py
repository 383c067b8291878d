"""The memory plan of a recipe: the layout and workload its settings describe, the tables `physreason plan` and the
trainers print, and the start-up refusal when the plan does not fit the GPUs."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
from rich.table import Table

from physreason.config import Config
from physreason.errors import ConfigError
from physreason.models.sizes import ModelShape, read_model_shape
from physreason.progress import make_console
from physreason.train.allocator import HEADROOM_EXPANDABLE, allocator_headroom, headroom_reason
from physreason.train.memory import (
    DTYPE_BYTES,
    GIB,
    TP_MEASURED,
    Layout,
    MemoryPlan,
    Workload,
    checkpointed_blocks,
    fitting_layouts,
    layout_overrides,
    plan_memory,
    tp_degrees,
    usable_bytes,
)
from physreason.train.runtime import Runtime
from physreason.vision.resize import pixel_budgets, smart_resize, video_frame_max_pixels

log = logging.getLogger(__name__)

Job = Literal["sft", "grpo"]


def mini_batch_key(job: Job) -> str:
    """The setting that holds rows per forward pass: train.mini_batch (SFT) or grpo.mini_batch (GRPO)."""
    return "grpo.mini_batch" if job == "grpo" else "train.mini_batch"


def recipe_layout(config: Config, gpus: int, distributed: bool, job: Job) -> Layout:
    """The layout `config` asks for on `gpus` processes (distributed: launched by torchrun, so FSDP2; one torchrun
    process takes the one-process path unless train.one_rank_precision = "legacy" or train.cpu_offload, as
    train/build.py's compute_cast decides)."""
    train = config.train
    one_rank_cast = gpus == 1 and train.one_rank_precision == "cast" and not train.cpu_offload
    return Layout(
        gpus=gpus,
        tp=config.policy.parallelism.tp_size,
        cp=config.policy.parallelism.cp_size,
        distributed=distributed and not one_rank_cast,
        lora=train.lora.enable,
        cpu_offload=train.cpu_offload,
        optimizer_state_dtype=train.optimizer_state_dtype,
        gradient_checkpointing=train.gradient_checkpointing,
        # "auto" not resolved against a GPU yet (resolve_checkpoint_every): planned as every block, the most recompute
        checkpoint_every=1 if train.checkpoint_every == "auto" else train.checkpoint_every,
        vision_checkpoint_every=train.vision_checkpoint_every,
        mini_batch=config.grpo.mini_batch if job == "grpo" else train.mini_batch,
    )


@dataclass(frozen=True)
class PromptShape:
    """What the recipe's prompts hold, read from its data before a GRPO start: the most videos and images of one
    prompt and the longest prompt's text tokens (chat template included, each visual's placeholder once)."""

    videos: int
    images: int
    text_tokens: int
    # the most visual tokens one prompt's images bring at the sizes the loader gives them (read from each file's
    # header); None: not read, each image planned at the image budget
    image_tokens: int | None = None


def video_tokens_bound(config: Config, shape: ModelShape) -> int:
    """Most visual tokens one video can bring under config.vision: vision.nframes (or max_frames) frames, each at
    most its share of total_pixels (video_frame_max_pixels, as the loader sizes them) and at most max_pixels, in
    temporal patches of the tower's temporal_patch_size."""
    vision = config.vision
    budgets = pixel_budgets(vision, shape.vision_factor)
    frames = vision.nframes if vision.nframes is not None else vision.max_frames
    frames = max(2, frames - frames % 2)  # the loader samples whole pairs of frames
    frame_pixels = video_frame_max_pixels(frames, budgets.min_pixels, budgets.max_pixels, budgets.total_pixels)
    patches = -(-frames // shape.vision_temporal)
    return patches * int(frame_pixels) // shape.vision_factor**2


def visual_tokens_per_row(config: Config, shape: ModelShape, prompts: PromptShape | None = None) -> int:
    """Most visual tokens one row (SFT) or prompt (GRPO) can hold, within the context: with `prompts` its videos and
    images at their budgets (video_tokens_bound, image_max_pixels); unknown, the larger of one video and one image."""
    if not shape.vision_depth:
        return 0
    budgets = pixel_budgets(config.vision, shape.vision_factor)
    video = video_tokens_bound(config, shape)
    image = budgets.image_max_pixels // shape.vision_factor**2
    if prompts is None:
        largest = max(video, image)
    else:
        images = prompts.images * image if prompts.image_tokens is None else prompts.image_tokens
        largest = prompts.videos * video + images
    return min(largest, config.model.model_max_length)


def prompt_shape(config: Config, prompts: Sequence[Any], tokenizer: Any, longest: int = 8) -> PromptShape:
    """The PromptShape of GRPO prompts (physreason.data.mcq.MCQPrompt): media counts of all of them, and the text
    tokens of the `longest` ones by characters (rendered as the rollouts render them), the most of those."""
    from physreason.models.inputs import prompting_for

    if not prompts:
        return PromptShape(0, 0, 0)
    style = prompting_for(config)[0].style

    def characters(prompt: Any) -> int:
        return len(prompt.question) + sum(len(text) for text in prompt.options.values())

    text = 0
    for prompt in sorted(prompts, key=characters, reverse=True)[:longest]:
        # A Reason1 grounding question names the frame's pixel size, known only once its media are decoded: a
        # four-digit stand-in writes the longest such question (the frame's size changes only those digits).
        messages = prompt.messages(config.grpo.answer_type, style, frame_size=(9999, 9999))
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        text = max(text, len(tokenizer(rendered, add_special_tokens=False).input_ids))
    return PromptShape(
        max(len(p.videos) for p in prompts), max(len(p.images) for p in prompts), text, prompt_image_tokens(config, prompts)
    )


# prompt_image_tokens reads at most this many image headers (about 50 us each from the page cache, milliseconds on a
# cold network file system); the images past it count at the image budget
MAX_IMAGE_HEADERS = 20_000


def prompt_image_tokens(config: Config, prompts: Sequence[Any]) -> int | None:
    """The most visual tokens the images of one of `prompts` bring, each at the size load_image resizes it to (its
    side lengths read from the file's header, the pixels not decoded). An image whose header cannot be read (any
    error: a damaged or odd file) counts at the image budget, as do the images past the first MAX_IMAGE_HEADERS
    distinct files; its loader names a bad file when the run reaches it. None for a model without a tower."""
    from PIL import Image

    shape = read_model_shape(config.model)
    if not shape.vision_depth:
        return None
    factor = shape.vision_factor
    budgets = pixel_budgets(config.vision, factor)
    budget_tokens = budgets.image_max_pixels // factor**2
    seen: dict[Any, int] = {}

    def tokens(path: Any) -> int:
        if path not in seen:
            if len(seen) >= MAX_IMAGE_HEADERS:
                return budget_tokens
            try:
                with Image.open(path) as image:
                    width, height = image.size
                side, other = smart_resize(height, width, factor, budgets.image_min_pixels, budgets.image_max_pixels)
                seen[path] = side * other // factor**2
            except Exception:  # noqa: BLE001 - PIL's plugins raise many kinds on odd headers; the budget bounds them
                seen[path] = budget_tokens
        return seen[path]

    return max(sum(tokens(path) for path in prompt.images) for prompt in prompts)


def recipe_workload(
    config: Config, shape: ModelShape, job: Job, gpu_bytes: int, prompts: PromptShape | None = None
) -> Workload:
    """What each micro-batch of `config` holds and what shares the GPUs with it (a colocated GRPO rollout engine).

    GRPO: completions of rollout.max_response_length after prompts of the visual tokens `prompts` brings plus its
    text (unknown: as long as the context leaves beside one response), laid out as the policy update lays them
    (grpo.pack_completions)."""
    train, lora = config.train, config.train.lora
    engine = 0
    if job == "grpo" and config.grpo.mode == "colocated":
        if config.engine.backend == "hf":
            engine = shape.total_params * DTYPE_BYTES.get(config.model.dtype, 2)  # its own weights; KV cache not counted
        else:  # vLLM takes its fraction of the whole GPU at start and keeps it
            engine = int(config.engine.gpu_memory_utilization * gpu_bytes)
    visual = visual_tokens_per_row(config, shape, prompts)
    grpo: dict[str, Any] = {}
    if job == "grpo":
        seq_len, response = config.model.model_max_length, config.rollout.max_response_length
        prompt = visual + prompts.text_tokens if prompts is not None else max(1, seq_len - response)
        grpo = dict(
            completions_per_prompt=config.rollout.n_generation,
            prompt_tokens=min(prompt, seq_len),
            response_tokens=response,
            packed=config.packs_completions,
            packed_spans=config.packs_completions and config.grpo.packed_attention == "spans"
            and config.model.attn_implementation == "sdpa" and config.policy.parallelism.cp_size == 1,
            completions_per_step=config.train.train_batch_per_replica,
            mini_batch_tokens=config.grpo.mini_batch_tokens,
        )
    return Workload(
        seq_len=config.model.model_max_length,
        param_dtype=train.param_dtype,
        reduce_dtype=train.fsdp_reduce_dtype,
        loss_chunk_size=train.loss_chunk_size,
        vision_tokens=visual,
        train_vision=not train.freeze_vision_tower,
        lora_rank=lora.rank,
        lora_targets=tuple(lora.target_modules),
        lora_vision_targets=tuple(lora.vision_target_modules) if lora.vision else (),
        reference_model=job == "grpo" and config.grpo.kl_beta > 0,
        engine_bytes=engine,
        compiled=train.compile,
        compiled_vision=train.compile_vision,
        **grpo,
    )


def gib(value: int) -> str:
    """Bytes as GiB with one decimal."""
    return f"{value / GIB:.1f}"


def describe(layout: Layout) -> str:
    """A layout in words: FSDP/TP degrees and the switches that differ from the defaults."""
    words = [f"FSDP {layout.dp} x TP {layout.tp}" if layout.distributed else "one process"]
    if layout.cp > 1:
        words.append(f"CP {layout.cp} (each row over {layout.cp} GPUs)")
    words.append("LoRA" if layout.lora else "full")
    if layout.cpu_offload:
        words.append("CPU offload")
    words.append(f"{'bf16' if layout.optimizer_state_dtype == 'bfloat16' else 'fp32'} AdamW state")
    if not layout.gradient_checkpointing:
        words.append("no checkpointing")
    elif (layout.checkpoint_every, layout.vision_checkpoint_every) == (1, 1):
        words.append("checkpointing")
    else:
        def share(every: int, kind: str) -> str:
            return f"every {kind} block" if every == 1 else f"1 in {every} {kind} blocks" if every else f"no {kind} block"

        words.append(
            f"recomputing {share(layout.checkpoint_every, 'decoder')} and {share(layout.vision_checkpoint_every, 'vision')}"
        )
    words.append(f"micro-batch {layout.mini_batch}")
    return ", ".join(words)


def plan_table(plan: MemoryPlan, gpu_bytes: int) -> Table:
    """The plan by part, in GiB per GPU, with the total against the GPU's memory (0: unknown) and the host share."""
    table = Table()
    table.add_column("part")
    table.add_column("GiB / GPU", justify="right")
    for part, value in plan.parts.items():
        if value:
            table.add_row(part, gib(value))
    if gpu_bytes:
        verdict = "fits" if plan.fits(gpu_bytes) else "DOES NOT FIT"
        table.add_row(f"total ({verdict} {gib(usable_bytes(gpu_bytes))} usable)", gib(plan.total), style="bold")
    else:
        table.add_row("total", gib(plan.total), style="bold")
    if plan.host_bytes:
        table.add_row("host, per process: offloaded state", gib(plan.host_bytes))
    table.add_row("host, per process: checkpoint while loading", gib(plan.load_host_bytes))
    return table


def layouts_table(plans: list[MemoryPlan], recipe: Layout, job: Job, limit: int = 10) -> Table:
    """The layouts that fit, most preferred first, each with the --set overrides that select it."""
    table = Table(title=f"layouts that fit on {recipe.gpus} GPU(s), nearest to the recipe first", title_justify="left")
    for column in ("layout", "GiB / GPU", "host GiB / process", "--set"):
        table.add_column(column, justify="right" if "GiB" in column else "left")
    for plan in plans[:limit]:
        changes = layout_overrides(recipe, plan.layout, mini_batch_key(job))
        table.add_row(describe(plan.layout), gib(plan.total), gib(plan.host_bytes), " ".join(changes) or "(the recipe)")
    return table


def tensor_parallel_note(shape: ModelShape, recipe: Layout, fitting: list[MemoryPlan]) -> str | None:
    """One line on tensor parallelism for `plan`, given the layouts that fit (fitting_layouts, which offers TP only
    where FSDP alone cannot fit without more CPU offload or LoRA), with what TP cost where measured; None where the GPU
    count or head counts allow no TP degree, or nothing fits."""
    if max(tp_degrees(shape, recipe.gpus)) == 1 and recipe.tp == 1 or not fitting:
        return None
    gpus = f"{recipe.gpus} GPU(s)"
    if any(plan.layout.tp > 1 for plan in fitting):
        return (
            f"tensor parallel: offered (TP > 1 rows below) only where FSDP alone cannot fit on {gpus} without more CPU "
            f"offload or LoRA; it costs throughput: {TP_MEASURED}"
        )
    if recipe.tp > 1:
        return (
            f"tensor parallel: not needed: FSDP alone fits on {gpus} (set policy.parallelism.tp_size=1, layouts "
            f"below); the recipe's tp_size={recipe.tp} costs throughput: {TP_MEASURED}"
        )
    return (
        f"tensor parallel: not recommended: FSDP alone fits on {gpus} wherever TP would; TP pays only for a shape "
        f"FSDP cannot fit ({TP_MEASURED})"
    )


def refusal(plan: MemoryPlan, gpu_bytes: int, fitting: list[MemoryPlan], job: Job, where: str) -> str:
    """The one line that refuses a start: planned total, the GPU's memory, the largest parts and what to change."""
    largest = sorted(plan.parts.items(), key=lambda item: -item[1])[:3]
    parts = ", ".join(f"{name} {gib(value)}" for name, value in largest)
    if fitting:
        sets = " ".join(f"--set {change}" for change in layout_overrides(plan.layout, fitting[0].layout, mini_batch_key(job)))
        advice = f"the nearest layout that fits is {describe(fitting[0].layout)} ({gib(fitting[0].total)} GiB): {sets}"
    else:
        advice = "no layout on this many GPUs fits: use more GPUs or a shorter model.model_max_length"
    reason = headroom_reason()
    return (
        f"memory plan: {gib(plan.total)} GiB per GPU ({parts} GiB, ...) but {where} has {gib(gpu_bytes)} GiB "
        f"({gib(usable_bytes(gpu_bytes))} usable{'; ' + reason if reason else ''}); {advice}; "
        "`physreason plan` lists every layout that fits; train.skip_memory_check=true starts anyway"
    )


# train.checkpoint_every = "auto" keeps this share of the GPU free beyond the plan (the plan's total already leaves the
# allocator ALLOCATOR_HEADROOM): the plans measured lay 0.2% below to 6% above their peaks (tests/test_memory_plan.py)
AUTO_RECOMPUTE_FREE = 0.10


def auto_recompute_free() -> float:
    """AUTO_RECOMPUTE_FREE, plus what the allocator's setting adds to the headroom when it fragments (allocator)."""
    return AUTO_RECOMPUTE_FREE + allocator_headroom() - HEADROOM_EXPANDABLE


def choose_checkpoint_every(
    config: Config, gpus: int, distributed: bool, job: Job, gpu_bytes: int | None, prompts: PromptShape | None = None
) -> tuple[int, str]:
    """What train.checkpoint_every = "auto" becomes for `config` on GPUs of `gpu_bytes`, and why.

    With gradient checkpointing on and a GPU: the largest n (the fewest decoder blocks recomputed, the least compute
    spent again) whose plan leaves auto_recompute_free() of the GPU free; 1 (every block) when none does, so the usual
    check then refuses or passes as for an explicit 1. Without a GPU (None) or without checkpointing: 1."""
    if not config.train.gradient_checkpointing:
        return 1, "train.gradient_checkpointing is off: nothing is recomputed"
    if gpu_bytes is None:
        return 1, "no GPU to plan against: every block"
    shape = read_model_shape(config.model)
    recipe = recipe_layout(config, gpus, distributed, job)  # "auto" planned as 1 there
    workload = recipe_workload(config, shape, job, gpu_bytes, prompts)
    free = auto_recompute_free()
    limit = gpu_bytes * (1 - free)
    for candidate in range(max(shape.layers, 1), 0, -1):  # fewest recomputed blocks first
        total = plan_memory(shape, replace(recipe, checkpoint_every=candidate), workload).total
        if total <= limit:
            recomputed = checkpointed_blocks(shape.layers, candidate)
            return candidate, (f"{recomputed} of {shape.layers} decoder blocks recomputed, the fewest whose plan "
                               f"({gib(total)} GiB) leaves {free:.0%} of {gib(gpu_bytes)} GiB free")  # fmt: skip
    return 1, (f"even every block recomputed plans over {gib(int(limit))} GiB ({1 - free:.0%} of "
               f"{gib(gpu_bytes)}): every block")  # fmt: skip


def with_checkpoint_every(config: Config, every: int) -> Config:
    """A copy of `config` with train.checkpoint_every = `every`."""
    resolved = config.model_copy(deep=True)
    resolved.train.checkpoint_every = every
    return resolved


def resolve_checkpoint_every(
    config: Config,
    gpus: int,
    distributed: bool,
    job: Job,
    gpu_bytes: int | None,
    prompts: PromptShape | None = None,
    console=None,
) -> Config:
    """`config` with train.checkpoint_every = "auto" made a number (choose_checkpoint_every); any other value:
    `config` itself. Says what it chose on `console`."""
    if config.train.checkpoint_every != "auto":
        return config
    every, why = choose_checkpoint_every(config, gpus, distributed, job, gpu_bytes, prompts)
    if console is not None:
        console.print(f"train.checkpoint_every = auto -> {every} ({why})")
    return with_checkpoint_every(config, every)


def resolve_runtime_checkpoint_every(
    config: Config, runtime: Runtime, job: Job, prompts: PromptShape | None = None
) -> Config:
    """resolve_checkpoint_every at a trainer's start, against this process's GPU (None on CPU). Under torchrun or Ray
    every process then takes the smallest n any of them chose (the most recompute), so that all recompute the same
    blocks: under tensor or context parallelism a recomputed block repeats its collectives, and ranks that differed
    would wait on each other for good."""
    if config.train.checkpoint_every != "auto":
        return config
    gpu_bytes = None
    if runtime.device.type == "cuda":
        gpu_bytes = torch.cuda.get_device_properties(runtime.device).total_memory
    every, why = choose_checkpoint_every(config, runtime.world_size, runtime.distributed, job, gpu_bytes, prompts)
    if runtime.distributed and torch.distributed.is_initialized():
        smallest = torch.tensor([every], dtype=torch.int64, device=runtime.device)
        torch.distributed.all_reduce(smallest, op=torch.distributed.ReduceOp.MIN)
        if int(smallest.item()) != every:
            every, why = int(smallest.item()), f"another process's choice, the smallest; this one's: {every}, {why}"
    if runtime.is_main:
        make_console(stderr=True).print(f"train.checkpoint_every = auto -> {every} ({why})")
    return with_checkpoint_every(config, every)


def check_runtime_memory(config: Config, runtime: Runtime, job: Job, prompts: PromptShape | None = None) -> MemoryPlan:
    """At a trainer's start: plan `config` on this job's processes (GRPO: with its `prompts`' shape), print it (main
    process) and refuse a start that will not fit this GPU (ConfigError). On CPU the plan is printed and nothing is
    checked."""
    gpu_bytes = None
    if runtime.device.type == "cuda":
        gpu_bytes = torch.cuda.get_device_properties(runtime.device).total_memory
    console = make_console(stderr=True) if runtime.is_main else None
    return check_memory(config, runtime.world_size, runtime.distributed, job, gpu_bytes, console, prompts)


def check_memory(
    config: Config,
    gpus: int,
    distributed: bool,
    job: Job,
    gpu_bytes: int | None,
    console=None,
    prompts: PromptShape | None = None,
) -> MemoryPlan:
    """Plan `config` on `gpus` processes, print the plan (to `console` when given), and raise ConfigError when it does
    not fit `gpu_bytes` (None: no GPU, nothing to check) unless train.skip_memory_check."""
    shape = read_model_shape(config.model)
    capacity = gpu_bytes or 0
    recipe = recipe_layout(config, gpus, distributed, job)
    workload = recipe_workload(config, shape, job, capacity, prompts)
    plan = plan_memory(shape, recipe, workload)
    if console is not None:
        console.print(f"memory plan: {describe(recipe)}")
        console.print(plan_table(plan, capacity))
    if gpu_bytes is None or plan.fits(gpu_bytes):
        return plan
    fitting = fitting_layouts(shape, recipe, workload, gpu_bytes)
    message = refusal(plan, gpu_bytes, fitting, job, "each GPU")
    if config.train.skip_memory_check:
        log.warning("%s (starting anyway: train.skip_memory_check)", message)
        return plan
    raise ConfigError(message)

