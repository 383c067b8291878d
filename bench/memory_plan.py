"""Measured peak GPU memory of one SFT step beside physreason's memory plan for the same shape and layout; with
--modes the tokens/s of each memory-saving mode against none; with --grounding-grpo the grounding experiment's GRPO
stage against its plan. What each runs: bench/RESULTS.md ("How the scripts measure"). JSON to $OUT.

  torchrun --standalone --nproc-per-node 1 bench/memory_plan.py --config tests/fixtures/qwen3_vl_32b --layers 4 \
      [--state bfloat16 | --offload]
  torchrun --standalone --nproc-per-node 1 bench/memory_plan.py --shape qwen2.5-vl-3b --layers 0 --seq-len 4096 \
      --modes none,offload,offload-overlap,bf16-state --steps 3 --warmup 1 [--profile DIR [--profile-steps 2]]
  python bench/memory_plan.py --grounding-grpo --steps 3
CPU check: python bench/memory_plan.py --tiny
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import harness
import torch
from shapes import SHAPES
from torch.profiler import record_function
from transformers import AutoConfig

from physreason.config import LoraConfig, TrainConfig
from physreason.cpu import apply_cpu_share
from physreason.data.collate import SFTBatch
from physreason.models import parallelize
from physreason.models.family import model_family, vision_special_token_ids
from physreason.models.lora import apply_lora
from physreason.models.sizes import shape_from_hf_config
from physreason.train import phases
from physreason.train.build import shard
from physreason.train.host_step import OverlappedHostStep
from physreason.train.memory import GIB, Layout, Workload, plan_memory
from physreason.train.model import CausalLMLoss
from physreason.train.profiling import CATEGORIES, Profiled, format_breakdown, launches_under, summary_json
from physreason.train.runtime import init_runtime
from physreason.train.schedule import build_optimizer, fused_adamw

ROOT = Path(__file__).resolve().parents[1]
# --modes: each mode's settings over the command line's (none: as given, fp32 state on the GPU)
MODES = {"none": {}, "offload": {"cpu_offload": True}, "bf16-state": {"optimizer_state_dtype": "bfloat16"},
         "offload-overlap": {"cpu_offload": True, "cpu_offload_overlap": True}}  # fmt: skip


def build_config(args: argparse.Namespace):
    """The transformers config of --config, truncated to --layers decoder blocks (--tiny: the tiny Qwen3-VL)."""
    if args.tiny:
        from physreason.models.tiny import save_tiny_model

        folder = save_tiny_model("qwen3_vl", Path(os.environ.get("TMPDIR", "/tmp")) / "memory_plan_tiny")
        return AutoConfig.from_pretrained(folder)
    config = SHAPES[args.shape](False) if args.shape else AutoConfig.from_pretrained(args.config)
    text = getattr(config, "text_config", config)
    if args.layers:
        text.num_hidden_layers = args.layers
    return config


def synthetic_batch(rows: int, seq_len: int, below: int, device: torch.device) -> SFTBatch:
    """Text rows of random tokens below `below` (the first vision token id), every position a target; mrope positions."""
    ids = torch.randint(0, below, (rows, seq_len), device=device)  # [B, L]
    positions = torch.arange(seq_len, device=device).expand(3, rows, seq_len)  # [3, B, L]
    return SFTBatch(ids, ids.roll(-1, dims=1), positions, torch.ones_like(ids), num_samples=rows)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "tests" / "fixtures" / "qwen3_vl_32b"))
    harness.add_shape(parser, None, help="a bench shape instead of --config")
    parser.add_argument("--layers", type=int, default=4, help="decoder blocks kept (0: all)")
    parser.add_argument("--lora", type=int, default=0, metavar="RANK",
                        help="train LoRA adapters of this rank on the decoder's linear layers (0: full training)")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--loss-chunk", type=int, default=0)
    parser.add_argument("--state", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--offload", action="store_true")
    parser.add_argument("--no-checkpointing", action="store_true")
    parser.add_argument("--modes", default=None, metavar="none,offload,offload-overlap,bf16-state",
                        help="measure tokens/s of each mode against none in this run (instead of one memory row)")
    harness.add_steps(parser, 3, 1, "steps per mode (--modes)")
    parser.add_argument("--profile", type=Path, default=None, metavar="DIR",
                        help="with --modes: --profile-steps more steps of each mode after its timed steps under "
                             "torch.profiler, the device synchronised around clipping, AdamW and zeroing; prints one "
                             "line a mode, writes DIR/<mode>/profile.txt (and trace.json.gz when small)")
    parser.add_argument("--profile-steps", type=int, default=2, help="steps under the profiler per mode")
    parser.add_argument("--tiny", action="store_true", help="the tiny Qwen3-VL on CPU, to check the script")
    parser.add_argument("--grounding-grpo", action="store_true",
                        help="measure the grounding experiment's GRPO stage against its plan")
    parser.add_argument("--grounding-clips", type=int, default=32, help="RL clips a task for --grounding-grpo")
    parser.add_argument("--grounding-args", default="", help="more bench/grounding.py options for --grounding-grpo")
    parser.add_argument("--grounding-out", type=Path, default=Path("/tmp/memory-plan-grounding"),
                        help="clips, model and run folder of --grounding-grpo")
    harness.add_json(parser)
    return parser


def train_config(args: argparse.Namespace, **mode) -> TrainConfig:
    """The trainer settings of the command line, with one --modes entry's settings over them."""
    settings = dict(optimizer_state_dtype=args.state, cpu_offload=args.offload) | mode
    return TrainConfig(
        gradient_checkpointing=not args.no_checkpointing, loss_chunk_size=args.loss_chunk, mini_batch=args.batch,
        lora=LoraConfig(enable=args.lora > 0, rank=max(args.lora, 1)), **settings,
    )  # fmt: skip


