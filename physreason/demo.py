"""The README's main job: the whole physreason loop on a tiny model, on CPU, with no downloads.

Builds a tiny random Qwen2.5-VL model, generates intuitive-physics clips (arrow of time, spatial
puzzle, object permanence), evaluates the model, fine-tunes it with SFT on the generated reasoning
traces, evaluates again, and prints the accuracy table. A tiny random model on a few dozen clips
shows that every stage runs end to end; the GPU runs in bench/RESULTS.md show what the stages
achieve at scale.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from physreason.chat.mcq import format_mcq
from physreason.chat.prompts import MCQ_SYSTEM_PROMPT, REASON2_SYSTEM_PROMPT
from physreason.config import Config, load_config
from physreason.data.synth.tasks import JSON_TASK_NAMES, LETTER_TASK_NAMES, TASKS
from physreason.errors import PhysReasonError

console = Console()


@dataclass
class DemoSizes:
    """How much the demo generates and trains (defaults fit a few minutes on 2 CPU cores)."""

    train_per_task: int = 60
    test_per_task: int = 30
    sft_steps: int = 80
    grpo_steps: int = 12
    max_tokens: int = 8


def _stage(title: str) -> float:
    console.rule(f"[bold]{title}")
    return time.perf_counter()


def write_records(out_file: Path, rows: Sequence[dict]) -> int:
    """Write `rows` as JSONL to `out_file` through a temporary file of this process's own, renamed over it; returns
    the count. Processes that write the same records at once (the benches' seeds run side by side) each replace the
    file whole, so none of them ever reads a partly written one."""
    handle, temporary = tempfile.mkstemp(dir=out_file.parent, prefix=f".{out_file.name}.", suffix=".tmp")
    with os.fdopen(handle, "w", encoding="utf-8") as sink:
        sink.writelines(json.dumps(row) + "\n" for row in rows)
    os.replace(temporary, out_file)
    return len(rows)


def letter_sft_records(data_root: Path, out_file: Path, tasks: Sequence[str] = LETTER_TASK_NAMES) -> int:
    """Write one SFT file of letter-answer conversations from every task's benchmark records under `data_root`.

    A tiny model on CPU cannot write the generated reasoning traces (hundreds of tokens each) in a
    demo's time, so the demo trains and evaluates the benchmark's `letter` answer type: the same
    prompt the evaluation builds, answered with the option letter.
    """
    rows = []
    for task in tasks:
        entries = json.loads((data_root / task / f"{task}_benchmark_qa_pairs.json").read_text(encoding="utf-8"))
        for entry in entries:
            qa = entry["qa_pairs"]
            conversation = [
                {"role": "system", "content": MCQ_SYSTEM_PROMPT},
                {"role": "user", "content": format_mcq(qa["question"], qa["index2ans"], "letter")},
                {"role": "assistant", "content": qa["answer"]},
            ]
            rows.append({"video": f"{task}/{entry['video']}", "conversations": conversation})
    return write_records(out_file, rows)


def json_sft_records(data_root: Path, out_file: Path, tasks: Sequence[str] = JSON_TASK_NAMES) -> int:
    """Write one SFT file of answer-only conversations from the JSON-answer tasks' benchmark records under `data_root`.

    The prompt is the one evaluation and GRPO send for a structured question (Cosmos-Reason2's: "You are a helpful
    assistant." and the task prompt as written, no reasoning instruction); the assistant turn is the JSON answer
    alone, without the generated reasoning, for a model too small to write it.
    """
    rows = []
    for task in tasks:
        entries = json.loads((data_root / task / f"{task}_benchmark_qa_pairs.json").read_text(encoding="utf-8"))
        for entry in entries:
            qa = entry["qa_pairs"]
            conversation = [
                {"role": "system", "content": REASON2_SYSTEM_PROMPT},
                {"role": "user", "content": qa["question"]},
                {"role": "assistant", "content": qa["answer"]},
            ]
            rows.append({"video": f"{task}/{entry['video']}", "conversations": conversation})
    return write_records(out_file, rows)


def rl_records(data_root: Path, out_file: Path, tasks: Sequence[str] = LETTER_TASK_NAMES) -> int:
    """Join the tasks' benchmark records under `data_root` into one JSONL of GRPO prompts."""
    rows = []
    for task in tasks:
        entries = json.loads((data_root / task / f"{task}_benchmark_qa_pairs.json").read_text(encoding="utf-8"))
        rows += [{**entry, "video": f"{task}/{entry['video']}"} for entry in entries]
    return write_records(out_file, rows)


def grpo_config(cfg: Config, out: Path, model_dir: Path, sizes: DemoSizes) -> Config:
    """GRPO from the fine-tuned model on the training clips: letter prompts, accuracy reward, 4 samples per prompt."""
    recipe = load_config(
        None,
        values={
            "data.dataset.name": str(out / "data" / "train" / "rl.jsonl"),
            "data.num_workers": 0,
            "train.output_dir": str(out / "grpo"),
            "train.max_steps": sizes.grpo_steps,
            "train.train_batch_per_replica": 16,
            "train.optm_lr": 5e-4,
            "train.optm_decay_type": "constant",
            "train.param_dtype": "float32",
            "train.gradient_checkpointing": False,
            "train.ckpt.save_freq": sizes.grpo_steps,
            "train.ckpt.max_keep": 1,
            "rollout.n_generation": 4,
            "rollout.batch_size": 4,
            "rollout.max_response_length": 4,
            "rollout.sampling_config.temperature": 1.0,
            "rollout.sampling_config.top_p": 1.0,
            "rollout.sampling_config.repetition_penalty": 1.0,
            "grpo.answer_type": "letter",
            "grpo.reward_function": {"accuracy": 1.0},
            "grpo.mini_batch": 8,
        },
    )
    return recipe.model_copy(
        update={"model": _with_model(cfg, model_dir).model, "engine": cfg.engine, "vision": cfg.vision, "logging": cfg.logging}
    )


def demo_config(out: Path, model_dir: Path, sizes: DemoSizes) -> Config:
    """One recipe for every stage: small frames, greedy letter answers, a short SFT run."""
    return load_config(
        None,
        values={
            "model.model_name_or_path": str(model_dir),
            "model.dtype": "float32",
            "model.model_max_length": 4096,
            "engine.backend": "hf",
            "engine.batch_size": 12,
            "vision.min_pixels": 12544,
            "vision.max_pixels": 25088,
            "vision.total_pixels": 200704,
            "vision.max_frames": 12,
            "generation.temperature": 0,
            "generation.repetition_penalty": 1.0,
            "generation.max_tokens": sizes.max_tokens,
            "eval.benchmark_root": str(out / "data" / "test"),
            "eval.datasets": list(LETTER_TASK_NAMES),
            "eval.answer_type": "letter",
            "data.dataset.name": str(out / "data" / "train" / "sft.jsonl"),
            "data.num_workers": 0,
            "data.val_fraction": 0,
            "train.output_dir": str(out / "sft"),
            "train.max_steps": sizes.sft_steps,
            "train.train_batch_per_replica": 8,
            "train.mini_batch": 4,
            "train.optm_lr": 2e-3,
            "train.optm_warmup_steps": 3,
            "train.param_dtype": "float32",
            "train.gradient_checkpointing": False,
            "train.ckpt.save_freq": sizes.sft_steps,
            "train.ckpt.max_keep": 1,
            "logging.logger": ["jsonl"],
        },
    )


def _with_model(cfg: Config, model_dir: Path) -> Config:
    """The same recipe pointed at another model folder (a stage's export)."""
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"model_name_or_path": str(model_dir)})})


