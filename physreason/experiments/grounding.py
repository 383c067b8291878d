"""Grounding and temporal localization on a GPU: SFT of a from-scratch model, then GRPO with the IoU reward against
its SFT control (issue 31, item 4).

The JSON-answer analogue of physreason.experiments.intuitive_physics, sharing its stages (physreason.experiments.common:
model, tower pre-training, SFT settings, GRPO settings, the control, seeds and their spread). Two `data synth` tasks
answer in Cosmos-Reason2's JSON: `grounding` (a named body's `box_2d` or `point_2d` at a named time, 0-1000 per
axis) and `temporal_localization` (`start` / `end` of a named event, `mm:ss.ff`), docs/grounding.md. Three disjoint
clip sets per task: SFT clips (train split, seed 0), RL prompts (train split, seed 1: clips SFT never saw) and held-out
test clips (test split).

Per initialisation seed (`--seeds 1,2,3`):
1. the random model of `--family` (Qwen2.5-VL as Cosmos-Reason1, Qwen3-VL as Cosmos-Reason2), `--scale`;
2. optionally (`--tower-steps N`) its vision tower pre-trained as in the letter experiment, on `--tower-clips-per-task`
   clips of each letter task (the from-scratch stand-in for a pre-trained encoder; off by default: the letter
   tower is trained for what happens over time, not where, so whether it helps localization is what a run tells;
   its head sees the tokens' mean per temporal patch, `--tower-head time`, where the letter recipe's sees every
   token);
3. SFT on the JSON answers of the SFT clips (answer only, the prompt evaluation and GRPO send);
4. from that SFT export, two arms: GRPO on the RL prompts with the IoU reward (`localization`: box IoU, point in
   box or temporal IoU, plus `--json-format-weight` x `json_format`; `--grpo-n` completions per prompt at
   temperature `--grpo-temperature`), and the control: SFT continued on the same RL clips' answers with GRPO's
   prompts per step, steps and learning rate;
5. evaluation of every stage on the test clips (greedy): per clip the IoU, so mean IoU and accuracy at IoU 0.5
   with their standard errors over clips, for box questions, point questions (IoU is 1 inside the body's box) and
   time spans apart; and GRPO against the control clip by clip (paired: mean difference, its standard error and a
   two-sided sign-flip permutation p-value), per seed and pooled over seeds (each clip's difference averaged).

The levers the issue names, each selectable (bench/RESULTS.md says what they gave when run):
- SFT stopped early: `--sft-steps 300` (its folders carry the step count);
- fewer SFT labels than RL prompts: `--train-per-task 250 --rl-per-task 500` (SFT trains on the answers of
  --train-per-task clips per task, GRPO asks --rl-per-task other clips; counts other than the recipe's are in the
  folder names). Runs that differ in clip counts and run side by side need their own --out: a clip folder's index
  files hold the first N clips of the last run that wrote them;
- reward shaping: `--iou-hit-weight W --iou-hit-threshold T` (grpo.reward_options of the `localization` reward:
  (1 - W) x IoU + W x [IoU >= T]; 0 the continuous IoU, 1 the thresholded hit, between a mix);
- more completions per prompt: `--grpo-n 16`; dynamic sampling: `--grpo-dynamic-sampling` (up to 8 prompt draws
  per step when every completion of a group scores the same: a step can take several times as long);
- GRPO's learning rate: the variant key `grpo-lr` (that variant's alone; `--grpo-lr` sets the control's and the
  variants' default);
- a KL term: `--kl-beta 0.04` or the variant key `kl-beta` (grpo.kl_beta: beta x the k3 KL to the reference, the SFT
  export the variant starts from, grpo.reference_model_path; 0, the recipe, loads no reference).
- FP8 rollouts (issue 47, item 3): `--rollout-engine vllm --variants grpo grpo-fp8:rollout-quantization=fp8`: every
  variant rolls out on vLLM in bf16 beside the policy (`--rollout-gpu-memory`, default 0.2 of the GPU; evaluations
  stay on the hf engine), the fp8 one on block-FP8 weights with the truncated importance-sampling correction; the
  reward curves ("GRPO mean reward") and the held-out IoUs over seeds say whether FP8 rollouts learn as bf16 ones do.
  Needs vLLM, a CUDA GPU for the fp8 arm, and an even --scale (128-row blocks; checked before any stage runs).
`--variants` runs several GRPO settings from each seed's one SFT export, each against the one control, in one table
(a row and a paired test per variant; p-values also Holm-adjusted over the table's tests):
`--variants grpo grpo-mix:iou-hit-weight=0.5 grpo-n16:grpo-n=16 grpo-lr1e-5:grpo-lr=1e-5 grpo-kl:kl-beta=0.04`.
Each variant has its own run folder, `<name><settings><suffix>`: <settings> tags its GRPO settings other than the
recipe's (`-hit0.5`, `-n16`, `-lr1e-05`, `-kl0.04`, ...; none for the recipe's), so a variant whose settings change
gets a new folder and never resumes an old run; the control's folder carries `-lr<x>` when --grpo-lr is not the
recipe's. A folder that holds a run of other settings anyway stops the bench.
Stages are resumable as in the letter experiment: a rerun with the same --out reuses clips, finished exports and
evaluations, and continues an interrupted SFT or GRPO from its last checkpoint (`--ckpt-every`).
Prints and writes the table as markdown and JSON to <out>/grounding<variant>.{md,json} and, when OUT is set, to
$OUT/grounding.{md,json}, with the GPU's name, the date, the command, the clip counts and each variant's settings.
Run: physreason experiment grounding --seeds 1,2,3
CPU check: physreason experiment grounding --train-per-task 4 --rl-per-task 4 --test-per-task 2 --sft-steps 2 \
    --sft-batch 2 --grpo-steps 1 --grpo-prompts 2 --grpo-n 2 --scale 1 --max-tokens 8 --ckpt-every 1 --workers 1 \
    --variants grpo grpo-hit:iou-hit-weight=1

Next GPU slot (one call of at most 10 minutes; not run yet). The image lacks PyAV, pydantic, tomli-w and a
transformers >= 5.18: carry them as wheels in `.whl` (device README; earlier runs carried transformers 5.24.0, PyAV
19.0.2, pydantic 2.12.5 with pydantic-core, annotated-types and typing-inspection) and start with
`python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
&& export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit;`. Then, on one GPU, two seeds side by side (as the
letter bench's eighth session ran three), SFT stopped early, two variants (plain IoU; half IoU, half hit@0.5),
GRPO and the control 30 steps:
    A="--train-per-task 1000 --rl-per-task 500 --test-per-task 150 --sft-steps 300 --grpo-steps 30 \
       --ckpt-every 1000 --out /tmp/g --variants grpo grpo-mix:iou-hit-weight=0.5"
    python3 -m physreason experiment grounding $A --workers 16 --stop-after data > $OUT/log0 2>&1
    for s in 1 2; do OUT= PHYSREASON_HOST_PROCESSES=2 timeout 540 python3 -m physreason experiment grounding $A --workers 7 \
        --seeds $s > $OUT/log$s 2>&1 & done
    wait; python3 -m physreason experiment grounding --combine /tmp/g/qwen2_5_vl/grounding-*-seeds?.json > $OUT/logc 2>&1
    cp /tmp/g/qwen2_5_vl/grounding-combined.* $OUT/
(`OUT=` keeps the seeds from writing the same $OUT/grounding.json; PHYSREASON_HOST_PROCESSES=2 gives each seed half the
host's CPU threads (physreason/cpu.py: seeds one a GPU under CUDA_VISIBLE_DEVICES get theirs without it); the combined
table holds each seed's paired tests and its JSON every seed's per-clip IoUs.) Estimate from the 2026-11-25 run on H200, one seed alone on its GPU with
12 workers (SFT 800 steps 130 s, GRPO 50 steps 168 s, control 50 steps 75 s, evaluations 9-20 s, clips 16 s): per
seed 15 (untrained eval) + 60 (SFT 300) + 15 + 2 x (105 (GRPO 30) + 15) + 50 (control 30) + 15 = 395 s alone. Two
side by side on 16 cores and one GPU share both; that slowdown is not measured for this bench: at 1.3x, 515 s, plus
about 30 s of clips and 10 s of installs, 9 minutes. A seed past 540 s is stopped and leaves no table: if the first
call overruns, or on an H100 (slower here, not measured), drop the second variant or use --grpo-steps 20.
With a kind of four GPUs (nvidia-h100-x4, 64 cores), four seeds at the shortened run's 50 GRPO steps, each alone on
its GPU as measured, same data, combine and copy lines:
    for s in 1 2 3 4; do CUDA_VISIBLE_DEVICES=$((s - 1)) OUT= timeout 560 python3 -m physreason experiment grounding \
        ${A/--grpo-steps 30/--grpo-steps 40} --workers 14 --seeds $s > $OUT/log$s 2>&1 & done
15 + 60 + 15 + 2 x (140 + 15) + 65 + 15 = 480 s per seed, plus clips and installs: about 8.5 minutes on H200.
Letter tasks, GRPO from an SFT stopped early against its control: physreason experiment intuitive-physics --sft-steps 300
--sft-control (its tower pre-training alone takes minutes: bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from physreason.cpu import apply_cpu_share
from physreason.experiments.common import (  # the stages the letter experiment shares
    Recipe,
    add_recipe_arguments,
    build_model,
    combined_runs,
    device_name,
    finished_export,
    generate_clip_sets,
    grpo_stage_config,
    logged,
    results_name,
    run_header,
    seed_stats,
    seed_tag,
    sft_control,
    sft_stage,
    spread,
    spread_text,
    stage_config,
    tower_stage,
    variant_suffix,
    window_means,
    write_results,
)

KINDS = ("box_2d", "point_2d", "time_span")  # what a question asks for: the table's task columns
KIND_LABELS = {"box_2d": "grounding, box", "point_2d": "grounding, point", "time_span": "temporal localization"}
IOU_HIT = 0.5  # physreason.rewards.localization.IOU_HIT: accuracy at IoU 0.5, R@0.5
PERMUTATIONS = 20000


def parse_args(argv: list[str] | None = None, prog: str | None = None) -> argparse.Namespace:
    """The experiment's knobs; the defaults are the recipe. `prog` names the command in usage lines and errors
    (default: the script's name)."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    args.option_order = "fixed"  # the letter clips of the tower pre-training (a JSON answer has no options)
    if not math.isfinite(args.kl_beta) or args.kl_beta < 0:
        parser.error(f"--kl-beta {args.kl_beta:g}: give a weight >= 0 (0: no KL term, the recipe)")
    if not 0 < args.rollout_gpu_memory < 1:
        parser.error(f"--rollout-gpu-memory {args.rollout_gpu_memory:g}: give a share of the GPU in (0, 1), e.g. 0.2")
    if args.rollout_kv_cache_gib is not None and not (math.isfinite(args.rollout_kv_cache_gib) and args.rollout_kv_cache_gib > 0):
        parser.error(f"--rollout-kv-cache-gib {args.rollout_kv_cache_gib:g}: give a size in GiB > 0, e.g. 2")
    args.variants = parse_variants(args.variants or [DEFAULT_VARIANT], args, parser)
    fp8 = {name: run for name, over in args.variants.items() if (run := variant_args(args, over)).rollout_quantization == "fp8"}
    if fp8 and args.rollout_engine != "vllm":
        parser.error(
            f"FP8 rollouts ({', '.join(fp8)}) run on vLLM: add --rollout-engine vllm (every variant then rolls out "
            "on vLLM, so the bf16 runs compare with the FP8 ones on the same engine)"
        )
    if fp8:
        check_fp8_widths(args.scale, parser)
    for name, run in fp8.items():
        if run.grpo_temperature != 1.0:
            parser.error(
                f"{name}: FP8 rollouts weight the loss by truncated importance ratios, which need the rollouts "
                f"sampled at temperature 1 (grpo-temperature is {run.grpo_temperature:g})"
            )
    return args


def check_fp8_widths(scale: int, parser: argparse.ArgumentParser) -> None:
    """parser.error unless the model of `scale` holds vLLM's 128 x 128 FP8 blocks (checked before any stage runs:
    the engine would refuse it only when GRPO starts, after SFT)."""
    from types import SimpleNamespace

    from physreason.models.fp8 import fp8_block_misfits
    from physreason.models.tiny import text_widths

    misfits = fp8_block_misfits(SimpleNamespace(**text_widths(scale)))
    if misfits:
        fits = [s for s in range(1, 9) if not fp8_block_misfits(SimpleNamespace(**text_widths(s)))]
        parser.error(
            f"FP8 rollouts need the model's fused layers in 128-row blocks, but at --scale {scale} "
            f"{'; '.join(misfits)}: use a --scale that fits ({', '.join(map(str, fits))}, ...)"
        )


def recipe_defaults() -> dict[str, Any]:
    """The recipe's value of each GRPO setting a variant may change (its argument's default), by argument name."""
    parser = build_parser()
    return {dest: parser.get_default(dest) for dest in (*(dest for dest, _ in VARIANT_KEYS.values()), *SETTING_TAGS)}


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The experiment's argument parser (see parse_args)."""
    from physreason.data.synth.tasks import JSON_TASK_NAMES

    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    add_recipe_arguments(parser, "grounding", Path("/tmp/physreason-grounding"), Recipe())
    parser.add_argument("--tasks", nargs="+", choices=JSON_TASK_NAMES, default=list(JSON_TASK_NAMES))
    parser.add_argument("--test-per-task", type=int, default=300, help="held-out clips per task")
    parser.add_argument(
        "--max-pixels",
        type=int,
        default=37632,
        help="largest frame area fed to the model (168x224 from the 256x192 clips: 6x8 tokens per frame pair, so "
        "a box can be told to about a sixth of the frame from the tokens' places alone)",
    )
    parser.add_argument("--max-tokens", type=int, default=128, help="longest answer, in evaluation and rollouts")
    parser.add_argument(
        "--tower-steps", type=int, default=0, help="pre-train the tower on letter clips first (0: no pre-training)"
    )
    parser.add_argument("--tower-clips-per-task", type=int, default=1000, help="letter clips per task for the tower")
    parser.add_argument(
        "--sft-freeze-tower",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="keep the vision tower fixed in SFT, GRPO and the control",
    )
    parser.add_argument("--grpo-prompts", type=int, default=16, help="prompts per GRPO step (and control batch)")
    parser.add_argument("--grpo-temperature", type=float, default=1.0)
    parser.add_argument("--json-format-weight", type=float, default=0.1, help="weight of the json_format reward")
    parser.add_argument(
        "--iou-hit-weight",
        type=float,
        default=0.0,
        help="reward shaping (grpo.reward_options.localization.hit_weight): the IoU reward is (1 - W) x IoU + W x "
        "[IoU >= --iou-hit-threshold]; 0 the continuous IoU, 1 the thresholded hit, between a mix",
    )
    parser.add_argument(
        "--iou-hit-threshold", type=float, default=IOU_HIT, help="IoU from which the hit bonus is paid (see above)"
    )
    parser.add_argument(
        "--kl-beta",
        type=float,
        default=0.0,
        help="GRPO's k3 KL penalty to the reference model, the SFT export GRPO starts from (grpo.kl_beta; 0: no KL "
        "term and no reference model loaded)",
    )
    parser.add_argument(
        "--rollout-engine",
        choices=("hf", "vllm"),
        default="hf",
        help="GRPO's rollout engine for every variant (engine.backend; evaluations stay on the hf engine): vllm "
        "runs the rollouts in bf16 beside the policy on its GPU (--rollout-gpu-memory), as FP8 rollouts need",
    )
    parser.add_argument(
        "--rollout-gpu-memory",
        type=float,
        default=0.2,
        help="with --rollout-engine vllm: the share of the GPU vLLM may take (engine.gpu_memory_utilization)",
    )
    parser.add_argument(
        "--rollout-kv-cache-gib",
        type=float,
        default=None,
        help="with --rollout-engine vllm: a fixed KV cache of this many GiB (engine.kv_cache_memory_gib), so seeds "
        "side by side on one GPU do not upset each other's vLLM memory profiling; default: vLLM sizes it",
    )
    parser.add_argument(
        "--rollout-quantization",
        choices=ROLLOUT_QUANTIZATIONS,
        default="none",
        help="rollout.quantization: fp8 rolls out on block-FP8 weights with the truncated importance-sampling "
        "correction (needs --rollout-engine vllm and a CUDA GPU); the variant key rollout-quantization sets it per run",
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        metavar="NAME[:KEY=VALUE,...]",
        help="several GRPO runs from each seed's one SFT export, each against the same control, in one table: e.g. "
        "`grpo grpo-hit:iou-hit-weight=1 grpo-n16:grpo-n=16 grpo-lr1e-5:grpo-lr=1e-5 grpo-kl:kl-beta=0.04`. A name "
        "starts with grpo (its results label, and with its settings other than the recipe's its run folder); the "
        f"keys override this command's settings of that run: {', '.join(VARIANT_KEYS)} (grpo-lr is the variant's "
        "alone: the control keeps --grpo-lr). Default: one variant, grpo, with this command's settings",
    )
    parser.add_argument("--stop-after", choices=("data", "sft", "all"), default="all")
    return parser


BOOLEANS = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}


