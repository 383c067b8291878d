"""torchrun worker for tests/test_context_parallel.py: one model split over the ranks vs the same model whole.

argv: cases as "kind:layout[:option+option],..." (layout "padded" | "packed" | "grpo" | "grpo_packed"; options
"tp2": the split model is also tensor-parallel over pairs of ranks, cp = the other factor of the world; "lora": both
models get the same LoRA adapters, vision tower included; "text": text-only rows, no pixels), output JSON path.
Text-only kinds (qwen2, qwen3, qwen3_moe) always get text rows. Per case every rank builds the same tiny model twice
(same seed): one runs whole in this process, the other with its sequence and vision patches split over the
context-parallel ranks. Rank 0 writes, per case, the two losses and, per parameter, the largest gradient difference
relative to that parameter's largest gradient entry.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from physreason.config.schema import LoraConfig
from physreason.data.collate import collate_padded
from physreason.data.packing import collate_packed
from physreason.data.sft import IGNORE_INDEX, SFTSample
from physreason.engines import Completion
from physreason.models.context_parallel import ContextParallel
from physreason.models.family import model_family, read_vision_tokens
from physreason.models.inputs import encode_visuals
from physreason.models.kinds import VISION_LANGUAGE_KINDS
from physreason.models.lora import apply_lora
from physreason.models.parallelize import apply_tensor_parallel, build_mesh
from physreason.models.tiny import build_tiny_model, build_tiny_tokenizer
from physreason.train.model import CausalLMLoss
from physreason.vision.video import VideoFrames


def video(frames: int, height: int, width: int, seed: int) -> VideoFrames:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(frames, height, width, 3), dtype=np.uint8)
    return VideoFrames(
        pixels, [i / 4 for i in range(frames)], list(range(frames)), 4.0, 4.0, frames, frames / 4, (height, width), "-"
    )


def video_sample(model, frames: int, before: int, after: int, seed: int) -> SFTSample:
    """Text, a video's placeholder tokens (one run per temporal patch for Qwen3-VL, as its prompts lay them), text."""
    params = model_family(model.config).processor
    side = 2 * params.factor
    visuals = encode_visuals(videos=[video(frames, side, 2 * side, seed)], params=params)
    spec = read_vision_tokens(model.config)
    rng = np.random.default_rng(seed)
    count = visuals.video_token_counts[0]
    groups = int(visuals.video_grid_thw[0, 0]) if spec.video_frame_spans else 1
    ids = [int(t) for t in rng.integers(10, 300, before)]
    for _ in range(groups):
        ids += [int(rng.integers(10, 300))] + [spec.video_token_id] * (count // groups)
    ids += [int(t) for t in rng.integers(10, 300, after)]
    input_ids = torch.tensor(ids)
    labels = input_ids.clone()
    labels[: len(ids) - after + 2] = IGNORE_INDEX
    return SFTSample(input_ids, labels, spec.positions(input_ids, visuals), visuals)


def text_sample(model, length: int, answer: int, seed: int) -> SFTSample:
    """A text-only row of `length` tokens whose last `answer` are targets (positions as the data pipeline makes them)."""
    spec = read_vision_tokens(model.config)
    input_ids = torch.tensor(np.random.default_rng(seed).integers(10, 300, length))
    labels = input_ids.clone()
    labels[: length - answer] = IGNORE_INDEX
    positions = spec.positions(input_ids, None) if spec is not None else torch.arange(length).expand(3, -1)  # [3, L]
    return SFTSample(input_ids, labels, positions)


def grads(model) -> dict[str, torch.Tensor]:
    """Each parameter's whole gradient (tensor-parallel shards gathered)."""
    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            out[name] = grad.clone()
    return out


def add_lora(model) -> None:
    """The same LoRA adapters on every call (seeded), B non-zero so that both A and B get gradients."""
    torch.manual_seed(4)
    apply_lora(model, LoraConfig(enable=True, rank=4, alpha=8.0, vision=True))
    for name, parameter in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(parameter, std=0.05)


def main() -> None:
    cases, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    results = {case: compare(*case.split(":")) for case in cases.split(",")}
    if dist.get_rank() == 0:
        json.dump(results, open(out, "w"))
    dist.destroy_process_group()


def compare(kind: str, layout: str, options: str = "") -> dict:
    """One case: the whole model's and the split model's losses and gradients."""
    chosen = set(options.split("+")) - {""}
    tokenizer = build_tiny_tokenizer()
    whole = build_tiny_model(kind, tokenizer, seed=0).train()
    split = build_tiny_model(kind, tokenizer, seed=0).train()
    if "lora" in chosen:
        add_lora(whole)
        add_lora(split)
    tp = 2 if "tp2" in chosen else 1
    world = dist.get_world_size()
    group = dist.group.WORLD
    if tp > 1:
        mesh = build_mesh("cpu", world, tp, world // tp)  # dp 1: every rank holds the same rows
        apply_tensor_parallel(split, mesh["tp"])
        group = mesh["cp"].get_group()
    ContextParallel(group).install(split, tp)
    vision = kind in VISION_LANGUAGE_KINDS
    if vision and "text" not in chosen:
        samples = [video_sample(whole, 8, 5, 13, seed=1), video_sample(whole, 4, 3, 7, seed=2)]
    else:
        samples = [text_sample(whole, 23, 9, seed=1), text_sample(whole, 14, 6, seed=2)]
    if layout == "packed":
        batch = collate_packed(samples, mrope=vision)
    else:
        batch = collate_padded(samples, tokenizer.pad_token_id, mrope=vision)
    result = {}
    if layout.startswith("grpo"):
        result = grpo_scores(whole, split, samples, tokenizer.pad_token_id, pack=layout == "grpo_packed")
    else:
        losses = []
        for model in (whole, split):
            loss = CausalLMLoss(model)(batch)
            loss.backward()
            losses.append(float(loss))
        result["losses"] = losses
    want, got = grads(whole), grads(split)
    for g in got.values():
        dist.all_reduce(g, group=group)  # what FSDP2's reduction over the dp x cp ranks adds up
    result["missing"] = sorted(set(want) ^ set(got))
    result["grad_rel"] = {
        name: float((got[name] - w).abs().max()) / (float(w.abs().max()) + 1e-12) for name, w in want.items() if name in got
    }
    result["grads"] = len(want)
    tower = [float(w.abs().max()) for name, w in want.items() if name.startswith("model.visual.")]
    result["tower_grad"] = max(tower) if tower else 0.0
    if "lora" in chosen:
        result["trained"] = sorted({"lora" if "lora_" in name else name for name in want})
    return result


def grpo_scores(whole, split, samples: list[SFTSample], pad_id: int, pack: bool) -> dict:
    """Policy log-probs of completions (the samples' answers) and a weighted-sum backward, whole vs split."""
    from physreason.data.mcq import MCQPrompt
    from physreason.train.policy import PolicyScorer, build_completion_batch
    from physreason.train.rollout import RolloutSample

    rollouts = []
    for i, sample in enumerate(samples):
        cut = int((sample.labels != IGNORE_INDEX).nonzero()[0])
        prompt_ids = sample.input_ids[:cut].tolist()
        completion_ids = sample.input_ids[cut:].tolist()
        completion = Completion("-", completion_ids, [-1.0] * len(completion_ids), "stop")
        prompt = MCQPrompt(f"p{i}", "Is it falling?", {"A": "yes", "B": "no"}, "A")
        for j in range(2):  # two completions share each prompt's pixels, as a rollout gives them
            rollouts.append(RolloutSample(0, prompt, prompt_ids, completion, {"total": 0.0}, sample.visuals, j - 0.5))
    vision = read_vision_tokens(whole.config)
    batch = build_completion_batch(rollouts, pad_id, vision, pack=pack)
    weights = torch.randn(batch.mask.shape, generator=torch.Generator().manual_seed(3))  # [B, T]
    scores = []
    for model in (whole, split):
        logprobs = PolicyScorer(model)(batch, 0.7, diagnostics=True)
        (logprobs.logprobs * weights * batch.mask).sum().backward()
        scores.append(logprobs)
    mask = batch.mask
    return {
        "losses": [float((s.logprobs * weights * mask).sum()) for s in scores],
        "logprob_diff": float((scores[0].logprobs - scores[1].logprobs)[mask].abs().max()),
        "entropy_diff": float((scores[0].entropy - scores[1].entropy)[mask].abs().max()),
    }


if __name__ == "__main__":
    main()
