"""Where a GRPO rollout's generate call goes: physreason's vLLM engine on bench/grpo_vs_trl.py's text workload (GPU).

The call: the Qwen2.5-VL-3B shape with the tiny tokenizer's vocabulary (as grpo_vs_trl.py builds it, here with vLLM's
dummy weights), vLLM at --gpu-memory of the GPU, P prompts of the text workload's length x n completions of exactly
--new tokens (ignore_eos), temperature 1, top_p 1, the sampled tokens' log-probs, vision tokens suppressed, one
sampling seed per call: what `train/rollout.py` asks of the engine each GRPO step. Variants drop one thing each;
`raw*` call `vllm.LLM.generate` on the same token ids (`raw`: the SamplingParams physreason builds with vLLM's
detokenizer on, vLLM's default; `raw-nodetok`: the same with detokenize=False, as physreason asks since 2026-11-28 and
then decodes each completion once; `raw-min`: n, temperature, max_tokens, ignore_eos only). Rounds run the variants in
turn, so drift hits each alike; one JSON line per call with its seconds and ms per decode step (seconds / --new).
Then one call of the `grpo` variant under torch.profiler (the device's busy time, the union of its kernels, against
the call's wall) and one under cProfile (host functions by own time): a host-bound call shows device busy << wall.
--mp: vLLM's engine core in a process of its own (VLLM_ENABLE_V1_MULTIPROCESSING=1; physreason runs it in-process).

    python3 bench/generate_profile.py [--prompts 8 --n 8 --new 256 --rounds 3] [--mp] [--variants grpo,raw]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from harness import Report, device_line, progress  # noqa: E402

# Text prompts only: vLLM then profiles no image or video inputs at start (a shorter start than GRPO's engine, which
# allows media); the text call's decode is the same.
MEDIA = {"image": 0, "video": 0}
VARIANTS = ("grpo", "no-seed", "no-suppress", "no-logprobs", "raw", "raw-nodetok", "raw-min")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per call [8]")
    parser.add_argument("--n", type=int, default=8, help="completions per prompt [8]")
    parser.add_argument("--new", type=int, default=256, help="new tokens in every completion [256]")
    parser.add_argument("--text-words", type=int, default=200, help="scene words before each question [200]")
    parser.add_argument("--rounds", type=int, default=3, help="timed calls of each variant, in turn [3]")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated: {', '.join(VARIANTS)}")
    parser.add_argument("--gpu-memory", type=float, default=0.3, help="vLLM gpu_memory_utilization [0.3]")
    parser.add_argument("--mp", action="store_true", help="vLLM's engine core in its own process")
    parser.add_argument(
        "--async-scheduling",
        action="store_true",
        help="ask vLLM for async scheduling (LLM(async_scheduling=True)); default: vLLM decides",
    )
    parser.add_argument("--no-profile", action="store_true", help="skip the profiled calls")
    parser.add_argument("--tiny", action="store_true", help="the tiny model (a CPU check of the script)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/physreason-generate-profile"))
    harness.add_json(parser)
    args = parser.parse_args(argv)
    args.variant_list = harness.comma_list(parser, "--variants", args.variants, VARIANTS)
    return args


def make_requests(prompts: int, text_words: int) -> list[Any]:
    """The text workload's requests: scene words, then a four-option question (distinct per prompt)."""
    from grpo_vs_trl import scene_words

    from physreason.engines.base import GenerationRequest

    requests = []
    for i in range(prompts):
        question = (f"{scene_words(text_words)}. Which way does ball {i} move next? A. left B. right C. up D. down. "
                    "Answer with the option's letter.")  # fmt: skip
        requests.append(GenerationRequest(messages=[{"role": "user", "content": question}], request_id=str(i)))
    return requests


