"""Pre-train a from-scratch model's vision tower with a dense loss on letter-answer SFT clips, before its SFT.

A Qwen-VL model trained from random weights gets one answer letter of supervision per clip, through a
language model that is itself random: the temporal tasks stay at chance (bench/RESULTS.md), while the same
tower learns them once its pooled features get a direct loss. Released VLMs start from a pre-trained vision
encoder; this is physreason's stand-in for that step, on the SFT clips themselves (never the test split).

The tower (`model.visual`: the patch embedding, its blocks and the merger into the language model's width)
is trained with a linear head on its pooled output: the merged tokens are averaged per temporal patch and
the per-patch means concatenated in time order, so the head sees the order of events; one head slice per
task (2 / 4 / 2 options), cross-entropy on the SFT answer letters. A tenth of the clips is held out: scored
during training, it picks the tower that is kept (the best mean accuracy over tasks; optionally stopping
early) and reports the tower's own accuracy. The model with the trained tower is saved as a new Hugging Face
folder, which SFT then starts from (the head is dropped). Used by `physreason demo` and `physreason experiment`.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import shutil
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

LETTERS = "ABCDEFGH"
HEAD_INPUTS = ("time", "tokens")  # what pretrain_tower's linear head sees (its docstring)


def _one_thread() -> None:
    """Decode workers run torch on one thread each, as DataLoader workers do: otherwise N workers each start a thread
    per core. Without it, two runs of 7-8 workers on 16 cores had not decoded 6,000 clips after nine minutes; with it,
    15 workers decode them in 16-19 s (one H200 machine, bench/RESULTS.md)."""
    import torch

    torch.set_num_threads(1)


def _decode(args: tuple[str, dict[str, Any], Any, int]) -> tuple[Any, list[int]]:
    """One clip's patchified pixels ([patches, 3 * temporal * patch^2], float16) and its [t, h, w] grid."""
    from physreason.config import VisionConfig
    from physreason.models.inputs import encode_visuals
    from physreason.vision import load_video

    path, vision, params, factor = args
    video = load_video(path, VisionConfig(**vision), factor=factor)
    visuals = encode_visuals(videos=[video], params=params)
    return visuals.pixel_values_videos.half().numpy(), visuals.video_grid_thw[0].tolist()


def own_task_loss(logits: Any, task: Any, answer: Any, bounds: Any) -> tuple[Any, Any]:
    """Mean cross-entropy of each row over its own task's columns only, and whether its top column is the answer.

    logits: [rows, all tasks' options]; task, answer: [rows] (answer indexes the task's options); bounds: the
    first column of every task and the end, [tasks + 1]. The other tasks' columns are masked out, so each row is a
    softmax over its 2 or 4 options, as if every task had its own head.
    """
    import torch

    columns = torch.arange(logits.shape[1], device=logits.device)
    low, high = bounds[task], bounds[task + 1]
    own = (columns >= low[:, None]) & (columns < high[:, None])
    scores = logits.masked_fill(~own, float("-inf"))
    target = low + answer
    return torch.nn.functional.cross_entropy(scores, target), (scores.argmax(1) == target).float()


def load_clips(data_root: Path, model_dir: Path, vision: dict[str, Any], workers: int) -> dict[str, Any]:
    """Decode every clip of `data_root/sft.jsonl` once: pixels, grids, task index and answer index per clip."""
    import numpy as np

    from physreason.data.loaders import media_path_in_root
    from physreason.data.synth.tasks import LETTER_TASK_NAMES, TASKS
    from physreason.models.inputs import load_processor_params, patch_factor

    tasks = list(LETTER_TASK_NAMES)
    params, factor = load_processor_params(str(model_dir)), patch_factor(str(model_dir))  # read once, not per clip
    records = data_root / "sft.jsonl"
    rows = [json.loads(line) for line in records.read_text().splitlines() if line.strip()]
    jobs, task_ids, answers = [], [], []
    for row in rows:
        video = media_path_in_root(data_root.resolve(), row["video"], str(records))  # never a file outside data_root
        task = row["video"].split("/")[0]
        letter = row["conversations"][-1]["content"].strip()
        if task not in tasks or letter not in LETTERS[: TASKS[task].n_options]:
            raise ValueError(f"{records}: record for {row['video']} has task {task!r}, answer {letter!r}")
        jobs.append((str(video), vision, params, factor))
        task_ids.append(tasks.index(task))
        answers.append(LETTERS.index(letter))
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=max(1, workers), mp_context=context, initializer=_one_thread) as pool:
        decoded = list(pool.map(_decode, jobs, chunksize=16))
    grids = {tuple(grid) for _, grid in decoded}
    if len(grids) != 1:
        raise ValueError(f"clips under {data_root} decode to different grids {sorted(grids)}: use one clip size")
    return {
        "pixels": np.stack([pixels for pixels, _ in decoded]),  # [clips, patches, dim]
        "grid": list(grids.pop()),
        "task": np.array(task_ids),
        "answer": np.array(answers),
        "tasks": tasks,
    }


