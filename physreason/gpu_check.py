"""`physreason gpu-check`: every path only a GPU reaches, at tiny size, in one call: one pass/fail line each (exit 1
if any failed).

CPU tests never reach the pinned-memory stager of async saves, float8 kernels, compiled blocks on CUDA, FSDP2 over
NCCL or the engines on a GPU; this command does, in a few minutes, so a change to any of those paths is checked on a GPU
before it lands. Each check is one named override list of the same tiny recipe (the demo's tiny random Qwen2.5-VL, a
few chat records, 6 steps) with the GPU count it needs, as torchtitan keeps its integration tests; a check needing more
GPUs than the machine has, or vLLM when it is not installed, prints `skip` with the reason.

One GPU:   sft-sync-saves, sft-async-saves (three saves each, then a resume from the second whose losses must equal
           the uninterrupted run's), float8-rowwise, float8-tensorwise, float8-fsdp-compiled (torchrun 1),
           cpu-offload, bf16-optimizer-state, bf16-state-grouped (one Triton kernel a group against one compiled
           kernel a parameter), packed-attention-spans (flash's variable-length kernel against sdpa under the
           mask), compiled-blocks, compiled-vision (image records: the vision blocks traced under recompute,
           losses as the eager tower's), chunked-loss (against the full loss of the same step),
           fsdp2-torchrun (FSDP2 on a one-rank mesh under torchrun 1: train.one_rank_precision = 'legacy', since one
           process now trains without FSDP2 by default), hf-generate, grpo-step
Two GPUs:  dp2, tp2, cp2: torchrun over NCCL against one process, 3 steps, losses within 1e-3 relative;
           dp2-skips (samples skipped on one rank, on both, and a rank with only skipped ones: counts over NCCL);
           float8-all-gather-dp2 (tensorwise weights all-gathered in float8, scales precomputed after each step)
--vllm:    vllm-generate, vllm-weight-push (the engine's output follows pushed weights), vllm-fp8-rollout,
           vllm-close (close() gives the GPU memory back; a second engine in the process answers as the first)

Set up on a bare GPU machine (the image has torch and an older transformers; nothing can be downloaded there):
    here, once:  bash tools/gpu_wheels.sh            (makes .device-wheels, about 60 MiB, git-ignored)
    run call:    carry [".device-wheels"], command:
                 source .device-wheels/setup.sh && python -m physreason gpu-check --commit C 2>&1 | tee $OUT/gpu_check.log
    with vLLM:   the parts of ../shared/gpu/vllm-wheels.sh first (see its header), then add --vllm
Each check runs in a worker process of its own (a CUDA fault cannot take the next check with it) with a time limit
(--timeout, 120 s; the vLLM checks get at least 300 s, vllm-fp8-rollout 420 s, for an engine's cold first start). With OUT set, $OUT/gpu_check.json is rewritten after every check and a failed check's log is
kept as $OUT/NAME.log. --only NAME[,NAME] runs some. --jobs N runs the one-GPU checks N at a time on the same GPU
(lines in the order they finish, the JSON in list order); the two-GPU and vLLM checks still run alone, afterwards.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import faulthandler
import gc
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

_STARTED = time.perf_counter()


def say(message: str) -> None:
    """One line stamped with the seconds since the command started, flushed: how far a cut-short run got."""
    print(f"[{time.perf_counter() - _STARTED:7.1f} s] {message}", flush=True)


@dataclass(frozen=True)
class Check:
    name: str
    gpus: int = 1
    needs: str = ""  # "vllm" or "torchao": skipped when the package is missing
    cuda_only: bool = False  # not run by --cpu (CUDA kernels, pinned memory)
    settings: tuple[str, ...] = field(default_factory=tuple)
    # The least time the check gets whatever --timeout says: a vLLM engine's first start on a fresh machine compiles
    # and captures its CUDA graphs cold (vllm-fp8-rollout needed more than 170 s on an H200, 81 s warm)
    min_timeout: float = 0.0


FLOAT8 = ("train.fp8.enable_fp8=true", "train.fp8.skip_small_linears=false")
# SFT settings each check adds to the base recipe (base_settings); the checks' bodies are in run_check.
CHECKS = (
    Check("sft-sync-saves", settings=("train.ckpt.save_mode='sync'",)),
    Check("sft-async-saves", settings=("train.ckpt.save_mode='async'",)),
    # The tiny model's layers are all too small for float8 to pay: skip_small_linears = false converts them anyway.
    # float8 trains in a plain process on the cast path (bf16 copies into float8 layers), the chunked loss there too
    Check("float8-rowwise", needs="torchao", cuda_only=True,
          settings=(*FLOAT8, "train.fp8.quant_recipe='rowwise'", "train.loss_chunk_size=16")),
    Check("float8-tensorwise", needs="torchao", cuda_only=True, settings=(*FLOAT8, "train.fp8.quant_recipe='tensorwise'")),
    # FSDP2 on one rank (bf16 all-gather) with compiled blocks (one process takes the cast path unless 'legacy')
    Check("float8-fsdp-compiled", needs="torchao", cuda_only=True,
          settings=(*FLOAT8, "train.fp8.quant_recipe='tensorwise'", "train.compile=true",
                    "train.one_rank_precision='legacy'")),
    # FSDP2 over 2 ranks: tensorwise weights all-gathered in float8, scales precomputed after each optimizer step, a save
    Check("float8-all-gather-dp2", gpus=2, needs="torchao", cuda_only=True,
          settings=(*FLOAT8, "train.fp8.quant_recipe='tensorwise'", "train.compile=true",
                    "policy.parallelism.dp_shard_size=2")),
    Check("cpu-offload", cuda_only=True, settings=("train.cpu_offload=true",)),
    Check("bf16-optimizer-state", settings=("train.optimizer_state_dtype='bfloat16'",)),
    Check("bf16-state-grouped", cuda_only=True),
    Check("packed-attention-spans", cuda_only=True),
    Check("compiled-blocks", cuda_only=True, settings=("train.compile=true",)),
    Check("compiled-vision", cuda_only=True, settings=("train.compile_vision=true",)),
    Check("chunked-loss", settings=("train.loss_chunk_size=16",)),
    # One process trains without FSDP2 by default (train.one_rank_precision = "cast"): "legacy" keeps FSDP2 here
    Check("fsdp2-torchrun", settings=("train.one_rank_precision='legacy'",)),
    Check("hf-generate"),
    Check("grpo-step"),
    Check("dp2", gpus=2, settings=("policy.parallelism.dp_shard_size=2",)),
    # samples skipped on one rank only, a step skipped on every rank, a step where one rank has only skipped samples
    Check("dp2-skips", gpus=2, settings=("policy.parallelism.dp_shard_size=2",)),
    Check("tp2", gpus=2, settings=("policy.parallelism.tp_size=2", "policy.parallelism.dp_shard_size=1")),
    Check("cp2", gpus=2, settings=("policy.parallelism.cp_size=2", "policy.parallelism.dp_shard_size=1")),
    Check("vllm-generate", needs="vllm", cuda_only=True, min_timeout=300),
    Check("vllm-weight-push", needs="vllm", cuda_only=True, min_timeout=300),
    Check("vllm-fp8-rollout", needs="vllm", cuda_only=True, min_timeout=420),
    Check("vllm-close", needs="vllm", cuda_only=True, min_timeout=300),
)


def prepare(work: Path) -> tuple[Path, Path, Path]:
    """The tiny model (bf16-friendly widths), 32 chat records and 8 multiple-choice prompts, made once under work."""
    from physreason.models.tiny import save_tiny_model

    model = work / "model"
    if not (model / "config.json").is_file():
        save_tiny_model("qwen2_5_vl", model)
    chat, mcq = work / "chat.jsonl", work / "mcq.jsonl"
    if not chat.is_file():
        rows = [{"conversations": [{"role": "user", "content": f"Does box {i} slide down the ramp?"},
                                   {"role": "assistant", "content": "<think>steep</think><answer>yes</answer>"}]}
                for i in range(32)]  # fmt: skip
        chat.write_text("\n".join(json.dumps(r) for r in rows))
    if not mcq.is_file():
        rows = [{"question": f"Which way does ball {i} go?", "options": ["up", "down", "left", "right"], "answer": "B"}
                for i in range(8)]  # fmt: skip
        mcq.write_text("\n".join(json.dumps(r) for r in rows))
    return model, chat, mcq


def base_settings(model: Path, data: Path, out: Path, steps: int = 6) -> list[str]:
    """The tiny SFT recipe every SFT check starts from: bf16 compute over fp32 masters, 4 rows a step, a save every 2."""
    return [
        f"model.model_name_or_path='{model}'", f"data.dataset.name='{data}'", f"train.output_dir='{out}'",
        f"train.max_steps={steps}", "train.train_batch_per_replica=4", "train.mini_batch=2", "train.optm_lr=2e-3",
        "train.optm_warmup_steps=1", "data.num_workers=0", "logging.logger=['jsonl']", "train.seed=7",
        "train.ckpt.save_freq=2", "train.ckpt.max_keep=3", "train.ckpt.export_safetensors=false",
    ]  # fmt: skip


# Runs SFT under torchrun; records the device mesh the trainer sharded over (dimension name -> size), so a check
# proves the layout it asked for was the one trained (a setting that silently fell back to one layout would pass the
# loss comparison alone).
SFT_WORKER = """
import json, sys
import torch.distributed as dist
import physreason.train.build as build
from physreason.config import load_config
from physreason.train.sft import run_sft
mesh_sizes = {}
real_shard = build.shard
def shard(wrapper, model, runtime, mesh, *args, **kwargs):  # the rest passes through as build.shard takes it
    if mesh is not None:
        mesh_sizes.update({name: mesh[name].size() for name in mesh.mesh_dim_names})
    return real_shard(wrapper, model, runtime, mesh, *args, **kwargs)
