"""FP8 against bf16: vLLM decode tokens/s with FP8 rollout weights, and SFT tokens/s with float8 training (GPU).

decode: the language-model shape (--shape) with random weights, pushed by the policy's path (train/weight_sync:
        FP8 blocks quantized at the push for rollout.quantization = 'fp8', bf16 otherwise; the same seeded weights
        on both sides), prompts of 512 tokens, 256 new tokens at temperature 1 with sampled-token log-probs (as
        rollouts ask), at --batches. Each engine runs in its own child process (a vLLM engine does not free its
        GPU memory in-process). Also times each engine's weight push.
sft:    sft_throughput.py's trainer step (FSDP2, fp32 masters, bf16 compute) on --shape, bf16 and then each float8
        recipe ([train.fp8] quant_recipe) in this one process; extra options go to sft_throughput's parser.
        --recipes picks the float8 rows (default both).
Prints one JSON line per measurement. GRPO step time: bench/grpo_step.py --quantization fp8.
What a machine cannot run is refused before any model is built, with one line that says what is missing: decode needs
a CUDA GPU, vLLM and a tokenizer folder; sft needs torchao and a GPU of compute capability 8.9 or more (H100, L40S),
except with --tiny, whose float8 rows torchao runs (slowly) on CPU to check the script.

    python bench/fp8.py decode --tokenizer DIR [--shape qwen3-vl-8b] [--batches 1 64 256]
    python bench/fp8.py sft [--shape qwen3-vl-8b --layers 14] [-- --chunked-ce --ac-every 2]
    python bench/fp8.py sft --tiny --recipes rowwise -- --seq-len 32 --steps 1 --warmup 0    (CPU: checks the script)
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
RECIPES = ("rowwise", "tensorwise")  # torchao's float8 recipes ([train.fp8] quant_recipe)


def out(**fields) -> None:
    print(json.dumps(fields), flush=True)


def require_decode_support(tokenizer: Path) -> None:
    """Exit with one line naming what is missing when this machine cannot run the decode measurement."""
    if not any((tokenizer / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise SystemExit(f"--tokenizer {tokenizer}: no tokenizer.json or tokenizer_config.json there; give the folder "
                         "of the Qwen2.5 tokenizer files")  # fmt: skip
    if not torch.cuda.is_available():
        raise SystemExit("fp8.py decode runs vLLM engines on a CUDA GPU and this machine has none; "
                         "fp8.py sft --tiny checks the SFT part on CPU")  # fmt: skip
    if importlib.util.find_spec("vllm") is None:
        raise SystemExit("fp8.py decode needs vLLM (0.26 or later) importable: install it, or put its wheels on "
                         "PYTHONPATH, then run again")  # fmt: skip


def require_sft_support(tiny: bool) -> None:
    """Exit with one line naming what is missing when this machine cannot run the float8 rows (--tiny: CPU is fine)."""
    from physreason.models.float8 import MIN_CAPABILITY, TORCHAO_RANGE

    if importlib.util.find_spec("torchao") is None:
        raise SystemExit(f"fp8.py sft needs torchao{TORCHAO_RANGE}: pip install 'physreason[fp8]' (or its wheel on "
                         "PYTHONPATH where no registry can be reached)")  # fmt: skip
    if not torch.cuda.is_available():
        if tiny:
            return  # torchao's float8 layers run on CPU, slowly: enough to check the script
        raise SystemExit("fp8.py sft measures float8 matmuls on a CUDA GPU of compute capability 8.9 or more (H100, "
                         "L40S) and this machine has none; --tiny checks the script on CPU")  # fmt: skip
    capability = torch.cuda.get_device_capability()
    if capability < MIN_CAPABILITY:
        raise SystemExit(f"fp8.py sft needs float8 tensor cores (compute capability 8.9 or more), but "
                         f"{torch.cuda.get_device_name()} is {capability[0]}.{capability[1]}: run it on an H100 or L40S")  # fmt: skip


def random_weights(folder: Path, device: str, seed: int = 0):
    """(name, bf16 tensor) of the folder's model, N(0, 0.02) from a seeded generator, made one at a time on `device`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    generator = torch.Generator(device).manual_seed(seed)
    for name, parameter in meta.named_parameters():
        tensor = torch.empty(parameter.shape, dtype=torch.bfloat16, device=device)
        if name.endswith("norm.weight"):
            yield name, tensor.fill_(1.0)
        else:
            yield name, tensor.normal_(0.0, 0.02, generator=generator)


