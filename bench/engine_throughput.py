"""Decode throughput of physreason's vLLM engine against raw `vllm.LLM`, and `update_weights` time (GPU).

Shapes and prompts: bench/RESULTS.md ("How the scripts measure"). One JSON line per measurement.

--compare fp8: physreason's engine with bf16 weights against the same engine with FP8 rollout weights, and with FP8
rollout weights plus an FP8 KV cache (engine.kv_cache_dtype = "fp8"), on the same shape, prompts and seeded random
weights (pushed through train/weight_sync.py's push_weights, quantized by the sender for FP8), 256 new tokens at
temperature 1 with ignore_eos and the sampled tokens' log-probs (RL rollouts). The engines do not share one process:
each runs in a child process (--sides, default bf16, fp8, fp8_kv), its --runs timed runs per batch back to back; then
one row per batch (each side's tok/s, each FP8 side's ratio of the means to bf16) and the JSON
(engine_throughput_fp8.json under $OUT, or --json). Every engine captures CUDA graphs for the batch sizes measured and
the powers of two below them only (vLLM's default list has 51 sizes: 100 s of a 7B engine's start on an H200);
--all-cudagraph-sizes keeps vLLM's list.

    python bench/engine_throughput.py vllm --tokenizer DIR     # raw vLLM vs our vllm engine, update_weights
    python bench/engine_throughput.py vllm --tokenizer DIR --shape qwen3-vl-8b --folder /tmp/physreason-8b-shape
    python bench/engine_throughput.py vllm --compare fp8 --tokenizer DIR [--shape qwen3-vl-8b] [--batches 1 64 256]
        [--sides bf16 fp8 fp8_kv]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from harness import Report, child_env, device_line, free_memory, timed
from harness import emit as out
from shapes import DECODER_SHAPES as SHAPES

from physreason.vllm_compat import cudagraph_sizes

PROMPT, NEW = 512, 256


def make_folder(folder: Path, tokenizer_dir: Path, shape: dict) -> Path:
    """A model folder: the shape's config, the real Qwen tokenizer with physreason's chat template."""
    from transformers import AutoTokenizer, GenerationConfig

    from physreason.models.chat_template import QWEN2_5_VL_CHAT_TEMPLATE

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(shape))
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.chat_template = QWEN2_5_VL_CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    GenerationConfig(eos_token_id=[151645, 151643], pad_token_id=151643).save_pretrained(folder)
    return folder


def make_requests(tokenizer, count: int, seed: int):
    """`count` requests whose rendered prompts are exactly PROMPT tokens (distinct random one-token words)."""
    from physreason.engines.base import GenerationRequest

    rng = random.Random(seed)
    candidates = sorted(t[1:] for t, i in tokenizer.get_vocab().items() if t.startswith("Ġ") and t[1:].isalpha() and i < 151643)
    # Words that BPE really encodes as one token after a space (some vocabulary entries are unreachable).
    words = [w for w in random.Random(0).sample(candidates, 4000) if len(tokenizer(" " + w, add_special_tokens=False).input_ids) == 1]
    def length(messages) -> int:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return len(tokenizer(text, add_special_tokens=False).input_ids)

    overhead = length([{"role": "user", "content": " x"}]) - 1
    requests = []
    for k in range(count):
        text = "".join(" " + rng.choice(words) for _ in range(PROMPT - overhead))
        messages = [{"role": "user", "content": text}]
        assert length(messages) == PROMPT, length(messages)
        requests.append(GenerationRequest(messages=messages, request_id=str(k)))
    return requests


def bench_vllm(folder: Path, batches: list[int], runs: int) -> None:
    from vllm import SamplingParams

    from physreason import vllm_compat
    from physreason.config import EngineConfig, ModelConfig, SamplingConfig
    from physreason.engines.vllm import VLLMEngine

    start = time.perf_counter()
    # gpu_memory_utilization leaves room for a second copy of the weights (the update_weights source).
    engine = VLLMEngine(ModelConfig(model_name_or_path=str(folder), model_max_length=4096),
                        EngineConfig(gpu_memory_utilization=0.6), load_format="dummy")  # fmt: skip
    out(what="vllm_engine_start", s=round(time.perf_counter() - start, 1))
    sampling = SamplingConfig(temperature=1.0, top_p=1.0, repetition_penalty=1.0, max_tokens=NEW, seed=0)
    # Two pairings: inference (no log-probs on either side) and RL rollouts (the log-prob of every sampled
    # token on both sides: raw vLLM with logprobs=0 as flat lists, which is what our engine asks for).
    raw_params = {False: SamplingParams(max_tokens=NEW, temperature=1.0, top_p=1.0, seed=0),
                  True: vllm_compat.sampling_params(sampling, NEW, engine.stop_token_ids, logprobs=True)}  # fmt: skip
    engine.generate(make_requests(engine.tokenizer, 2, seed=99), sampling)  # warm-up
    for batch in batches:
        requests = make_requests(engine.tokenizer, batch, seed=batch)
        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in engine.generate(requests, sampling.model_copy(update={"max_tokens": 1}))]
        t = time.perf_counter()
        texts = [engine._render(r) for r in requests]
        engine.tokenizer(texts, add_special_tokens=False)
        out(what="physreason_host_prep", batch=batch, s=round(time.perf_counter() - t, 4))
        for logprobs in (False, True):
            for name in ("raw_vllm", "physreason_vllm") * runs:  # interleaved, so drift hits both sides
                engine.llm.reset_prefix_cache()
                torch.cuda.synchronize()
                t = time.perf_counter()
                if name == "raw_vllm":
                    outputs = engine.llm.generate(prompts, raw_params[logprobs], use_tqdm=False)
                    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
                else:
                    results = engine.generate(requests, sampling, logprobs=logprobs)
                    tokens = sum(len(r.completions[0].token_ids) for r in results)
                dt = time.perf_counter() - t
                out(what=name, logprobs=logprobs, batch=batch, prompt=PROMPT, new=NEW, tokens=tokens, s=round(dt, 2),
                    tok_per_s=round(tokens / dt, 1))
    bench_update_weights(engine)


def bench_update_weights(engine) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(engine.model_config.model_name_or_path))
    weights = [(n, torch.empty(p.shape, dtype=torch.bfloat16, device="cuda").normal_(0, 0.02)) for n, p in meta.named_parameters()]
    size = sum(t.numel() * t.element_size() for _, t in weights)
    for attempt in range(3):
        seconds, _ = timed(lambda: engine.update_weights(weights))
        out(what="update_weights", attempt=attempt, tensors=len(weights), gib=round(size / 2**30, 2), source="cuda bf16",
            s=round(seconds, 3))


# ---- --compare fp8: the engine with bf16 weights against FP8 rollout weights ---------------------------------------

# side -> (rollout.quantization, engine.kv_cache_dtype): bf16 is the engine's own dtype; fp8 block-FP8 weights; fp8_kv
# block-FP8 weights and an FP8 KV cache. Ratios are each FP8 side's against bf16.
SIDES = {"bf16": ("none", "auto"), "fp8": ("fp8", "auto"), "fp8_kv": ("fp8", "fp8")}
LABELS = {"bf16": "bf16", "fp8": "fp8", "fp8_kv": "fp8+kv8"}


def policy_model(folder: Path, device: str, seed: int = 0) -> torch.nn.Module:
    """The folder's causal LM in bf16 on `device`, every parameter N(0, 0.02) from a seeded generator (norms 1): the
    same weights in every process, standing in for the policy that pushes them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.bfloat16)
    generator = torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.fill_(1.0)
            else:
                parameter.normal_(0.0, 0.02, generator=generator)
    return model


