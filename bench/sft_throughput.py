"""SFT throughput and MFU of physreason's trainer step beside a plain transformers baseline, in the same run.

Sides, rows, levers, video rows, MFU and profiles: bench/RESULTS.md ("How the scripts measure"). Rows print as they
finish; JSON to $OUT/sft_throughput.json.
Run:    python bench/sft_throughput.py --chunked-ce --compile --ac-every 2
Sweep:  python bench/sft_throughput.py --sweep | --rows="--compile --ac-every 0; --compile --ac-every 0 --grad-accum 4"
TP:     torchrun --standalone --nproc-per-node 2 bench/sft_throughput.py --tp 2 [--sweep | --rows=...]
CPU:    python bench/sft_throughput.py --tiny --seq-len 256 --steps 1 --warmup 1 --sweep
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import shlex
import time
from pathlib import Path

import harness
import torch
import torch.distributed as dist
from shapes import PEAK_BF16_FLOPS, qwen3_vl_8b, qwen25_vl_3b, train_flops_per_token
from shapes import make_batch as make_text_batch

from physreason.train.profiling import Profiled

# Rows of --sweep: the last recorded best first, then no checkpointing, optimizer amortisation,
# larger micro-batches and longer rows, then the attention kernels (those change the compiled graphs, so last).
SWEEP = (
    "--chunked-ce --compile --ac-every 2",
    "--compile --ac-every 0",
    "--chunked-ce --compile --ac-every 0",
    "--chunked-ce --compile --ac-every 0 --grad-accum 4",
    "--compile --ac-every 0 --grad-accum 4",
    "--chunked-ce --compile --ac-every 0 --grad-accum 2 --batch 2",
    "--chunked-ce --compile --ac-every 0 --grad-accum 2 --seq-len 8192",
    "--chunked-ce --compile --ac-every 0 --grad-accum 4 --wrap autocast",
    "--chunked-ce --compile --ac-every 0 --grad-accum 4 --sdpa-backend cudnn",
    "--chunked-ce --compile --ac-every 0 --grad-accum 4 --sdpa-backend flash",
)
# Options that shape the process (its world, its baseline) and so cannot change from row to row.
PROCESS_OPTIONS = ("--tp", "--sweep", "--rows", "--tiny", "--skip-baseline", "--shape", "--video-seconds",
                   "--video-size", "--video-fps", "--video-total-pixels", "--profile", "--profile-steps", "--json")
SHAPES = {"qwen2.5-vl-3b": qwen25_vl_3b, "qwen3-vl-8b": qwen3_vl_8b}  # --shape
ROW_OPTIONS = ("chunked_ce", "ce_chunk", "ce_recompute", "ce_eager", "clip_separate", "cast_eager", "compile",
               "packing", "ac_every", "grad_accum", "batch", "seq_len", "sdpa_backend", "wrap", "float8",
               "float8_all_linears", "reshard", "compile_loss", "compile_vision", "conv_patch_embed", "vision_ac_every")
# Cosmos-Reason2's inference video budget (configs/infer-cosmos-reason2-8b.toml)
REASON2_FPS = 4.0
REASON2_TOTAL_PIXELS = 11324620


def video_grid(config, args) -> tuple[int, int, int]:
    """(t, h, w) patch grid of one --video-seconds clip sampled and resized as physreason.vision does it."""
    from physreason.config import VisionConfig
    from physreason.vision.resize import pixel_budgets, smart_resize, video_frame_max_pixels
    from physreason.vision.sampling import num_sampled_frames

    vision = config.vision_config
    factor = vision.patch_size * vision.spatial_merge_size
    settings = VisionConfig(fps=args.video_fps, total_pixels=args.video_total_pixels)
    budgets = pixel_budgets(settings, factor)
    source_fps = 30.0
    height, width = (int(v) for v in args.video_size.split("x"))
    frames = num_sampled_frames(round(args.video_seconds * source_fps), source_fps, settings.fps, settings.min_frames,
                                settings.max_frames, vision.temporal_patch_size)  # fmt: skip
    frame_max = video_frame_max_pixels(frames, budgets.min_pixels, budgets.max_pixels, budgets.total_pixels,
                                       vision.temporal_patch_size)  # fmt: skip
    h, w = smart_resize(height, width, factor, budgets.min_pixels, frame_max)
    return frames // vision.temporal_patch_size, h // vision.patch_size, w // vision.patch_size


def video_sample(config, seq_len: int, grid: tuple[int, int, int], generator: torch.Generator):
    """One Qwen3-VL SFT sample of seq_len tokens: 16 prompt tokens, the video (a timestamp, vision start, pads and
    vision end per temporal patch, as physreason.models.qwen3_vl lays it out), then answer tokens with the loss."""
    from physreason.data.sft import IGNORE_INDEX, SFTSample
    from physreason.models.inputs import VisualInputs
    from physreason.models.qwen3_vl import qwen3_vl_position_ids

    vision = config.vision_config
    t, h, w = grid
    per_group = h * w // vision.spatial_merge_size**2
    text_ids = min(config.video_token_id, config.vision_start_token_id, config.image_token_id)

    def text(count: int) -> list[int]:
        return torch.randint(0, text_ids, (count,), generator=generator).tolist()

    ids = text(16)
    for _ in range(t):
        ids += text(4) + [config.vision_start_token_id] + [config.video_token_id] * per_group + [config.vision_end_token_id]
    answer = seq_len - len(ids)
    if answer < 16:
        raise ValueError(f"--seq-len {seq_len} leaves {answer} answer tokens after a video of {len(ids)} tokens: raise it")
    prompt_len = len(ids)
    ids = torch.tensor(ids + text(answer))  # [L]
    labels = ids.clone()
    labels[:prompt_len] = IGNORE_INDEX
    grid_thw = torch.tensor([[t, h, w]])
    channels = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    pixels = torch.randn(t * h * w, channels, generator=generator)  # [patches, C * T * P * P]
    positions = qwen3_vl_position_ids(ids, config.image_token_id, config.video_token_id, None, grid_thw,
                                      vision.spatial_merge_size)  # fmt: skip
    visuals = VisualInputs(pixel_values_videos=pixels, video_grid_thw=grid_thw, video_token_counts=[t * per_group])
    return SFTSample(ids, labels, positions, visuals)


def make_batch(config, seq_len: int, rows: int, packing: bool, device, grid: tuple[int, int, int] | None = None):
    """`rows` rows of seq_len tokens (bench/shapes.make_batch); with a video `grid`, each row one video sample
    (`video_sample`)."""
    from physreason.data.collate import collate_padded

    if grid is None:
        return make_text_batch(config, seq_len, rows, packing, device)
    if packing:
        raise ValueError("--packing is for text rows; a video row is one sample")
    generator = torch.Generator().manual_seed(0)
    samples = [video_sample(config, seq_len, grid, generator) for _ in range(rows)]
    return collate_padded(samples, 0, mrope=True).to(device)


def attention_backend(name: str):
    """Context that restricts F.scaled_dot_product_attention to one kernel ('auto': torch chooses)."""
    if name == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kernels = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
               "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    return sdpa_kernel([kernels[name]])


def vision_train_flops(config, grid: tuple[int, int, int]) -> float:
    """Training FLOPs (3 x forward) of the vision tower on one clip of patch grid (t, h, w): 2 x in x out per
    token through each linear (blocks and patch embedding per patch, mergers per merged token) plus attention
    (QK^T and AV, 4 x segment length x width per patch and block) over each temporal patch's h x w patches."""
    from transformers import AutoModel

    vision = config.vision_config
    t, h, w = grid
    patches = t * h * w
    merged = patches // vision.spatial_merge_size**2
    with torch.device("meta"):
        tower = AutoModel.from_config(vision)
    forward = 0.0
    for name, module in tower.named_modules():
        if isinstance(module, torch.nn.Linear):
            forward += 2 * module.in_features * module.out_features * (merged if "merger" in name else patches)
        elif isinstance(module, torch.nn.Conv3d):
            forward += 2 * module.weight.numel() * patches  # stride = kernel: each patch once
    forward += 4 * (h * w) * vision.hidden_size * patches * vision.depth
    return 3 * forward