def decode_one(folder: Path, quantization: str, batches: list[int], runs: int) -> None:
    """One engine (bf16 or FP8 rollout weights): push the seeded weights, then time generate at each batch."""
    from engine_throughput import NEW, PROMPT, make_requests

    from physreason.config import EngineConfig, ModelConfig, SamplingConfig
    from physreason.engines.vllm import VLLMEngine
    from physreason.models.fp8 import fp8_rollout_weights

    start = time.perf_counter()
    extra = {"quantization": quantization} if quantization != "none" else {"load_format": "dummy"}
    engine = VLLMEngine(
        ModelConfig(model_name_or_path=str(folder), model_max_length=4096), EngineConfig(gpu_memory_utilization=0.6), **extra
    )
    out(what="engine_start", quantization=quantization, s=round(time.perf_counter() - start, 1))
    for attempt in range(2):
        weights = random_weights(folder, "cuda")
        torch.cuda.synchronize()
        t = time.perf_counter()
        engine.update_weights(fp8_rollout_weights(weights) if quantization == "fp8" else weights)
        torch.cuda.synchronize()
        out(what="push", quantization=quantization, attempt=attempt, s=round(time.perf_counter() - t, 3))
    sampling = SamplingConfig(temperature=1.0, top_p=1.0, repetition_penalty=1.0, max_tokens=NEW, seed=0)
    engine.generate(make_requests(engine.tokenizer, 2, seed=99), sampling)  # warm-up
    for batch in batches:
        requests = make_requests(engine.tokenizer, batch, seed=batch)
        for run in range(runs):
            engine.llm.reset_prefix_cache()
            torch.cuda.synchronize()
            t = time.perf_counter()
            results = engine.generate(requests, sampling, logprobs=True)
            dt = time.perf_counter() - t
            tokens = sum(len(r.completions[0].token_ids) for r in results)
            out(what="decode", quantization=quantization, batch=batch, run=run, prompt=PROMPT, new=NEW, tokens=tokens,
                s=round(dt, 2), tok_per_s=round(tokens / dt, 1))


def bench_decode(args: argparse.Namespace) -> None:
    from engine_throughput import make_folder
    from shapes import DECODER_SHAPES

    require_decode_support(args.tokenizer)
    out(what="device", device=torch.cuda.get_device_name(), torch=torch.__version__, shape=args.shape)
    folder = make_folder(args.folder, args.tokenizer, DECODER_SHAPES[args.shape])
    for quantization in ("none", "fp8"):
        command = [sys.executable, __file__, "decode", "--tokenizer", str(args.tokenizer), "--folder", str(folder),
                   "--shape", args.shape, "--runs", str(args.runs), "--only", quantization,
                   "--batches", *map(str, args.batches)]  # fmt: skip
        subprocess.run(command, check=True)


def bench_sft(args: argparse.Namespace, rest: list[str]) -> None:
    require_sft_support(args.tiny)
    import torch.distributed as dist
    from sft_throughput import build_parser, init_distributed, measure, model_config, run_ours
    from torch.distributed.device_mesh import init_device_mesh

    parser = build_parser()
    layers = ["--layers", str(args.layers)] if args.layers else []
    base = parser.parse_args(["--shape", args.shape, *layers, *(["--tiny"] if args.tiny else []), *rest])
    device = init_distributed(1)
    mesh = init_device_mesh(device.type, (dist.get_world_size(), 1), mesh_dim_names=("dp", "tp"))
    config = model_config(parser, base)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    out(what="device", device=name, torch=torch.__version__, shape=args.shape, layers=args.layers, options=rest)
    baseline = None
    for recipe in ("none", *args.recipes):
        row = copy.copy(base)
        row.float8 = recipe
        result = measure(run_ours, config, row, device, mesh)
        if recipe == "none":
            baseline = result.get("tokens_per_s")
        ratio = result["tokens_per_s"] / baseline if baseline and "tokens_per_s" in result else None
        out(what="sft", float8=recipe, **{k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()},
            vs_bf16=round(ratio, 3) if ratio else None)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    """Parse the command line and run the decode or the SFT measurement (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    decode = commands.add_parser("decode", help="vLLM decode tokens/s, FP8 rollout weights vs bf16")
    decode.add_argument("--tokenizer", type=Path, required=True, help="folder with the Qwen2.5 tokenizer files")
    decode.add_argument("--folder", type=Path, default=Path("/tmp/physreason-fp8-shape"))
    decode.add_argument("--shape", choices=["qwen2.5-vl-7b", "qwen3-vl-8b"], default="qwen2.5-vl-7b")
    decode.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    decode.add_argument("--runs", type=int, default=2, help="timed runs per batch size")
    decode.add_argument("--only", choices=["none", "fp8"], default=None, help=argparse.SUPPRESS)  # the child's engine
    sft = commands.add_parser("sft", help="SFT tokens/s, float8 training vs bf16 (options after -- go to sft_throughput)")
    sft.add_argument("--shape", choices=["qwen2.5-vl-3b", "qwen3-vl-8b"], default="qwen2.5-vl-3b")
    sft.add_argument("--layers", type=int, default=None, help="decoder layers instead of the shape's (fits one GPU)")
    sft.add_argument("--tiny", action="store_true", help="tiny shapes, to check the script on CPU")
    sft.add_argument("--recipes", default="rowwise,tensorwise", help="float8 recipes measured after bf16, comma-separated")
    args, rest = parser.parse_known_args(argv)
    rest = [r for r in rest if r != "--"]
    if args.command == "decode":
        if rest:
            parser.error(f"unknown options for decode: {rest}")
        if args.only is None:
            bench_decode(args)
        else:
            decode_one(args.folder, args.only, args.batches, args.runs)
    else:
        args.recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
        if not args.recipes or any(r not in RECIPES for r in args.recipes):
            parser.error(f"--recipes: give a comma-separated list of {', '.join(RECIPES)}")
        bench_sft(args, rest)


if __name__ == "__main__":
    main()
