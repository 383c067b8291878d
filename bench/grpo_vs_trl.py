"""GRPO end to end, physreason against TRL's GRPOTrainer on the same GPU: samples/s, tokens/s, where each step goes.

Sides, workloads, recipe, what is timed, what stops TRL on video and the package pins: bench/RESULTS.md ("How
bench/grpo_vs_trl.py measures"). A table on stdout, JSON to $OUT/grpo_vs_trl.json when OUT is set.
GPU: python3 bench/grpo_vs_trl.py --workloads image|text|video --rounds 3   CPU check: python bench/grpo_vs_trl.py --tiny
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import re
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from harness import peak_gib, sync, vision_settings, write_json  # noqa: E402

WORKLOADS = ("video", "image", "text")
SIDES = ("trl", "physreason", "physreason-padded")
DEFAULT_SIDES = ("trl", "physreason")
TRL_WORKLOADS = ("image", "text")
TRL_VIDEO = (
    "TRL 1.16 cannot train Qwen2.5-VL on video: its prompts carry only image parts, its vLLM generation takes only "
    "images and its policy forward has no pixel_values_videos/video_grid_thw (see bench/RESULTS.md)"
)
PARTS = ("generate", "score", "train", "sync")
TRL_VISION_ATTENTION = ("varlen", "native")
REWARD_WEIGHTS = {"accuracy": 1.0, "format": 1.0}
SYNTH_TASK = "arrow_of_time"
SCENE = "the ball rolls down the slope, bounces off the wall and slides along the floor past the red box"
# Sizes when a flag is not given: (GPU run, --tiny CPU run).
SIZES = {"prompts": (8, 2), "n": (8, 2), "response_len": (256, 8), "mini_batch": (8, 2),
         "mini_batch_tokens": (8192, 512), "steps": (3, 1), "warmup": (1, 0), "text_words": (200, 20)}  # fmt: skip
# Untimed first steps of a compiled GPU run: the first compiles, the next may recompile for new shapes (on 2026-11-29 a
# compiled physreason run's steps took 44.4, 10.0, 2.9 and 2.4 s).
COMPILE_WARMUP = 3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; sizes left out take the GPU defaults, or the small --tiny ones."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated: video, image, text")
    parser.add_argument("--sides", default=",".join(DEFAULT_SIDES), help=f"comma-separated: {', '.join(SIDES)}")
    parser.add_argument("--prompts", type=int, help="prompts per step [8; tiny 2]")
    parser.add_argument("--n", type=int, help="completions per prompt (group size) [8; tiny 2]")
    parser.add_argument("--response-len", type=int, help="new tokens in every completion [256; tiny 8]")
    parser.add_argument("--mini-batch", type=int, help="completions per forward pass, TRL and padded [8; tiny 2]")
    parser.add_argument("--mini-batch-tokens", type=int, help="physreason's tokens per forward pass [8192; tiny 512]")
    parser.add_argument("--steps", type=int, help="timed optimizer steps per run [3; tiny 1]")
    parser.add_argument("--warmup", type=int,
                        help="untimed first steps per run [1, 3 with --compile (compiling and recompiling steps); tiny 0]")
    parser.add_argument("--rounds", type=int, default=1,
                        help="rounds of TRL and physreason runs per workload, the first side alternating")
    parser.add_argument("--trl-vision-attention", choices=TRL_VISION_ATTENTION, default="varlen",
                        help="TRL policy's vision tower: varlen (physreason's grouped attention kernel, as with "
                             "flash-attn, and its patch embedding as one linear layer, as transformers' fusion_config "
                             "patch_embeddings does) or native (transformers' per-window loop and Conv3d)")
    parser.add_argument("--text-words", type=int, help="scene words before each text question [200; tiny 20]")
    parser.add_argument("--engine", choices=["auto", "vllm", "hf"], default="auto", help="auto: vLLM when installed")
    parser.add_argument("--gpu-memory", type=float, default=0.3, help="vLLM gpu_memory_utilization, both sides")
    parser.add_argument("--run-timeout", type=int, default=900, help="seconds one run may take")
    parser.add_argument("--packed-attention", choices=["mask", "spans"], default="mask",
                        help="physreason's grpo.packed_attention (its packed rows: sdpa under the mask, or one "
                             "variable-length flash call a layer)")
    parser.add_argument("--no-recompute", action="store_true",
                        help="both sides keep their activations (gradient checkpointing off on both; on by default "
                             "on a GPU): where both fit, the table without recomputation")
    parser.add_argument("--trl-no-recompute", action="store_true",
                        help="TRL's side keeps its activations (its gradient checkpointing off) while physreason "
                             "recomputes as --checkpoint-every says: each side at its fastest setting that fits, "
                             "where TRL fits without recomputation (its gradient checkpointing is every block or none)")
    parser.add_argument("--allocator", choices=("expandable", "inherit"), default="expandable",
                        help="expandable (default): both sides' processes get PYTORCH_CUDA_ALLOC_CONF="
                             "expandable_segments:True unless it is set; inherit: leave the environment as it is "
                             "(physreason's processes then set it themselves, TRL's keep the default allocator)")
    parser.add_argument("--compile", action="store_true",
                        help="both sides compiled: physreason's train.compile (its decoder blocks) and, on the image "
                             "and video workloads, train.compile_vision (its vision blocks); TRL's torch_compile (the "
                             "whole policy through accelerate's dynamo plugin). Off by default: neither side compiles")
    parser.add_argument("--checkpoint-every", default="1",
                        help="physreason's train.checkpoint_every with recomputation on: n (decoder blocks 0, n, 2n, "
                             "... recomputed) or auto (the fewest whose plan leaves a tenth of the GPU free) [1: every "
                             "block, as TRL's gradient checkpointing, which has no such setting]")
    parser.add_argument("--append", action="store_true",
                        help="add this call's rounds to the runs already in $OUT/grpo_vs_trl.json (one setup on one "
                             "machine: refused otherwise) and print the table of them all; the first side keeps "
                             "alternating across calls")
    parser.add_argument("--work", type=Path, default=Path("/tmp/physreason-grpo-bench"), help="models, data, logs")
    parser.add_argument("--tiny", action="store_true", help="tiny models on CPU, few small steps (checks the script)")
    parser.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--workload", choices=WORKLOADS, help=argparse.SUPPRESS)
    parser.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.warmup is None and args.compile and not args.tiny:
        args.warmup = COMPILE_WARMUP
    for name, (gpu, tiny) in SIZES.items():
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else gpu)
    args.workloads = harness.comma_list(parser, "--workloads", args.workloads, WORKLOADS)
    args.sides = harness.comma_list(parser, "--sides", args.sides, SIDES)
    sizes = (args.prompts, args.mini_batch, args.mini_batch_tokens, args.response_len, args.steps, args.rounds)
    if min(sizes) < 1 or args.warmup < 0:
        parser.error(
            "--prompts, --mini-batch, --mini-batch-tokens, --response-len, --steps and --rounds must be >= 1, "
            "--warmup >= 0"
        )
    if args.n < 2:
        parser.error("--n must be >= 2: GRPO needs at least two completions per prompt (TRL refuses fewer)")
    if (args.prompts * args.n) % args.mini_batch:
        parser.error(f"--mini-batch {args.mini_batch} must divide --prompts x --n = {args.prompts * args.n}")
    if args.checkpoint_every != "auto":
        if not re.fullmatch(r"[0-9]+", args.checkpoint_every) or int(args.checkpoint_every) < 1:
            parser.error(f"--checkpoint-every {args.checkpoint_every!r}: a whole number >= 1, or auto")
        args.checkpoint_every = str(int(args.checkpoint_every))
    return args


def contact_sheet(frames, temporal_patch: int = 2):
    """[rows*H, cols*W, 3] uint8: the first frame of each temporal patch of [T, H, W, 3] frames, tiled in a grid as
    square as allows no blank tile, so the sheet has as many patches (and visual tokens) as the clip."""
    import numpy as np

    tiles = np.asarray(frames[::temporal_patch])  # [k, H, W, 3]
    count, height, width = tiles.shape[:3]
    cols = next(d for d in range(math.ceil(math.sqrt(count)), count + 1) if count % d == 0)
    rows = count // cols
    grid = tiles.reshape(rows, cols, height, width, 3).transpose(0, 2, 1, 3, 4)  # [rows, H, cols, W, 3]
    return np.ascontiguousarray(grid.reshape(rows * height, cols * width, 3))


def scene_words(count: int) -> str:
    """`count` words of scene description (the text workload's prompt length)."""
    words = SCENE.split()
    return " ".join(words[i % len(words)] for i in range(count))


def prepare_data(work: Path, model: Path, clips: int, text_words: int, tiny: bool, workers: int) -> dict[str, Any]:
    """Synthetic clips, their contact sheets and one MCQ JSONL per workload under `work`; facts about the prompts."""
    from PIL import Image

    from physreason.data.synth.generate import generate_task
    from physreason.models.inputs import load_processor_params
    from physreason.vision import load_image, load_video

    synth = work / "synth"
    generate_task(SYNTH_TASK, clips, synth, "train", 0, workers, show_progress=False, option_order="fixed")
    task_dir = synth / SYNTH_TASK
    qa = json.loads((task_dir / f"{SYNTH_TASK}_benchmark_qa_pairs.json").read_text())
    vision = vision_settings(tiny)
    sheets = work / "sheets"
    sheets.mkdir(parents=True, exist_ok=True)
    files = {name: work / f"mcq_{name}.jsonl" for name in WORKLOADS}
    lines: dict[str, list[str]] = {name: [] for name in WORKLOADS}
    video_frames = image_size = None
    for index, record in enumerate(qa):
        pair = record["qa_pairs"]
        flat = {"id": f"clip-{index}", "question": pair["question"], "options": pair["index2ans"],
                "answer": pair["answer"]}  # fmt: skip
        clip = task_dir / record["video"]
        frames = load_video(clip, vision).frames  # [T, H, W, 3] as the engine and the policy get them
        sheet = sheets / f"{clip.stem}.png"
        if not sheet.is_file():
            Image.fromarray(contact_sheet(frames)).save(sheet)
        video_frames = list(frames.shape[:3])
        image_size = list(load_image(sheet, vision).shape[:2])  # after physreason's image resizing (a no-op here)
        lines["video"].append(json.dumps({**flat, "video": str(clip.relative_to(work))}))
        lines["image"].append(json.dumps({**flat, "image": str(sheet.relative_to(work))}))
        text = f"{scene_words(text_words)}. {pair['question']}" if text_words else pair["question"]
        lines["text"].append(json.dumps({**flat, "question": text}))
    for name, path in files.items():
        path.write_text("\n".join(lines[name]) + "\n")
    params = load_processor_params(str(model))
    patch, merge = params.patch_size, params.merge_size
    frames_t, height, width = video_frames
    video_tokens = math.ceil(frames_t / params.temporal_patch_size) * (height // patch) * (width // patch) // merge**2
    image_tokens = (image_size[0] // patch) * (image_size[1] // patch) // merge**2
    return {"files": {name: str(path) for name, path in files.items()}, "clips": len(qa),
            "video_frames_thw": video_frames, "video_tokens": video_tokens, "image_hw": image_size,
            "image_tokens": image_tokens, "vision": vision.model_dump()}  # fmt: skip


def vision_attention_of(model: Any) -> str:
    """What the model's vision attention modules run: "grouped <kernel> (varlen)", "<kernel> per-window loop", or
    "no vision tower"."""
    from physreason.models.vision_attention import ATTENTION_CLASSES, WRAPPED_KERNELS, registered_name

    names = sorted({m.config._attn_implementation for m in model.modules() if type(m).__name__ in ATTENTION_CLASSES})
    if not names:
        return "no vision tower"
    grouped = {registered_name(kernel): kernel for kernel in WRAPPED_KERNELS}
    return ", ".join(f"grouped {grouped[n]} (varlen)" if n in grouped else f"{n} per-window loop" for n in names)


def set_vision_attention(model: Any, mode: str) -> str:
    """Give a loaded model's vision tower physreason's grouped attention and linear patch embedding ("varlen": what
    physreason's loader gives its own policy) or leave transformers' own ("native"); returns what its attention now
    runs. The modules read `_attn_implementation` at every forward, and the patch embedding's class is switched in
    place, so this holds for all later forwards of the trainer's model."""
    from physreason.models.patch_embed import use_linear_patch_embed
    from physreason.models.vision_attention import use_grouped_vision_attention

    if mode not in TRL_VISION_ATTENTION:
        raise ValueError(f"vision attention mode {mode!r} not among {TRL_VISION_ATTENTION}")
    if mode == "varlen":
        use_grouped_vision_attention(model)
        use_linear_patch_embed(model)
    return vision_attention_of(model)


# ---------------------------------------------------------------------------------------------------------------
# physreason run (child process)


def physreason_config(spec: dict[str, Any], workload: str, output: Path, packed: bool = True):
    """The bench's GRPO recipe as a physreason Config (bench/RESULTS.md says it); packed: the `physreason` side."""
    from types import SimpleNamespace

    from physreason.config import load_config

    bf16, completions = spec["bf16"], spec["prompts"] * spec["n"]
    every = spec.get("checkpoint_every", "1")  # train.checkpoint_every: a whole number as text, or "auto"
    overrides = harness.grpo_settings(spec["model"], spec["data"]["files"][workload], output, SimpleNamespace(**spec),
                              spec["engine"], bf16, spec["warmup"] + spec["steps"], 8192)  # fmt: skip
    overrides += [
        f"train.gradient_checkpointing={'true' if spec.get('recompute', bf16) else 'false'}", "train.optm_lr=1e-5",
        "train.optm_weight_decay=0.01", "train.optm_grad_norm_clip=1.0", "rollout.sampling_config.temperature=1.0",
        "rollout.sampling_config.top_p=1.0", "rollout.sampling_config.repetition_penalty=1.0",
        "rollout.sampling_config.ignore_eos=true", "rollout.sampling_config.suppress_vision_tokens=true",
        f"grpo.mini_batch={completions if packed else spec['mini_batch']}",
        f"grpo.mini_batch_tokens={spec['mini_batch_tokens'] if packed else 0}",
        f"grpo.pack_completions={'true' if packed else 'false'}", "grpo.loss_agg_mode='token-mean'",
        f"grpo.packed_attention='{spec.get('packed_attention', 'mask') if packed else 'mask'}'",
        f"train.compile={'true' if spec.get('compile') else 'false'}",
        f"train.checkpoint_every={every if every != 'auto' else repr(every)}",
        f"train.compile_vision={'true' if spec.get('compile') and workload != 'text' else 'false'}",
        "grpo.epsilon_low=0.2", "grpo.epsilon_high=0.2", "grpo.kl_beta=0.0", "grpo.mu_iterations=1",
        "grpo.shuffle_options=false",
        f"grpo.reward_function={{accuracy = {REWARD_WEIGHTS['accuracy']}, format = {REWARD_WEIGHTS['format']}}}",
    ]  # fmt: skip
    overrides += [f"vision.{key}={json.dumps(value)}" for key, value in spec["data"]["vision"].items()
                  if value is not None]  # fmt: skip
    return load_config(None, overrides)


def run_physreason(spec: dict[str, Any], workload: str, packed: bool = True) -> dict[str, Any]:
    """One physreason GRPO run of the workload (packed rows, or padded ones); per-step figures from its metrics."""
    import physreason.models.loading as loading
    from physreason.train.grpo import run_grpo

    started = time.perf_counter()
    output = Path(spec["work"]) / "runs" / f"physreason-{'packed' if packed else 'padded'}-{workload}-{time.time_ns()}"
    config = physreason_config(spec, workload, output, packed)
    # The loader switches every model it loads (policy, and the hf engine's) to grouped vision attention; note what
    # each one ends up running, from the model itself.
    attention: list[str] = []
    switch = loading.use_grouped_vision_attention

    def recorded_switch(model: Any) -> bool:
        applied = switch(model)
        attention.append(vision_attention_of(model))
        return applied

    loading.use_grouped_vision_attention = recorded_switch
    try:
        with harness.recorded_checkpoint_every() as chosen:  # what train.checkpoint_every became at the start
            result = run_grpo(config)
    finally:
        loading.use_grouped_vision_attention = switch
    steps = []
    for metrics in result.metrics:
        samples = round(metrics["perf/samples_per_s"] * metrics["time/step_s"])
        parts = {part: metrics[f"time/{part}_s"] for part in ("generate", "score", "sync")}
        steps.append(step_record(metrics["time/step_s"], parts, own_train_s=metrics["time/train_s"], samples=samples,
                                 prompt_tokens=metrics["rollout/prompt_length_mean"] * samples,
                                 completion_tokens=metrics["rollout/response_length_mean"] * samples))  # fmt: skip
    record = run_record(started, steps, ", ".join(sorted(set(attention))) or "not recorded (the loader was not called)")
    return {**record, "checkpoint_every": chosen[0] if chosen else None}


def step_record(step_s: float, parts: dict[str, float], **counts: Any) -> dict[str, Any]:
    """One step's seconds, its parts' seconds, the rest as train_s, and the counts."""
    return {"step_s": step_s, **{f"{part}_s": value for part, value in parts.items()},
            "train_s": step_s - sum(parts.values()), **counts}  # fmt: skip


def run_record(started: float, steps: list[dict[str, Any]], vision_attention: str) -> dict[str, Any]:
    """A run's result: its steps, its seconds (set-up apart), peak memory and what the vision tower ran."""
    total = time.perf_counter() - started
    return {"steps": steps, "run_s": total, "setup_s": total - sum(s["step_s"] for s in steps),
            "peak_gib": peak_gib(None), "vision_attention": vision_attention}  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# TRL run (child process)


class Sections:
    """Exclusive wall time per named section: a wrapped call's time, less that of wrapped calls inside it."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self._inner: list[float] = []

    def wrap(self, owner: Any, method: str, section: str, after: Callable[[Any], None] | None = None) -> None:
        """Replace owner.method by a timed call that adds to `section`; `after(result)` sees each result."""
        original = getattr(owner, method)

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            sync()
            start = time.perf_counter()
            self._inner.append(0.0)
            try:
                result = original(*args, **kwargs)
                sync()
            finally:
                elapsed = time.perf_counter() - start
                inner = self._inner.pop()
                self.totals[section] += elapsed - inner
                if self._inner:
                    self._inner[-1] += elapsed
            if after is not None:
                after(result)
            return result

        setattr(owner, method, timed)


def mcq_total_reward(completions: list, answer: list[str], options: list[str], **_: Any) -> list[float]:
    """physreason's accuracy + format rewards of each completion (the total run_grpo trains on), for TRL."""
    from physreason.rewards import compute_rewards

    totals = []
    for completion, letter, options_json in zip(completions, answer, options, strict=True):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        rewards = compute_rewards(text, REWARD_WEIGHTS, answer=letter, options=json.loads(options_json))
        totals.append(rewards["total"])
    return totals


def _dataset_from_dict(rows: dict[str, list]):
    """`datasets.Dataset.from_dict`, with a random fingerprint where datasets cannot hash the table (on the GPU machine
    dill raises PicklingError on pyarrow 26's MonthDayNano); the fingerprint only names cache files, never reused."""
    import datasets.arrow_dataset as arrow_dataset
    from datasets.fingerprint import generate_random_fingerprint

    original = arrow_dataset.generate_fingerprint

    def fingerprint(dataset) -> str:
        try:
            return original(dataset)
        except Exception:  # PicklingError from dill, or whatever else the hasher meets
            return generate_random_fingerprint()

    arrow_dataset.generate_fingerprint = fingerprint
    try:
        return arrow_dataset.Dataset.from_dict(rows)
    finally:
        arrow_dataset.generate_fingerprint = original


def trl_dataset(spec: dict[str, Any], workload: str):
    """The workload's prompts as a TRL conversational dataset: the same messages physreason renders, images apart."""
    from PIL import Image

    from physreason.config import DatasetConfig
    from physreason.data.mcq import load_mcq_prompts

    rows: dict[str, list] = defaultdict(list)
    for prompt in load_mcq_prompts(DatasetConfig(name=spec["data"]["files"][workload])):
        system, user = prompt.messages("grpo")
        # String contents: TRL's prepare_multimodal_messages puts one image part before the text of the first user
        # message, the layout physreason's messages have.
        text = "".join(part["text"] for part in user["content"] if part["type"] == "text")
        rows["prompt"].append([system, {"role": "user", "content": text}])
        rows["answer"].append(prompt.answer)
        rows["options"].append(json.dumps(prompt.options))
        if prompt.images:
            rows["image"].append(Image.open(prompt.images[0]).convert("RGB"))
    return _dataset_from_dict(dict(rows))


def trl_processor(model: str):
    """None (TRL loads the model's processor) when torchvision is installed; else the processor without its video half
    (transformers builds Qwen2.5-VL's video processor only with torchvision; TRL never calls it)."""
    import importlib.util

    if importlib.util.find_spec("torchvision") is not None:
        return None
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen2_5_VLProcessor

    class ImageOnlyProcessor(Qwen2_5_VLProcessor):
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument_name != "video_processor":
                return super().check_argument_for_proper_class(argument_name, argument)
            return None

    return ImageOnlyProcessor(
        image_processor=AutoImageProcessor.from_pretrained(model),
        tokenizer=AutoTokenizer.from_pretrained(model),
        video_processor=None,
        chat_template=Path(model, "chat_template.jinja").read_text(),
    )


def trl_config(spec: dict[str, Any], output: Path):
    """The bench's GRPO recipe as a TRL GRPOConfig (the recipe in bench/RESULTS.md)."""
    from trl import GRPOConfig

    vllm = spec["engine"] == "vllm"
    completions = spec["prompts"] * spec["n"]
    return GRPOConfig(
        output_dir=str(output), max_steps=spec["warmup"] + spec["steps"],
        per_device_train_batch_size=spec["mini_batch"], gradient_accumulation_steps=completions // spec["mini_batch"],
        num_generations=spec["n"],
        max_completion_length=spec["response_len"], temperature=1.0, top_p=1.0, repetition_penalty=1.0,
        generation_kwargs=(
            {"ignore_eos": True, "logit_bias": {token: -100.0 for token in spec["vision_token_ids"]}}
            if vllm
            else {"min_new_tokens": spec["response_len"], "suppress_tokens": spec["vision_token_ids"]}
        ),
        loss_type="dapo", epsilon=0.2, epsilon_high=0.2, beta=0.0, num_iterations=1, scale_rewards="group",
        mask_truncated_completions=False, learning_rate=1e-5, weight_decay=0.01, max_grad_norm=1.0,
        optim="adamw_torch_fused" if spec["bf16"] else "adamw_torch", model_init_kwargs={"dtype": "float32"},
        bf16=spec["bf16"], use_cpu=not spec["bf16"], gradient_checkpointing=trl_recompute(spec), use_vllm=vllm,
        vllm_mode="colocate", vllm_gpu_memory_utilization=spec["gpu_memory"], vllm_max_model_length=8192,
        vllm_enable_sleep_mode=False, vllm_importance_sampling_correction=False, save_strategy="no", report_to="none",
        logging_steps=1, disable_tqdm=True, seed=42, dataloader_num_workers=0, torch_compile=bool(spec.get("compile")),
    )  # fmt: skip


def trl_recompute(spec: dict[str, Any]) -> bool:
    """Whether TRL's policy recomputes activations (gradient checkpointing, every block): as physreason's side
    (`recompute`, on by default on a GPU) unless --trl-no-recompute turned TRL's off."""
    return bool(spec.get("recompute", spec["bf16"])) and not spec.get("trl_no_recompute", False)


def run_trl(spec: dict[str, Any], workload: str) -> dict[str, Any]:
    """One TRL GRPOTrainer run of the workload, its sections timed (as bench/RESULTS.md says)."""
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    started = time.perf_counter()
    sections = Sections()
    counts: list[dict[str, float]] = []
    steps: list[dict[str, Any]] = []

    def count_tokens(batch: dict[str, Any]) -> None:
        counts.append({"samples": int(batch["completion_ids"].shape[0]),
                       "prompt_tokens": float(batch["prompt_mask"].sum()),
                       "completion_tokens": float(batch["completion_mask"].sum())})  # fmt: skip

    class StepClock(TrainerCallback):
        """Per optimizer step: wall time and the sections' time since the previous step ended."""

        def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
            sync()
            self.last = time.perf_counter()
            self.seen = dict(sections.totals)

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            sync()
            now = time.perf_counter()
            parts = {p: sections.totals.get(p, 0.0) - self.seen.get(p, 0.0) for p in ("generate", "score", "sync")}
            produced = {k: sum(c[k] for c in counts) for k in ("samples", "prompt_tokens", "completion_tokens")}
            counts.clear()
            steps.append(step_record(now - self.last, parts, **produced))
            self.last, self.seen = now, dict(sections.totals)

    output = Path(spec["work"]) / "runs" / f"trl-{workload}-{time.time_ns()}"
    trainer = GRPOTrainer(model=spec["model"], reward_funcs=mcq_total_reward, args=trl_config(spec, output),
                          train_dataset=trl_dataset(spec, workload), processing_class=trl_processor(spec["model"]),
                          callbacks=[StepClock()])  # fmt: skip
    vision_attention = set_vision_attention(trainer.model, spec["trl_vision_attention"])
    sections.wrap(trainer, "_generate_and_score_completions", "score", after=count_tokens)
    sections.wrap(trainer, "_generate", "generate")
    if getattr(trainer, "vllm_generation", None) is not None:
        sections.wrap(trainer.vllm_generation, "sync_weights", "sync")
    trainer.train()
    return run_record(started, steps, vision_attention)


# ---------------------------------------------------------------------------------------------------------------
# parent: data, runs, summary


def summarise(steps: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Medians over the timed steps: step seconds, samples/s, tokens/s and each part's share of the step."""
    timed = steps[warmup:]
    if not timed:
        raise ValueError(f"no timed step: the run made {len(steps)} steps with {warmup} warm-up")
    step_s = statistics.median(s["step_s"] for s in timed)
    samples = statistics.median(s["samples"] for s in timed)
    prompt_tokens = statistics.median(s["prompt_tokens"] for s in timed)
    completion_tokens = statistics.median(s["completion_tokens"] for s in timed)
    parts = {part: statistics.median(s[f"{part}_s"] for s in timed) for part in PARTS}
    return {"step_s": step_s, "samples_per_step": samples, "samples_per_s": samples / step_s,
            "tokens_per_s": (prompt_tokens + completion_tokens) / step_s,
            "completion_tokens_per_s": completion_tokens / step_s,
            "prompt_tokens_per_sample": prompt_tokens / max(samples, 1),
            "completion_tokens_per_sample": completion_tokens / max(samples, 1),
            **{f"{part}_s": value for part, value in parts.items()},
            **{f"{part}_share": value / step_s for part, value in parts.items()}}  # fmt: skip


def run_child(side: str, workload: str, spec_path: Path, work: Path, timeout: int) -> dict[str, Any]:
    """Run one side on one workload in a fresh process; its result, or why it failed with its log's tail."""
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%H%M%S")
    log_path, result_path = logs / f"{side}-{workload}-{stamp}.log", logs / f"{side}-{workload}-{stamp}.json"
    command = [sys.executable, str(Path(__file__).resolve()), "--child", side, "--workload", workload]
    command += ["--spec", str(spec_path), "--result", str(result_path)]
    print(f"run: {side} on {workload} ...", flush=True)
    started = time.perf_counter()
    code = harness.run_logged(command, log_path, timeout, env=harness.child_env())
    wall = time.perf_counter() - started
    if code == 0 and result_path.is_file():
        result = json.loads(result_path.read_text())
        print(f"run: {side} on {workload} done in {wall:.0f} s", flush=True)
        return {"ok": True, "log": str(log_path), **result}
    tail = log_path.read_text(errors="replace")[-4000:]
    reason = f"timed out after {timeout} s" if code is None else f"exit code {code}"
    print(f"run: {side} on {workload} FAILED ({reason}); log {log_path}\n{tail[-1500:]}", flush=True)
    return {"ok": False, "error": reason, "log": str(log_path), "log_tail": tail}


def child_main(args: argparse.Namespace) -> None:
    """Entry point of a run's process: run one side on one workload, write its result, exit at once."""
    spec = json.loads(args.spec.read_text())
    if args.child == "trl":
        result = run_trl(spec, args.workload)
    else:
        result = run_physreason(spec, args.workload, packed=args.child == "physreason")
    result["allocator"] = allocator_in_use()
    args.result.write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    # vLLM's engine threads can hold a finished process open; the result is written.
    os._exit(0)


def allocator_in_use() -> dict[str, Any]:
    """This run's allocator at its end: the setting in its environment (physreason's training processes set one when
    there is none) and whether torch's segments are expandable (None without a GPU or a snapshot field to tell)."""
    import torch

    from physreason.train.allocator import user_alloc_conf

    conf = user_alloc_conf()
    expandable = None
    if torch.cuda.is_available():
        flags = [seg["is_expandable"] for seg in torch.cuda.memory_snapshot() if "is_expandable" in seg]
        expandable = any(flags) if flags else None
    return {"setting": "=".join(conf) if conf else None, "expandable_segments": expandable}


def samples_per_s_ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    """samples/s of each physreason side over TRL's on the same workload (physreason's video over TRL's image, the
    workload with as many visual tokens that TRL can take), and packed over padded physreason."""
    table = {(r["workload"], r["side"]): r["summary"] for r in rows if r.get("summary")}
    ratios = {}
    pairs = [(w, side, w, "trl") for w in WORKLOADS for side in SIDES[1:]]
    pairs += [("video", side, "image", "trl") for side in SIDES[1:]]
    pairs += [(w, "physreason", w, "physreason-padded") for w in WORKLOADS]
    for workload, side, base_workload, base_side in pairs:
        if (workload, side) in table and (base_workload, base_side) in table:
            name = f"{side} {workload} / {base_side} {base_workload}"
            ratios[name] = table[workload, side]["samples_per_s"] / table[base_workload, base_side]["samples_per_s"]
    return ratios


def format_table(rows: list[dict[str, Any]]) -> str:
    """A markdown table of the summaries, one row per (workload, side)."""
    head = "| workload | side | step s | samples/s | tokens/s | completion tok/s | generate | score | train | sync | peak GiB |"
    lines = [head, "|" + "---|" * 11]
    for row in rows:
        if not row.get("summary"):
            lines.append(f"| {row['workload']} | {row['side']} | {row.get('error', 'n/a')} |" + " |" * 8)
            continue
        s = row["summary"]
        peak = f"{row['peak_gib']:.1f}" if row.get("peak_gib") is not None else "n/a"
        shares = " | ".join(f"{s[f'{part}_share']:.0%}" for part in PARTS)
        lines.append(
            f"| {row['workload']} | {row['side']} | {s['step_s']:.2f} | {s['samples_per_s']:.2f} | "
            f"{s['tokens_per_s']:.0f} | {s['completion_tokens_per_s']:.0f} | {shares} | {peak} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    """Prepare the model and data, run the sides interleaved, print the table and write the JSON."""
    args = parse_args(argv)
    if args.child:
        child_main(args)
        return None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(harness.REPO))
    from physreason.train.allocator import EXPANDABLE_SEGMENTS, user_alloc_conf

    if user_alloc_conf() is None and args.allocator == "expandable":
        # physreason's training processes set expandable segments themselves (physreason.train.allocator); TRL's
        # process gets the same, as its users set it after the default allocator's out-of-memory error (RESULTS.md).
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = EXPANDABLE_SEGMENTS
    allocator = "=".join(user_alloc_conf() or ("PYTORCH_CUDA_ALLOC_CONF", "unset (inherit)"))
    import importlib.util

    import torch
    from shapes import build_model_folder

    engine = args.engine
    if engine == "auto":
        engine = "vllm" if importlib.util.find_spec("vllm") is not None and not args.tiny else "hf"
    work = args.work / ("tiny" if args.tiny else "3b")
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    model = build_model_folder(work / ("model-tiny" if args.tiny else "model-3b"), "qwen2.5-vl-3b", args.tiny)
    clips = min(64, args.prompts * (args.warmup + args.steps))
    data = prepare_data(work, model, clips, args.text_words, args.tiny, workers=min(4, os.cpu_count() or 1))
    from transformers import AutoConfig

    from physreason.models.family import vision_special_token_ids

    spec = {"model": str(model), "vision_token_ids": vision_special_token_ids(AutoConfig.from_pretrained(model)),
            "work": str(work), "engine": engine, "bf16": not args.tiny and torch.cuda.is_available(),
            "recompute": not args.tiny and torch.cuda.is_available() and not args.no_recompute,
            "trl_no_recompute": args.trl_no_recompute,
            "gpu_memory": args.gpu_memory, "trl_vision_attention": args.trl_vision_attention, "data": data,
            "packed_attention": args.packed_attention, "compile": args.compile,
            "checkpoint_every": args.checkpoint_every,
            **{name: getattr(args, name) for name in ("prompts", "n", "response_len", "mini_batch", "mini_batch_tokens",
                                                      "steps", "warmup")}}  # fmt: skip
    spec_path = work / "spec.json"
    spec_path.write_text(json.dumps(spec, indent=2))
    info = harness.device_info()
    device = info["device"]
    print(
        f"{device}, engine {engine}: {args.prompts} prompts x {args.n} completions of {args.response_len} tokens per "
        f"step, micro-batch {args.mini_batch} (physreason: packed rows, attention from the {args.packed_attention}); "
        f"{'both sides compiled' if args.compile else 'neither side compiled'}; "
        f"recompute: {recompute_words(spec)}; allocator {allocator} on both sides; "
        f"clip {data['video_frames_thw']} frames -> {data['video_tokens']} video "
        f"tokens, contact sheet {data['image_hw']} -> {data['image_tokens']} image tokens; setup "
        f"{time.perf_counter() - started:.0f} s",
        flush=True,
    )
    have_trl = importlib.util.find_spec("trl") is not None
    setup = {"device": device, "engine": engine, "data": data, "args": setup_args(args), "allocator": allocator}
    runs: list[dict[str, Any]] = earlier_runs(harness.out_file(JSON_NAME), setup) if args.append else []
    first_round = max((r["round"] for r in runs), default=-1) + 1
    for round_index in range(first_round, first_round + args.rounds):
        order = list(args.sides) if round_index % 2 == 0 else list(reversed(args.sides))
        for workload in args.workloads:
            for side in order:
                record: dict[str, Any] = {"workload": workload, "side": side, "round": round_index}
                if side == "trl" and workload not in TRL_WORKLOADS:
                    record.update(ok=False, error="TRL cannot take video", reason=TRL_VIDEO)
                elif side == "trl" and not have_trl:
                    record.update(ok=False, error="trl is not installed")
                else:
                    record.update(run_child(side, workload, spec_path, work, args.run_timeout))
                runs.append(record)

    workloads = [w for w in WORKLOADS if w in args.workloads or any(r["workload"] == w for r in runs)]
    sides = [*args.sides, *(s for s in SIDES if s not in args.sides and any(r["side"] == s for r in runs))]
    rows = table_rows(runs, workloads, sides, args.warmup)
    ratios = samples_per_s_ratios(rows)

    rounds = len({r["round"] for r in runs})
    print(f"\nGRPO step, physreason vs TRL on {device} (medians of {args.steps} steps x {rounds} rounds)\n")
    print(format_table(rows))
    for row in rows:
        if row.get("vision_attention"):
            print(f"vision attention, {row['side']} on {row['workload']}: {row['vision_attention']}")
    allocators = {(r["side"], r["workload"], json.dumps(r["allocator"], sort_keys=True)) for r in runs if r.get("allocator")}
    for side, workload, seen in sorted(allocators):
        print(f"allocator, {side} on {workload}: {json.loads(seen)}")
    for run in runs:
        if run.get("checkpoint_every") is not None and not args.no_recompute:  # nothing recomputed: no choice to show
            print(f"train.checkpoint_every, {run['side']} on {run['workload']}, round {run['round'] + 1}: "
                  f"{run['checkpoint_every']} (asked {args.checkpoint_every})")  # fmt: skip
    if rounds > 1:  # each round's own ratio, the spread beside the pooled one
        for number in sorted({r["round"] for r in runs}):
            alone = [r for r in runs if r["round"] == number]
            for name, value in samples_per_s_ratios(table_rows(alone, workloads, sides, args.warmup)).items():
                print(f"samples/s ratio, round {number + 1}, {name}: {value:.2f}x")
    for name, value in ratios.items():
        print(f"samples/s ratio, {name}: {value:.2f}x")
    if "video" in workloads and "trl" in sides:
        print(f"TRL on video: {TRL_VIDEO}")
    packages = ("torch", "transformers", "vllm", "trl", "accelerate", "datasets")
    payload = {**info, "engine": engine, "versions": harness.versions(*packages),
               "args": {k: str(v) for k, v in vars(args).items() if k not in ("child", "workload", "spec", "result")},
               "setup": setup["args"], "data": data, "rows": rows, "ratios_samples_per_s": ratios, "runs": runs,
               "trl_video": TRL_VIDEO, "allocator": allocator}  # fmt: skip
    write_json(JSON_NAME, payload)
    return payload


def recompute_words(spec: dict[str, Any]) -> str:
    """What each side recomputes, for the run's first line ('physreason every block, TRL every block')."""
    if not spec.get("recompute", spec["bf16"]):
        physreason = "nothing"
    elif spec.get("checkpoint_every", "1") == "auto":
        physreason = "blocks as its plan chooses (checkpoint_every auto)"
    elif spec.get("checkpoint_every", "1") == "1":
        physreason = "every block"
    else:
        physreason = f"one block in {spec['checkpoint_every']} (checkpoint_every {spec['checkpoint_every']})"
    return f"physreason {physreason}, TRL {'every block' if trl_recompute(spec) else 'nothing'}"


JSON_NAME = "grpo_vs_trl.json"
# What two calls' runs must share to pool into one table (--append): the step's sizes and both sides' settings.
SETUP_ARGS = ("prompts", "n", "response_len", "mini_batch", "mini_batch_tokens", "steps", "warmup",
              "trl_vision_attention", "text_words", "gpu_memory", "tiny", "no_recompute", "packed_attention",
              "compile", "checkpoint_every", "trl_no_recompute")  # fmt: skip


def setup_args(args: argparse.Namespace) -> dict[str, Any]:
    """The arguments that make a run comparable with another's (SETUP_ARGS)."""
    return {name: getattr(args, name) for name in SETUP_ARGS}


def earlier_runs(path: Path | None, setup: dict[str, Any]) -> list[dict[str, Any]]:
    """--append: the runs in the JSON at `path` (none when there is no file yet), refused when that JSON was measured
    on another device or engine, on other data or with other sizes: its rounds would not pool with this call's."""
    if path is None:
        raise SystemExit("--append needs the JSON's place: set OUT (the runs are read from $OUT/grpo_vs_trl.json)")
    if not path.is_file():
        return []
    earlier = json.loads(path.read_text())
    theirs = {"device": earlier.get("device"), "engine": earlier.get("engine"), "data": earlier.get("data"),
              "args": earlier.get("setup"), "allocator": earlier.get("allocator")}  # fmt: skip
    if isinstance(theirs["args"], dict):
        # measured before --compile, --checkpoint-every and --trl-no-recompute existed: neither side compiled, every
        # block recomputed on both sides
        theirs["args"] = {"compile": False, "checkpoint_every": "1", "trl_no_recompute": False, **theirs["args"]}
    for key, value in setup.items():
        ours = json.loads(json.dumps(value, default=str))
        if theirs[key] != ours:
            if isinstance(ours, dict) and isinstance(theirs[key], dict):  # name the settings that differ
                differ = sorted(k for k in {*ours, *theirs[key]} if ours.get(k) != theirs[key].get(k))
                ours = {k: ours.get(k) for k in differ}
                theirs[key] = {k: theirs[key].get(k) for k in differ}
            raise SystemExit(f"--append: {path} was measured with another {key} ({theirs[key]!r}, this call "
                             f"{ours!r}): pool only one setup's runs on one machine; move that file aside")  # fmt: skip
    return list(earlier.get("runs", []))


def table_rows(runs: list[dict[str, Any]], workloads: list[str], sides: list[str], warmup: int) -> list[dict[str, Any]]:
    """One row per workload and side: the medians over every timed step (after `warmup`) of all its finished runs."""
    rows = []
    for workload in workloads:
        for side in sides:
            mine = [r for r in runs if r["workload"] == workload and r["side"] == side]
            done = [r for r in mine if r.get("ok")]
            row: dict[str, Any] = {"workload": workload, "side": side}
            if done:
                steps = [s for r in done for s in r["steps"][warmup:]]
                row["summary"] = summarise(steps, 0)
                row["peak_gib"] = max((r["peak_gib"] for r in done if r["peak_gib"] is not None), default=None)
                row["setup_s"] = statistics.median(r["setup_s"] for r in done)
                row["vision_attention"] = ", ".join(sorted({r.get("vision_attention", "not recorded") for r in done}))
            else:
                row["error"] = mine[0].get("error", "not run") if mine else "not run"
            rows.append(row)
    return rows


if __name__ == "__main__":
    main()