def boolean(text: str) -> bool:
    """true/false, 1/0, yes/no, on/off as a bool; ValueError otherwise."""
    if text.lower() not in BOOLEANS:
        raise ValueError(text)
    return BOOLEANS[text.lower()]


def positive_int(text: str) -> int:
    """An int > 0; ValueError otherwise."""
    if (value := int(text)) <= 0:
        raise ValueError(text)
    return value


def positive_float(text: str) -> float:
    """A finite float > 0; ValueError otherwise."""
    if not (math.isfinite(value := float(text)) and value > 0):
        raise ValueError(text)
    return value


ROLLOUT_QUANTIZATIONS = ("none", "fp8")


def rollout_quantization(text: str) -> str:
    """none or fp8 (rollout.quantization); ValueError otherwise."""
    if text not in ROLLOUT_QUANTIZATIONS:
        raise ValueError(text)
    return text


def non_negative_float(text: str) -> float:
    """A finite float >= 0; ValueError otherwise."""
    if not (math.isfinite(value := float(text)) and value >= 0):
        raise ValueError(text)
    return value


KIND_TEXT = {  # what a --variants value must be, for its error line
    int: "a valid int",
    float: "a valid float",
    boolean: "a valid boolean (true/false, 1/0, yes/no, on/off)",
    positive_int: "a valid int > 0",
    positive_float: "a valid float > 0",
    non_negative_float: "a valid float >= 0 (0: off)",
    rollout_quantization: f"one of {', '.join(ROLLOUT_QUANTIZATIONS)}",
}
VARIANT_KEYS: dict[str, tuple[str, Callable[[str], Any]]] = {  # --variants key -> the argument it sets, its type
    "iou-hit-weight": ("iou_hit_weight", float),
    "iou-hit-threshold": ("iou_hit_threshold", float),
    "grpo-n": ("grpo_n", positive_int),
    "grpo-dynamic-sampling": ("grpo_dynamic_sampling", boolean),
    "grpo-temperature": ("grpo_temperature", positive_float),
    "json-format-weight": ("json_format_weight", float),
    "grpo-lr": ("grpo_lr", positive_float),
    "kl-beta": ("kl_beta", non_negative_float),
    "rollout-quantization": ("rollout_quantization", rollout_quantization),
}
# GRPO settings a variant may not change: the control continues SFT with GRPO's steps and prompts per step, so a
# variant that changed them would no longer be paired with the control it is tested against. (The control's lr is the
# command's --grpo-lr; a variant's grpo-lr changes its GRPO run alone.)
CONTROL_KEYS = ("grpo-steps", "grpo-prompts")
DEFAULT_VARIANT = "grpo"
VARIANT_NAME = re.compile(r"grpo([-_.][A-Za-z0-9]+)*")


