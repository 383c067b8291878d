"""The start-up summary every long command prints before it works: what runs, how, on what, and where results go.

`physreason infer`, `eval`, `sft` and `grpo` print the same block (a title line, then one `name: value` line each),
so a log says which model, family and prompt style, reasoning mode, dtype and device, sampling, data and output
folder produced what follows, before a minute is spent loading a model.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from physreason.errors import ConfigError
from physreason.progress import make_console

if TYPE_CHECKING:
    from physreason.chat.style import Prompting
    from physreason.config import ModelConfig

# Family names as config.json's model_type spells them, in words.
_FAMILY_NAMES = {
    "qwen2_5_vl": "Qwen2.5-VL (Cosmos-Reason1)",
    "qwen3_vl": "Qwen3-VL (Cosmos-Reason2)",
    "qwen3_vl_moe": "Qwen3-VL MoE (Cosmos-Reason2)",
}


def startup_lines(title: str, items: Mapping[str, object]) -> list[str]:
    """The summary as text lines: `title`, then `  name: value` per item (None values are left out)."""
    shown = {name: value for name, value in items.items() if value is not None}
    width = max((len(name) for name in shown), default=0)
    return [title] + [f"  {name + ':':<{width + 1}} {value}" for name, value in shown.items()]


def print_startup(title: str, items: Mapping[str, object], *, console: Console | None = None, stderr: bool = False) -> None:
    """Print the start-up summary (on stdout, or stderr where stdout carries data such as `infer --json`)."""
    console = console or make_console(stderr=stderr)
    for line in startup_lines(title, items):
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def describe_model(model: ModelConfig) -> str:
    """The checkpoint: a local folder as its resolved path, a Hub id with its revision."""
    local = Path(model.model_name_or_path).expanduser()
    if local.is_dir():
        return f"{local.resolve()} (local folder)"
    return f"{model.model_name_or_path} @ {model.revision or 'default branch'}"


def describe_family(model: ModelConfig) -> str:
    """The checkpoint's family from its config.json ('unknown' when it cannot be read without loading)."""
    from physreason.models.inputs import checkpoint_family

    try:
        family = checkpoint_family(model.model_name_or_path, model.revision)
    except (OSError, ValueError, ConfigError):  # unreadable, malformed or of no supported family: said elsewhere
        return "unknown"
    if family is None:
        return "unknown"
    return _FAMILY_NAMES.get(family.name, family.name)


def describe_prompting(prompting: Prompting) -> str:
    """Prompt style and reasoning mode, and a recipe's own system prompt."""
    text = f"{prompting.style}, reasoning {'on' if prompting.reasoning else 'off'}"
    if prompting.system_prompt is not None:
        text += f", system prompt {prompting.system_prompt!r}"
    return text


def describe_sampling(sampling: Any, *, seed: bool = True) -> str:
    """Sampling settings as one line (a SamplingConfig, or rollouts' token sampling with `n` / `max_tokens` apart);
    `seed=False` leaves the seed out (eval: each repeat's seed replaces it)."""
    parts = [
        "greedy" if sampling.temperature == 0 else f"temperature {sampling.temperature:g}",
        f"top_p {sampling.top_p:g}",
        f"top_k {sampling.top_k}",
        f"repetition {sampling.repetition_penalty:g}",
        f"presence {sampling.presence_penalty:g}",
        f"frequency {sampling.frequency_penalty:g}",
    ]
    if getattr(sampling, "max_tokens", None) is not None:
        parts.append(f"max_tokens {sampling.max_tokens}")
    if getattr(sampling, "n", 1) != 1:
        parts.append(f"n {sampling.n}")
    if seed:
        parts.append(f"seed {sampling.seed}" if sampling.seed is not None else "seed none")
    return ", ".join(parts)


def describe_device(dtype: str, backend: str | None = None, tensor_parallel_size: int = 1) -> str:
    """dtype, device and engine: 'bfloat16 on cuda (NVIDIA H100 80GB HBM3), engine vllm, 2 GPUs per engine'."""
    import torch

    if torch.cuda.is_available():
        device = f"cuda ({torch.cuda.get_device_name(0)}, {torch.cuda.device_count()} visible)"
    else:
        device = "cpu"
    text = f"{dtype} on {device}"
    if backend is not None:
        text += f", engine {backend}"
    if tensor_parallel_size > 1:
        text += f", {tensor_parallel_size} GPUs per engine"
    return text



def print_training_startup(
    config: Any,
    job: str,
    *,
    prompt: str,
    data: str,
    steps: str,
    device: Any,
    world_size: int,
    sampling: str | None = None,
) -> None:
    """sft's and grpo's start-up summary (main process): model, family, prompt, data (format and counts), dtype on
    device over the processes, steps, rollout sampling (grpo) and the output folder."""
    processes = f", {world_size} processes" if world_size > 1 else ""
    items: dict[str, object] = {
        "model": describe_model(config.model),
        "family": describe_family(config.model),
        "prompt": prompt,
        "data": data,
        "device": f"{config.train.param_dtype} compute on {device}{processes}",
        "sampling": sampling,
        "steps": steps,
        "output": Path(config.train.output_dir).expanduser().resolve(),
    }
    print_startup(f"physreason {job}", items)