def text_train_flops(config, seq_len: int, targets: int) -> float:
    """Training FLOPs of one row: train_flops_per_token's decoder on all seq_len tokens, its lm_head on `targets`."""
    lm_head = 6 * config.text_config.vocab_size * config.text_config.hidden_size
    return (train_flops_per_token(config, seq_len) - lm_head) * seq_len + lm_head * targets


def build_model(config, device, dtype: torch.dtype):
    """The model with random weights, initialised on `device` (fast on a GPU), the same on every rank."""
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(0)
    with torch.device(device):
        # a copy: the grouped vision attention of `ours` is set on the model's config, never on the baseline's
        model = AutoModelForImageTextToText.from_config(copy.deepcopy(config))
    return model.to(dtype)


def run_baseline(config, args, device) -> dict:
    """transformers alone: bf16 weights, gradient checkpointing, fused AdamW, one row per step."""
    from physreason.data.sft import IGNORE_INDEX
    from physreason.models.parallelize import enable_activation_checkpointing
    from physreason.train import phases

    model = build_model(config, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    enable_activation_checkpointing(model)
    model.train()
    phases.mark_vision_tower(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    if args.grid is None:
        ids = torch.randint(0, config.text_config.vocab_size, (1, args.seq_len), device=device)
        inputs = {"input_ids": ids, "labels": ids}
        flops = args.seq_len * train_flops_per_token(config, args.seq_len)
    else:
        batch = make_batch(config, args.seq_len, 1, False, device, args.grid)
        # transformers shifts labels itself: undo the batch's shift
        labels = torch.cat([torch.full_like(batch.targets[:, :1], IGNORE_INDEX), batch.targets[:, :-1]], dim=1)
        inputs = {**batch.model_inputs(), "labels": labels}
        flops = text_train_flops(config, args.seq_len, batch.num_targets) + vision_train_flops(config, args.grid)

    def step(timings: dict[str, list[float]] | None = None):
        laps = harness.Laps(timings, device)  # profiled steps only: the device synchronised around each phase
        loss = model(**inputs, use_cache=False).loss
        laps.lap("forward")
        with phases.phase(phases.BACKWARD):
            loss.backward()
        laps.lap("backward")
        with phases.phase(phases.OPTIMIZER):
            optimizer.step()
            laps.lap("optimizer.step")
            optimizer.zero_grad(set_to_none=True)
            laps.lap("zero_grad")

    harness.reset_peak()
    seconds = harness.timed_steps(step, args.warmup, args.steps, device)
    split = profile(step, args, "transformers-baseline", device, seconds)
    return {"seconds_per_step": seconds, "tokens_per_step": args.seq_len, "flops_per_step": flops, "gpus": 1,
            "peak_gib": harness.peak_gib(), **({"profile_split": split} if split else {})}  # fmt: skip


# phases of a step that --profile times with the device synchronised around each (a row without clipping skips it)
SPLIT_PHASES = ("forward", "backward", "clip", "optimizer.step", "zero_grad")
NOT_PER_STEP = "kernel total exceeds the step's wall: the profiler window is not a per-step breakdown"


def profile(step, args, label: str, device, timed_seconds: float | None = None) -> dict | None:
    """With --profile: --profile-steps more steps under torch.profiler, written and summarised
    (physreason/train/profiling.py), the device synchronised around each phase of each step (`step(timings)`), so
    the step's wall and its phases' walls stand beside the profiler's kernel total; prints that line and returns its
    figures (None: no --profile, or a rank that does not profile). `timed_seconds`: the row's timed step, beside
    which the profiled steps' wall shows what the profiler and the synchronisation cost."""
    from physreason.train.profiling import device_busy_us, optimizer_steps

    if args.profile is None or dist.is_initialized() and dist.get_rank() != 0 and not os.environ.get("PROFILE_ALL_RANKS"):
        if args.profile is not None:  # other ranks still step, so collectives stay matched
            for _ in range(args.profile_steps):
                step({})
        return None
    name = "".join(c if c.isalnum() or c in "-_" else "_" for c in label)[:120]
    timings: dict[str, list[float]] = {}
    walls: list[float] = []
    with Profiled(args.profile, name, device) as profiler:
        for _ in range(args.profile_steps):
            harness.sync(device)
            started = time.perf_counter()
            step(timings)
            harness.sync(device)
            walls.append(time.perf_counter() - started)
            profiler.step()
    events = list(profiler.profiler.events())
    steps = args.profile_steps
    in_window = optimizer_steps(events)
    per = in_window or steps  # what ran in the window, not what was asked for
    device_sum, busy, longest = device_busy_us(events)
    split = {
        "label": label, "device_time": profiler.device, "profiled_steps": steps, "optimizer_steps_in_window": in_window,
        "step_wall_ms": 1e3 * sum(walls) / steps,
        "phase_wall_ms": {p: 1e3 * sum(timings[p]) / steps for p in SPLIT_PHASES if p in timings},
        "kernel_ms_per_step": profiler.result.total_us / per / 1e3,
        "device_events_ms_per_step": device_sum / per / 1e3, "device_busy_ms_per_step": busy / per / 1e3,
        "longest_device_event_ms": longest / 1e3,
        "timed_step_ms": None if timed_seconds is None else 1e3 * timed_seconds,
    }  # fmt: skip
    split["line"] = split_line(split)
    print(split["line"], flush=True)
    return split


def split_line(split: dict) -> str:
    """One line of `profile`'s figures: the synchronised step wall and phase walls beside the profiler's kernel total
    a step, flagged where that total cannot be one step's (more than its wall) or the window held another number of
    optimizer steps than were profiled."""
    phases_ms = ", ".join(f"{name} {ms:.1f}" for name, ms in split["phase_wall_ms"].items())
    cuda = split["device_time"] == "cuda"
    timed = "" if split.get("timed_step_ms") is None else f" (timed step {split['timed_step_ms']:.1f} ms)"
    line = (
        f"  synchronised split of {split['label']} ({split['profiled_steps']} profiled steps, "
        f"{split['optimizer_steps_in_window']} optimizer steps in the profiler window): step {split['step_wall_ms']:.1f} "
        f"ms wall{timed}; phases ms wall: {phases_ms}; profiler {'GPU kernel' if cuda else 'CPU op'} total "
        f"{split['kernel_ms_per_step']:.1f} ms a step"
    )  # fmt: skip
    if cuda:
        line += (f" (trace's device events {split['device_events_ms_per_step']:.1f} ms, device busy "
                 f"{split['device_busy_ms_per_step']:.1f} ms, longest device event "
                 f"{split['longest_device_event_ms']:.1f} ms)")  # fmt: skip
    if split["optimizer_steps_in_window"] not in (0, split["profiled_steps"]):
        line += f"; the window held {split['optimizer_steps_in_window']} optimizer steps: per-step figures divide by that"
    if split["kernel_ms_per_step"] > split["step_wall_ms"]:
        line += f"; {NOT_PER_STEP}"
    return line


def run_ours(config, args, device, mesh) -> dict:
    """physreason's CausalLMLoss wrapped as the trainer wraps it, with the row's options."""
    import physreason.train.loss as loss_module
    from physreason.models.parallelize import (
        apply_compute_cast,
        apply_fsdp2,
        apply_tensor_parallel,
        clip_and_step,
        clip_grad_norm,
        enable_activation_checkpointing,
    )
    from physreason.models.patch_embed import use_linear_patch_embed
    from physreason.models.vision_attention import use_grouped_vision_attention
    from physreason.train import phases
    from physreason.train.model import CausalLMLoss

    tp, world = mesh["tp"].size(), mesh.size()
    if args.wrap == "autocast" and world > 1:
        raise ValueError("--wrap autocast is the single-process trainer path; it cannot run under torchrun with more ranks")
    if args.wrap == "cast" and world > 1:
        raise ValueError("--wrap cast is the one-rank trainer path: one process")
    model = build_model(config, device, torch.float32)
    use_grouped_vision_attention(model)  # as physreason's loader does (a no-op for text rows' compute)
    if not args.conv_patch_embed:
        use_linear_patch_embed(model)  # as physreason's loader does
    if args.ac_every > 0:
        enable_activation_checkpointing(model, args.ac_every, args.vision_ac_every)
    all_gather = False
    if args.float8 != "none":  # as train/build.py does: before FSDP2 and compile, float8 all-gather over 2+ ranks
        from physreason.models.float8 import convert_to_float8, float8_all_gather

        all_gather = float8_all_gather(args.float8, mesh["dp"].size() if args.wrap == "fsdp" else 1)
        # --tiny: every layer is too small to pay; convert them anyway so the script's float8 path runs
        convert_to_float8(model, args.float8, all_gather, skip_small=not (args.float8_all_linears or args.tiny))
    module = CausalLMLoss(model, loss_chunk_size=args.ce_chunk if args.chunked_ce else 0)
    compute_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    autocast = contextlib.nullcontext()
    if args.wrap == "fsdp":
        if tp > 1:
            apply_tensor_parallel(model, mesh["tp"])
        apply_fsdp2(module, model, mesh["dp"], compute_dtype, torch.float32, reshard=args.reshard)
    elif args.wrap == "cast":
        apply_compute_cast(module, model, compute_dtype)
    elif compute_dtype != torch.float32:
        autocast = torch.autocast(device.type, dtype=compute_dtype)
    if args.compile:
        for block in model.model.language_model.layers:
            block.compile()
    if args.compile_vision:
        for block in model.model.visual.blocks:
            block.compile()
    # A/B of a candidate: the lm_head + cross-entropy chunk compiled (restored after the row)
    import physreason.models.parallelize as parallelize_module

    chunk_loss, fused, logit_grad = loss_module._chunk_loss, loss_module.FUSED, loss_module.LOGIT_GRAD
    widen = parallelize_module.WIDEN
    loss_module.FUSED = not args.ce_recompute
    if args.ce_eager:
        loss_module.LOGIT_GRAD = "never"
    if args.cast_eager:
        parallelize_module.WIDEN = "never"
    if args.compile_loss:
        loss_module._chunk_loss = torch.compile(chunk_loss)
    module.train()
    parameters = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=1e-5, fused=device.type == "cuda")
    if all_gather:  # one amax pass for all float8-all-gathered weights after each step, as the trainer does
        from physreason.models.float8 import precompute_scales_after_steps

        precompute_scales_after_steps(optimizer, module)
    batch = make_batch(config, args.seq_len, args.batch, args.packing, device, args.grid)
    scale = 1.0 / (batch.num_targets * args.grad_accum)

    def step(timings: dict[str, list[float]] | None = None):
        laps = harness.Laps(timings, device)  # profiled steps only: the device synchronised around each phase
        for _ in range(args.grad_accum):
            with autocast, attention_backend(args.sdpa_backend):
                loss = module(batch)
            laps.lap("forward")
            with phases.phase(phases.BACKWARD):
                (loss * scale).backward()
            laps.lap("backward")
        with phases.phase(phases.OPTIMIZER):
            if args.clip_separate:  # the path before: a multiply over the gradients, then the step
                clip_grad_norm(parameters, 1.0)
                laps.lap("clip")
                optimizer.step()
            else:  # as the trainer does: the clip coefficient folded into fused AdamW (its grad_scale)
                clip_and_step(parameters, 1.0, optimizer, on_norm=lambda: laps.lap("clip"))
            laps.lap("optimizer.step")
            optimizer.zero_grad(set_to_none=True)
            laps.lap("zero_grad")

    try:
        harness.reset_peak()
        seconds = harness.timed_steps(step, args.warmup, args.steps, device)
        split = profile(step, args, f"{dist.get_rank()}-{describe_row(args)}", device, seconds)
    finally:
        loss_module._chunk_loss, loss_module.FUSED, loss_module.LOGIT_GRAD = chunk_loss, fused, logit_grad
        parallelize_module.WIDEN = widen
    replicas = args.grad_accum * (world // tp)
    tokens = batch.input_ids.numel() * replicas
    if args.grid is None:
        flops = tokens * train_flops_per_token(config, args.seq_len)
    else:
        per_row = text_train_flops(config, args.seq_len, batch.num_targets // args.batch)
        flops = replicas * args.batch * (per_row + vision_train_flops(config, args.grid))
    return {"seconds_per_step": seconds, "tokens_per_step": tokens, "flops_per_step": flops, "gpus": world,
            "peak_gib": harness.peak_gib(), **({"profile_split": split} if split else {})}  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096, help="tokens per row")
    parser.add_argument("--batch", type=int, default=1, help="rows per micro-batch")
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    harness.add_steps(parser, 10, 3, "optimizer steps (compilation happens in the warm-up)")
    parser.add_argument("--chunked-ce", action="store_true", help="lm_head + CE in checkpointed sequence chunks")
    parser.add_argument("--ce-chunk", type=int, default=1024, help="tokens per CE chunk")
    parser.add_argument("--ce-recompute", action="store_true",
                        help="chunked CE under activation checkpointing (the path before the fused one: the logits "
                             "computed again in the backward)")
    parser.add_argument("--ce-eager", action="store_true",
                        help="the fused chunks' softmax and logit gradient as eager ops (the path before "
                             "train/loss.py's compiled one, LOGIT_GRAD = 'never')")
    parser.add_argument("--clip-separate", action="store_true",
                        help="clip by a multiply over the gradients, then optimizer.step() (the path before the clip "
                             "coefficient rode in fused AdamW's grad_scale on the GPU)")
    parser.add_argument("--cast-eager", action="store_true",
                        help="--wrap cast: widen the bf16 gradients with torch's copy (the path before the compiled "
                             "widening, parallelize.WIDEN = 'never')")
    parser.add_argument("--compile", action="store_true", help="torch.compile each decoder block")
    parser.add_argument("--float8", choices=("none", "rowwise", "tensorwise"), default="none",
                        help="float8 matmuls in the language model's linear layers (torchao; [train.fp8] quant_recipe)")
    parser.add_argument("--float8-all-linears", action="store_true",
                        help="with --float8: convert the linears too small to pay as well (train.fp8.skip_small_linears "
                             "= false; lever)")
    parser.add_argument("--packing", action="store_true", help="4 samples packed into the row")
    parser.add_argument("--ac-every", type=int, default=1, help="checkpoint every n-th decoder block (0: none; 2: selective)")
    parser.add_argument("--vision-ac-every", type=int, default=1,
                        help="with --ac-every > 0: checkpoint every n-th vision block (0: none; train.vision_checkpoint_every)")
    parser.add_argument("--sdpa-backend", choices=("auto", "flash", "cudnn", "efficient", "math"), default="auto",
                        help="attention kernel (torch.nn.attention.sdpa_kernel); cudnn is the fast one on Hopper")
    parser.add_argument("--wrap", choices=("fsdp", "cast", "autocast"), default="fsdp",
                        help="fsdp: FSDP2 (the torchrun trainer path, and one process's with train.one_rank_precision "
                             "= 'legacy'); cast: the one-process trainer path (no FSDP2, each block cast to bf16 for "
                             "its forward); autocast: the plain-process trainer path before 'cast'")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree; launch with torchrun --nproc-per-node N")
    parser.add_argument("--sweep", action="store_true", help="run the built-in SWEEP rows after one baseline")
    parser.add_argument("--rows", default=None, metavar='"A; B"',
                        help="rows of options separated by ';' to run after one baseline (write --rows=...)")
    parser.add_argument("--skip-baseline", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes, to check the script on CPU")
    parser.add_argument("--layers", type=int, default=None,
                        help="decoder blocks of the language model (default: the shape's own); a full fine-tune of the "
                             "8B shape with fp32 masters and AdamW (16 bytes/parameter) does not fit one GPU, half its "
                             "blocks do; both sides run the same truncated model and MFU counts its FLOPs")
    harness.add_shape(parser, "qwen2.5-vl-3b", SHAPES)
    parser.add_argument("--reshard", choices=("all", "all-but-last", "none"), default="all",
                        help="FSDP2 blocks that free their gathered parameters after forward (lever; default all)")
    parser.add_argument("--compile-loss", action="store_true", help="torch.compile the lm_head + CE chunk (lever)")
    parser.add_argument("--compile-vision", action="store_true", help="torch.compile each vision block (lever)")
    parser.add_argument("--conv-patch-embed", action="store_true",
                        help="video rows: the patch embedding as transformers' Conv3d (the path before: physreason's "
                             "loader computes it as one linear layer)")
    parser.add_argument("--video-seconds", type=float, default=0.0,
                        help="video rows: one clip of this many seconds per row (Qwen3-VL shapes; 0: text rows)")
    parser.add_argument("--video-size", default="720x1280", help="HEIGHTxWIDTH of the video rows' source clip")
    parser.add_argument("--video-fps", type=float, default=REASON2_FPS, help="frames sampled per second")
    parser.add_argument("--video-total-pixels", type=int, default=REASON2_TOTAL_PIXELS,
                        help="pixel budget of the clip (Cosmos-Reason2's inference recipe)")
    parser.add_argument("--profile", type=Path, default=None, metavar="DIR",
                        help="profile --profile-steps steps of each row after its timed steps, traces into DIR; the device is "
                             "synchronised around each phase of those steps, and one line a row prints the step's "
                             "wall and its phases' walls beside the profiler's kernel total")
    parser.add_argument("--profile-steps", type=int, default=3, help="steps under the profiler per row")
    harness.add_json(parser)
    return parser


def row_args(parser: argparse.ArgumentParser, base: argparse.Namespace, options: str) -> argparse.Namespace:
    """The command line's options with one sweep row's options applied over them."""
    tokens = shlex.split(options)
    fixed = [t for t in tokens if t.split("=")[0] in PROCESS_OPTIONS]
    if fixed:
        parser.error(f"sweep row {options!r}: {', '.join(fixed)} apply to the whole process, not to one row")
    return check_recompute(parser, parser.parse_args(tokens, namespace=copy.copy(base)), f"sweep row {options!r}: ")


def row_options(args: argparse.Namespace) -> list[str]:
    """Each row's options: --rows split at ';', else the sweep's rows (--sweep), else one row of the command line."""
    if args.rows is not None:
        return [row.strip() for row in args.rows.split(";")]
    return list(SWEEP) if args.sweep else [""]


def check_recompute(parser: argparse.ArgumentParser, args: argparse.Namespace, where: str = "") -> argparse.Namespace:
    """Refuse --vision-ac-every beside --ac-every 0: that row recomputes nothing (as the product's
    train.gradient_checkpointing = false turns both stacks off), so the vision option would be ignored and the row
    mislabelled (one such row ran on 2026-11-29)."""
    if args.ac_every < 0 or args.vision_ac_every < 0:
        parser.error(f"{where}--ac-every and --vision-ac-every take 0 or more")
    if args.ac_every == 0 and args.vision_ac_every != parser.get_default("vision_ac_every"):
        parser.error(f"{where}--vision-ac-every {args.vision_ac_every} needs --ac-every 1 or more: --ac-every 0 "
                     "recomputes no block of either stack")
    return args


def describe_row(args: argparse.Namespace) -> str:
    """The row's label as `describe` makes it (for file names)."""
    return describe(build_parser(), args)


def describe(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """'physreason' plus every row option that differs from its default."""
    parts = []
    for name in ROW_OPTIONS:
        value, default = getattr(args, name), parser.get_default(name)
        if value != default:
            flag = "--" + name.replace("_", "-")
            parts.append(flag if value is True else f"{flag} {value}")
    return " ".join(["physreason", *parts])


def model_config(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """The transformers config of --shape (--tiny, --layers, sdpa) for the process; sets args.grid, the patch grid of
    the video rows (None: text rows)."""
    config = SHAPES[args.shape](args.tiny)
    if args.layers:
        config.text_config.num_hidden_layers = args.layers
    config.text_config._attn_implementation = "sdpa"
    args.grid = None
    if args.video_seconds > 0:
        if not hasattr(config.vision_config, "deepstack_visual_indexes"):
            parser.error("--video-seconds builds Qwen3-VL video rows: use --shape qwen3-vl-8b")
        config.vision_config._attn_implementation = "sdpa"
        if args.tiny:  # the tiny vocabulary has no room for Qwen's special ids: take its last four
            top = config.text_config.vocab_size
            names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
            for offset, key in enumerate(names, start=1):
                setattr(config, key, top - offset)
        args.grid = video_grid(config, args)
    return config


def measure(run, config, row, device, *extra) -> dict:
    """One table row: the run's figures with tokens/s and MFU, or its OOM / missing-kernel error."""
    # RuntimeError, ValueError: e.g. "No available kernel" for an --sdpa-backend on this device
    result = harness.guarded(run, config, row, device, *extra, errors=(RuntimeError, ValueError))
    if "error" not in result:
        result["tokens_per_s"] = result["tokens_per_step"] / result["seconds_per_step"]
        result["mfu"] = result["flops_per_step"] / result["seconds_per_step"] / (result["gpus"] * PEAK_BF16_FLOPS)
    return result


def main() -> None:
    parser = build_parser()
    args = check_recompute(parser, parser.parse_args())
    for options in row_options(args):  # a bad row fails here, before any row runs
        row_args(parser, args, options)
    device = harness.init_world()
    if dist.get_world_size() % args.tp:
        raise SystemExit(f"--tp {args.tp} must divide the number of processes ({dist.get_world_size()}): "
                         f"launch with torchrun --nproc-per-node {args.tp}")
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    main_rank = dist.get_rank() == 0
    config = model_config(parser, args)
    # every row builds new blocks; let dynamo keep their compiled code instead of falling back to eager
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    rows_options = row_options(args)
    runs: dict[str, dict] = {}

    def emit(label: str, row: dict) -> None:
        # a row repeated in --rows (alternating orders) keeps every run: "label #2", "label #3", ...
        repeat = 1
        while (label if repeat == 1 else f"{label} #{repeat}") in runs:
            repeat += 1
        label = label if repeat == 1 else f"{label} #{repeat}"
        runs[label] = row
        if not main_rank:
            return
        base = runs.get("transformers baseline", {}).get("tokens_per_s")
        if "error" in row:
            print(f"{label:<100} {row['error']}", flush=True)
        else:
            ratio = f"{row['tokens_per_s'] / base:.2f}x" if base else "-"
            print(f"{label:<100} {row['tokens_per_s']:>10,.0f} {row['mfu']:>7.1%} {row['peak_gib']:>9.1f} {ratio:>12}", flush=True)
        harness.write_json("sft_throughput.json", {**info, "tp": args.tp, "args": vars(args), "runs": runs}, args.json)

    if main_rank:
        info = harness.device_line(device, ranks=world)
        print(f"{info['device']} x {world} (tp {args.tp}), {train_flops_per_token(config, args.seq_len) / 1e9:.1f} GFLOP/token "
              f"at seq_len {args.seq_len}; MFU per GPU of {PEAK_BF16_FLOPS / 1e12:.0f} TFLOP/s")
        if args.grid is not None:
            t, h, w = args.grid
            merge = config.vision_config.spatial_merge_size
            print(f"video rows: {args.video_seconds:g} s at {args.video_fps:g} fps of {args.video_size}, total_pixels "
                  f"{args.video_total_pixels:,}: {t * config.vision_config.temporal_patch_size} frames of "
                  f"{h * config.vision_config.patch_size}x{w * config.vision_config.patch_size}, grid {list(args.grid)}, "
                  f"{t * h * w // merge**2:,} visual tokens; vision tower "
                  f"{vision_train_flops(config, args.grid) / 1e12:.2f} TFLOP per clip (training)")
        print(f"{'run':<100} {'tok/s':>10} {'MFU':>7} {'peak GiB':>9} {'vs baseline':>12}", flush=True)
    if not args.skip_baseline:
        emit("transformers baseline", measure(run_baseline, config, args, device))
    compiled_backend = None
    for options in rows_options:
        row = row_args(parser, args, options)
        if row.compile and compiled_backend not in (None, row.sdpa_backend):
            torch._dynamo.reset()  # compiled graphs bake in the attention kernel chosen when they were traced
        compiled_backend = row.sdpa_backend if row.compile else compiled_backend
        emit(describe(parser, row), measure(run_ours, config, row, device, mesh))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