def parse_variants(
    specs: list[str], args: argparse.Namespace, parser: argparse.ArgumentParser
) -> dict[str, dict[str, Any]]:
    """`--variants` as {name: {argument: value}}: each name's overrides of this command's GRPO settings, checked
    (names, keys, values, the IoU shaping's ranges) before anything runs; parser.error names the bad part."""
    from physreason.errors import ConfigError
    from physreason.rewards.localization import IoUShaping

    variants: dict[str, dict[str, Any]] = {}
    for spec in specs:
        name, _, settings = spec.partition(":")
        if not VARIANT_NAME.fullmatch(name) or "sft-control" in name:
            parser.error(
                f"--variants {spec!r}: name a variant grpo or grpo-<letters, digits> (e.g. grpo-hit), not containing "
                "sft-control: it names the run folder beside the control's"
            )
        if name in variants:
            parser.error(f"--variants: {name!r} is given twice; give each variant one name")
        overrides: dict[str, Any] = {}
        for item in filter(None, settings.split(",")):
            key, equals, value = item.partition("=")
            if key in CONTROL_KEYS:
                parser.error(
                    f"--variants {spec!r}: {key} is shared by every variant and the control (the control continues "
                    f"SFT with GRPO's steps and prompts per step); set --{key} for the whole command instead"
                )
            if key not in VARIANT_KEYS or not equals:
                parser.error(
                    f"--variants {spec!r}: {item!r} is not KEY=VALUE with KEY one of {', '.join(VARIANT_KEYS)}"
                )
            dest, kind = VARIANT_KEYS[key]
            try:
                overrides[dest] = kind(value)
            except ValueError:
                parser.error(f"--variants {spec!r}: {key}={value!r} is not {KIND_TEXT[kind]}")
        settings_of = variant_args(args, overrides)
        try:
            IoUShaping(settings_of.iou_hit_threshold, settings_of.iou_hit_weight)
        except ConfigError as exc:
            parser.error(f"--variants {spec!r} (or --iou-hit-*): {exc}")
        variants[name] = overrides
    return variants