def build_trained(args: argparse.Namespace, runtime, hf_config, train: TrainConfig, draw_on: torch.device):
    """(module, optimizer) as the trainer builds them: random fp32 weights drawn on `draw_on`, LoRA, checkpointing,
    CausalLMLoss, FSDP2 under torchrun (or onto the device), AdamW with train's state dtype."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    if train.cpu_offload and not runtime.distributed:
        raise SystemExit(
            "offload is FSDP2's CPU offload, and FSDP2 runs under torchrun: launch with "
            "torchrun --standalone --nproc-per-node 1 bench/memory_plan.py ..."
        )
    cls = AutoModelForImageTextToText if model_family(hf_config).is_vision_language else AutoModelForCausalLM
    torch.manual_seed(0)
    with torch.device(draw_on):
        model = cls.from_config(hf_config, dtype=torch.float32, attn_implementation="sdpa")
    if train.lora.enable:  # as the trainer's load_trainable: adapters before checkpointing, the base frozen
        apply_lora(model, train.lora)
    if train.gradient_checkpointing:
        parallelize.enable_activation_checkpointing(model)
    module = CausalLMLoss(model, train.loss_chunk_size)
    mesh = None
    if runtime.distributed:
        mesh = parallelize.build_mesh(runtime.device.type, runtime.world_size, 1)
    shard(module, model, runtime, mesh, train)  # FSDP2 moves offloaded shards to the host
    module.train()
    optimizer, _ = build_optimizer(module, train, 1, fused=fused_adamw(runtime.device, train.cpu_offload))
    return module, optimizer


def make_step(args: argparse.Namespace, runtime, hf_config, train: TrainConfig, draw_on: torch.device,
              host_seconds: list[tuple[float, float, bool]] | None = None):  # fmt: skip
    """(module, optimizer, step) of build_trained; step() is one optimizer step as the trainer's on --batch rows of
    random text: forward (bf16 autocast outside FSDP2), backward, clipping and AdamW (parallelize.clip_and_step).

    host_seconds: each step appends (the wall seconds of its gradient norm, with the clip multiply where one runs (under
    offload on one rank the norm comes from the GPU: only its copy to the host); of its AdamW step, which under
    offload takes the clip coefficient itself; whether clipping scaled). Meant for offload, whose gradients are on
    the host once the backward returns (FSDP2 waits for their copies) and whose clipping and AdamW run there, so the
    figures need no GPU sync; on the GPU they would be launch time only. With train.cpu_offload_overlap the step is
    the trainer's too: AdamW runs in the background (optimizer.overlap, an OverlappedHostStep) beside the next
    forward, which waits unit by unit, and its AdamW figure is only the start of the thread (the thread's own seconds
    and the main thread's waits are on optimizer.overlap)."""
    module, optimizer = build_trained(args, runtime, hf_config, train, draw_on)
    overlap = OverlappedHostStep(module, optimizer) if train.cpu_offload_overlap else None
    # as build_training_model: offloaded gradients take their norm from FSDP2's reduce outputs on the GPU (one rank)
    reduced = parallelize.ReducedGradNorm.attach(module) if train.cpu_offload else None
    text = getattr(hf_config, "text_config", hf_config)
    below = min(vision_special_token_ids(hf_config) or [text.vocab_size])
    batch = synthetic_batch(args.batch, args.seq_len, below, runtime.device)
    parameters = [p for p in module.parameters() if p.requires_grad]
    autocast = not runtime.distributed  # FSDP2 casts to bf16 itself

    def step(timings: dict[str, list[float]] | None = None) -> None:
        """One step; with `timings` (the profiled steps only) the device is synchronised around clipping, AdamW and
        zeroing, and each one's wall seconds (and the seconds until optimizer.step() returned) appended there."""
        with torch.autocast(runtime.device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = module(batch)
        if overlap is not None:
            overlap.wait()  # as train_step: every unit stepped before the gradients arrive
        with phases.phase(phases.BACKWARD):
            (loss / batch.num_targets).backward()
        with phases.phase(phases.OPTIMIZER):
            clock = harness.Laps(timings, runtime.device)
            laps = [time.perf_counter()]
            ranges = [record_function(OPTIMIZER_PARTS[0]), record_function(OPTIMIZER_PARTS[1])]
            ranges[0].__enter__()

            def norm_done() -> None:  # between the norm (and any clip multiply) and optimizer.step()
                ranges[0].__exit__(None, None, None)
                clock.lap("clip")
                laps.append(time.perf_counter())
                ranges[1].__enter__()

            norm = parallelize.clip_and_step(parameters, 1.0, optimizer, on_norm=norm_done, reduced=reduced,
                                             step=overlap.start if overlap is not None else None)  # fmt: skip
            ranges[1].__exit__(None, None, None)
            clock.lap("step_returned", sync_device=False)
            clock.lap("step")
            if host_seconds is not None:
                now = time.perf_counter()
                host_seconds.append((laps[1] - laps[0], now - laps[1], float(norm) > 1.0))
            with record_function(OPTIMIZER_PARTS[2]):
                if overlap is None:  # the thread releases each unit's gradients itself
                    optimizer.zero_grad(set_to_none=True)
            clock.lap("zero_grad")

    optimizer.reduced_norm = reduced  # for reduced_served
    optimizer.overlap = overlap  # for the offload-overlap row's figures
    return module, optimizer, step


def reduced_served(optimizer) -> str:
    """Where the offload row's gradient norms came from: FSDP2's reduce outputs on the GPU, or the host gradients."""
    reduced = getattr(optimizer, "reduced_norm", None)
    if reduced is None:
        return "norm read on the host (no one-rank FSDP2 reduce hook)"
    return f"norm from the GPU's reduce outputs in {reduced.served} steps of the mode, the rest on the host"


# profiler ranges inside the optimizer phase, so --profile counts each one's kernel launches
OPTIMIZER_PARTS = ("bench.clip_grad_norm", "bench.optimizer_step", "bench.zero_grad")


def planned_tensors(args: argparse.Namespace, runtime, hf_config, train: TrainConfig):
    """(plan, planned tensor bytes) of physreason's memory plan for this shape and layout."""
    shape = shape_from_hf_config(hf_config)
    layout = Layout(gpus=runtime.world_size, distributed=runtime.distributed, cpu_offload=train.cpu_offload,
                    optimizer_state_dtype=train.optimizer_state_dtype, gradient_checkpointing=train.gradient_checkpointing,
                    mini_batch=args.batch, lora=train.lora.enable)  # fmt: skip
    # Text rows: the vision tower never runs, so it gets no gradients and no AdamW state (train_vision=False).
    workload = Workload(seq_len=args.seq_len, loss_chunk_size=args.loss_chunk, vision_tokens=0, train_vision=False,
                        lora_rank=train.lora.rank, lora_targets=tuple(train.lora.target_modules))  # fmt: skip
    plan = plan_memory(shape, layout, workload)
    return plan, plan.total - plan.parts["runtime overhead"]  # max_memory_allocated sees tensors only


def measure_memory(args: argparse.Namespace, runtime, hf_config) -> None:
    """One memory row: the second step's measured peak beside the plan's parts and total."""
    train = train_config(args)
    # Random weights are drawn on the GPU (minutes faster than a CPU draw for a 7B shape); with --offload they start on
    # the host as the trainer's do. The peak is measured from the first step on, after sharding, either way.
    _, _, step = make_step(args, runtime, hf_config, train, torch.device("cpu") if args.offload else runtime.device)
    cuda = runtime.device.type == "cuda"
    for _ in range(2):  # the second step holds the optimizer state from the start, as every later step does
        harness.reset_peak()
        step()
    measured = torch.cuda.max_memory_allocated() if cuda else 0
    plan, planned = planned_tensors(args, runtime, hf_config, train)
    shape = shape_from_hf_config(hf_config)
    if runtime.is_main:
        for part, value in plan.parts.items():
            print(f"  planned {part:<22} {value / GIB:8.2f} GiB")
        print(f"planned tensors {planned / GIB:.2f} GiB, measured max_memory_allocated {measured / GIB:.2f} GiB, "
              f"ratio {measured / max(planned, 1):.3f} ({shape.total_params / 1e9:.2f} B parameters, {shape.layers} blocks)")
        record = {"args": vars(args), "parts": plan.parts, "planned": planned, "measured": measured,
                  **harness.device_info(runtime.device), "world_size": runtime.world_size}  # fmt: skip
        harness.write_json("memory_plan.json", record, args.json)


def measure_modes(args: argparse.Namespace, runtime, hf_config, modes: list[str]) -> list[dict]:
    """Tokens/s of each mode on the same shape and rows, one after the other in this process."""
    info = harness.device_info(runtime.device)
    tokens = args.batch * args.seq_len * runtime.world_size
    rows: list[dict] = []
    cpu = apply_cpu_share()  # init_runtime applied it: the threads the host's AdamW runs on
    if runtime.is_main:
        print(f"{info['device']} x {runtime.world_size}, {shape_from_hf_config(hf_config).total_params / 1e9:.2f} B "
              f"parameters, {tokens:,} tokens per step; {args.warmup} warm-up + {args.steps} timed steps per mode", flush=True)
        print(f"{'mode':<15} {'s/step':>8} {'tokens/s':>10} {'vs none':>8} {'peak GiB':>9} {'planned GiB':>12}", flush=True)
    for mode in modes:
        train = train_config(args, **MODES[mode])
        # Drawn on the device for every mode (fast); with offload, FSDP2 moves the shards to the host when it wraps.
        host_seconds: list[tuple[float, float, bool]] | None = [] if train.cpu_offload else None
        module, optimizer, step = make_step(args, runtime, hf_config, train, runtime.device, host_seconds)
        for _ in range(args.warmup):
            step()
        overlap = optimizer.overlap
        if overlap is not None:
            # the timed steps hold exactly their own AdamW steps: none of the warm-up's in flight at the start, and the
            # last one waited for at the end (a run's steady state hides a little more: its first forward too)
            overlap.wait()
        harness.sync(runtime.device)
        harness.reset_peak()  # the timed steps' peak
        if host_seconds is not None:
            host_seconds.clear()  # the timed steps' only
        if overlap is not None:
            before = overlap.steps, overlap.step_seconds, overlap.waited_seconds

            def steps_and_wait(step=step, overlap=overlap) -> None:
                for _ in range(args.steps):
                    step()
                overlap.wait()

            seconds = harness.timed(steps_and_wait, runtime.device)[0] / args.steps
            background = [now - then for now, then in zip((overlap.steps, overlap.step_seconds, overlap.waited_seconds),
                                                          before, strict=True)]  # fmt: skip
        else:
            seconds = harness.timed_steps(step, 0, args.steps, runtime.device)
        profiled = profile_mode(args, runtime, mode, step) if args.profile is not None else None
        _, planned = planned_tensors(args, runtime, hf_config, train)
        row = {"mode": mode, "seconds_per_step": seconds, "tokens_per_s": tokens / seconds,
               "peak_gib": harness.peak_gib(), "planned_gib": planned / GIB}  # fmt: skip
        if host_seconds:  # offload: clipping and AdamW on the host, and which AdamW ran there
            row["host_norm_seconds"] = sum(norm for norm, _, _ in host_seconds) / len(host_seconds)
            row["host_adamw_seconds"] = sum(adamw for _, adamw, _ in host_seconds) / len(host_seconds)
            row["host_clipped_steps"] = sum(clipped for _, _, clipped in host_seconds)
            row["host_timed_steps"] = len(host_seconds)
            row["norm_from_gpu"] = reduced_served(optimizer)
            row["host_step_seconds"] = row["host_norm_seconds"] + row["host_adamw_seconds"]
            row["host_adamw"] = "fused" if optimizer.defaults.get("fused") else type(optimizer).__name__
            if overlap is not None:  # AdamW in the background: its seconds, and those the main thread waited for it
                row["host_adamw_seconds"] = background[1] / max(background[0], 1)
                row["host_wait_seconds"] = background[2] / args.steps
                row["host_step_seconds"] = row["host_norm_seconds"] + row["host_wait_seconds"]
        if hasattr(optimizer, "grouped_launches"):  # bf16 state: which update ran (one kernel a group, or a parameter)
            stepped = args.warmup + args.steps + (args.profile_steps if profiled else 0)
            row["adamw_launches_per_step"] = {"grouped": optimizer.grouped_launches / stepped,
                                              "per_parameter": optimizer.per_parameter_updates / stepped,
                                              "table_builds": optimizer.table_builds / stepped}
        if profiled:
            row["profile"] = profiled
        none = next((r for r in rows if r["mode"] == "none"), row if mode == "none" else None)
        row["vs_none"] = row["tokens_per_s"] / none["tokens_per_s"] if none else None
        rows.append(row)
        if overlap is not None:
            overlap.close()  # its hooks and optimizers hold the shards: gone before the next mode
        del module, optimizer, step, overlap
        harness.free_memory()  # the next mode starts from an empty GPU (and frees the offloaded shards' pinned memory)
        if runtime.is_main:
            ratio = f"{row['vs_none']:.3f}" if row["vs_none"] is not None else "-"
            print(f"{mode:<15} {seconds:8.3f} {row['tokens_per_s']:10,.0f} {ratio:>8} {row['peak_gib']:9.2f} "
                  f"{row['planned_gib']:12.2f}", flush=True)  # fmt: skip
            if "host_wait_seconds" in row:
                host = row["host_step_seconds"]
                print(f"  {mode}: AdamW ({row['host_adamw']}) in the background {row['host_adamw_seconds']:.3f} s a "
                      f"step, of which the main thread waited {row['host_wait_seconds']:.3f} s (forward hooks and "
                      f"before the backward); gradient norm {row['host_norm_seconds']:.3f} s ({row['norm_from_gpu']}); "
                      f"clipped in {row['host_clipped_steps']} of {row['host_timed_steps']} steps; forward and backward "
                      f"with their copies, the rest of AdamW hidden under them, {seconds - host:.3f} s; "
                      f"{cpu.describe()}", flush=True)  # fmt: skip
            elif "host_step_seconds" in row:
                host = row["host_step_seconds"]
                print(f"  {mode}: clipping and AdamW ({row['host_adamw']}) on the host {host:.3f} s of the {seconds:.3f} s "
                      f"step (gradient norm {row['host_norm_seconds']:.3f} s, {row['norm_from_gpu']}; AdamW "
                      f"{row['host_adamw_seconds']:.3f} s; "
                      f"clipped in {row['host_clipped_steps']} of {row['host_timed_steps']} steps, the coefficient "
                      f"folded into AdamW), forward and backward with their copies {seconds - host:.3f} s; "
                      f"{cpu.describe()}", flush=True)  # fmt: skip
            if "adamw_launches_per_step" in row:
                launches = row["adamw_launches_per_step"]
                print(f"  AdamW of {mode}: {launches['grouped']:.0f} grouped kernels and {launches['per_parameter']:.0f} "
                      f"per-parameter updates a step; pointer tables built {launches['table_builds']:.2f} a step "
                      "(one a bucket when its gradients move every step)", flush=True)  # fmt: skip
            if profiled:
                print(profiled["line"], flush=True)
            record = {"args": vars(args), **info, "world_size": runtime.world_size, "cpu_threads": cpu.threads, "rows": rows}
            harness.write_json("memory_plan_modes.json", record, args.json)
    return rows


def profile_mode(args: argparse.Namespace, runtime, mode: str, step) -> dict | None:
    """--profile: --profile-steps more steps of `mode` (after its timed steps, so the timed figure has no profiler in
    it) under torch.profiler, the device synchronised around clipping, AdamW and zeroing. Writes DIR/<mode>/profile.txt
    (the breakdown of physreason/train/profiling.py, the host timings, key_averages' top 25) and the chrome trace
    gzipped when that is under 5 MB; returns the figures per step, with the one-line summary under "line"."""
    import gzip
    import shutil

    steps = args.profile_steps
    timings: dict[str, list[float]] = {}
    walls: list[float] = []
    if not runtime.is_main:  # other ranks step too, so collectives stay matched
        for _ in range(steps):
            step(timings)
        return None
    folder = args.profile / mode
    shutil.rmtree(folder, ignore_errors=True)
    with Profiled(folder, "trace", runtime.device, echo=False) as profiler:
        for _ in range(steps):
            harness.sync(runtime.device)
            started = time.perf_counter()
            step(timings)
            harness.sync(runtime.device)
            walls.append(time.perf_counter() - started)
            profiler.step()
    result, device = profiler.result, profiler.device
    events = list(profiler.profiler.events())
    launches = {part.split(".")[-1]: n / steps for part, n in launches_under(events, OPTIMIZER_PARTS, device).items()}
    host_ms = {name: 1e3 * sum(values) / len(values) for name, values in timings.items()}
    record = {**summary_json(result, steps), "steps": steps, "step_wall_ms": 1e3 * sum(walls) / steps,
              "host_ms": host_ms, "optimizer_launches_per_step": launches}  # fmt: skip
    unit = "kernels" if device == "cuda" else "ops"
    categories = ", ".join(f"{name} {record['by_category_ms_per_step'][name]:.1f}" for name in CATEGORIES)
    record["line"] = (
        f"  profile of {mode} ({steps} steps, synchronised): step {record['step_wall_ms']:.1f} ms wall, "
        f"{'GPU kernel' if device == 'cuda' else 'CPU op'} time {record['total_ms_per_step']:.1f} ms [{categories}; "
        f"unattributed {record['unattributed_ms_per_step']:.1f}]; wall ms clip {host_ms['clip']:.2f}, optimizer.step "
        f"{host_ms['step']:.2f} (returned after {host_ms['step_returned']:.2f}), zero_grad {host_ms['zero_grad']:.2f}; "
        f"{unit} a step: clip {launches['clip_grad_norm']:.0f}, optimizer.step {launches['optimizer_step']:.0f}, "
        f"zero_grad {launches['zero_grad']:.0f}"
    )  # fmt: skip
    sort = "device_time_total" if device == "cuda" else "cpu_time_total"
    table = profiler.profiler.key_averages().table(sort_by=sort, row_limit=25)
    raw = folder / "trace.trace.json"
    text = [record["line"].strip(), "", format_breakdown(result, steps), "", f"key_averages, top 25 by {sort}:", table]
    packed = gzip.compress(raw.read_bytes(), compresslevel=6)
    if len(packed) < 5 * 2**20:
        (folder / "trace.json.gz").write_bytes(packed)
    else:
        text.insert(1, f"(chrome trace not kept: {len(packed) / 2**20:.0f} MB gzipped)")
    raw.unlink()
    (folder / "trace.profile.json").unlink()  # its figures are in memory_plan_modes.json's row
    (folder / "profile.txt").write_text("\n".join(text) + "\n")
    return record


def measure_grounding_grpo(args: argparse.Namespace) -> dict:
    """bench/grounding.py's GRPO stage, --steps steps from its random model: the plan of the recipe and its prompts
    (as the trainer prints it at start) beside the measured peak of the whole stage."""
    import shlex
    import shutil

    from physreason.data.mcq import load_mcq_prompts
    from physreason.experiments import grounding
    from physreason.models import loading
    from physreason.progress import make_console
    from physreason.train.grpo import run_grpo
    from physreason.train.memory_report import check_memory, prompt_shape

    clips = str(args.grounding_clips)
    g = grounding.parse_args([
        "--out", str(args.grounding_out), "--train-per-task", "1", "--rl-per-task", clips, "--test-per-task", "1",
        "--grpo-steps", str(args.steps), "--ckpt-every", str(10**6), *shlex.split(args.grounding_args),
    ])  # fmt: skip
    out = g.out.resolve() / g.family
    grounding.generate(out, g)
    model_dir = grounding.build_model(g, out, 1)
    cfg = grounding.stage_config(g, out, model_dir, 1)
    run_dir = out / "grpo-memory"
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: a resumed one would skip its steps
    config = grounding.variant_grpo_config(grounding.variant_args(g, {}), cfg, out, model_dir, run_dir)
    config.train.resume = False
    cuda = torch.cuda.is_available()
    gpu_bytes = torch.cuda.get_device_properties(0).total_memory if cuda else None
    prompts = load_mcq_prompts(config.data.dataset, config.data.max_samples)
    shape_of_prompts = prompt_shape(config, prompts, loading.load_tokenizer(config.model))
    plan = check_memory(config, 1, False, "grpo", gpu_bytes, make_console(stderr=True), shape_of_prompts)
    planned = plan.total - plan.parts["runtime overhead"]  # max_memory_allocated sees tensors only
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    run_grpo(config)
    seconds = time.perf_counter() - started
    measured = torch.cuda.max_memory_allocated() if cuda else 0
    reserved = torch.cuda.max_memory_reserved() if cuda else 0
    for part, value in plan.parts.items():
        print(f"  planned {part:<22} {value / GIB:8.3f} GiB")
    print(f"grounding GRPO, {args.steps} steps in {seconds:.1f} s: prompts {shape_of_prompts}; planned tensors "
          f"{planned / GIB:.3f} GiB (total {plan.total / GIB:.3f} with the runtime overhead), measured "
          f"max_memory_allocated {measured / GIB:.3f} GiB (max_memory_reserved {reserved / GIB:.3f}), "
          f"measured / planned {measured / max(planned, 1):.3f}")  # fmt: skip
    record = {"args": vars(args), "grounding_args": {k: str(v) for k, v in vars(g).items()}, "parts": plan.parts,
              "planned": planned, "planned_total": plan.total, "measured": measured, "reserved": reserved,
              "prompts": vars(shape_of_prompts), "seconds": seconds, **harness.device_info()}  # fmt: skip
    harness.write_json("memory_plan_grounding.json", record, args.json)
    return record


def main(argv: list[str] | None = None) -> None:
    """One memory row, or with --modes the throughput of each mode (bench/RESULTS.md says how)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.grounding_grpo:
        measure_grounding_grpo(args)
        return
    modes = None
    if args.modes is not None:
        modes = harness.comma_list(parser, "--modes", args.modes, MODES)
        if args.offload or args.state != "float32":
            parser.error("--modes sets offload and the state dtype per mode: leave out --offload and --state")
        if args.steps < 1:
            parser.error("--steps must be at least 1")
    if args.profile is not None and (modes is None or args.profile_steps < 1):
        parser.error("--profile needs --modes and --profile-steps of at least 1")
    runtime = init_runtime()
    hf_config = build_config(args)
    if modes is None:
        measure_memory(args, runtime, hf_config)
    else:
        measure_modes(args, runtime, hf_config, modes)


if __name__ == "__main__":
    main()