build.shard = shard
import physreason.models.float8 as float8
precomputes = []  # float8 scale passes after optimizer steps (float8 all-gather only)
real_precompute = float8._torchao_precompute
def precompute(module):
    precomputes.append(1)
    return real_precompute(module)
float8._torchao_precompute = precompute
result = run_sft(load_config(None, json.loads(sys.argv[1])))
if not dist.is_initialized() or dist.get_rank() == 0:
    json.dump({"losses": result.losses, "mesh": mesh_sizes, "float8_precomputes": len(precomputes)},
              open(sys.argv[2], "w"))
if dist.is_initialized():
    dist.destroy_process_group()
"""


def torchrun(
    work: Path, nproc: int, settings: list[str], timeout: float, mesh: dict | None = None, info: dict | None = None
) -> list[float]:
    """SFT with `settings` in `nproc` torchrun processes (NCCL on GPUs); rank 0's losses. `mesh`, when given, is
    filled with the trained mesh's dimension sizes; `info` with the worker's whole record (float8_precomputes: the
    float8 scale passes that followed optimizer steps). The processes' output goes to a log beside the losses."""
    from physreason.files import write_atomic
    from physreason.net import free_port

    stamp = time.monotonic_ns()
    script, losses = work / "sft_worker.py", work / f"losses_{nproc}_{stamp}.json"
    write_atomic(script, SFT_WORKER)  # checks running at once (--jobs) never read a half-written script
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
               str(free_port()), str(script), json.dumps(settings), str(losses)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    (work / f"torchrun_{nproc}_{stamp}.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        # the ranks' output into this check's log, which a failed check leaves under $OUT
        print("\n".join((done.stdout + done.stderr).splitlines()[-300:]), file=sys.stderr, flush=True)
        raise RuntimeError(f"torchrun {nproc} exited {done.returncode}: {last_error(done.stderr)}")
    record = json.loads(losses.read_text())
    if mesh is not None:
        mesh.update(record["mesh"])
    if info is not None:
        info.update(record)
    return record["losses"]


# An exception's own line ("ValueError: ...", "[rank0]: TypeError: ..."), as a traceback or a torchrun rank ends
ERROR_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?([\w.]*(?:Error|Exception)\b.*)")
# torchrun's own summary after a rank failed: it names no cause (its "error_file: <N/A>" once stood for the error)
TORCHRUN_SUMMARY = ("ChildFailedError", "error_file:", "raise ChildFailedError")


def last_error(text: str) -> str:
    """The line that names the error in a traceback or log: the last exception line (torchrun's summary skipped),
    else the last line that mentions an error, else the last line."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    lines = [line for line in lines if not any(part in line for part in TORCHRUN_SUMMARY)] or lines
    for line in reversed(lines):
        match = ERROR_LINE.match(line)
        if match:
            return match.group(1)[:300]
    for line in reversed(lines):
        if "Error" in line or "Exception" in line or line.startswith("error"):
            return line[:300]
    return lines[-1][:300] if lines else "(no output)"


def close(a: list[float], b: list[float], rtol: float) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rtol * max(abs(x), abs(y), 1e-6) for x, y in zip(a, b))


def sft(settings: list[str]):
    from physreason.config import load_config
    from physreason.train.sft import run_sft

    return run_sft(load_config(None, settings))


def finite(losses: list[float], expected: int) -> str:
    import math

    if len(losses) != expected or not all(math.isfinite(x) for x in losses):
        raise AssertionError(f"expected {expected} finite losses, got {losses}")
    return f"losses {losses[0]:.4f} -> {losses[-1]:.4f}"


def image_records(work: Path, count: int = 8) -> Path:
    """`count` chat records each with a small random image (the vision tower's input), made once under work."""
    import numpy as np
    from PIL import Image

    records = work / "images.jsonl"
    if not records.is_file():
        rng = np.random.default_rng(0)
        rows = []
        for i in range(count):
            Image.fromarray(rng.integers(0, 256, size=(56 + 28 * (i % 2), 84, 3), dtype=np.uint8)).save(work / f"img{i}.png")
            rows.append({"image": f"img{i}.png", "conversations": [
                {"role": "user", "content": f"Does object {i} roll off the table?"},
                {"role": "assistant", "content": "<think>tilted</think><answer>yes</answer>"}]})  # fmt: skip
        records.write_text("\n".join(json.dumps(r) for r in rows))
    return records


# dp2-skips: 12 records in order, 2 a rank a step; these are too long for the context (no answer token fits): step 1 one
# on rank 1, step 2 all four (a step without an update), step 3 both of rank 0's (it trains on filler while rank 1
# trains)
SKIPPED_RECORDS = (3, 4, 5, 6, 7, 8, 9)


def check_skips(model: Path, work: Path, timeout: float, settings: tuple[str, ...]) -> str:
    """SFT over 2 ranks where samples are skipped on one rank, on both, and where one rank has nothing left: the
    step's counts (one all-reduce) and skip reasons (gathered at steps with skips) travel over NCCL, the step of only
    skipped samples makes no update, and the run ends with the global counts."""
    import math

    data = work / "skips.jsonl"
    rows = [{"conversations": [
        {"role": "user", "content": ("word " * 400 if i in SKIPPED_RECORDS else "") + f"Does box {i} slide down the ramp?"},
        {"role": "assistant", "content": "<think>steep</think><answer>yes</answer>"}]} for i in range(12)]  # fmt: skip
    data.write_text("\n".join(json.dumps(r) for r in rows))
    out = work / "dp2-skips"
    losses = torchrun(work, 2, base_settings(model, data, out, steps=3) + [
        "train.ckpt.enable_checkpoint=false", "model.model_max_length=128", "data.shuffle=false",
        "data.val_fraction=0", "train.log_freq=1", *settings], timeout)  # fmt: skip
    if len(losses) != 3 or not (math.isfinite(losses[0]) and math.isnan(losses[1]) and math.isfinite(losses[2])):
        raise AssertionError(f"wanted a loss, no loss (every sample skipped) and a loss, got {losses}")
    rows = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    by_step = {row["step"]: row for row in rows if "train/lr" in row}
    skipped = sum(value for key, value in by_step[3].items() if key.startswith("skipped/"))
    empty = by_step[2].get("train/empty_steps")
    if skipped != len(SKIPPED_RECORDS) or empty != 1.0:
        raise AssertionError(f"after step 3: {skipped:g} skipped (wanted {len(SKIPPED_RECORDS)} over both ranks); "
                             f"step 2 logged empty steps {empty} (wanted 1)")  # fmt: skip
    return f"losses {losses[0]:.4f}, -, {losses[2]:.4f}; {skipped:g} skipped over both ranks, 1 step without an update"


def check_compiled_vision(model: Path, work: Path, settings: tuple[str, ...]) -> str:
    """SFT on image records with the vision blocks compiled against the same run eager: the blocks traced (a graph,
    no break at the recompute's checkpoint) and the losses within bf16's reach of the eager tower's."""
    import torch
    from torch._dynamo.utils import counters

    data = image_records(work)
    common = base_settings(model, data, work / "compiled-vision-eager", steps=3) + [
        "train.ckpt.enable_checkpoint=false", "train.param_dtype='bfloat16'"]  # fmt: skip
    eager = sft(common).losses
    torch._dynamo.reset()
    counters.clear()
    compiled = sft([*common, f"train.output_dir='{work / 'compiled-vision'}'", *settings]).losses
    graphs = counters["stats"]["unique_graphs"]
    reasons = " ".join(counters["graph_break"])
    if not graphs or "HOP" in reasons or "checkpoint" in reasons:
        raise AssertionError(f"the vision blocks ran eagerly: {graphs} graphs, graph breaks: {reasons or 'none'}")
    if not close(compiled, eager, 2e-2):
        raise AssertionError(f"compiled tower {compiled} vs eager {eager}")
    return f"{finite(compiled, 3)}, {graphs} graphs; eager {eager[-1]:.4f} at step 3"


def check_saves(check: Check, model: Path, chat: Path, work: Path) -> str:
    """Three saves (steps 2, 4, 6) with one checkpointer, then a resume from step 4 whose losses equal the run's."""
    from physreason.train.checkpoint import checkpoint_dirs

    out = work / check.name
    straight = sft(base_settings(model, chat, out) + list(check.settings))
    found = [p.name for p in checkpoint_dirs(out)]
    if found != ["step_2", "step_4", "step_6"]:
        raise AssertionError(f"checkpoints {found}, expected step_2, step_4, step_6")
    leftovers = sorted(p.name for p in (out / "checkpoints").glob("*.tmp"))
    if leftovers:
        raise AssertionError(f"half-written checkpoints left: {leftovers}")
    resumed = sft(base_settings(model, chat, work / f"{check.name}-resumed") + list(check.settings)
                  + [f"train.resume='{out / 'checkpoints' / 'step_4'}'", "train.trust_checkpoint=true"])
    tail = straight.losses[4:]
    if resumed.losses != tail:
        gap = max((abs(a - b) for a, b in zip(resumed.losses, tail)), default=float("nan"))
        raise AssertionError(f"resumed losses {resumed.losses} != uninterrupted {tail} (max gap {gap:.3g})")
    return f"3 saves, resume from step_4 bitwise equal ({tail[0]:.6f}, {tail[1]:.6f})"


def check_chunked(model: Path, chat: Path, work: Path, settings: tuple[str, ...]) -> str:
    full = sft(base_settings(model, chat, work / "loss-full", steps=2) + ["train.ckpt.enable_checkpoint=false"])
    chunked = sft(base_settings(model, chat, work / "loss-chunked", steps=2) + ["train.ckpt.enable_checkpoint=false",
                                                                             *settings])
    if not close(full.losses, chunked.losses, 2e-3):
        raise AssertionError(f"chunked losses {chunked.losses} differ from the full loss's {full.losses}")
    return f"chunked {chunked.losses[0]:.5f} vs full {full.losses[0]:.5f}"


def check_generate(model: Path) -> str:
    from physreason.config import load_config
    from physreason.engines.base import GenerationRequest
    from physreason.engines.factory import create_engine

    config = load_config(None, [f"model.model_name_or_path='{model}'", "engine.backend='hf'", "model.dtype='bfloat16'"])
    requests = [GenerationRequest(messages=[{"role": "user", "content": [{"type": "text", "text": f"Does {i} roll?"}]}])
                for i in range(4)]  # fmt: skip
    sampling = config.generation.model_copy(update={"max_tokens": 16, "temperature": 1.0})
    with create_engine(config.model, config.engine) as engine:
        results = engine.generate(requests, sampling)
        device = next(engine.model.parameters()).device if hasattr(engine, "model") else "?"
    errors = [r.error for r in results if r.error]
    if errors:
        raise AssertionError(f"generation failed: {errors[0]}")
    tokens = [len(c.token_ids) for r in results for c in r.completions]
    if not tokens or min(tokens) == 0:
        raise AssertionError(f"completions without tokens: {tokens}")
    return f"{len(tokens)} completions, {sum(tokens)} tokens on {device}"


def check_grpo(model: Path, mcq: Path, work: Path) -> str:
    from physreason.config import load_config
    from physreason.train.grpo import run_grpo

    settings = [
        f"model.model_name_or_path='{model}'", f"data.dataset.name='{mcq}'", f"train.output_dir='{work / 'grpo'}'",
        "engine.backend='hf'", "engine.batch_size=16", "train.train_batch_per_replica=16", "rollout.n_generation=8",
        "rollout.batch_size=2", "rollout.max_response_length=8", "grpo.mini_batch=8", "train.max_steps=2",
        "train.optm_lr=1e-3", "logging.logger=['jsonl']", "train.ckpt.enable_checkpoint=false",
    ]  # fmt: skip
    result = run_grpo(load_config(None, settings))
    if len(result.rewards) != 2:
        raise AssertionError(f"expected 2 GRPO steps, got rewards {result.rewards}")
    return f"2 steps, mean rewards {result.rewards}"


def vllm_setup(model: Path, utilization: float = 0.3):
    """The vLLM checks' config (bf16, `utilization` of the GPU), one text request and greedy sampling of 12 tokens."""
    from physreason.config import load_config
    from physreason.engines.base import GenerationRequest

    config = load_config(None, [f"model.model_name_or_path='{model}'", "engine.backend='vllm'", "model.dtype='bfloat16'",
                                f"engine.gpu_memory_utilization={utilization}"])  # fmt: skip
    request = [GenerationRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "Does it roll?"}]}])]
    return config, request, config.generation.model_copy(update={"max_tokens": 12, "temperature": 0.0})