def variant_args(args: argparse.Namespace, overrides: dict[str, Any]) -> argparse.Namespace:
    """This command's arguments with one variant's overrides laid over them."""
    return argparse.Namespace(**{**vars(args), **overrides})


def variant_text(args: argparse.Namespace) -> str:
    """One line of a variant's GRPO settings: its reward, completions per prompt, dynamic sampling, temperature, lr
    and KL term."""
    w, t = args.iou_hit_weight, args.iou_hit_threshold
    reward = "IoU" if w == 0 else f"hit@{t:g}" if w == 1 else f"{1 - w:g} x IoU + {w:g} x hit@{t:g}"
    kl = f"KL {args.kl_beta:g} x k3 to the SFT export" if args.kl_beta else "no KL"
    rollouts = "" if args.rollout_engine == "hf" else (
        "; rollouts on vLLM, FP8 weights with truncated importance sampling" if args.rollout_quantization == "fp8"
        else "; rollouts on vLLM, bf16"
    )  # fmt: skip
    return (
        f"reward {reward} + {args.json_format_weight:g} x json_format; {args.grpo_n} completions per prompt at "
        f"temperature {args.grpo_temperature:g}; dynamic sampling {'on' if args.grpo_dynamic_sampling else 'off'}; "
        f"lr {args.grpo_lr:g}; {kl}{rollouts}"
    )


def variant_settings(args: argparse.Namespace) -> dict[str, Any]:
    """A variant's GRPO settings (the arguments VARIANT_KEYS sets), by argument name: the results JSON's record."""
    return {dest: getattr(args, dest) for dest in (*(dest for dest, _ in VARIANT_KEYS.values()), "rollout_engine")}


SETTING_TAGS: dict[str, Callable[[Any], str]] = {  # argument -> its folder-name tag when not the recipe's
    "iou_hit_weight": lambda v: f"-hit{v:g}",
    "iou_hit_threshold": lambda v: f"-at{v:g}",
    "grpo_n": lambda v: f"-n{v}",
    "grpo_dynamic_sampling": lambda v: "-dyn" if v else "-nodyn",
    "grpo_temperature": lambda v: f"-temp{v:g}",
    "json_format_weight": lambda v: f"-fmt{v:g}",
    "grpo_lr": lambda v: f"-lr{v:g}",
    "kl_beta": lambda v: f"-kl{v:g}",
    "rollout_engine": lambda v: f"-{v}",
    "rollout_quantization": lambda v: f"-{v}",
}


