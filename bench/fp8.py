"""FP8 against bf16: vLLM decode tokens/s with FP8 rollout weights, SFT tokens/s with float8 training, and the
float8 SFT loss curve beside bf16's (GPU; --tiny checks sft and curve on CPU).

What each measures and what a machine must have: bench/RESULTS.md ("How the scripts measure"). One JSON line a
measurement. GRPO step time: bench/grpo_step.py --quantization fp8.
    python bench/fp8.py decode --tokenizer DIR [--shape qwen3-vl-8b] [--batches 1 64 256]   (engine_throughput.py --compare fp8)
    python bench/fp8.py sft [--shape qwen3-vl-8b --layers 14] [-- --chunked-ce --ac-every 2]
    python bench/fp8.py sft --tiny --recipes rowwise -- --seq-len 32 --steps 1 --warmup 0    (CPU: checks the script)
    python bench/fp8.py curve [--steps 200 --recipe rowwise --out /tmp/physreason-fp8-curve]
    python bench/fp8.py curve --tiny --steps 5                                                 (CPU: checks the script)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.metadata
import importlib.util
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import comma_list, device_info, init_world  # noqa: E402 - bench/ is on sys.path first
from harness import emit as out  # noqa: E402

RECIPES = ("rowwise", "tensorwise")  # torchao's float8 recipes ([train.fp8] quant_recipe)
CURVE_WINDOW = 50  # steps at the end of the curves over which the mean |float8 - bf16| is taken


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


def require_float8_support(command: str, tiny: bool) -> None:
    """Exit with one line naming what is missing when this machine cannot run `command`'s float8 training (--tiny: CPU
    is fine)."""
    from physreason.models.float8 import MIN_CAPABILITY, TORCHAO_RANGE

    if importlib.util.find_spec("torchao") is None:
        raise SystemExit(f"fp8.py {command} needs torchao{TORCHAO_RANGE}: pip install 'physreason[fp8]' (or its wheel on "
                         "PYTHONPATH where no registry can be reached)")  # fmt: skip
    if not torch.cuda.is_available():
        if tiny:
            return  # torchao's float8 layers run on CPU: enough to check the script
        raise SystemExit(f"fp8.py {command} trains with float8 matmuls on a CUDA GPU of compute capability 8.9 or more "
                         "(H100, L40S) and this machine has none; --tiny checks the script on CPU")  # fmt: skip
    capability = torch.cuda.get_device_capability()
    if capability < MIN_CAPABILITY:
        raise SystemExit(f"fp8.py {command} needs float8 tensor cores (compute capability 8.9 or more), but "
                         f"{torch.cuda.get_device_name()} is {capability[0]}.{capability[1]}: run it on an H100 or L40S")  # fmt: skip


def bench_decode(args: argparse.Namespace) -> None:
    """bench/engine_throughput.py --compare fp8: the same engine with bf16 weights, FP8 rollout weights, and FP8 rollout
    weights with an FP8 KV cache, one after the other."""
    from engine_throughput import compare_fp8

    require_decode_support(args.tokenizer)
    compare_fp8(args.tokenizer, args.folder, args.shape, args.batches, args.runs, gpu_memory=0.6)


def bench_sft(args: argparse.Namespace, rest: list[str]) -> None:
    require_float8_support("sft", args.tiny)
    import torch.distributed as dist
    from sft_throughput import build_parser, measure, model_config, run_ours
    from torch.distributed.device_mesh import init_device_mesh

    parser = build_parser()
    layers = ["--layers", str(args.layers)] if args.layers else []
    base = parser.parse_args(["--shape", args.shape, *layers, *(["--tiny"] if args.tiny else []), *rest])
    device = init_world()
    mesh = init_device_mesh(device.type, (dist.get_world_size(), 1), mesh_dim_names=("dp", "tp"))
    config = model_config(parser, base)
    out(what="device", **device_info(device), shape=args.shape, layers=args.layers, options=rest)
    # every row compiles new blocks: let dynamo keep their compiled code rather than run them eagerly (as main does)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    import torch._inductor.config as inductor_config

    precision_casts = inductor_config.emulate_precision_casts  # the rowwise conversion sets it, for its own row only
    baseline = None
    for recipe in ("none", *args.recipes):
        row = copy.copy(base)
        row.float8 = recipe
        inductor_config.emulate_precision_casts = precision_casts
        result = measure(run_ours, config, row, device, mesh)
        if recipe == "none":
            baseline = result.get("tokens_per_s")
        ratio = result["tokens_per_s"] / baseline if baseline and "tokens_per_s" in result else None
        out(what="sft", float8=recipe, **{k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()},
            vs_bf16=round(ratio, 3) if ratio else None)
    dist.destroy_process_group()


def curve_recipe(args: argparse.Namespace) -> argparse.Namespace:
    """bench/intuitive_physics.py's recipe settings for the curve: its defaults, no tower pre-training, the curve's
    steps, batch, learning rate, warm-up, model scale and clip count (default: one pass over the clips, none twice)."""
    from physreason.data.synth.tasks import LETTER_TASK_NAMES
    from physreason.experiments import intuitive_physics

    clips = args.train_per_task or math.ceil(args.steps * args.batch / len(LETTER_TASK_NAMES))
    warmup = args.steps // 10 if args.warmup is None else args.warmup
    return intuitive_physics.parse_args([
        "--tower-steps", "0", "--sft-steps", str(args.steps), "--sft-batch", str(args.batch), "--sft-lr", str(args.lr),
        "--sft-warmup", str(warmup), "--train-per-task", str(clips), "--scale", str(args.scale), "--out", str(args.out),
        *(["--workers", str(args.workers)] if args.workers else []),
        *(["--loader-workers", "0"] if args.tiny else []),  # a few clips: spawning loader processes costs more
    ])  # fmt: skip


def curve_run(recipe: argparse.Namespace, model_dir: Path, seed: int, float8: str | None) -> dict:
    """One SFT run of the curve (bf16, or float8 with recipe `float8`) into its own folder under recipe.out; returns
    its folder, seconds and, when it diverged, the error (its metrics up to then stay in the folder)."""
    from physreason.errors import TrainingDiverged
    from physreason.experiments import intuitive_physics
    from physreason.models.float8 import emulated_float8_on_cpu
    from physreason.train.sft import run_sft

    name = "bf16" if float8 is None else f"float8-{float8}"
    cfg = intuitive_physics.stage_config(recipe, recipe.out, model_dir, seed)
    cfg.train.output_dir = str(recipe.out / f"sft-{name}")
    cfg.train.param_dtype = "bfloat16"  # the baseline the issue names; the recipe itself computes in fp32
    cfg.train.resume = False  # a fresh log each time: the bench owns this folder
    cfg.train.ckpt.enable_checkpoint = False  # the curve is the product; no checkpoint to refuse a rerun over
    cfg.train.fp8.enable_fp8 = float8 is not None
    cfg.train.fp8.quant_recipe = float8 or "rowwise"
    # the curve checks float8's numerics: its small model's layers convert although float8 cannot speed them up
    cfg.train.fp8.skip_small_linears = False
    cpu = not torch.cuda.is_available()
    start = time.perf_counter()
    error = None
    try:
        with emulated_float8_on_cpu() if cpu else contextlib.nullcontext():
            run_sft(cfg)
    except TrainingDiverged as diverged:
        error = str(diverged)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    matmuls = "bf16" if float8 is None else "float8, emulated on CPU" if cpu else "float8 tensor cores"
    return {"run": name, "folder": cfg.train.output_dir, "matmuls": matmuls, "s": round(time.perf_counter() - start, 1),
            "error": error}  # fmt: skip


def compare_losses(bf16: dict[int, float], float8: dict[int, float], window: int = CURVE_WINDOW) -> dict:
    """Per-step losses of both runs compared: each run's last logged step and loss and its mean over the last `window`
    steps, and over the steps both logged, the mean |float8 - bf16| over the last `window` and the largest one with its
    step. Raises SystemExit when the runs share no step."""
    shared = sorted(set(bf16) & set(float8))
    if not shared:
        raise SystemExit("the bf16 and float8 runs logged no common step: nothing to compare (see their metrics.jsonl)")
    differences = {step: abs(float8[step] - bf16[step]) for step in shared}
    last = shared[-window:]
    largest = max(shared, key=differences.__getitem__)

    def run_summary(losses: dict[int, float]) -> dict:
        steps = sorted(losses)
        tail = steps[-window:]
        return {"steps": len(steps), "final_step": steps[-1], "final_loss": losses[steps[-1]],
                "mean_loss_last": sum(losses[s] for s in tail) / len(tail)}  # fmt: skip

    return {
        "window": len(last),
        "bf16": run_summary(bf16),
        "float8": run_summary(float8),
        "shared_steps": len(shared),
        "mean_abs_diff_last": sum(differences[s] for s in last) / len(last),
        "max_abs_diff": differences[largest],
        "max_abs_diff_step": largest,
    }


def curve_markdown(header: list[str], runs: list[dict], summary: dict, recipe_name: str) -> str:
    """The curve's summary as markdown: the run's header lines, one row per run, the differences."""
    window = summary["window"]
    lines = [*header, "", f"| run | matmuls | steps | final loss | mean loss, last {window} steps | s |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for run, key in zip(runs, ("bf16", "float8"), strict=True):
        row = summary[key]
        stopped = f" (diverged after step {row['final_step']})" if run["error"] else ""
        lines.append(f"| {run['run']}{stopped} | {run['matmuls']} | {row['steps']} | {row['final_loss']:.4f} | "
                     f"{row['mean_loss_last']:.4f} | {run['s']} |")  # fmt: skip
    lines += ["", f"float8 ({recipe_name}) - bf16 over the {summary['shared_steps']} steps both logged: mean |difference| "
              f"{summary['mean_abs_diff_last']:.4f} over the last {window}, largest {summary['max_abs_diff']:.4f} at "
              f"step {summary['max_abs_diff_step']}."]  # fmt: skip
    return "\n".join(lines) + "\n"


def curve_figure(curves: dict[str, dict[str, list[tuple[int, float]]]], title: str) -> Any:
    """Both runs' loss (and learning rate) in one matplotlib Figure, drawn by physreason.plots: every step a line."""
    from physreason.plots import curves_figure

    metrics = {f"{run}/{key}": points[f"train/{key}"] for run, points in curves.items() for key in ("loss", "lr")}
    figure, _ = curves_figure(metrics, title)
    return figure


