"""Options that set recipe keys, shared by `physreason infer` and `physreason serve`: one declaration and one key each.

A command declares an option with one of these types (`dtype: Dtype = None`) and builds its recipe with
`load_config(config, overrides, recipe_values(ctx.params))`: every parameter named in RECIPE_KEYS that was given
sets its key, so an option and the key it sets are written once for every command.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import typer

# A command parameter's name -> the recipe key it sets (when given: None means not given).
RECIPE_KEYS = {
    "model": "model.model_name_or_path",
    "dtype": "model.dtype",
    "engine": "engine.backend",
    "lora": "engine.lora",
    "tensor_parallel_size": "engine.tensor_parallel_size",
    "gpu_memory_utilization": "engine.gpu_memory_utilization",
    "max_model_len": "engine.max_model_len",
    "enforce_eager": "engine.enforce_eager",
    "fps": "vision.fps",
    "nframes": "vision.nframes",
    "video_start": "vision.video_start",
    "video_end": "vision.video_end",
    "max_pixels": "vision.max_pixels",
    "total_pixels": "vision.total_pixels",
    "timestamps": "vision.timestamps",
    "temperature": "generation.temperature",
    "top_p": "generation.top_p",
    "top_k": "generation.top_k",
    "repetition_penalty": "generation.repetition_penalty",
    "presence_penalty": "generation.presence_penalty",
    "frequency_penalty": "generation.frequency_penalty",
    "max_tokens": "generation.max_tokens",
    "seed": "generation.seed",
    "n": "generation.n",
    "reasoning": "prompt.reasoning",
    "prompt_style": "prompt.style",
    "system_prompt": "prompt.system_prompt",
    "num_gpus": "infer.num_gpus",
    "ray_address": "infer.ray_address",
    "retry_failed": "infer.retry_failed",
}


def recipe_values(params: Mapping[str, Any]) -> dict[str, Any]:
    """The recipe keys that a command's given options set, from its parameters by name (a path as its text)."""
    return {
        RECIPE_KEYS[name]: str(value) if isinstance(value, Path) else value
        for name, value in params.items()
        if name in RECIPE_KEYS and value is not None
    }


Model = Annotated[
    str | None, typer.Option("--model", "-m", help="Hub id (nvidia/Cosmos-Reason1-7B) or local model folder.")
]
Dtype = Annotated[str | None, typer.Option(help="bfloat16, float16, float32 or auto.")]
TensorParallelSize = Annotated[
    int | None,
    typer.Option("--tensor-parallel-size", "--tp", help="GPUs one engine spans (vLLM's name; --tp for short)."),
]
GpuMemoryUtilization = Annotated[float | None, typer.Option(help="GPU memory fraction vLLM may use.")]
MaxModelLen = Annotated[int | None, typer.Option(help="Context length of the engine.")]
EnforceEager = Annotated[
    bool | None, typer.Option("--enforce-eager/--cuda-graphs", help="vLLM: disable CUDA graphs.")
]
Fps = Annotated[float | None, typer.Option(help="Frames per second sampled from videos [default: 4].")]


def reasoning_option(what: str) -> Any:
    """The --reasoning/--no-reasoning option (prompt.reasoning): `what` it sets, then the default every style has."""
    return typer.Option(
        None,
        "--reasoning/--no-reasoning",
        help=f"{what} [default: the prompt style's: on for Cosmos-Reason1, off for Cosmos-Reason2].",
    )


PromptStyle = Annotated[
    str | None,
    typer.Option(
        "--prompt-style",
        help="reason1, reason2 or auto: the prompts of Cosmos-Reason1 or Cosmos-Reason2 [default: auto, from the "
        "checkpoint's family: Qwen3-VL is reason2].",
    ),
]
Temperature = Annotated[
    float | None,
    typer.Option(
        help="Sampling temperature; 0 is greedy [default: the style's: 0.6; Reason2 without reasoning 0.7]."
    ),
]
TopP = Annotated[
    float | None, typer.Option(help="Nucleus mass [default: the style's: 0.95; Reason2 without reasoning 0.8].")
]
RepetitionPenalty = Annotated[
    float | None, typer.Option(help="Repetition penalty [default: the style's: 1.05; Reason2 1.0].")
]
PresencePenalty = Annotated[
    float | None,
    typer.Option(
        help="Penalty on tokens already in the completion [default: the style's: 0; Reason2 without reasoning 1.5]."
    ),
]
MaxTokens = Annotated[int | None, typer.Option(help="Most new tokens [default: 4096].")]