def settings_tag(args: argparse.Namespace, defaults: dict[str, Any]) -> str:
    """The folder-name tag of a variant's GRPO settings that differ from the recipe's ("" for the recipe's), e.g.
    -n16-lr1e-05-kl0.04: a variant whose settings change gets another run folder, so a rerun never resumes or reuses
    a run of other settings."""
    return "".join(
        SETTING_TAGS[dest](getattr(args, dest)) for dest in SETTING_TAGS if getattr(args, dest) != defaults[dest]
    )


def generate(out: Path, args: argparse.Namespace) -> dict[str, float]:
    """The clip sets of every task and their SFT / GRPO / control record files (existing clips are reused)."""
    from physreason.data.synth.records import json_sft_records, letter_sft_records, rl_records
    from physreason.data.synth.tasks import LETTER_TASK_NAMES

    sets = [
        ("train", "train", 0, args.train_per_task, args.tasks),
        ("rl", "train", 1, args.rl_per_task, args.tasks),
        ("test", "test", 0, args.test_per_task, args.tasks),
    ]
    if args.tower_steps:
        sets.append(("tower", "train", 0, args.tower_clips_per_task, list(LETTER_TASK_NAMES)))
    timings = generate_clip_sets(out, sets, args)
    json_sft_records(out / "data" / "train", out / "data" / "train" / "sft.jsonl", args.tasks)
    json_sft_records(out / "data" / "rl", out / "data" / "rl" / "control-sft.jsonl", args.tasks)
    rl_records(out / "data" / "rl", out / "data" / "rl" / "grpo.jsonl", args.tasks)
    if args.tower_steps:
        letter_sft_records(out / "data" / "tower", out / "data" / "tower" / "sft.jsonl")
    return timings


def clip_ious(results_dir: Path) -> dict[str, dict[str, float]]:
    """Per question kind (box_2d, point_2d, time_span), each scored test clip's IoU, by `<dataset>/<sample id>`.

    Samples that failed (no completion: a clip that could not be read, an engine error) have no IoU and are left out;
    an answer that does not parse scored IoU 0.
    """
    from physreason.chat.structured import answer_kind
    from physreason.eval.results import read_run

    scores: dict[str, dict[str, float]] = {kind: {} for kind in KINDS}
    for run in sorted({path.parent for path in results_dir.rglob("*.jsonl")}):
        for sample_id, record in read_run(run).items():
            if "iou" in record:
                scores[answer_kind(record["correct_answer"])][f"{run.parent.name}/{sample_id}"] = float(record["iou"])
    return scores


def clip_summary(ious: list[float]) -> dict[str, float] | None:
    """Mean IoU and accuracy at IoU 0.5 over clips, each with its standard error (sample std / sqrt n), and n."""
    import numpy as np

    if not ious:
        return None
    values = np.asarray(ious, dtype=float)
    hits = (values >= IOU_HIT).astype(float)
    return {
        "mean_iou": float(values.mean()),
        "mean_iou_se": standard_error(values),
        "acc50": float(hits.mean()),
        "acc50_se": standard_error(hits),
        "n": len(values),
    }


def standard_error(values: Any) -> float:
    """Standard error of the mean of a 1-D array: sample std / sqrt(n); 0 for fewer than two values."""
    return float(values.std(ddof=1) / math.sqrt(len(values))) if len(values) > 1 else 0.0


def paired_test(a: dict[str, float], b: dict[str, float], seed: int = 0) -> dict[str, float] | None:
    """a - b over the clips both scored: mean difference, its standard error, t, and a two-sided sign-flip p-value.

    Under the null hypothesis that the arms do not differ, each clip's difference is as likely negative as positive;
    the p-value is the share of random sign flips (PERMUTATIONS of them, plus the observed one) whose mean is at
    least as far from 0 as the observed mean. It needs no normality, unlike the t-test, on IoUs bounded in [0, 1].
    """
    import numpy as np

    common = sorted(a.keys() & b.keys())
    if len(common) < 2:
        return None
    diff = np.array([a[k] - b[k] for k in common])  # [clips]
    mean, se = float(diff.mean()), standard_error(diff)
    signs = np.random.default_rng(seed).choice([-1.0, 1.0], size=(PERMUTATIONS, len(diff)))  # [draws, clips]
    extreme = int((np.abs(signs @ diff) / len(diff) >= abs(mean) - 1e-12).sum())
    return {
        "mean_diff": mean,
        "se": se,
        "t": mean / se if se > 0 else 0.0,
        "p": (extreme + 1) / (PERMUTATIONS + 1),
        "n": len(diff),
    }


BASE_ROW, SFT_ROW, CONTROL_ROW = "untrained model", "after SFT", "after SFT+SFT (control)"


def grpo_row(variant: str) -> str:
    """The table row of a GRPO variant: "after SFT+GRPO" for the default variant, else with its name."""
    return "after SFT+GRPO" if variant == DEFAULT_VARIANT else f"after SFT+GRPO ({variant})"


def stage_labels(variants: dict[str, str] | list[str], suffix: str, seed: int, control_tag: str = "") -> dict[str, str]:
    """Table row -> its run and evaluation folder name, in table order (the letter experiment's names: the control keeps
    grpo<suffix>-sft-control whatever the variants, as they share it). `variants` maps each name to its settings tag
    (settings_tag; a list: the recipe's settings), the variant's folder being <name><tag><suffix>; `control_tag` is the
    control's lr tag when --grpo-lr is not the recipe's."""
    tags = variants if isinstance(variants, dict) else dict.fromkeys(variants, "")
    return {
        BASE_ROW: f"base{seed_tag(seed)}",
        SFT_ROW: f"sft{suffix}",
        **{grpo_row(name): f"{name}{tag}{suffix}" for name, tag in tags.items()},
        CONTROL_ROW: f"grpo{control_tag}{suffix}-sft-control",
    }