def device_busy(prof: Any) -> tuple[float, int, list[tuple[str, float]]]:
    """(seconds the device ran any kernel or copy, the number of them, the ten costliest names with their seconds)."""
    spans, totals = [], {}
    for event in prof.events():
        if getattr(event, "device_type", None) is None or "cuda" not in str(event.device_type).lower():
            continue
        start, end = event.time_range.start, event.time_range.end
        spans.append((start, end))
        totals[event.name] = totals.get(event.name, 0.0) + (end - start) / 1e6
    spans.sort()
    busy, current = 0.0, None
    for start, end in spans:
        if current is None or start > current[1]:
            if current is not None:
                busy += current[1] - current[0]
            current = [start, end]
        else:
            current[1] = max(current[1], end)
    if current is not None:
        busy += current[1] - current[0]
    top = sorted(totals.items(), key=lambda kv: -kv[1])[:10]
    return busy / 1e6, len(spans), [(name[:90], round(s, 4)) for name, s in top]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.mp:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from shapes import build_model_folder
    from vllm import SamplingParams

    from physreason import vllm_compat
    from physreason.config import EngineConfig, ModelConfig, SamplingConfig
    from physreason.engines.vllm import VLLMEngine

    name = "model-tiny" if args.tiny else "model-3b-config"
    folder = build_model_folder(args.work / name, "qwen2.5-vl-3b", args.tiny, weights=False)
    report = Report("generate_profile.json", args.json, **device_line(), mp=args.mp, prompts=args.prompts, n=args.n,
                    new=args.new, text_words=args.text_words)  # fmt: skip
    started = time.perf_counter()
    engine = VLLMEngine(ModelConfig(model_name_or_path=str(folder), model_max_length=8192),
                        EngineConfig(gpu_memory_utilization=args.gpu_memory, limit_mm_per_prompt=MEDIA),
                        load_format="dummy", **({"async_scheduling": True} if args.async_scheduling else {}))  # fmt: skip
    vllm_config = engine.llm.llm_engine.vllm_config
    report.update(engine_start_s=round(time.perf_counter() - started, 1),
                  async_scheduling=vllm_config.scheduler_config.async_scheduling,
                  v2_model_runner=getattr(vllm_config, "use_v2_model_runner", None),
                  cudagraph_mode=str(vllm_config.compilation_config.cudagraph_mode))  # fmt: skip
    progress(
        f"vLLM: async scheduling {report.data['async_scheduling']}, V2 model runner "
        f"{report.data['v2_model_runner']}, CUDA graphs {report.data['cudagraph_mode']}"
    )
    progress(f"engine started in {time.perf_counter() - started:.1f} s")
    requests = make_requests(args.prompts, args.text_words)
    base = SamplingConfig(temperature=1.0, top_p=1.0, repetition_penalty=1.0, max_tokens=args.new, n=args.n,
                          ignore_eos=True, suppress_vision_tokens=True)  # fmt: skip
    # the token ids physreason sends, for the raw variants (one untimed call that also warms the engine)
    first = engine.generate(requests, base.model_copy(update={"seed": 1}))
    if any(r.error for r in first):
        raise SystemExit(f"generate failed: {next(r.error for r in first if r.error)}")
    prompt_ids = [r.prompt_token_ids for r in first]
    raw_prompts = [{"prompt_token_ids": ids} for ids in prompt_ids]
    seed_counter = iter(range(100, 10_000))

    def physreason_call(variant: str) -> int:
        seed = None if variant == "no-seed" else next(seed_counter)
        sampling = base.model_copy(update={"seed": seed, "suppress_vision_tokens": variant != "no-suppress"})
        results = engine.generate(requests, sampling, logprobs=variant != "no-logprobs")
        errors = [r.error for r in results if r.error]
        if errors:
            raise SystemExit(f"generate failed for {len(errors)} of {len(results)} requests: {errors[0]}")
        return sum(len(c.token_ids) for r in results for c in r.completions)

    def raw_call(variant: str) -> int:
        if variant == "raw-min":
            params = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.new, ignore_eos=True, detokenize=False)
        else:
            from physreason.models.family import vision_special_token_ids

            suppressed = vision_special_token_ids(engine.hf_config)
            params = vllm_compat.sampling_params(base.model_copy(update={"seed": next(seed_counter)}), args.new,
                                                 engine.stop_token_ids, True, suppressed)  # fmt: skip
            params.detokenize = variant != "raw-nodetok"
        outputs = engine.llm.generate(raw_prompts, params, use_tqdm=False)
        return sum(len(c.token_ids) for o in outputs for c in o.outputs)

    def call(variant: str) -> tuple[float, int]:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t = time.perf_counter()
        tokens = raw_call(variant) if variant.startswith("raw") else physreason_call(variant)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - t, tokens

    for variant in args.variant_list:  # one untimed call each (a variant's first sampling path)
        call(variant)
    seconds: dict[str, list[float]] = {v: [] for v in args.variant_list}
    for round_index in range(args.rounds):
        for variant in args.variant_list:
            engine.llm.reset_prefix_cache()
            s, tokens = call(variant)
            seconds[variant].append(s)
            report.row(dict(what="call", variant=variant, round=round_index, s=round(s, 4), tokens=tokens,
                            ms_per_step=round(1000 * s / args.new, 3)))  # fmt: skip
    summary = {v: {"median_s": round(statistics.median(s), 4), "ms_per_step": round(1000 * statistics.median(s) / args.new, 3)}
               for v, s in seconds.items() if s}  # fmt: skip
    report.update(summary=summary)
    for variant, row in summary.items():
        progress(f"{variant:12s} median {row['median_s']:.3f} s, {row['ms_per_step']:.2f} ms a decode step")
    if args.no_profile or "grpo" not in args.variant_list:
        return
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    engine.llm.reset_prefix_cache()
    with profile(activities=activities) as prof:
        wall, _ = call("grpo")
    busy, kernels, top = device_busy(prof)
    report.update(profile={"wall_s": round(wall, 4), "device_busy_s": round(busy, 4), "device_events": kernels,
                           "busy_share": round(busy / wall, 3), "top_device": top})  # fmt: skip
    progress(f"profiled grpo call: wall {wall:.3f} s, device busy {busy:.3f} s ({busy / wall:.0%}), {kernels} events")
    for kernel, s in top:
        progress(f"  device {s:8.4f} s  {kernel}")
    engine.llm.reset_prefix_cache()
    profiler = cProfile.Profile()
    profiler.enable()
    wall, _ = call("grpo")
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).strip_dirs().sort_stats("tottime").print_stats(30)
    lines = [line for line in text.getvalue().splitlines() if line.strip()][:45]
    report.update(host_profile={"wall_s": round(wall, 4), "top_tottime": lines})
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # vLLM's engine threads can hold a finished process open; the results are written