def check_vllm(name: str, model: Path) -> str:
    import torch

    from physreason.engines.factory import create_engine

    if name == "vllm-fp8-rollout":  # block FP8 needs k/v rows in multiples of 128: the tiny model at scale 2
        from physreason.models.tiny import save_tiny_model

        if not (model.parent / "model-scale2" / "config.json").is_file():
            save_tiny_model("qwen2_5_vl", model.parent / "model-scale2", scale=2)
        model = model.parent / "model-scale2"
    config, request, greedy = vllm_setup(model)
    quantization = "fp8" if name == "vllm-fp8-rollout" else "none"
    with create_engine(config.model, config.engine, vllm_executor="uni", quantization=quantization) as engine:
        from transformers import AutoModelForImageTextToText

        from physreason.train.weight_sync import push_weights

        # The names a policy sends: its in-memory Hugging Face state dict (transformers 5 saves other names to disk)
        policy = AutoModelForImageTextToText.from_pretrained(model, dtype=torch.bfloat16)

        def push(state: dict[str, torch.Tensor]) -> None:
            """The policy's weights to the engine as training pushes them (FP8: quantized by the sender)."""
            policy.load_state_dict(state)
            if quantization == "fp8":
                push_weights(engine, policy, quantization="fp8")
            else:
                engine.update_weights(list(policy.state_dict().items()))

        weights = {k: v.clone() for k, v in policy.state_dict().items()}
        if quantization == "fp8":  # an FP8 rollout engine starts from random weights: the policy pushes its own first
            push(weights)
        first = engine.generate(request, greedy)[0]
        if first.error or not first.completions[0].token_ids:
            raise AssertionError(f"vLLM generation failed: {first.error}")
        if name == "vllm-generate":
            return f"{len(first.completions[0].token_ids)} tokens ({quantization})"
        generator = torch.Generator().manual_seed(1)
        push({k: torch.randn(v.shape, generator=generator).to(v.dtype) * 0.5 if v.ndim == 2 else v
              for k, v in weights.items()})  # fmt: skip
        second = engine.generate(request, greedy)[0]
        push(weights)
        third = engine.generate(request, greedy)[0]
        if second.completions[0].token_ids == first.completions[0].token_ids:
            raise AssertionError("greedy output did not change after pushing other weights")
        if third.completions[0].token_ids != first.completions[0].token_ids:
            raise AssertionError("pushing the original weights back did not restore the greedy output")
        if quantization == "fp8":
            how = "copied into the live model" if engine.pushes_in_place else "through vLLM's reload_weights"
            if getattr(engine, "in_place_refusal", None):
                how += f": {engine.in_place_refusal}"
            return f"{len(first.completions[0].token_ids)} tokens (fp8); greedy output followed two more pushes ({how})"
        return "greedy output followed the pushed weights and came back with the originals"