def run_labels(args: argparse.Namespace, seed: int) -> dict[str, str]:
    """stage_labels of this command's variants for one seed: each variant's folder carries its settings other than
    the recipe's, the control's its lr when --grpo-lr is not the recipe's."""
    defaults = recipe_defaults()
    tags = {name: settings_tag(variant_args(args, overrides), defaults) for name, overrides in args.variants.items()}
    control = "" if args.grpo_lr == defaults["grpo_lr"] else SETTING_TAGS["grpo_lr"](args.grpo_lr)
    return stage_labels(tags, variant_suffix(args, seed), seed, control)


# The settings a GRPO run folder's config.toml must share with a variant that reuses the folder, as the same name
# with other settings (an edited --variants) would otherwise resume or reuse the other variant's run.
VARIANT_CONFIG_KEYS = (
    "grpo.reward_function",
    "grpo.reward_options",
    "grpo.dynamic_sampling",
    "rollout.n_generation",
    "rollout.batch_size",
    "rollout.sampling_config.temperature",
    "train.optm_lr",
    "grpo.kl_beta",
    "grpo.reference_model_path",
    "engine.backend",
    "rollout.quantization",
)


def config_value(cfg: Any, key: str) -> Any:
    """The value of a dotted key in a Config."""
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def refuse_other_settings(rl_cfg: Any) -> None:
    """Stop the bench when rl_cfg's run folder holds a run of the same name with other VARIANT_CONFIG_KEYS."""
    from physreason.config import load_config

    recorded = Path(rl_cfg.train.output_dir) / "config.toml"
    if not recorded.is_file():
        return
    earlier = load_config(recorded)
    differ = [k for k in VARIANT_CONFIG_KEYS if config_value(earlier, k) != config_value(rl_cfg, k)]
    if differ:
        raise SystemExit(
            f"{recorded.parent} holds a GRPO run with other settings ("
            + "; ".join(f"{k}: {config_value(earlier, k)} there, {config_value(rl_cfg, k)} now" for k in differ)
            + "): give this variant another name in --variants, or another --out"
        )


def variant_grpo_config(args: argparse.Namespace, cfg: Any, out: Path, sft_dir: Path, output_dir: Path) -> Any:
    """GRPO from `sft_dir` on the RL prompts with one variant's arguments: the IoU reward (shaped when
    --iou-hit-weight is set), json_format, completions per prompt, temperature, dynamic sampling, lr (the variant's:
    grpo_stage_config sets --grpo-lr, laid over here) and the KL term against `sft_dir` (kl_beta > 0 only)."""
    rl_cfg = grpo_stage_config(args, cfg, out, sft_dir, out / "data" / "rl" / "grpo.jsonl", output_dir)
    rl_cfg.train.optm_lr = args.grpo_lr
    rl_cfg.grpo.kl_beta = args.kl_beta
    if args.kl_beta:  # the reference is the SFT export GRPO starts from, named so whatever the schema's fallback
        rl_cfg.grpo.reference_model_path = str(sft_dir)
    rl_cfg.grpo.reward_function = {"localization": 1.0, "json_format": args.json_format_weight}
    if args.iou_hit_weight:  # without a hit bonus the threshold does nothing: the recipe keeps no options
        rl_cfg.grpo.reward_options = {
            "localization": {"hit_weight": args.iou_hit_weight, "hit_threshold": args.iou_hit_threshold}
        }
    rl_cfg.grpo.shuffle_options = False  # no options: the question is asked as written
    rl_cfg.rollout.max_response_length = args.max_tokens
    rl_cfg.rollout.sampling_config.temperature = args.grpo_temperature
    rl_cfg.rollout.quantization = args.rollout_quantization
    if args.rollout_engine == "vllm":
        # vLLM rolls out in bf16 (the FP8 arm quantizes the same bf16 weights); the policy still loads and trains
        # in float32 (train.param_dtype), so only the engine's copy changes
        rl_cfg.engine = rl_cfg.engine.model_copy(
            update={"backend": "vllm", "gpu_memory_utilization": args.rollout_gpu_memory, "hf_static_cache": False,
                    "kv_cache_memory_gib": args.rollout_kv_cache_gib}  # fmt: skip
        )
        rl_cfg.model = rl_cfg.model.model_copy(update={"dtype": "bfloat16"})
    return rl_cfg


def run_seed(args: argparse.Namespace, out: Path, seed: int) -> dict[str, Any]:
    """Every stage after the data for one seed: the per-clip IoUs of each evaluated stage, and the runs' logs."""
    from physreason.config import with_model
    from physreason.eval.launch import accuracy_by_dataset
    from physreason.train.grpo import run_grpo

    timings: dict[str, float] = {}
    model_dir = build_model(args, out, seed)
    cfg = stage_config(args, out, model_dir, seed)
    cfg.eval.datasets = list(args.tasks)
    cfg.generation.max_tokens = args.max_tokens
    suffix = variant_suffix(args, seed)
    cfg.train.output_dir = str(out / f"sft{suffix}")
    labels = run_labels(args, seed)
    results = out / "results"

    def evaluate(row: str, model: Path) -> None:
        t = time.perf_counter()
        accuracy_by_dataset(with_model(cfg, model), results / labels[row])
        timings[f"eval {row}"] = time.perf_counter() - t

    evaluate(BASE_ROW, model_dir)
    tower = None
    if args.tower_steps:
        t = time.perf_counter()
        tower_dir, tower = tower_stage(args, model_dir, out / "data" / "tower", cfg, seed)
        cfg = with_model(cfg, tower_dir)
        timings["tower_s"] = time.perf_counter() - t
    t = time.perf_counter()
    sft_dir = sft_stage(cfg, args.sft_steps)
    timings["sft_s"] = time.perf_counter() - t
    evaluate(SFT_ROW, sft_dir)
    if args.stop_after == "all":
        for name, overrides in args.variants.items():
            row = grpo_row(name)
            t = time.perf_counter()
            rl_cfg = variant_grpo_config(variant_args(args, overrides), cfg, out, sft_dir, out / labels[row])
            refuse_other_settings(rl_cfg)
            grpo_dir = finished_export(Path(rl_cfg.train.output_dir), args.grpo_steps) or run_grpo(rl_cfg).export_dir
            timings[f"grpo_s {name}"] = time.perf_counter() - t
            evaluate(row, grpo_dir)
        t = time.perf_counter()
        control = out / labels[CONTROL_ROW]
        control_dir = sft_control(cfg, sft_dir, out / "data" / "rl" / "control-sft.jsonl", control, args)
        timings["sft_control_s"] = time.perf_counter() - t
        evaluate(CONTROL_ROW, control_dir)
    ious = {row: clip_ious(results / label) for row, label in labels.items() if (results / label).is_dir()}
    tables = {row: {kind: clip_summary(list(scores[kind].values())) for kind in KINDS} for row, scores in ious.items()}
    paired = {
        row: {kind: paired_test(ious[row][kind], ious[CONTROL_ROW][kind], seed) for kind in KINDS}
        for row in grpo_rows(labels)
        if row in ious and CONTROL_ROW in ious
    }
    rewards = {row: logged(out / labels[row], "reward/total_mean") for row in grpo_rows(labels)}
    for row, values in rewards.items():
        print(f"seed {seed}: {row}: GRPO mean reward, means of 10 steps:", window_means(values, 10))
    print({k: round(v, 1) for k, v in timings.items()})
    return {
        "seed": seed,
        "labels": labels,
        "tables": tables,
        "paired_grpo_minus_control": paired,
        "clip_ious": ious,
        "sft_losses": logged(Path(cfg.train.output_dir), "train/loss"),
        "grpo_rewards": rewards,
        "tower_pretraining": tower,
        "timings": timings,
    }