def bench_curve(args: argparse.Namespace) -> dict:
    """Run the bf16 and float8 SFT of the curve, then draw and summarise them (bench/RESULTS.md says how)."""
    require_float8_support("curve", args.tiny)
    from physreason.data.synth.records import letter_sft_records
    from physreason.data.synth.tasks import LETTER_TASK_NAMES
    from physreason.experiments import intuitive_physics
    from physreason.plots import metrics_file, read_metrics

    args.out = args.out.resolve()
    recipe = curve_recipe(args)
    device = intuitive_physics.device_name()
    out(what="device", **device_info(), torchao=importlib.metadata.version("torchao"),
        steps=args.steps, batch=args.batch, recipe=args.recipe, scale=args.scale, clips_per_task=recipe.train_per_task)  # fmt: skip
    sets = [("train", "train", 0, recipe.train_per_task, LETTER_TASK_NAMES)]
    timings = intuitive_physics.generate_clip_sets(args.out, sets, recipe)
    letter_sft_records(args.out / "data" / "train", args.out / "data" / "train" / "sft.jsonl")
    model_dir = intuitive_physics.build_model(recipe, args.out, args.seed)
    runs = []
    for float8 in (None, args.recipe):
        runs.append(curve_run(recipe, model_dir, args.seed, float8))
        out(what="curve_run", **runs[-1])
    curves = {run["run"]: read_metrics(metrics_file(run["folder"])) for run in runs}
    losses = [dict(points["train/loss"]) for points in curves.values()]
    summary = compare_losses(*losses)
    header = intuitive_physics.run_header(device, [args.seed])
    title = (f"intuitive-physics SFT, {args.steps} steps of {args.batch}, seed {args.seed}: bf16 vs float8 {args.recipe} "
             f"({device})")  # fmt: skip
    png = args.out / "fp8_curve.png"
    curve_figure(curves, title).savefig(png, dpi=120)
    payload = {"device": device, "header": header, "args": {k: str(v) for k, v in vars(args).items()},
               "runs": runs, "summary": summary, "losses": {run: dict(points["train/loss"]) for run, points in curves.items()},
               "data_timings": timings, "png": str(png)}  # fmt: skip
    markdown = curve_markdown(header, runs, summary, args.recipe)
    intuitive_physics.write_results(args.out / "fp8_curve", payload, markdown, out_name="fp8_curve")
    if os.environ.get("OUT"):
        shutil.copy(png, Path(os.environ["OUT"], png.name))
    out(what="curve", png=str(png), **{k: round(v, 4) if isinstance(v, float) else v for k, v in summary.items()})
    print(markdown, flush=True)
    return payload