def _evaluate(cfg: Config, label: str, results_dir: Path) -> dict[str, float | None]:
    from physreason.eval.launch import run_eval
    from physreason.eval.report import collect_reports

    cfg = cfg.model_copy(deep=True)
    cfg.eval.results_dir = str(results_dir / label)
    run_eval(cfg, show_progress=True)
    return {r.dataset: r.mean_std()[0] for r in collect_reports(cfg.eval.results_dir)}


def _finished_export(output_dir: Path, steps: int) -> Path | None:
    """The safetensors export of a training run that reached `steps` (an earlier demo's), or None."""
    folder = output_dir / "safetensors" / f"step_{steps}"
    return folder if (folder / "config.json").is_file() else None


def run_demo(out: str | Path = "demo-out", sizes: DemoSizes | None = None) -> dict[str, dict[str, float | None]]:
    """Run every stage under `out` (reruns reuse finished stages) and return accuracy per stage and task."""
    from physreason.data.synth.generate import generate_task
    from physreason.models.tiny import save_tiny_model
    from physreason.train.grpo import run_grpo
    from physreason.train.sft import run_sft

    sizes = sizes or DemoSizes()
    out = Path(out).resolve()
    start = _stage("1/7 tiny Qwen2.5-VL model (random weights)")
    model_dir = out / "model"
    if not (model_dir / "model.safetensors").is_file():
        save_tiny_model("qwen2_5_vl", model_dir)
    console.print(f"model: {model_dir} ({time.perf_counter() - start:.1f} s)")

    start = _stage("2/7 intuitive-physics clips")
    for split, n in (("train", sizes.train_per_task), ("test", sizes.test_per_task)):
        for task in LETTER_TASK_NAMES:
            generate_task(task, n, out / "data" / split, split, base_seed=0, workers=2, show_progress=False)
        console.print(f"{split}: {n} clips per task in {out / 'data' / split}")
    letter_sft_records(out / "data" / "train", out / "data" / "train" / "sft.jsonl")
    rl_records(out / "data" / "train", out / "data" / "train" / "rl.jsonl")
    console.print(f"({time.perf_counter() - start:.1f} s)")

    cfg = demo_config(out, model_dir, sizes)
    table: dict[str, dict[str, float | None]] = {}
    start = _stage("3/7 evaluate the base model")
    table["base model"] = _evaluate(cfg, "base", out / "results")
    console.print(f"({time.perf_counter() - start:.1f} s)")

    start = _stage("4/7 supervised fine-tuning (letter answers)")
    sft_export = _finished_export(Path(cfg.train.output_dir), sizes.sft_steps)
    if sft_export is None:
        cfg.train.resume = True  # a demo stopped during SFT continues from its last checkpoint
        result = run_sft(cfg)
        if result.losses:
            first, last = result.losses[0], result.losses[-1]
            console.print(f"SFT loss {first:.3f} -> {last:.3f} over {len(result.losses)} steps")
        if result.export_dir is None:
            raise PhysReasonError("the SFT run exported no model; check train.ckpt.export_safetensors")
        sft_export = result.export_dir
    console.print(f"fine-tuned model: {sft_export} ({time.perf_counter() - start:.1f} s)")

    start = _stage("5/7 evaluate the fine-tuned model")
    table["after SFT"] = _evaluate(_with_model(cfg, sft_export), "sft", out / "results")
    console.print(f"({time.perf_counter() - start:.1f} s)")

    start = _stage("6/7 GRPO from the fine-tuned model (accuracy reward)")
    rl_cfg = grpo_config(cfg, out, sft_export, sizes)
    rl_export = _finished_export(Path(rl_cfg.train.output_dir), sizes.grpo_steps)
    if rl_export is None:
        rl_cfg.train.resume = True
        rl = run_grpo(rl_cfg)
        if rl.rewards:
            console.print(f"mean reward {rl.rewards[0]:.3f} -> {rl.rewards[-1]:.3f} over {len(rl.rewards)} steps")
        if rl.export_dir is None:
            raise PhysReasonError("the GRPO run exported no model; check train.ckpt.export_safetensors")
        rl_export = rl.export_dir
    console.print(f"GRPO model: {rl_export} ({time.perf_counter() - start:.1f} s)")

    start = _stage("7/7 evaluate the GRPO model")
    table["after SFT+GRPO"] = _evaluate(_with_model(cfg, rl_export), "grpo", out / "results")
    console.print(f"({time.perf_counter() - start:.1f} s)")

    print_table(table, sizes.test_per_task)
    return table


def print_table(table: dict[str, dict[str, float | None]], test_per_task: int) -> None:
    """Accuracy (%) per stage and task, beside chance."""
    view = Table(title=f"held-out accuracy (%), {test_per_task} clips per task")
    view.add_column("model")
    for task in LETTER_TASK_NAMES:
        view.add_column(task, justify="right")
    view.add_row("chance", *(f"{100 * TASKS[t].chance:.1f}" for t in LETTER_TASK_NAMES))
    for stage, scores in table.items():
        view.add_row(stage, *("-" if scores.get(t) is None else f"{100 * scores[t]:.1f}" for t in LETTER_TASK_NAMES))
    console.print(view)