def grpo_rows(rows: Any) -> list[str]:
    """The GRPO variants' rows among `rows` (a run's labels or tables), in their order."""
    return [row for row in rows if row.startswith("after SFT+GRPO")]


def table_rows(runs: list[dict[str, Any]]) -> list[str]:
    """Every stage row of the runs' tables, in table order (runs combined from several files may differ in their
    variants: the union, each file's order kept)."""
    rows = list(dict.fromkeys(row for run in runs for row in run["tables"]))
    return [BASE_ROW, SFT_ROW, *grpo_rows(rows), CONTROL_ROW]


def seed_summary(runs: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per stage and question kind, mean IoU and acc@0.5 over seeds (mean, std, min, max, n: seed_stats)."""
    tables = [
        {row: {f"{kind}/{key}": s[key] for kind, s in table.items() if s for key in ("mean_iou", "acc50")}
         for row, table in run["tables"].items()}
        for run in runs
    ]  # fmt: skip
    return {row: {key: stats for key, stats in values.items() if stats} for row, values in spread(tables).items()}


def pooled_paired(runs: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float] | None]]:
    """Each GRPO variant minus the control, per question kind over all seeds that ran both: each clip's difference
    averaged over those seeds, then tested; {variant's row: {kind: test or None}}."""
    pooled: dict[str, dict[str, dict[str, float] | None]] = {}
    for row in grpo_rows(dict.fromkeys(row for run in runs for row in run["clip_ious"])):
        pooled[row] = {}
        for kind in KINDS:
            arms = [
                (run["clip_ious"][row][kind], run["clip_ious"][CONTROL_ROW][kind])
                for run in runs
                if row in run["clip_ious"] and CONTROL_ROW in run["clip_ious"]
            ]
            if not arms:
                pooled[row][kind] = None
                continue
            common = set.intersection(*(set(g) & set(c) for g, c in arms))
            mean = {arm: {k: sum(pair[arm][k] for pair in arms) / len(arms) for k in common} for arm in (0, 1)}
            test = paired_test(mean[0], mean[1])
            if test is not None:
                test["seeds"] = len(arms)
            pooled[row][kind] = test
    return pooled


REWARD_WINDOW = 10  # steps whose mean reward stands for the start and the end of a GRPO run


def reward_summary(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per GRPO variant, the mean training reward of each seed's first and last REWARD_WINDOW steps (fewer when the
    run is shorter) and their spread over seeds (seed_stats): FP8 rollouts against bf16 ones, a variant against the
    recipe, on what GRPO optimises. Variants no seed logged a reward for are left out."""
    summary: dict[str, dict[str, Any]] = {}
    for row in grpo_rows(dict.fromkeys(row for run in runs for row in run.get("grpo_rewards", {}))):
        first, last = {}, {}
        for run in runs:
            values = run.get("grpo_rewards", {}).get(row) or []
            if values:
                first[run["seed"]] = sum(values[:REWARD_WINDOW]) / len(values[:REWARD_WINDOW])
                last[run["seed"]] = sum(values[-REWARD_WINDOW:]) / len(values[-REWARD_WINDOW:])
        if last:
            summary[row] = {
                "first": seed_stats(list(first.values())),
                "last": seed_stats(list(last.values())),
                "last_per_seed": last,
            }
    return summary


def reward_text(stats: dict[str, float]) -> str:
    """`mean ± std [min-max]` of rewards (three decimals), or the value alone for one seed."""
    if stats["n"] == 1:
        return f"{stats['mean']:.3f}"
    return f"{stats['mean']:.3f} ± {stats['std']:.3f} [{stats['min']:.3f}-{stats['max']:.3f}]"


def holm(pvalues: list[float]) -> list[float]:
    """Holm's step-down adjustment of p-values (the family-wise error over all of them), in the given order.

    With several variants the table holds several tests; the smallest raw p is then likelier to fall under 0.05 by
    chance alone. Holm keeps the chance of any false claim at 0.05 without assuming the tests independent.
    """
    order = sorted(range(len(pvalues)), key=lambda i: pvalues[i])
    adjusted, running = [0.0] * len(pvalues), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(pvalues) - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted


def markdown(runs: list[dict[str, Any]], pooled: dict[str, Any], header: list[str]) -> str:
    """The stage table (mean IoU and acc@0.5 per question kind) and the paired table of each GRPO variant against
    the control."""
    single = len(runs) == 1
    note = (
        "(%; ± one standard error over the test clips)"
        if single
        else f"(%; mean ± std over {len(runs)} seeds [min-max]; standard errors over clips per seed in the JSON)"
    )
    kinds = [kind for kind in KINDS if any(run["tables"][SFT_ROW][kind] for run in runs)]
    columns = [f"{KIND_LABELS[k]}: {'mean tIoU' if k == 'time_span' else 'mean IoU'}" for k in kinds]
    columns = [c for kind, col in zip(kinds, columns) for c in (col, f"{KIND_LABELS[kind]}: acc@0.5")]
    lines = [*header, "", f"Held-out test clips {note}", ""]
    lines += ["| stage | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for row in table_rows(runs):
        cells = []
        for kind in kinds:
            for key in ("mean_iou", "acc50"):
                values = [s[key] for run in runs if (s := run["tables"].get(row, {}).get(kind))]
                if not values:
                    cells.append("-")
                elif single:
                    stats = runs[0]["tables"][row][kind]
                    cells.append(f"{100 * stats[key]:.1f} ± {100 * stats[key + '_se']:.1f}")
                else:
                    cells.append(spread_text(seed_stats(values)))
        if any(cell != "-" for cell in cells):
            lines.append(f"| {row} | " + " | ".join(cells) + " |")
    rewards = reward_summary(runs)
    if rewards:
        lines += [
            "",
            f"GRPO's training reward (each step's mean over its completions; the mean of the first and of the last "
            f"{REWARD_WINDOW} steps a seed, then mean ± std [min-max] over seeds)",
            "",
            f"| variant | first {REWARD_WINDOW} steps | last {REWARD_WINDOW} steps | per seed, last {REWARD_WINDOW} |",
            "|---|---|---|---|",
        ]
        for row, summary in rewards.items():
            per_seed = ", ".join(f"seed {seed}: {value:.3f}" for seed, value in summary["last_per_seed"].items())
            lines.append(
                f"| {row.removeprefix('after SFT+GRPO').strip(' ()') or 'grpo'} | "
                f"{reward_text(summary['first'])} | {reward_text(summary['last'])} | {per_seed} |"
            )
    tests = [(row, kind, test) for row, by_kind in pooled.items() for kind in kinds if (test := by_kind.get(kind))]
    if tests:
        adjusted = holm([test["p"] for _, _, test in tests])
        lines += [
            "",
            "GRPO minus its SFT control, clip by clip (mean IoU points; pooled: each clip's difference averaged over "
            "seeds; p: two-sided sign-flip permutation test; Holm: p adjusted over the table's "
            f"{len(tests)} tests)",
            "",
            "| question | difference | standard error | p | p (Holm) | clips | per seed (difference, p) |",
            "|---|---|---|---|---|---|---|",
        ]
        for (row, kind, test), p_holm in zip(tests, adjusted, strict=True):
            per_seed = ", ".join(
                f"seed {run['seed']}: {100 * t['mean_diff']:+.1f}, p {t['p']:.3f}"
                for run in runs
                if (t := run["paired_grpo_minus_control"].get(row, {}).get(kind))
            )
            name = row.removeprefix("after SFT+GRPO").strip(" ()")
            question = f"{name}: {KIND_LABELS[kind]}" if name else KIND_LABELS[kind]
            lines.append(
                f"| {question} | {100 * test['mean_diff']:+.1f} | {100 * test['se']:.1f} | {test['p']:.4f} | "
                f"{p_holm:.4f} | {test['n']} | {per_seed} |"
            )
    return "\n".join(lines) + "\n"


def recipe_lines(args: argparse.Namespace) -> list[str]:
    """Header lines of what the run trained on and with: clip counts, SFT, GRPO and each variant's settings."""
    return [
        f"- clips per task: {args.train_per_task} SFT (labelled), {args.rl_per_task} RL prompts, "
        f"{args.test_per_task} test",
        f"- SFT {args.sft_steps} steps of {args.sft_batch}; GRPO and the control {args.grpo_steps} steps of "
        f"{args.grpo_prompts} prompts, the control at lr {args.grpo_lr:g} (each variant's lr below)",
        *(f"- {name}: {variant_text(variant_args(args, overrides))}" for name, overrides in args.variants.items()),
    ]


def combine(files: list[Path]) -> dict[str, Any]:
    """The tables and pooled paired test over the seeds of earlier runs' JSON files, written beside the first; the
    header keeps each file's recipe lines (clip counts, steps, variants), once each."""
    runs, devices, header = combined_runs(files)
    run_keys = ("- device:", "- date:", "- command:", "- seeds:")
    recipes = [line for path in files for line in json.loads(path.read_text()).get("header", [])]
    header += list(dict.fromkeys(line for line in recipes if not line.startswith(run_keys)))
    pooled = pooled_paired(runs)
    text = markdown(runs, pooled, header)
    print(text)
    payload = {"device": devices, "header": header, "summary": seed_summary(runs), "paired_grpo_minus_control": pooled,
               "reward_summary": reward_summary(runs)}  # fmt: skip
    write_results(files[0].with_name("grounding-combined"), {**payload, "per_seed": runs}, text)
    return payload


def main(argv: list[str] | None = None, prog: str | None = None) -> dict[str, Any] | None:
    """Run the experiment for every seed and write the tables; returns the JSON payload (None after --stop-after data)."""
    args = parse_args(argv, prog)
    if args.combine:
        return combine(args.combine)
    print(apply_cpu_share().describe(), flush=True)  # threads of this seed's share of the host, before any stage
    out = args.out.resolve() / args.family
    started = time.perf_counter()
    data_timings = generate(out, args)
    data_timings["data_s"] = time.perf_counter() - started
    if args.stop_after == "data":
        print({k: round(v, 1) for k, v in data_timings.items()})
        return None
    runs = [run_seed(args, out, seed) for seed in args.seeds]
    device = device_name()
    pooled = pooled_paired(runs)
    header = [*run_header(device, args.seeds), *recipe_lines(args)]
    text = markdown(runs, pooled, header)
    print(text)
    payload = {
        "device": device,
        "header": header,
        "args": {k: str(v) for k, v in vars(args).items()},
        "variant_settings": {name: variant_settings(variant_args(args, o)) for name, o in args.variants.items()},
        "control_lr": args.grpo_lr,
        "data_timings": data_timings,
        "summary": seed_summary(runs),
        "paired_grpo_minus_control": pooled,
        "reward_summary": reward_summary(runs),
        "per_seed": runs,
        "total_s": time.perf_counter() - started,
    }
    write_results(out / results_name("grounding", args), payload, text, out_name="grounding")
    return payload


if __name__ == "__main__":
    main()