def check_packed_attention(device: str = "cuda", dtype_name: str = "bfloat16", timed: int = 20) -> str:
    """grpo.packed_attention = "spans" (flash attention's variable-length kernel on CUDA) against sdpa under the rows'
    [L, L] mask, at a GRPO row of the 3B shape (16 query / 2 key-value heads of 128; a 580-token prompt with three
    unequal completions, and a shorter row with padding): outputs and the gradients of queries, keys and values, each
    path in `dtype_name` measured against the masked path in float32; the spans path may not be more than twice as far
    from it as the masked path (plus 1e-3). Also times a forward and backward of each (not a pass condition)."""
    from types import SimpleNamespace

    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from physreason.models import packed_attention
    from physreason.models.packed_attention import PackedRows, attach, dense_mask, packed_sdpa_attention

    small = device == "cpu"  # a dry run of the logic (the reference loop, not the kernel)
    prompt, lengths = (40, (16, 11, 16)) if small else (580, (256, 200, 256))
    width = prompt + sum(lengths)  # row 0 fills its width; row 1 is padded
    starts = [prompt + sum(lengths[:i]) for i in range(len(lengths))]
    layout = PackedRows(((prompt, tuple(zip(starts, lengths))), (prompt // 2, ((prompt // 2, lengths[1]),))), width)
    dtype = getattr(torch, dtype_name)
    generator = torch.Generator(device).manual_seed(0)
    module = SimpleNamespace(num_key_value_groups=8, is_causal=True)
    leaves = [torch.randn(2, heads, width, 128, device=device, generator=generator) for heads in (16, 2, 2)]
    weights = torch.randn(2, width, 16, 128, device=device, generator=generator)
    real = torch.zeros(2, width, dtype=torch.bool, device=device)
    real[0] = True
    real[1, : prompt // 2 + lengths[1]] = True
    weights = weights * real[:, :, None, None]

    def run(spans: bool, precision: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
        inputs = [leaf.detach().to(precision).clone().requires_grad_() for leaf in leaves]
        mask = dense_mask(layout, device)
        if spans:
            out, _ = packed_sdpa_attention(module, *inputs, attach(mask, layout), scaling=128**-0.5)
        else:
            out, _ = sdpa_attention_forward(module, *inputs, mask, scaling=128**-0.5)
        (out.float() * weights).sum().backward()
        return out.detach().float().clone(), [x.grad.float().clone() for x in inputs]

    calls = []
    original = packed_attention._varlen
    packed_attention._varlen = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        want, want_grads = run(False, torch.float32)
        results = {spans: run(spans, dtype) for spans in (False, True)}
    finally:
        packed_attention._varlen = original
    if not calls:
        raise AssertionError("the spans path did not run (transformers' sdpa answered the call)")
    parts = []
    for index, what in enumerate(("output", "query grad", "key grad", "value grad")):
        reference = want[real] if index == 0 else want_grads[index - 1]
        gaps = {}
        for spans, (out, grads) in results.items():
            got = out[real] if index == 0 else grads[index - 1]
            gaps[spans] = float((got - reference).abs().max()) / (float(reference.abs().max()) + 1e-12)
        if gaps[True] > 2 * gaps[False] + 1e-3:
            raise AssertionError(f"{what}: spans {gaps[True]:.2e} from float32, the masked path {gaps[False]:.2e}")
        parts.append(f"{what} {gaps[True]:.1e} (mask {gaps[False]:.1e})")
    # the same call traced whole by torch.compile (train.compile): on CUDA flash's op inside one graph
    plan = packed_attention._plan(layout, torch.device(device))
    compiled = torch.compile(
        lambda q, k, v: packed_sdpa_attention(module, q, k, v, None, scaling=128**-0.5, physreason_packed_plan=plan)[0],
        fullgraph=True,
    )
    inputs = [leaf.to(dtype) for leaf in leaves]
    eager_out = packed_sdpa_attention(module, *inputs, None, scaling=128**-0.5, physreason_packed_plan=plan)[0]
    gap = float((compiled(*inputs).float() - eager_out.float()).abs().max())
    if gap > 1e-2 * float(eager_out.float().abs().max()):
        raise AssertionError(f"compiled spans path differs from eager by {gap:.3g}")
    parts.append(f"compiled (fullgraph) within {gap:.1e}")
    times = {}
    if not small:
        for spans in (False, True):
            for _ in range(3):
                run(spans, dtype)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(timed):
                run(spans, dtype)
            torch.cuda.synchronize()
            times[spans] = (time.perf_counter() - start) / timed * 1e3
    speed = f"; forward+backward {times[True]:.2f} ms spans, {times[False]:.2f} ms mask" if times else ""
    return f"{dtype_name} relative gaps to float32: " + ", ".join(parts) + speed


def check_bf16_grouped(device: str = "cuda", timed: int = 400) -> str:
    """bf16-state AdamW's grouped update (one Triton kernel a parameter group) against one compiled kernel a
    parameter: 3 steps over tensors of every kind it meets (sizes off the chunk, bfloat16 weights, an empty shard, a
    transposed weight that takes the per-parameter way), then an FSDP2 MLP on a one-rank mesh (DTensor parameters);
    weights and moments must agree within bfloat16 rounding. Also times a step of each over `timed` tensors (400).
    device="cpu" runs the same logic through Triton's interpreter (a dry run of this check, not a CPU path)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from physreason.net import free_port
    from physreason.train.adamw import AdamWBF16State

    def compare(ours, theirs, grouped, per_parameter, what: str) -> None:
        if grouped.grouped_launches == 0 or per_parameter.grouped_launches != 0:
            raise AssertionError(f"{what}: {grouped.grouped_launches} grouped launches (the Triton update did not run)")
        for index, (a, b) in enumerate(zip(ours, theirs)):
            a, b = (t.full_tensor() if hasattr(t, "full_tensor") else t for t in (a.detach(), b.detach()))
            # fused multiply-adds may round a bf16 moment one unit apart (2**-8 relative); a float32 weight then moves
            # by about lr x 2**-8 a step, a bfloat16 weight by a unit of its own; a wrong formula moves it by ~lr
            rtol = 2**-6 if a.dtype == torch.bfloat16 else 0.0
            if not torch.allclose(a.float(), b.float(), rtol=rtol, atol=1e-2 * 2**-7):
                gap = (a.float() - b.float()).abs().max().item()
                raise AssertionError(f"{what}: weight {index} {tuple(a.shape)} {a.dtype} differs by {gap:.3g}")
        for index, (a, b) in enumerate(zip(ours, theirs)):
            for key in ("exp_avg", "exp_avg_sq"):
                x, y = (o.state[p][key] for o, p in ((grouped, a), (per_parameter, b)))
                if x.dtype != torch.bfloat16:
                    raise AssertionError(f"{what}: {key} of weight {index} is {x.dtype}, not bfloat16")
                x, y = (t.full_tensor().float() if hasattr(t, "full_tensor") else t.float() for t in (x, y))
                # one unit apart, relative to the tensor's scale (a moment that cancels to near zero, m + (g - m) x 0.1
                # with g near -9 m, keeps the absolute error of its inputs)
                scale = 2**-7 * y.abs().max().item() if y.numel() else 0.0
                if not torch.allclose(x, y, rtol=2**-7, atol=scale + 1e-12):
                    gap = (x - y).abs().max().item()
                    raise AssertionError(f"{what}: {key} of weight {index} differs by {gap:.3g} (scale {scale:.3g})")

    torch.manual_seed(0)
    shapes = [(1000, 300), (4099,), (64, 64), (1,), (0, 8), (3, 5, 7), (40000,), (16384,)]
    start = [torch.randn(s, device=device) for s in shapes]
    start += [torch.randn(128, 33, device=device).bfloat16(), torch.randn(30, 20, device=device).t()]
    built = []
    for grouped in (True, False):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        groups = [{"params": params[:-3]}, {"params": params[-3:], "weight_decay": 0.0}]
        built.append((params, AdamWBF16State(groups, lr=1e-2, weight_decay=0.1, grouped=grouped)))
    (ours, grouped), (theirs, per_parameter) = built
    for _ in range(3):
        for a, b in zip(ours, theirs):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        grouped.step()
        per_parameter.step()
    compare(ours, theirs, grouped, per_parameter, "plain tensors")
    if grouped.per_parameter_updates != 3:  # the transposed weight, 3 steps
        raise AssertionError(f"{grouped.per_parameter_updates} per-parameter updates beside the grouped kernel, not 3")

    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh(device, (1,))
        models, optimizers = [], []
        for grouped_update in (True, False):
            torch.manual_seed(1)
            model = torch.nn.Sequential(torch.nn.Linear(96, 200), torch.nn.GELU(), torch.nn.Linear(200, 7)).to(device)
            fully_shard(model, mesh=mesh)
            models.append(model)
            optimizers.append(AdamWBF16State(model.parameters(), lr=1e-2, weight_decay=0.1, grouped=grouped_update))
        inputs = torch.randn(3, 16, 96, device=device)
        for step in range(3):  # the first model's gradients (DTensors) go to both, so only the updates differ
            models[0](inputs[step]).square().mean().backward()
            for a, b in zip(models[0].parameters(), models[1].parameters()):
                b.grad = a.grad.detach().clone()
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        compare(list(models[0].parameters()), list(models[1].parameters()), *optimizers, "FSDP2 (DTensor)")
    finally:
        dist.destroy_process_group()

    # time: 400 float32 tensors (105 M elements, 2.1 GB read and written a step), after a warm-up step of each
    sizes = [(1024, 512) if i % 2 else (4096,) for i in range(timed)]
    seconds = []
    for grouped_update in (True, False):
        params = [torch.nn.Parameter(torch.randn(s, device=device)) for s in sizes]
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer = AdamWBF16State(params, lr=1e-3, grouped=grouped_update)
        optimizer.step()
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(5):
            optimizer.step()
        if device == "cuda":
            torch.cuda.synchronize()
        seconds.append((time.perf_counter() - started) / 5)
        del params, optimizer
    elements = sum(torch.Size(s).numel() for s in sizes)
    return (f"3 steps equal within bf16 rounding (plain, bf16 weights, empty, FSDP2); {timed} tensors, {elements / 1e6:.0f} M "
            f"elements: grouped {seconds[0] * 1e3:.2f} ms a step ({elements * 20 / seconds[0] / 1e9:.0f} GB/s) vs "
            f"per-parameter {seconds[1] * 1e3:.2f} ms")


def check_vllm_close(model: Path, utilization: float = 0.3) -> str:
    """A closed vLLM engine gives its GPU memory back, and a second engine in the same process answers as the first.

    Free device memory (torch.cuda.mem_get_info, which sees vLLM's KV cache and CUDA graphs too) before the first
    engine, while it lives and after its close(); at least 90% of what it took must come back, then a second engine
    at the same utilisation must start and give the same greedy tokens. A failure also says what torch's allocator
    still holds and which Python objects hold the largest CUDA tensors left (`cuda_tensor_holders`), so one run on
    a GPU names the reference to cut.
    """
    import torch

    from physreason.engines.factory import create_engine

    config, request, greedy = vllm_setup(model, utilization)
    gib = 1024**3

    def one_engine() -> tuple[list[int], list[int], list[int]]:
        """Greedy tokens of one engine, and free / allocated bytes while it lives and after its close."""
        with create_engine(config.model, config.engine, vllm_executor="uni") as engine:
            result = engine.generate(request, greedy)[0]
            if result.error or not result.completions[0].token_ids:
                raise AssertionError(f"vLLM generation failed: {result.error}")
            free, allocated = [torch.cuda.mem_get_info()[0]], [allocated_bytes()]
        return result.completions[0].token_ids, [*free, torch.cuda.mem_get_info()[0]], [*allocated, allocated_bytes()]

    free, allocated = [torch.cuda.mem_get_info()[0]], [allocated_bytes()]
    first, free_first, allocated_first = one_engine()
    free += free_first
    allocated += allocated_first
    taken, returned = free[0] - free[1], free[2] - free[1]
    memory = (f"free {free[0] / gib:.1f} GiB before, {free[1] / gib:.1f} with the engine, {free[2] / gib:.1f} after "
              f"close")  # fmt: skip
    if taken <= 0 or returned < 0.9 * taken:  # said now, while the first engine's leftovers are the only ones
        holders = "; ".join(cuda_tensor_holders()) or "no Python object holds a CUDA tensor of 64 MiB or more"
        raise AssertionError(
            f"close() gave back {returned / gib:.1f} of the {taken / gib:.1f} GiB the engine took ({memory}; torch's "
            f"allocator {allocated[0] / gib:.1f} / {allocated[1] / gib:.1f} / {allocated[2] / gib:.1f} GiB allocated "
            f"at the same points); largest CUDA tensors left: {holders}"
        )
    second, free_second, _ = one_engine()
    memory += f", {free_second[1] / gib:.1f} after the second engine's"
    if second != first:
        raise AssertionError(f"the second engine's greedy tokens {second} differ from the first's {first}")
    return f"{returned / taken:.0%} of {taken / gib:.1f} GiB back after close; second engine same tokens ({memory})"


def allocated_bytes() -> int:
    """Bytes torch's CUDA allocator has handed out (0 without CUDA)."""
    import torch

    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0


def cuda_tensor_holders(min_bytes: int = 64 * 1024**2, limit: int = 3, depth: int = 5) -> list[str]:
    """The largest CUDA tensors Python still reaches (storage of at least `min_bytes`), each with the chain of
    objects that holds it (`tensor <- dict['kv_cache'] <- Attention <- ...`, the first referrer at each level,
    frames and this function's own lists left out). Memory a C++ object holds with no Python tensor (a CUDA
    graph's pool, NCCL buffers) does not show here; the allocator's figure beside it tells the two apart."""
    import types

    import torch

    seen = gc.get_objects()
    big = []
    for obj in seen:
        try:
            if issubclass(type(obj), torch.Tensor) and obj.is_cuda and obj.untyped_storage().nbytes() >= min_bytes:
                big.append(obj)
        except Exception:  # noqa: BLE001 (a tensor subclass that refuses storage access is not a lead)
            continue
    big.sort(key=lambda t: -t.untyped_storage().nbytes())
    big = big[:limit]
    skip = {id(seen), id(big)}
    lines = []
    for tensor in big:
        chain, obj = [], tensor
        for _ in range(depth):
            refs = [r for r in gc.get_referrers(obj) if id(r) not in skip and not isinstance(r, types.FrameType)]
            skip.add(id(refs))
            if not refs:
                chain.append("(no Python referrer)")
                break
            holder = refs[0]
            chain.append(_held_as(holder, obj))
            obj = holder
        size = tensor.untyped_storage().nbytes() / 1024**3
        lines.append(f"{size:.2f} GiB {tuple(tensor.shape)} {tensor.dtype} <- " + " <- ".join(chain))
    del seen
    return lines


def _held_as(holder: object, obj: object) -> str:
    """How `holder` refers to `obj`: dict['key'], list[3], Type.attribute, or the holder's type."""
    if isinstance(holder, dict):
        return f"dict[{next((k for k, v in holder.items() if v is obj), '?')!r}]"
    if isinstance(holder, (list, tuple)):
        return f"{type(holder).__name__}[{next((i for i, v in enumerate(holder) if v is obj), '?')}]"
    attrs = getattr(holder, "__dict__", None)
    name = next((k for k, v in attrs.items() if v is obj), None) if isinstance(attrs, dict) else None
    return f"{type(holder).__qualname__}.{name}" if name else type(holder).__qualname__


def run_check(check: Check, work: Path, timeout: float) -> str:
    """The body of one check, in this (worker) process; returns the detail of a pass, raises on a failure."""
    import torch

    torch.backends.cudnn.deterministic = True
    model, chat, mcq = prepare(work)
    name = check.name
    if name.startswith("sft-"):
        return check_saves(check, model, chat, work)
    if name == "cpu-offload":  # FSDP2 offloads its shards: it runs under torchrun, as users launch it
        losses = torchrun(work, 1, base_settings(model, chat, work / name, steps=3)
                          + ["train.ckpt.enable_checkpoint=false", *check.settings], timeout)  # fmt: skip
        return finite(losses, 3)
    if name in ("float8-fsdp-compiled", "float8-all-gather-dp2"):
        nproc = check.gpus
        # over 2 ranks the weights are torchao's float8-all-gather tensors: the save at step 2 checks they checkpoint
        saves = [] if nproc > 1 else ["train.ckpt.enable_checkpoint=false"]
        settings = base_settings(model, chat, work / name, steps=3) + saves + list(check.settings)
        info: dict = {}
        losses = torchrun(work, nproc, settings, timeout, info=info)
        # float8 keeps FSDP2 on one process too (build.compute_cast): a run without a mesh tested another path
        if info["mesh"].get("dp") != nproc:
            raise AssertionError(f"float8 over {nproc} rank(s) trained on the mesh {info['mesh'] or 'none (no FSDP2)'}")
        # float8 all-gather (2+ ranks) precomputes the scales after each of the 3 steps; one rank gathers in bf16
        wanted = 3 if nproc > 1 else 0
        if info["float8_precomputes"] != wanted:
            raise AssertionError(f"{info['float8_precomputes']} float8 scale passes over {nproc} rank(s), wanted {wanted}")
        return f"{finite(losses, 3)}, float8 all-gather {'on' if wanted else 'off'}, {wanted} scale passes"
    if name.startswith("float8-") or name in ("bf16-optimizer-state", "compiled-blocks"):
        settings = base_settings(model, chat, work / name, steps=3) + ["train.ckpt.enable_checkpoint=false"]
        if name.startswith("float8-") or name == "compiled-blocks":
            settings.append("train.param_dtype='bfloat16'")
        result = sft(settings + list(check.settings))
        return finite(result.losses, 3)
    if name == "chunked-loss":
        return check_chunked(model, chat, work, check.settings)
    if name == "compiled-vision":
        return check_compiled_vision(model, work, check.settings)
    if name == "bf16-state-grouped":
        return check_bf16_grouped()
    if name == "packed-attention-spans":
        return check_packed_attention()
    if name == "fsdp2-torchrun":
        trained: dict[str, int] = {}
        losses = torchrun(work, 1, base_settings(model, chat, work / name, steps=3)
                          + ["train.ckpt.enable_checkpoint=false", *check.settings], timeout, trained)  # fmt: skip
        if trained.get("dp") != 1:  # no mesh: the run took the one-rank cast path, not FSDP2
            raise AssertionError(f"asked for FSDP2 on one rank, trained on the mesh {trained or 'none (no FSDP2)'}")
        return f"{finite(losses, 3)}, FSDP2 on a one-rank mesh"
    if name == "hf-generate":
        return check_generate(model)
    if name == "grpo-step":
        return check_grpo(model, mcq, work)
    if name == "dp2-skips":
        return check_skips(model, work, timeout, check.settings)
    if name in ("dp2", "tp2", "cp2"):
        common = base_settings(model, chat, work / name, steps=3) + ["train.ckpt.enable_checkpoint=false",
                                                                     "model.dtype='float32'", "train.param_dtype='float32'"]
        one = torchrun(work, 1, common + [f"train.output_dir='{work / (name + '-one')}'"], timeout)
        mesh: dict[str, int] = {}
        two = torchrun(work, 2, common + list(check.settings), timeout, mesh)
        wanted = {"dp2": "dp", "tp2": "tp", "cp2": "cp"}[name]
        if mesh.get(wanted) != 2:
            raise AssertionError(f"asked for {wanted} 2, trained on the mesh {mesh}")
        if not close(one, two, 1e-3):
            raise AssertionError(f"2 GPUs {two} vs 1 GPU {one}")
        gap = max(abs(a - b) for a, b in zip(one, two))
        layout = " x ".join(f"{k} {v}" for k, v in mesh.items())
        return f"mesh {layout}: 2 GPUs {two[-1]:.6f} vs 1 GPU {one[-1]:.6f} at step 3 (max gap {gap:.1e})"
    if name == "vllm-close":
        return check_vllm_close(model)
    if name.startswith("vllm-"):
        return check_vllm(name, model)
    raise ValueError(f"unknown check {name}")


def missing(check: Check, gpus: int, vllm: bool, cpu: bool) -> str | None:
    """Why `check` cannot run here, or None."""
    if cpu and check.cuda_only:
        return "needs CUDA (--cpu runs the checks' logic on CPU processes)"
    if check.gpus > gpus:
        return f"needs {check.gpus} GPUs, {gpus} visible"
    if check.needs == "vllm" and not vllm:
        return "needs --vllm (vLLM carried and installed)"
    if check.needs and importlib.util.find_spec(check.needs) is None:
        return f"{check.needs} is not installed"
    return None


def worker(name: str, work: Path, timeout: float, result_file: Path) -> int:
    check = next(c for c in CHECKS if c.name == name)
    # A check that hangs is killed at --timeout by the parent; shortly before that, every thread's stack goes to
    # the check's log, so a hang names where it waits (the image has no py-spy).
    faulthandler.dump_traceback_later(max(timeout - 10.0, 1.0), exit=False)
    try:
        detail = run_check(check, work, timeout)
        result = {"ok": True, "detail": detail}
    except BaseException as exc:  # noqa: BLE001 - the line names it
        traceback.print_exc()
        result = {"ok": False, "detail": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"}
    result_file.write_text(json.dumps(result))
    return 0


def run_worker(check: Check, work: Path, timeout: float) -> dict:
    """Run one check in a worker process of its own (a CUDA fault cannot take the next check with it); its row."""
    started = time.perf_counter()
    timeout = max(timeout, check.min_timeout)
    result_file = work / f"{check.name}.result.json"
    result_file.unlink(missing_ok=True)
    log = work / f"{check.name}.log"
    command = [sys.executable, "-m", "physreason.gpu_check", "--worker", check.name, "--work", str(work), "--result",
               str(result_file), "--timeout", str(timeout)]  # fmt: skip
    try:
        with open(log, "w") as sink:
            subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, timeout=timeout, check=False)
        if result_file.is_file():
            outcome = json.loads(result_file.read_text())
        else:
            outcome = {"ok": False, "detail": f"worker died: {last_error(log.read_text(errors='replace'))}"}
    except subprocess.TimeoutExpired:
        outcome = {"ok": False, "detail": f"did not finish in {timeout:g} s ({log})"}
    return {"check": check.name, "status": "pass" if outcome["ok"] else "FAIL", "detail": outcome["detail"],
            "seconds": round(time.perf_counter() - started, 1)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vllm", action="store_true", help="also run the vLLM checks (vLLM must be installed)")
    parser.add_argument("--only", default="", help="comma-separated check names (default: all)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds each check may take (the vLLM checks get at least 300, vllm-fp8-rollout 420)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="one-GPU checks run this many at a time on the same GPU (checks of several GPUs and "
                             "the vLLM checks still run alone); 1: one after another")
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    parser.add_argument("--list", action="store_true", help="print the checks and exit")
    parser.add_argument("--cpu", action="store_true",
                        help="run the checks' logic on CPU (gloo processes stand in for GPUs): the command's own test")
    parser.add_argument("--commit", default="", help="the commit the tree is at, for the report (git rev-parse here)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs {args.jobs}: give 1 or more")
    if args.list:
        for c in CHECKS:
            print(f"{c.name:22s} {c.gpus} GPU{'s' if c.gpus > 1 else ''} {c.needs}")
        return 0
    work = args.work or Path(tempfile.mkdtemp(prefix="gpu_check_"))
    work.mkdir(parents=True, exist_ok=True)
    if args.worker:
        return worker(args.worker, work, args.timeout, args.result)

    import torch

    gpus = 2 if args.cpu else torch.cuda.device_count()
    names = [n for n in args.only.split(",") if n]
    unknown = sorted(set(names) - {c.name for c in CHECKS})
    if unknown:
        parser.error(f"unknown check(s) {', '.join(unknown)}; --list shows them")
    chosen = [c for c in CHECKS if not names or c.name in names]
    device = "CPU (--cpu)" if args.cpu else torch.cuda.get_device_name(0) if gpus else "no CUDA GPU"
    # The device machine gets the working tree without its git history: pass the commit (--commit) to name it.
    commit = args.commit
    versions = f"torch {torch.__version__}"
    for package in ("transformers", "torchao", "vllm"):
        if importlib.util.find_spec(package) is not None:
            versions += f", {package} {__import__(package).__version__}"
    say(f"gpu_check on {gpus} x {device}; {versions}; commit {commit or '(not given: --commit)'}")
    prepare(work)  # the tiny model and data, once, before the workers
    out = os.environ.get("OUT")
    rows: dict[str, dict] = {}
    lock = threading.Lock()

    def record(row: dict) -> None:
        """One finished check: its line, its log under $OUT when it failed, the JSON rewritten (list order)."""
        with lock:
            rows[row["check"]] = row
            if out and row["status"] == "FAIL" and (work / f"{row['check']}.log").is_file():
                # a failed check's log (its traceback, a torchrun's ranks' output) comes back with the results
                Path(out).mkdir(parents=True, exist_ok=True)
                text = (work / f"{row['check']}.log").read_text(errors="replace")
                (Path(out) / f"{row['check']}.log").write_text(text[-200_000:])
            say(f"{row['status']:4s} {row['check']:22s} {row['seconds']:6.1f} s  {row['detail']}")
            if out:
                Path(out).mkdir(parents=True, exist_ok=True)
                ordered = [rows[c.name] for c in chosen if c.name in rows]
                summary = {"device": device, "gpus": gpus, "versions": versions, "commit": commit, "rows": ordered}
                (Path(out) / "gpu_check.json").write_text(json.dumps(summary, indent=1))

    # --jobs N: the one-GPU checks share the GPU, N at a time; checks of several GPUs and the vLLM engines (each takes
    # a fixed share of the GPU's memory) run alone afterwards. With 1, every check in list order.
    runnable = [c for c in chosen if missing(c, gpus, args.vllm, args.cpu) is None]
    shared = [c for c in runnable if c.gpus == 1 and c.needs != "vllm"] if args.jobs > 1 else []
    if shared:
        for check in chosen:
            if check not in runnable:
                record({"check": check.name, "status": "skip", "detail": missing(check, gpus, args.vllm, args.cpu),
                        "seconds": 0.0})  # fmt: skip
        with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
            futures = [pool.submit(run_worker, check, work, args.timeout) for check in shared]
            for future in concurrent.futures.as_completed(futures):
                record(future.result())
    for check in chosen:
        if check in shared or check.name in rows:
            continue
        reason = missing(check, gpus, args.vllm, args.cpu)
        if reason is None:
            record(run_worker(check, work, args.timeout))
        else:
            record({"check": check.name, "status": "skip", "detail": reason, "seconds": 0.0})
    ordered = [rows[c.name] for c in chosen]
    failed = [r["check"] for r in ordered if r["status"] == "FAIL"]
    passed = sum(r["status"] == "pass" for r in ordered)
    skipped = sum(r["status"] == "skip" for r in ordered)
    say(f"{passed} passed, {len(failed)} failed, {skipped} skipped" + (f": {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
