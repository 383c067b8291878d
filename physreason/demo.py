"""The README's main job: the whole physreason loop on a tiny model, on CPU, with no downloads.

Builds a tiny random Qwen2.5-VL model, generates intuitive-physics clips (arrow of time, spatial
puzzle, object permanence; options in one fixed order), evaluates the model, pre-trains its vision
tower on the training clips with a dense loss (physreason.train.tower: the stand-in for the pre-trained
encoder released VLMs start from, without which a random model stays at chance), fine-tunes it with SFT
on letter answers with the tower fixed (the spatial puzzle's clips and a few control clips of the other tasks by
default), evaluates again, runs GRPO on SFT's clips, keeps GRPO's weights only when they beat SFT's on validation
clips beyond the noise, evaluates, and prints the accuracy table of held-out clips beside chance and the band a
guessing model lands in, the demo's own checks of that table, and what each stage cost in wall and CPU seconds. The
GPU runs in bench/RESULTS.md show what the same stages achieve at scale.
"""

from __future__ import annotations

import json
import resource
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rich.table import Table

from physreason.config import Config, load_config, with_model
from physreason.data.synth.records import letter_sft_records, rl_records
from physreason.data.synth.tasks import LETTER_TASK_NAMES, TASKS
from physreason.errors import PhysReasonError
from physreason.progress import make_console

console = make_console()


@dataclass
class DemoSizes:
    """How much the demo generates and trains (defaults fit a few minutes on 2 CPU cores).

    The first four fields are positional in the experiments (physreason/experiments/common.py): new ones go last.
    """

    train_per_task: int = 60
    # 48: a whole number of every task's class-and-letter blocks, so each task's held-out classes are balanced exactly
    # (a model that always answers one letter scores chance exactly), and a guess's band is about +-14 points
    test_per_task: int = 48
    sft_steps: int = 150
    grpo_steps: int = 12
    max_tokens: int = 8
    tower_steps: int = 150
    # Tasks whose clips SFT trains on (the tower trains on every task's). The spatial puzzle alone by default: its
    # static cue is the one the pre-trained tower carries within the demo's minutes, and SFT steps spread over three
    # tasks left all three at chance (README, "What the demo does").
    sft_tasks: tuple[str, ...] = ("spatial_puzzle",)
    # Training clips of each SFT task (the others get train_per_task, for the tower and the controls): SFT's 60
    # spatial-puzzle clips, seen for 10 epochs, left it 43 points on two seeds of three (README).
    sft_task_clips: int = 240
    # The first this many training clips of each task SFT does not train on join SFT's and GRPO's data (the
    # controls): taught only the spatial puzzle's four letters, the model fell below chance on the two-option tasks
    # (README). 16: a whole number of their class-and-letter blocks.
    control_clips: int = 16
    # Validation clips (the val split: scenes neither training nor the test has) of each SFT task: GRPO's weights are
    # kept only when they beat the SFT model's here beyond the noise (grpo_kept), so GRPO does not lower the trained
    # task by chance, and the test clips never choose anything.
    val_per_task: int = 96