def pretrain_tower(
    model_dir: Path,
    data_root: Path,
    out_dir: Path,
    vision: dict[str, Any],
    steps: int = 1500,
    lr: float = 1e-3,
    batch: int = 32,
    workers: int = 4,
    seed: int = 0,
    eval_every: int = 0,
    patience: int = 0,
    verbose: bool = True,
    head_input: str = "time",
) -> dict[str, Any]:
    """Train `model_dir`'s vision tower on the clips (see the module docstring); save the model to `out_dir`.

    Every `eval_every` steps (0: a thirtieth of `steps`) the held-out tenth is scored; the tower and head of the best
    mean held-out accuracy over tasks are kept and saved, and with `patience` > 0 training stops once that many steps
    pass without a better score; `verbose` prints the loss and the result. `head_input` is what the linear head
    sees: "time" the merged tokens averaged per temporal patch (one vector a patch of frames, in time order), "tokens"
    every merged token in place (the frame's layout kept: which region shows what). A mean is a linear function of
    the tokens, so "tokens" can express everything "time" can; it also lets a task that hinges on where things are
    (the spatial puzzle's shuffled quadrants) be read without the tower first writing positions into its features. The same command reached loss 0.001 on an H200 and 0.076 on an H100 (spatial puzzle
    held-out 98.4 vs 73.0): the selection keeps a run's best tower whatever its last steps did.
    """
    import numpy as np
    import torch
    from transformers import AutoModelForImageTextToText

    if head_input not in HEAD_INPUTS:
        raise ValueError(f"pretrain_tower: head_input {head_input!r} is not one of {', '.join(HEAD_INPUTS)}")

    from physreason.data.synth.tasks import TASKS
    from physreason.models.patch_embed import use_linear_patch_embed
    from physreason.models.vision_attention import use_grouped_vision_attention

    started = time.perf_counter()
    clips = load_clips(data_root, model_dir, vision, workers)
    decode_s = time.perf_counter() - started
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    use_grouped_vision_attention(model)  # one attention call per layer instead of one per temporal patch
    use_linear_patch_embed(model)  # one GEMM instead of a 3-D convolution
    tower = model.model.visual.to(device).train()
    grid_t, grid_h, grid_w = clips["grid"]
    merge = tower.spatial_merge_size if hasattr(tower, "spatial_merge_size") else 2
    per_group = grid_h * grid_w // merge**2
    width = model.config.text_config.hidden_size
    offsets = np.cumsum([0] + [TASKS[name].n_options for name in clips["tasks"]])
    per_clip = grid_t * width * (per_group if head_input == "tokens" else 1)
    head = torch.nn.Linear(per_clip, int(offsets[-1])).to(device)
    params = list(tower.parameters()) + list(head.parameters())
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(step, steps) / steps))),
    )
    # every clip's pixels stay on the device when it is a GPU (6,000 clips at 84x112: about 4 GB in float16)
    pixels = torch.from_numpy(clips["pixels"]).to(device)  # [clips, patches, dim] float16
    task = torch.from_numpy(clips["task"]).to(device)
    answer = torch.from_numpy(clips["answer"]).to(device)
    bounds = torch.from_numpy(offsets).to(device)
    generator = np.random.default_rng(seed)
    order = generator.permutation(len(pixels))
    n_val = max(len(pixels) // 10, 1)
    val, train = order[:n_val], order[n_val:]
    grid = torch.tensor([clips["grid"]], dtype=torch.long)

    def logits_of(rows: torch.Tensor) -> torch.Tensor:
        """rows: clip indices on the device; returns [B, options of all tasks]."""
        frames = pixels[rows].float()  # [B, patches, dim]
        grids = grid.repeat(len(rows), 1).to(device)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            merged = tower(frames.flatten(0, 1), grid_thw=grids).pooler_output  # [B * tokens, width]
            tokens = merged.float().view(len(rows), grid_t, per_group, width)
            pooled = tokens if head_input == "tokens" else tokens.mean(2)  # [B, grid_t, (per_group,) width]
            return head(pooled.flatten(1)).float()

    def loss_and_hits(index: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.from_numpy(index).to(device)  # once per batch, for the pixels and the labels
        return own_task_loss(logits_of(rows), task[rows], answer[rows], bounds)

    def accuracy(index: np.ndarray) -> dict[str, float]:
        tower.eval()
        hits = []
        with torch.no_grad():
            for start in range(0, len(index), 256):
                hits.append(loss_and_hits(index[start : start + 256])[1].cpu())
        tower.train()
        flat, kinds = torch.cat(hits), torch.from_numpy(clips["task"][index])
        return {
            name: round(100 * float(flat[kinds == k].mean()), 1)
            for k, name in enumerate(clips["tasks"])
            if bool((kinds == k).any())
        }

    def held_out_score() -> tuple[dict[str, float], float]:
        """Held-out accuracy per task and their mean (the selection score)."""
        held = accuracy(val)
        return held, sum(held.values()) / len(held)

    every = eval_every or max(1, steps // 30)
    curve, heldout_curve = [], []
    best_score, best_step, best_state = -1.0, 0, None
    window: list[float] = []
    for step in range(steps):
        index = train[generator.integers(len(train), size=batch)]
        loss, _ = loss_and_hits(index)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        window.append(loss.item())
        if (step + 1) % max(1, steps // 10) == 0:
            curve.append({"step": step + 1, "loss": round(sum(window) / len(window), 4)})
            if verbose:
                print(f"tower step {step + 1}/{steps}: loss {curve[-1]['loss']}", flush=True)
            window = []
        if (step + 1) % every == 0 or step + 1 == steps:
            held, score = held_out_score()
            heldout_curve.append({"step": step + 1, **held})
            if score > best_score:  # strictly better: on a plateau the earliest step is kept
                best_score, best_step = score, step + 1
                best_state = {
                    "tower": {k: v.detach().clone() for k, v in tower.state_dict().items()},
                    "head": {k: v.detach().clone() for k, v in head.state_dict().items()},
                }
            elif patience and step + 1 - best_step >= patience:
                if verbose:
                    print(f"tower: no better held-out accuracy for {patience} steps, stopping at {step + 1}", flush=True)
                break
    stopped_at = step + 1 if steps else 0
    if best_state is not None:
        tower.load_state_dict(best_state["tower"])
        head.load_state_dict(best_state["head"])
    result = {
        "steps": steps,
        "lr": lr,
        "batch": batch,
        "head_input": head_input,
        "seed": seed,
        "clips": len(pixels),
        "grid_thw": clips["grid"],
        "loss_curve": curve,
        "heldout_curve": heldout_curve,
        "best_step": best_step,
        "stopped_at": stopped_at,
        "train_accuracy": accuracy(train[:1500]),
        "heldout_accuracy": accuracy(val),
        "decode_s": round(decode_s, 1),
    }
    model.model.visual = tower.to("cpu").float()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    for item in model_dir.iterdir():  # tokenizer, processor, generation config, chat template
        if item.is_file() and item.name not in {"config.json", "model.safetensors", "model.safetensors.index.json"}:
            shutil.copy2(item, out_dir / item.name)
    result["total_s"] = round(time.perf_counter() - started, 1)
    (out_dir / "tower_pretraining.json").write_text(json.dumps(result, indent=2))
    if verbose:
        print(f"tower pre-training: {result}", flush=True)
    return result