def engine_options(side: str, batches: list[int], gpu_memory: float, all_cudagraph_sizes: bool = False):
    """The side's EngineConfig and VLLMEngine keyword arguments (its weights, and the CUDA graph sizes to capture)."""
    from physreason.config import EngineConfig

    quantization, kv_cache_dtype = SIDES[side]
    extra: dict[str, Any] = {"quantization": "fp8"} if quantization == "fp8" else {"load_format": "dummy"}
    if not all_cudagraph_sizes:
        extra["compilation_config"] = {"cudagraph_capture_sizes": cudagraph_sizes(batches)}
    return EngineConfig(gpu_memory_utilization=gpu_memory, kv_cache_dtype=kv_cache_dtype), extra


def decode_one(folder: Path, side: str, batches: list[int], runs: int, gpu_memory: float, rows: Path,
               all_cudagraph_sizes: bool = False) -> None:  # fmt: skip
    """One engine (a side of SIDES): push the seeded policy weights the way GRPO does, then time generate at each
    batch size (`runs` timed runs after an untimed one); its rows go to `rows` as they finish."""
    from physreason.config import ModelConfig, SamplingConfig
    from physreason.engines.vllm import VLLMEngine
    from physreason.train.weight_sync import push_weights

    quantization, kv_cache_dtype = SIDES[side]
    report = Report(rows.name, rows, side=side, quantization=quantization, kv_cache_dtype=kv_cache_dtype)
    start = time.perf_counter()
    config, extra = engine_options(side, batches, gpu_memory, all_cudagraph_sizes)
    engine = VLLMEngine(ModelConfig(model_name_or_path=str(folder), model_max_length=4096), config, **extra)
    out(what="engine_start", side=side, s=round(time.perf_counter() - start, 1),
        kv_cache=str(engine.llm.llm_engine.vllm_config.cache_config.cache_dtype),  # as vLLM resolved it
        cudagraph_sizes=extra.get("compilation_config", {}).get("cudagraph_capture_sizes", "vllm's"))  # fmt: skip
    model = policy_model(folder, "cuda")
    for attempt in range(2):
        seconds, _ = timed(partial(push_weights, engine, model, torch.bfloat16, quantization=quantization))
        out(what="push", side=side, attempt=attempt, s=round(seconds, 3))
    model = None  # the engine holds its own copy now
    free_memory()
    sampling = SamplingConfig(temperature=1.0, top_p=1.0, repetition_penalty=1.0, max_tokens=NEW, seed=0,
                              ignore_eos=True)  # fmt: skip
    engine.generate(make_requests(engine.tokenizer, 2, seed=99), sampling)  # warm-up
    for batch in batches:
        requests = make_requests(engine.tokenizer, batch, seed=batch)
        # Untimed, short: the prefill's GEMM shapes of this batch (FP8 kernels are compiled at first use).
        engine.generate(requests, sampling.model_copy(update={"max_tokens": 8}), logprobs=True)
        for run in range(runs):
            engine.llm.reset_prefix_cache()
            seconds, results = timed(partial(engine.generate, requests, sampling, logprobs=True))
            tokens = sum(len(r.completions[0].token_ids) for r in results)
            errors = [r.error for r in results if r.error]
            report.row(dict(what="decode", side=side, quantization=quantization, kv_cache_dtype=kv_cache_dtype,
                            batch=batch, run=run, prompt=PROMPT, new=NEW, tokens=tokens, errors=len(errors),
                            s=round(seconds, 2), tok_per_s=round(tokens / seconds, 1)))  # fmt: skip


