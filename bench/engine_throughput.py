"""Decode throughput of physreason's vLLM engine against raw `vllm.LLM`, and `update_weights` time (GPU).

Shapes and prompts: bench/RESULTS.md ("How the scripts measure"). One JSON line per measurement.

    python bench/engine_throughput.py vllm --tokenizer DIR     # raw vLLM vs our vllm engine, update_weights
    python bench/engine_throughput.py vllm --tokenizer DIR --shape qwen3-vl-8b --folder /tmp/physreason-8b-shape
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
from harness import device_line, timed
from harness import emit as out
from shapes import DECODER_SHAPES as SHAPES

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine", choices=["vllm"], help="the engine measured (the hf static-cache path was removed)")
    parser.add_argument("--tokenizer", type=Path, required=True, help="folder with the Qwen2.5 tokenizer files")
    parser.add_argument("--folder", type=Path, default=Path("/tmp/physreason-7b-shape"))
    parser.add_argument("--runs", type=int, default=2, help="timed runs of each engine (interleaved)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256], help="vllm: batch sizes to measure")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-vl-7b", help="language-model shape")
    args = parser.parse_args()
    device_line(shape=args.shape)
    folder = make_folder(args.folder, args.tokenizer, SHAPES[args.shape])
    bench_vllm(folder, args.batches, args.runs)


if __name__ == "__main__":
    main()
