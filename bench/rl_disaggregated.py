"""GRPO throughput on 2 GPUs: colocated (policy and vLLM share both GPUs) vs disaggregated (1 policy GPU + 1 rollout GPU).

Model: random weights in the Qwen2.5-VL-3B shape (tiny tokenizer and processor files, real vocabulary
size), prompts: `physreason data synth` arrow-of-time clips. Each mode runs as its own process;
a sampler thread reads `nvidia-smi` every 200 ms. Reported per mode: completions trained per second
after the warm-up steps, and each GPU's idle fraction (utilization below 5%) over the same window.

Run on a machine with 2 GPUs, vLLM and ray installed:
    python bench/rl_disaggregated.py --out /tmp/rl-bench --steps 12 --warmup 2
Results go to <out>/results.json and one markdown table row per mode on stdout (for bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

# Qwen2.5-VL-3B-Instruct's config.json, the parts that set compute and memory.
TEXT_3B = {
    "hidden_size": 2048,
    "intermediate_size": 11008,
    "num_hidden_layers": 36,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
}
VISION_3B = {
    "depth": 32,
    "hidden_size": 1280,
    "intermediate_size": 3420,
    "num_heads": 16,
    "out_hidden_size": 2048,
    "fullatt_block_indexes": [7, 15, 23, 31],
}


def build_model(folder: Path) -> Path:
    """A random bf16 Qwen2.5-VL model of the 3B shape, saved with the tiny model's tokenizer and processor files."""
    import torch
    import transformers

    from physreason.models.tiny import save_tiny_model

    if (folder / "model.safetensors.index.json").is_file() or (folder / "model.safetensors").is_file():
        tiny_done = json.loads((folder / "config.json").read_text())["text_config"]["hidden_size"] == 2048
        if tiny_done:
            return folder
    save_tiny_model("qwen2_5_vl", folder)
    config = json.loads((folder / "config.json").read_text())
    config["text_config"].update(TEXT_3B)
    config["text_config"]["rope_parameters"]["mrope_section"] = [16, 24, 24]
    config["vision_config"].update(VISION_3B)
    config["vocab_size"] = TEXT_3B["vocab_size"]
    config["tie_word_embeddings"] = True
    hf_config = transformers.Qwen2_5_VLConfig(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = transformers.Qwen2_5_VLForConditionalGeneration(hf_config).to(torch.bfloat16)
    for name in ("model.safetensors",):
        (folder / name).unlink(missing_ok=True)
    model.save_pretrained(folder)
    return folder


def build_data(folder: Path, count: int) -> Path:
    data = folder / "arrow_of_time" / "arrow_of_time_benchmark_qa_pairs.json"
    if not data.is_file():
        subprocess.run(
            [sys.executable, "-m", "physreason", "data", "synth", "--task", "arrow_of_time", "--n", str(count), "--out", str(folder)],
            check=True,
        )
    return data


def recipe(model: Path, data: Path, out: Path, mode: str, steps: int) -> dict:
    return {
        "model": {"model_name_or_path": str(model), "model_max_length": 4096, "dtype": "bfloat16"},
        "engine": {"backend": "vllm", "gpu_memory_utilization": 0.45 if mode == "colocated" else 0.85, "max_model_len": 4096},
        "vision": {"fps": 4.0, "min_pixels": 3136, "max_pixels": 81920, "total_pixels": 1605632, "max_frames": 32},
        "data": {"dataset": {"name": str(data)}, "num_workers": 2},
        "train": {
            "output_dir": str(out / mode),
            "max_steps": steps,
            "train_batch_per_replica": 64,  # 8 prompts x 8 completions
            "param_dtype": "bfloat16",
            "gradient_checkpointing": True,
            "log_freq": 1,
            "ckpt": {"enable_checkpoint": False},
        },
        "rollout": {
            "n_generation": 8,
            "max_response_length": 512,
            "batch_size": 8,
            "sampling_config": {"temperature": 1.0, "top_p": 1.0, "repetition_penalty": 1.0},
            "parallelism": {"n_init_replicas": 1, "tp_size": 1},
        },
        "policy": {"parallelism": {"dp_shard_size": 1 if mode == "disaggregated" else -1}},
        "grpo": {"mode": mode, "allowed_outdated_steps": 1, "mini_batch": 8},
        "logging": {"logger": ["jsonl"]},
    }


class GPUSampler:
    """Samples each GPU's utilization (%) with nvidia-smi every 200 ms in a background process."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, list[int]]] = []
        self._proc = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-lms", "200"],
            stdout=subprocess.PIPE,
            text=True,
        )
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        row: list[int] = []
        for line in self._proc.stdout:
            row.append(int(line.strip() or 0))
            if len(row) == 2:
                self.samples.append((time.time(), row))
                row = []

    def stop(self) -> None:
        self._proc.terminate()

    def idle_fraction(self, start: float, end: float) -> list[float]:
        window = [row for t, row in self.samples if start <= t <= end]
        if not window:
            return [float("nan"), float("nan")]
        return [sum(r[g] < 5 for r in window) / len(window) for g in range(2)]


def run_mode(mode: str, config_path: Path) -> None:
    """Child process: one GRPO run in `mode`."""
    from physreason.config import load_config

    config = load_config(config_path, [])
    if mode == "disaggregated":
        from physreason.distributed.controller import run_disaggregated

        run_disaggregated(config)
    else:
        from physreason.train.grpo import run_grpo

        run_grpo(config)


def measure(mode: str, config: dict, out: Path, warmup: int) -> dict:
    from physreason.config import Config, dump_config

    config_path = out / f"{mode}.toml"
    dump_config(Config.model_validate(config), config_path)
    if mode == "colocated":
        command = ["torchrun", "--nproc-per-node", "2", __file__, "--child", mode, str(config_path)]
    else:
        command = [sys.executable, __file__, "--child", mode, str(config_path)]
    sampler = GPUSampler()
    started = time.time()
    subprocess.run(command, check=True)
    sampler.stop()
    lines = [json.loads(line) for line in (out / mode / "logs" / "metrics.jsonl").open()]
    measured = [m for m in lines if m["step"] > warmup]
    window_start = started + sum(m["time/step_s"] for m in lines if m["step"] <= warmup)
    completions = len(measured) * config["train"]["train_batch_per_replica"]
    seconds = sum(m["time/step_s"] for m in measured)
    return {
        "mode": mode,
        "steps": len(measured),
        "samples_per_s": completions / seconds,
        "gpu_idle_fraction": sampler.idle_fraction(window_start, time.time()),
        "mean_staleness": sum(m.get("rollout/staleness_mean", 0.0) for m in measured) / max(len(measured), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("/tmp/rl-bench"))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--clips", type=int, default=128)
    parser.add_argument("--child", nargs=2, metavar=("MODE", "CONFIG"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_mode(args.child[0], Path(args.child[1]))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    model = build_model(args.out / "qwen2_5_vl_3b_random")
    data = build_data(args.out / "data", args.clips)
    results = [measure(mode, recipe(model, data, args.out, mode, args.steps), args.out, args.warmup)
               for mode in ("colocated", "disaggregated")]
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    print("| mode | samples/s | GPU0 idle | GPU1 idle | staleness |")
    print("|---|---|---|---|---|")
    for r in results:
        idle = r["gpu_idle_fraction"]
        print(f"| {r['mode']} | {r['samples_per_s']:.2f} | {idle[0]:.0%} | {idle[1]:.0%} | {r['mean_staleness']:.2f} |")


if __name__ == "__main__":
    main()