def main(argv: list[str] | None = None) -> None:
    """Parse the command line and run the decode, SFT or loss-curve measurement (bench/RESULTS.md says how)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    decode = commands.add_parser("decode", help="vLLM decode tokens/s, FP8 rollout weights vs bf16")
    decode.add_argument("--tokenizer", type=Path, required=True, help="folder with the Qwen2.5 tokenizer files")
    decode.add_argument("--folder", type=Path, default=Path("/tmp/physreason-fp8-shape"))
    decode.add_argument("--shape", choices=["qwen2.5-vl-7b", "qwen3-vl-8b"], default="qwen2.5-vl-7b")
    decode.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    decode.add_argument("--runs", type=int, default=2, help="timed runs per batch size")
    sft = commands.add_parser("sft", help="SFT tokens/s, float8 training vs bf16 (options after -- go to sft_throughput)")
    sft.add_argument("--shape", choices=["qwen2.5-vl-3b", "qwen3-vl-8b"], default="qwen2.5-vl-3b")
    sft.add_argument("--layers", type=int, default=None, help="decoder layers instead of the shape's (fits one GPU)")
    sft.add_argument("--tiny", action="store_true", help="tiny shapes, to check the script on CPU")
    sft.add_argument("--recipes", default="rowwise,tensorwise", help="float8 recipes measured after bf16, comma-separated")
    curve = commands.add_parser("curve", help="intuitive-physics SFT loss curve, float8 beside bf16, as a PNG and summary")
    curve.add_argument("--steps", type=int, default=200, help="SFT steps of each run")
    curve.add_argument("--recipe", choices=RECIPES, default="rowwise", help="the float8 run's [train.fp8] quant_recipe")
    curve.add_argument("--seed", type=int, default=0, help="initialisation seed (weights, data order), as intuitive_physics --seeds")
    curve.add_argument("--batch", type=int, default=None, help="samples per step (default 16, the recipe's; --tiny 2)")
    curve.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (the recipe's)")
    curve.add_argument("--warmup", type=int, default=None, help="warm-up steps (default a tenth of --steps)")
    curve.add_argument("--scale", type=int, default=None, help="from-scratch model size (default 2, the recipe's 3.8M; --tiny 1)")
    curve.add_argument("--train-per-task", type=int, default=None,
                       help="SFT clips per task (default: steps x batch / 3, one pass with no clip seen twice)")
    curve.add_argument("--workers", type=int, default=None, help="clip generation and data-loader processes")
    curve.add_argument("--out", type=Path, default=Path("/tmp/physreason-fp8-curve"), help="clips, model, runs, results")
    curve.add_argument("--tiny", action="store_true", help="smallest model and batch, to check the script on CPU")
    args, rest = parser.parse_known_args(argv)
    rest = [r for r in rest if r != "--"]
    if args.command == "curve":
        if rest:
            parser.error(f"unknown options for curve: {rest}")
        if args.steps < 1:
            parser.error("--steps: give at least 1")
        args.batch = args.batch or (2 if args.tiny else 16)
        args.scale = args.scale or (1 if args.tiny else 2)
        bench_curve(args)
    elif args.command == "decode":
        if rest:
            parser.error(f"unknown options for decode: {rest}")
        bench_decode(args)
    else:
        args.recipes = comma_list(parser, "--recipes", args.recipes, RECIPES)
        bench_sft(args, rest)


if __name__ == "__main__":
    from physreason.errors import Interrupted

    try:
        main()
    except Interrupted as stopped:  # Ctrl-C or SIGTERM: the SFT run finished its step and stopped; exit as the CLI does
        print(stopped, file=sys.stderr)
        sys.exit(stopped.exit_code)