def ratio_rows(decode_rows: list[dict[str, Any]], sides: list[str] | tuple[str, ...] = tuple(SIDES)) -> list[dict[str, Any]]:
    """One row per batch size from the decode rows of the engines: each side's tok/s per run, their means, the tokens
    each run decoded, and each FP8 side's mean over bf16's (`ratio` for fp8, `ratio_fp8_kv` for fp8_kv; None where
    either side has no run)."""
    table = []
    for batch in sorted({row["batch"] for row in decode_rows}):
        entry: dict[str, Any] = {"batch": batch}
        for side in sides:
            runs = [r for r in decode_rows if r["batch"] == batch and r["side"] == side]
            entry[f"{side}_tok_per_s"] = [r["tok_per_s"] for r in runs]
            entry[f"{side}_tokens"] = [r["tokens"] for r in runs]
            speeds = entry[f"{side}_tok_per_s"]
            entry[f"{side}_mean"] = round(statistics.fmean(speeds), 1) if runs else None
        bf16 = entry.get("bf16_mean")
        for side in sides:
            if side != "bf16":
                mean = entry[f"{side}_mean"]
                entry["ratio" if side == "fp8" else f"ratio_{side}"] = round(mean / bf16, 3) if bf16 and mean is not None else None
        table.append(entry)
    return table


def ratio_line(row: dict[str, Any], sides: list[str] | tuple[str, ...] = tuple(SIDES)) -> str:
    """`batch 256: bf16 9,700 tok/s (9,650, 9,750) | fp8 13,580 tok/s (...) | fp8+kv8 ... | fp8/bf16 1.40x |
    fp8+kv8/bf16 1.55x` ("-" for a missing side or ratio)."""

    def speed(name: str) -> str:
        if row[f"{name}_mean"] is None:
            return f"{LABELS[name]} -"
        runs = ", ".join(f"{v:,.0f}" for v in row[f"{name}_tok_per_s"])
        return f"{LABELS[name]} {row[f'{name}_mean']:,.0f} tok/s ({runs})"

    parts = [speed(name) for name in sides]
    if "bf16" in sides:
        for name in sides:
            if name != "bf16":
                ratio = row["ratio" if name == "fp8" else f"ratio_{name}"]
                parts.append(f"{LABELS[name]}/bf16 " + ("-" if ratio is None else f"{ratio:.2f}x"))
    return f"batch {row['batch']}: " + " | ".join(parts)


def run_child(command: list[str]) -> int:
    """Run one engine's child process (its output goes through to ours); its exit code."""
    return subprocess.run(command, env=child_env()).returncode