def reward_windows(rewards: Sequence[float], windows: int = 3) -> list[tuple[int, int, float]]:
    """Mean reward over consecutive windows of steps: (first step, last step, mean), steps counted from 1.

    One step's mean over a few completions is noise (16 binary rewards: a standard error of about 0.12), so a
    first-to-last comparison reads as a trend where there is none; window means show the trend there is.
    """
    size = max(1, -(-len(rewards) // windows))
    return [
        (start + 1, min(start + size, len(rewards)), sum(rewards[start : start + size]) / len(rewards[start : start + size]))
        for start in range(0, len(rewards), size)
    ]


def reward_trend(rewards: Sequence[float], windows: int = 3) -> str:
    """One plain sentence on the step-mean `rewards`: the first and last windows' means, and whether the change
    exceeds twice its standard error (from the spread of the steps within each window); "" for fewer than 2 windows.

    A fall beyond the noise is said to be a fall: the summary must not read as progress, nor as a regression, on
    its own.
    """
    spans = reward_windows(rewards, windows)
    if len(spans) < 2:
        return ""
    (a0, a1, first), (b0, b1, last) = spans[0], spans[-1]

    def variance_of_mean(lo: int, hi: int, mean: float) -> float:
        steps = rewards[lo - 1 : hi]
        return sum((r - mean) ** 2 for r in steps) / max(1, len(steps) - 1) / len(steps)

    error = (variance_of_mean(a0, a1, first) + variance_of_mean(b0, b1, last)) ** 0.5
    change = last - first
    if abs(change) <= 2 * error:
        verdict = "no change beyond the step-to-step noise"
    else:
        verdict = "it rose" if change > 0 else "it fell"
    return (
        f"from {first:.3f} (steps {a0}-{a1}) to {last:.3f} (steps {b0}-{b1}): {change:+.3f}, standard error "
        f"{error:.3f}; {verdict}"
    )


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process and of its finished children (the tower's decoding workers)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _stage(title: str) -> tuple[float, float]:
    """Print the stage's title; returns its start (wall seconds, CPU seconds) for `_took`."""
    console.rule(f"[bold]{title}")
    return time.perf_counter(), _cpu_seconds()


def _took(start: tuple[float, float]) -> str:
    """Wall and CPU seconds since `start`: on shared cores the wall time says little, the CPU time what it cost."""
    return f"{time.perf_counter() - start[0]:.1f} s, {_cpu_seconds() - start[1]:.1f} CPU-s"


def grpo_config(cfg: Config, out: Path, model_dir: Path, sizes: DemoSizes) -> Config:
    """GRPO from the fine-tuned model on SFT's clips (`rl_file`): letter prompts, accuracy reward, 8 samples a prompt."""
    recipe = load_config(
        None,
        values={
            "data.dataset.name": str(rl_file(out, sizes)),
            "data.num_workers": 0,
            "train.output_dir": str(out / "grpo"),
            "train.max_steps": sizes.grpo_steps,
            "train.seed": cfg.train.seed,
            "train.train_batch_per_replica": 32,
            # A fortieth of SFT's rate: GRPO refines the fine-tuned model, its reward being 32 samples' noisy mean. At
            # a tenth (2e-4) 12 steps changed 53 of seed 0's 96 validation answers (25 turned right, 28 wrong).
            "train.optm_lr": 5e-5,
            "train.optm_decay_type": "constant",
            "train.param_dtype": "float32",
            "train.gradient_checkpointing": False,
            "train.freeze_vision_tower": sizes.tower_steps > 0,  # as SFT trained the model
            "train.ckpt.save_freq": sizes.grpo_steps,
            "train.ckpt.max_keep": 1,
            "rollout.n_generation": 8,
            "rollout.batch_size": 4,
            "rollout.max_response_length": 4,
            "rollout.sampling_config.temperature": 1.0,
            "rollout.sampling_config.top_p": 1.0,
            "rollout.sampling_config.repetition_penalty": 1.0,
            "grpo.answer_type": "letter",
            # The clips list their options in one fixed order, which SFT learned: reshuffling would ask new questions.
            "grpo.shuffle_options": False,
            "grpo.reward_function": {"accuracy": 1.0},
            "grpo.mini_batch": 16,
        },
    )
    return recipe.model_copy(
        update={"model": with_model(cfg, model_dir).model, "engine": cfg.engine, "vision": cfg.vision, "logging": cfg.logging}
    )


def demo_config(out: Path, model_dir: Path, sizes: DemoSizes, seed: int | None = None) -> Config:
    """One recipe for every stage: small frames, greedy letter answers, a short SFT run (seeded with `seed`; None
    keeps the schema's train.seed, as the intuitive-physics experiment's published runs had it)."""
    cfg = load_config(
        None,
        values={
            "model.model_name_or_path": str(model_dir),
            "model.dtype": "float32",
            "model.model_max_length": 4096,
            "engine.backend": "hf",
            "engine.batch_size": 12,
            # 84x112 frames, 4 per clip (two temporal patches, 24 visual tokens): the GPU recipe's frame size, and a
            # third of its frames, so that tower pre-training and SFT fit a few minutes of 2 CPU cores.
            "vision.min_pixels": 9408,
            "vision.max_pixels": 12544,
            "vision.total_pixels": 200704,
            "vision.max_frames": 4,
            "generation.temperature": 0,
            "generation.repetition_penalty": 1.0,
            "generation.max_tokens": sizes.max_tokens,
            "eval.benchmark_root": str(out / "data" / "test"),
            "eval.datasets": list(LETTER_TASK_NAMES),
            "eval.answer_type": "letter",
            "data.dataset.name": str(sft_file(out, sizes)),
            "data.num_workers": 0,
            "data.val_fraction": 0,
            "train.output_dir": str(out / sft_file(out, sizes).stem),  # other SFT tasks: another run folder
            "train.max_steps": sizes.sft_steps,
            "train.train_batch_per_replica": 8,
            "train.mini_batch": 4,
            "train.optm_lr": 2e-3,
            "train.optm_warmup_steps": 3,
            "train.param_dtype": "float32",
            "train.gradient_checkpointing": False,
            # A tower pre-trained with a dense loss carries what the clips show; a random language model's one
            # letter per clip would only blur it (bench/RESULTS.md: fixed did better than trained on).
            "train.freeze_vision_tower": sizes.tower_steps > 0,
            "train.ckpt.save_freq": sizes.sft_steps,
            "train.ckpt.max_keep": 1,
            "logging.logger": ["jsonl"],
        },
    )
    if seed is not None:
        cfg.train.seed = seed
        # Greedy answers do not depend on it, but the evaluation's folders and progress name it: seed N's run says
        # "seed N", not every seed's "seed 1".
        cfg.eval.seed = seed
    return cfg


def _data_name(sizes: DemoSizes) -> str:
    """Names SFT's data: "sft" for every task, else its tasks and the control clips of the others."""
    if set(sizes.sft_tasks) == set(LETTER_TASK_NAMES):
        return "sft"
    controls = f"-controls{sizes.control_clips}" if sizes.control_clips else ""
    return "sft-" + "-".join(sizes.sft_tasks) + controls


def sft_file(out: Path, sizes: DemoSizes) -> Path:
    """The letter-answer records SFT trains on: every task's, or `sft_tasks`' and the others' first `control_clips`,
    in a file named after them (so each choice trains in a run folder of its own)."""
    return out / "data" / "train" / f"{_data_name(sizes)}.jsonl"


def rl_file(out: Path, sizes: DemoSizes) -> Path:
    """GRPO's prompts: the clips of SFT's records (`sft_file`)."""
    return out / "data" / "train" / f"rl{_data_name(sizes)[3:]}.jsonl"


def _with_controls(rows: list[dict], sizes: DemoSizes) -> list[dict]:
    """The rows of `sft_tasks`, and the first `control_clips` rows of every other task (rows name their task first
    in "video")."""
    kept, seen = [], dict.fromkeys(LETTER_TASK_NAMES, 0)
    for row in rows:
        task = row["video"].split("/")[0]
        if task in sizes.sft_tasks or seen[task] < sizes.control_clips:
            kept.append(row)
        seen[task] += 1
    return kept


def _finished_export(output_dir: Path, steps: int) -> Path | None:
    """The safetensors export of a training run that reached `steps` (an earlier demo's), or None."""
    folder = output_dir / "safetensors" / f"step_{steps}"
    return folder if (folder / "config.json").is_file() else None


DEMO_MARKER = "physreason-demo.json"


def claim_demo_folder(out: Path) -> None:
    """Refuse (ConfigError) an `out` that holds anything but an earlier demo's output, then mark it as the demo's.

    The demo writes a model into out/model and replaces out/data/train/sft.jsonl and rl.jsonl: in a folder of the
    user's own (`--out .`, a project folder with its model and data) that would overwrite them. A folder is the
    demo's when it carries DEMO_MARKER, or (written before the marker) holds the demo's pre-trained tower folder and
    its tiny model.
    """
    from physreason.overwrite import check_replace

    earlier = (out / DEMO_MARKER).is_file() and not (out / DEMO_MARKER).is_symlink()
    legacy = out.is_dir() and (out / "model" / "model.safetensors").is_file() and any(out.glob("model-tower*"))
    check_replace(out, option="--out", marked=earlier or legacy,
                  mark=f"{DEMO_MARKER}, which physreason demo writes", remedy="give a new or empty folder")  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    if not earlier:
        (out / DEMO_MARKER).write_text(json.dumps({"written_by": "physreason demo"}) + "\n", encoding="utf-8")


def run_demo(
    out: str | Path = "demo-out", sizes: DemoSizes | None = None, seed: int = 0
) -> dict[str, dict[str, float | None]]:
    """Run every stage under `out` (reruns reuse finished stages) and return accuracy per stage and task.

    `seed` draws the clips (training, validation and held-out alike), the tower's initialisation and batches, and
    SFT's and GRPO's data order and sampling: another seed is another run of the same recipe, on clips of its own.
    """
    from physreason.data.synth.generate import generate_task
    from physreason.data.synth.records import write_records
    from physreason.eval.launch import accuracy_by_dataset
    from physreason.models.tiny import save_tiny_model
    from physreason.train.grpo import run_grpo
    from physreason.train.sft import run_sft
    from physreason.train.tower import pretrain_tower

    sizes = sizes or DemoSizes()
    out = Path(out).resolve()
    claim_demo_folder(out)
    begun = time.perf_counter(), _cpu_seconds()
    start = _stage("1/8 tiny Qwen2.5-VL model (random weights)")
    model_dir = out / "model"
    if not (model_dir / "model.safetensors").is_file():
        save_tiny_model("qwen2_5_vl", model_dir)
    console.print(f"model: {model_dir} ({_took(start)})")

    start = _stage("2/8 intuitive-physics clips")
    trained = [t for t in LETTER_TASK_NAMES if t in sizes.sft_tasks]
    sets = (("train", None), ("val", trained), ("test", LETTER_TASK_NAMES))
    for split, tasks in sets:
        for task in tasks or LETTER_TASK_NAMES:
            n = {"val": sizes.val_per_task, "test": sizes.test_per_task}.get(split, sizes.train_per_task)
            if split == "train" and task in sizes.sft_tasks:
                n = max(n, sizes.sft_task_clips)
            # Options in one fixed order: a model trained from scratch learns the clip's answer, not an XOR of the
            # clip and a shuffled letter order (docs/intuitive-physics.md). Chance stays 50 / 25 / 50.
            generate_task(
                task, n, out / "data" / split, split, base_seed=seed, workers=2, show_progress=False,
                option_order="fixed",
            )
            console.print(f"{split}: {n} {task} clips in {out / 'data' / split}")
    train_dir = out / "data" / "train"
    letter_sft_records(train_dir, train_dir / "sft.jsonl")  # every task: the tower's
    rl_records(train_dir, train_dir / "rl.jsonl")
    for every, own in ((train_dir / "sft.jsonl", sft_file(out, sizes)), (train_dir / "rl.jsonl", rl_file(out, sizes))):
        if own != every:
            rows = [json.loads(line) for line in every.read_text(encoding="utf-8").splitlines() if line.strip()]
            write_records(own, _with_controls(rows, sizes))
    console.print(f"({_took(start)})")

    cfg = demo_config(out, model_dir, sizes, seed)
    table: dict[str, dict[str, float | None]] = {}
    start = _stage("3/8 evaluate the base model")
    table["base model"] = accuracy_by_dataset(cfg, out / "results" / "base")
    console.print(f"({_took(start)})")

    if sizes.tower_steps:
        start = _stage("4/8 pre-train the vision tower on the training clips (dense loss)")
        tower_dir = out / f"model-tower{sizes.tower_steps}"
        done = tower_dir / "tower_pretraining.json"
        if done.is_file():
            tower = json.loads(done.read_text(encoding="utf-8"))
        else:
            tower = pretrain_tower(
                model_dir, out / "data" / "train", tower_dir, cfg.vision.model_dump(), sizes.tower_steps, batch=32,
                workers=1, seed=seed, verbose=False,
            )  # fmt: skip
        held_out = ", ".join(f"{task} {accuracy:.1f}" for task, accuracy in tower["heldout_accuracy"].items())
        console.print(
            f"tower loss {tower['loss_curve'][0]['loss']:.3f} -> {tower['loss_curve'][-1]['loss']:.3f} over "
            f"{tower['steps']} steps; its accuracy (%) on the tenth of training clips it did not train on: {held_out}"
        )
        console.print(f"({_took(start)})")
        cfg = with_model(cfg, tower_dir)
    else:
        _stage("4/8 vision tower pre-training: skipped (tower_steps 0); SFT trains the random tower")

    controls = [t for t in LETTER_TASK_NAMES if t not in sizes.sft_tasks]
    what = ", ".join(trained) + (f" (+{sizes.control_clips} clips each of {', '.join(controls)})"
                                 if controls and sizes.control_clips else "")  # fmt: skip
    start = _stage(f"5/8 SFT on {what}: letter answers{', tower fixed' if sizes.tower_steps else ''}")
    sft_export = _finished_export(Path(cfg.train.output_dir), sizes.sft_steps)
    if sft_export is None:
        cfg.train.resume = True  # a demo stopped during SFT continues from its last checkpoint
        result = run_sft(cfg)
        sft_losses = [loss for loss in result.losses if loss == loss]  # a step whose every sample was skipped: nan
        if sft_losses:
            first, last = sft_losses[0], sft_losses[-1]
            console.print(f"SFT loss {first:.3f} -> {last:.3f} over {len(result.losses)} steps")
        if result.export_dir is None:
            raise PhysReasonError("the SFT run exported no model; check train.ckpt.export_safetensors")
        sft_export = result.export_dir
    console.print(f"fine-tuned model: {sft_export} ({_took(start)})")

    start = _stage("6/8 evaluate the fine-tuned model (held-out test clips; validation clips for GRPO's check)")
    table["after SFT"] = accuracy_by_dataset(with_model(cfg, sft_export), out / "results" / "sft")
    val_cfg = cfg.model_copy(deep=True)
    val_cfg.eval.benchmark_root, val_cfg.eval.datasets = str(out / "data" / "val"), trained
    val_sft = clip_hits(with_model(val_cfg, sft_export), out / "results" / "val-sft")
    console.print(f"({_took(start)})")

    start = _stage("7/8 GRPO from the fine-tuned model on SFT's clips (accuracy reward)")
    rl_cfg = grpo_config(cfg, out, sft_export, sizes)
    rl_export = _finished_export(Path(rl_cfg.train.output_dir), sizes.grpo_steps)
    if rl_export is None:
        rl_cfg.train.resume = True
        rl = run_grpo(rl_cfg)
        if rl.rewards:
            shown = ", ".join(f"steps {a}-{b}: {mean:.3f}" for a, b, mean in reward_windows(rl.rewards))
            console.print(f"GRPO mean reward on its training prompts, {shown}")
            trend = reward_trend(rl.rewards)
            if trend:
                console.print(f"GRPO reward {trend}")
        if rl.export_dir is None:
            raise PhysReasonError("the GRPO run exported no model; check train.ckpt.export_safetensors")
        rl_export = rl.export_dir
    console.print(f"GRPO model: {rl_export} ({_took(start)})")

    start = _stage("8/8 GRPO's model on the validation clips; on the test clips if it is kept")
    val_grpo = clip_hits(with_model(val_cfg, rl_export), out / "results" / "val-grpo")
    if grpo_kept(val_sft, val_grpo):
        table["after SFT+GRPO"] = accuracy_by_dataset(with_model(cfg, rl_export), out / "results" / "grpo")
    else:
        table["after SFT+GRPO"] = dict(table["after SFT"])  # the SFT weights, kept: the same model, the same scores
    verdict = grpo_verdict(val_sft, val_grpo)
    console.print(f"{verdict} ({_took(start)})")

    print_table(table, sizes.test_per_task, sizes.sft_tasks, sizes.control_clips)
    console.print(verdict)
    for ok, line in demo_checks(table, sizes.test_per_task, sizes.sft_tasks):
        console.print(line if ok else f"[bold red]{line}[/]")
    console.print(f"whole demo: {_took(begun)} (stages reused from an earlier run cost nothing here)")
    return table


def clip_hits(cfg: Config, results_dir: Path) -> dict[str, bool]:
    """Evaluate cfg's model on its benchmarks into `results_dir` (resumable there): whether each clip's answer was
    right, keyed "<data set>/<clip id>"."""
    from physreason.eval.launch import run_eval
    from physreason.eval.results import read_run, run_dir

    cfg = cfg.model_copy(deep=True)
    cfg.eval.results_dir = str(results_dir)
    outcome = run_eval(cfg)
    return {
        f"{run.dataset}/{clip}": bool(record.get("is_correct"))
        for run in outcome.runs
        for clip, record in read_run(run_dir(outcome.base, run.dataset, run.seed)).items()
    }


def grpo_changes(val_sft: dict[str, bool], val_grpo: dict[str, bool]) -> tuple[int, int]:
    """Validation clips GRPO's model turned right (wrong under SFT's) and turned wrong (right under SFT's); a clip
    GRPO's evaluation lacks counts as wrong."""
    gained = sum(1 for clip, hit in val_sft.items() if not hit and val_grpo.get(clip, False))
    lost = sum(1 for clip, hit in val_sft.items() if hit and not val_grpo.get(clip, False))
    return gained, lost


def grpo_kept(val_sft: dict[str, bool], val_grpo: dict[str, bool]) -> bool:
    """Whether GRPO's weights replace SFT's: only when, on the validation clips, the answers GRPO turned right
    outnumber those it turned wrong by more than twice the noise of those changes (gained - lost > 2 sqrt(gained +
    lost): a sign test, about 98% one-sided). A gain within that noise keeps SFT's weights, as does no gain, so GRPO
    does not lower the trained task by chance; the test clips play no part in the choice."""
    gained, lost = grpo_changes(val_sft, val_grpo)
    return gained - lost > 2 * (gained + lost) ** 0.5


def grpo_verdict(val_sft: dict[str, bool], val_grpo: dict[str, bool]) -> str:
    """One sentence: what GRPO changed on the validation clips, and whether its weights or SFT's were kept."""
    if not val_sft:
        return "GRPO's weights not kept: no validation clips to compare on (the last column is the SFT model's)"
    gained, lost = grpo_changes(val_sft, val_grpo)
    before, after = sum(val_sft.values()), sum(val_sft.values()) + gained - lost
    said = (f"on {len(val_sft)} validation clips (scenes neither training nor the test has) GRPO turned right "
            f"{gained} and wrong {lost} of SFT's answers ({before} -> {after} right; twice the noise of those "
            f"changes: {2 * (gained + lost) ** 0.5:.1f})")  # fmt: skip
    if grpo_kept(val_sft, val_grpo):
        return f"GRPO's weights kept: {said}"
    return f"GRPO's weights not kept: {said}; no gain beyond that noise, so the last column is the SFT model's"


# The demo's aim for the tasks SFT trains on: this many points (a fraction) above chance after SFT.
AIM_ABOVE_CHANCE = 0.25
TRAINED_STAGES = ("after SFT", "after SFT+GRPO")
_TOLERANCE = 1e-9  # accuracies are counts over clips: 24 / 48 is chance exactly, not a float's hair below it


def guess_band(chance: float, clips: int) -> tuple[float, float]:
    """The central 95% of a guessing model's scores on `clips` clips, as fractions: the lowest and highest counts k
    with P(X < k) <= 2.5% and P(X > k) <= 2.5% for X ~ Binomial(clips, chance), divided by `clips`."""
    from math import comb

    pmf = [comb(clips, k) * chance**k * (1 - chance) ** (clips - k) for k in range(clips + 1)]
    low, below = 0, 0.0
    while below + pmf[low] <= 0.025:
        below += pmf[low]
        low += 1
    high, above = clips, 0.0
    while above + pmf[high] <= 0.025:
        above += pmf[high]
        high -= 1
    return low / clips, high / clips


def demo_checks(
    table: dict[str, dict[str, float | None]], test_per_task: int, sft_tasks: Sequence[str] = ("spatial_puzzle",)
) -> list[tuple[bool, str]]:
    """The demo's own verdict on its table, (passed, line) each.

    Every task SFT trained ends SFT at least AIM_ABOVE_CHANCE above chance, and GRPO does not lower it (a fall is
    said, in clips); no task, after SFT or after GRPO, scores below the band a guessing model lands in on this many
    clips (the base model, with random weights, writes no letter at all and is not held to it).
    """
    checks: list[tuple[bool, str]] = []

    def score(stage: str, task: str) -> float | None:
        return table.get(stage, {}).get(task)

    for task in (t for t in LETTER_TASK_NAMES if t in sft_tasks):
        chance, sft, grpo = TASKS[task].chance, score("after SFT", task), score("after SFT+GRPO", task)
        if sft is None or grpo is None:
            checks.append((False, f"{task}: no score after SFT or after GRPO"))
            continue
        margin = sft - chance
        met = margin >= AIM_ABOVE_CHANCE - _TOLERANCE
        checks.append((met, f"{task} after SFT: {100 * sft:.1f}, {100 * margin:+.1f} points from chance "
                            f"({100 * chance:.1f}); the demo aims at +{100 * AIM_ABOVE_CHANCE:.0f}"
                            + ("" if met else ": short of it")))  # fmt: skip
        clips = round((grpo - sft) * test_per_task)
        if grpo < sft - _TOLERANCE:
            checks.append((False, f"GRPO lowered {task}: {100 * sft:.1f} -> {100 * grpo:.1f} ({-clips} of "
                                  f"{test_per_task} held-out clips fewer right)"))  # fmt: skip
        else:
            said = f"raised {task} ({clips:+d} clips)" if clips > 0 else f"did not lower {task}"
            checks.append((True, f"GRPO {said}: {100 * sft:.1f} -> {100 * grpo:.1f}"))
    below = []
    for stage in TRAINED_STAGES:
        for task in LETTER_TASK_NAMES:
            value, low = score(stage, task), guess_band(TASKS[task].chance, test_per_task)[0]
            if value is not None and value < low - _TOLERANCE:
                below.append(f"{task} {stage} {100 * value:.1f} (a guess: {100 * low:.1f} or more)")
    if below:
        checks.append((False, "below chance, under the band a guess lands in: " + "; ".join(below)))
    else:
        checks.append((True, "no task below chance after SFT or after GRPO (none under the band a guess lands in)"))
    return checks


def print_table(
    table: dict[str, dict[str, float | None]],
    test_per_task: int,
    sft_tasks: Sequence[str] = LETTER_TASK_NAMES,
    control_clips: int = 0,
) -> None:
    """Accuracy (%) per task and stage beside chance and a guess's band: the tasks SFT trained on in one section, the
    others in another, so an untrained task's score is never read as the training's result."""
    console.print(task_table(table, test_per_task, sft_tasks, control_clips))


def task_table(
    table: dict[str, dict[str, float | None]],
    test_per_task: int,
    sft_tasks: Sequence[str] = LETTER_TASK_NAMES,
    control_clips: int = 0,
) -> Table:
    """The demo's result table: one row per task (chance, a guess's band, then each stage), the tasks SFT trained
    first, a rule, then the others (with `control_clips` of their clips in SFT's data, or none)."""
    trained = [t for t in LETTER_TASK_NAMES if t in sft_tasks]
    others = [t for t in LETTER_TASK_NAMES if t not in sft_tasks]
    view = Table(
        title=f"held-out accuracy (%), {test_per_task} test clips per task",
        caption=f"a guess lands in: the central 95% of the scores of a model that guesses (binomial, {test_per_task} "
        "clips); a score under it is below chance, one inside it is at chance",
    )
    view.add_column("task")
    view.add_column("chance", justify="right")
    view.add_column("a guess lands in", justify="right")
    for stage in table:
        view.add_column(stage, justify="right")

    def add(task: str) -> None:
        scores = ["-" if table[stage].get(task) is None else f"{100 * table[stage][task]:.1f}" for stage in table]
        low, high = guess_band(TASKS[task].chance, test_per_task)
        view.add_row(f"  {task}", f"{100 * TASKS[task].chance:.1f}", f"{100 * low:.1f}-{100 * high:.1f}", *scores)

    view.add_row("[bold]trained by SFT (then GRPO)[/]", *([""] * (len(table) + 2)))
    for task in trained:
        add(task)
    if others:
        view.add_section()
        title = (f"not trained: {control_clips} control clips each in SFT's data" if control_clips
                 else "not in SFT's data")  # fmt: skip
        view.add_row(f"[bold]{title}[/]", *([""] * (len(table) + 2)))
        for task in others:
            add(task)
    return view