def compare_fp8(tokenizer: Path, folder: Path, shape: str, batches: list[int], runs: int, gpu_memory: float,
                json_path: Path | None = None, sides: list[str] | tuple[str, ...] = tuple(SIDES),
                all_cudagraph_sizes: bool = False) -> list[dict[str, Any]]:  # fmt: skip
    """Each side in order, each engine in its own child process (two vLLM engines in one process would share its
    distributed state and split its memory); the ratio rows, also written to the JSON."""
    folder = make_folder(folder, tokenizer, SHAPES[shape])
    header = device_line(shape=shape, compare="fp8")
    graphs = "vllm's" if all_cudagraph_sizes else cudagraph_sizes(batches)
    report = Report("engine_throughput_fp8.json", json_path, **header, prompt=PROMPT, new=NEW, runs=runs,
                    gpu_memory_utilization=gpu_memory, sampling="temperature 1, ignore_eos, log-probs",
                    sides={side: dict(zip(("quantization", "kv_cache_dtype"), SIDES[side], strict=True)) for side in sides},
                    cudagraph_sizes=graphs,
                    layout=f"one engine per child process, {', '.join(sides)} in turn, runs back to back")  # fmt: skip
    decode_rows, failed = [], {}
    with tempfile.TemporaryDirectory() as work:
        for side in sides:
            rows = Path(work, f"{side}.json")
            command = [sys.executable, __file__, "vllm", "--compare", "fp8", "--only", side, "--rows", str(rows),
                       "--tokenizer", str(tokenizer), "--folder", str(folder), "--shape", shape, "--runs", str(runs),
                       "--gpu-memory", str(gpu_memory), "--batches", *map(str, batches),
                       *(["--all-cudagraph-sizes"] if all_cudagraph_sizes else [])]  # fmt: skip
            code = run_child(command)
            if code != 0:
                failed[side] = code
            if rows.is_file():
                decode_rows += json.loads(rows.read_text())["rows"]
    report.update(decode=decode_rows, failed=failed)
    for row in ratio_rows(decode_rows, sides):
        report.row(row, ratio_line(row, sides))
    return report.rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine", choices=["vllm"], help="the engine measured (the hf static-cache path was removed)")
    parser.add_argument("--tokenizer", type=Path, required=True, help="folder with the Qwen2.5 tokenizer files")
    parser.add_argument("--folder", type=Path, default=Path("/tmp/physreason-7b-shape"))
    parser.add_argument("--runs", type=int, default=2, help="timed runs of each engine (raw: interleaved)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256], help="vllm: batch sizes to measure")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-vl-7b", help="language-model shape")
    parser.add_argument("--compare", choices=["raw", "fp8"], default="raw",
                        help="raw: our engine against raw vllm.LLM (bf16); fp8: our engine, bf16 against FP8 rollout weights")  # fmt: skip
    parser.add_argument("--gpu-memory", type=float, default=0.6, help="fp8: each engine's gpu_memory_utilization")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="fp8: the JSON's path (default: $OUT)")
    parser.add_argument("--sides", nargs="+", choices=list(SIDES), default=list(SIDES),
                        help="fp8: the engines compared, in this order (bf16: bf16 weights; fp8: block-FP8 weights; "
                        "fp8_kv: block-FP8 weights and engine.kv_cache_dtype = 'fp8')")  # fmt: skip
    parser.add_argument("--all-cudagraph-sizes", action="store_true",
                        help="fp8: capture vLLM's default CUDA graph sizes (slower start), not only the measured batches "
                        "and the powers of two below them")  # fmt: skip
    parser.add_argument("--only", choices=list(SIDES), default=None, help=argparse.SUPPRESS)  # a child's engine
    parser.add_argument("--rows", type=Path, default=None, help=argparse.SUPPRESS)  # where a child writes its rows
    args = parser.parse_args(argv)
    if args.runs < 1 or any(batch < 1 for batch in args.batches):
        parser.error("--runs and --batches: give whole numbers of at least 1")
    if not 0 < args.gpu_memory <= 1:
        parser.error(f"--gpu-memory {args.gpu_memory}: give a fraction of the GPU's memory in (0, 1]")
    if not any((args.tokenizer / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        parser.error(f"--tokenizer {args.tokenizer}: no tokenizer.json or tokenizer_config.json there; give the folder "
                     "of the Qwen2.5 tokenizer files")  # fmt: skip
    if len(set(args.sides)) != len(args.sides):
        parser.error(f"--sides {' '.join(args.sides)}: name each side once")
    if args.only is not None:
        decode_one(args.folder, args.only, args.batches, args.runs, args.gpu_memory, args.rows, args.all_cudagraph_sizes)
        return
    if not torch.cuda.is_available():
        raise SystemExit("engine_throughput.py runs vLLM engines on a CUDA GPU and this machine has none")
    if args.compare == "fp8":
        compare_fp8(args.tokenizer, args.folder, args.shape, args.batches, args.runs, args.gpu_memory, args.json,
                    args.sides, args.all_cudagraph_sizes)  # fmt: skip
        return
    device_line(shape=args.shape)
    folder = make_folder(args.folder, args.tokenizer, SHAPES[args.shape])
    bench_vllm(folder, args.batches, args.runs)


if __name__ == "__main__":
    main()
