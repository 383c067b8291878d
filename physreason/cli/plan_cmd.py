"""`physreason plan`: the per-GPU memory of a recipe by part, and the layouts that fit, before anything runs."""

from __future__ import annotations

from pathlib import Path

import typer


def plan(
    config: Path = typer.Argument(..., help="TOML recipe (SFT or GRPO)."),
    model: str | None = typer.Option(
        None, "--model", "-m", help="Model to plan for: hub id or local model folder (sets model.model_name_or_path)."
    ),
    gpus: int = typer.Option(1, "--gpus", min=1, help="Processes, one GPU each (torchrun --nproc-per-node x nodes)."),
    gpu_memory: float = typer.Option(
        79.2, "--gpu-memory", min=1.0, help="Memory of one GPU in GiB (an 80 GB H100 reports 79.2)."
    ),
    job: str = typer.Option(
        "auto",
        "--job",
        help="'sft', 'grpo' (counts the rollout engine and KL reference) or 'auto': grpo when the recipe sets any "
        "[grpo] or [rollout] key, else sft.",
    ),
    torchrun: bool = typer.Option(
        False, "--torchrun", help="With --gpus 1: plan a torchrun launch instead of one plain process (FSDP2 on one rank only with "
        "train.one_rank_precision='legacy' or train.cpu_offload; otherwise the same one-process path)."
    ),
    overrides: list[str] = typer.Option(
        [], "--set", metavar="KEY=VALUE", help="Override a key, e.g. --set train.mini_batch=2 (repeatable)."
    ),
) -> None:
    """Plan a recipe's per-GPU peak memory by part from the checkpoint's config.json alone (no weights are read).

    Exits 0 when the recipe fits, 2 when it does not (after listing the layouts that fit and the --set overrides
    that select each).
    """
    from rich.console import Console

    from physreason.config import load_config
    from physreason.errors import ConfigError
    from physreason.models.sizes import read_model_shape
    from physreason.train.memory import GIB, fitting_layouts, plan_memory
    from physreason.train.memory_report import (
        describe,
        layouts_table,
        plan_table,
        recipe_layout,
        recipe_workload,
        refusal,
        resolve_checkpoint_every,
        tensor_parallel_note,
    )

    if job not in ("sft", "grpo", "auto"):
        raise ConfigError(f"--job {job!r}: use 'sft', 'grpo' or 'auto'")
    recipe_config = load_config(config, overrides, {"model.model_name_or_path": model} if model is not None else None)
    if job == "auto":
        # a GRPO recipe planned as SFT would leave out the rollout engine and the KL reference: a plan that fits
        # on paper and not on the GPU
        job = "grpo" if any(key.startswith(("grpo.", "rollout.")) for key in recipe_config.explicit_keys) else "sft"
    capacity = int(gpu_memory * GIB)
    shape = read_model_shape(recipe_config.model)
    distributed = gpus > 1 or torchrun or recipe_config.train.cpu_offload
    console = Console(width=160)
    prompts = _prompt_shape(recipe_config, console) if job == "grpo" else None
    recipe_config = resolve_checkpoint_every(recipe_config, gpus, distributed, job, capacity, prompts, console)  # type: ignore[arg-type]
    recipe = recipe_layout(recipe_config, gpus, distributed, job)  # type: ignore[arg-type]
    workload = recipe_workload(recipe_config, shape, job, capacity, prompts)  # type: ignore[arg-type]
    plan_ = plan_memory(shape, recipe, workload)
    console.print(
        f"{recipe_config.model.model_name_or_path}: {_parameter_count(shape.total_params)} parameters, "
        f"{shape.layers} blocks of hidden {shape.hidden}; {recipe_config.model.model_max_length} tokens x "
        f"micro-batch {recipe.mini_batch} per forward"
    )
    console.print(f"recipe ({job} job): {describe(recipe)}")
    if job == "grpo":
        console.print(
            f"prompts: at most {prompts.videos} video(s), {prompts.images} image(s)"
            + (f" ({prompts.image_tokens} image tokens at their sizes)" if prompts.image_tokens else "")
            + f" and {prompts.text_tokens} text tokens"
            if prompts is not None
            else "prompts: data not read (not a local file, or unreadable); planned as long as the context allows "
            "beside one response"
        )
    if recipe_config.train.fp8.enable_fp8:
        from physreason.models.float8 import float8_outlook

        fp8 = recipe_config.train.fp8
        tokens = recipe_config.model.model_max_length * recipe.mini_batch
        block = [(lin.leaf, lin.in_features, lin.out_features) for lin in shape.linears
                 if lin.unit == "decoder" and lin.block == 0]  # fmt: skip
        outlook = float8_outlook(block, tokens, fp8.quant_recipe, recipe_config.train.compile, fp8.skip_small_linears)
        console.print(f"[train.fp8] {outlook}", markup=False)
    console.print(plan_table(plan_, capacity))
    fitting = fitting_layouts(shape, recipe, workload, capacity)
    note = tensor_parallel_note(shape, recipe, fitting)
    if note is not None:
        console.print(note, markup=False, soft_wrap=True)
    if fitting:
        console.print(layouts_table(fitting, recipe, job))  # type: ignore[arg-type]
    if not plan_.fits(capacity):
        raise ConfigError(refusal(plan_, capacity, fitting, job, f"a {gpu_memory:g} GiB GPU"))  # type: ignore[arg-type]


def _prompt_shape(config, console):
    """The PromptShape of a GRPO recipe's local prompts (media and longest text), or None when its data is not a local
    file or folder (a hub dataset is not downloaded to plan) or cannot be read: then one line says why (the prompts
    `grpo` would refuse at start, a question holding a chat-structure token among them) and the plan goes on from the
    recipe's lengths."""
    from physreason.data.mcq import load_mcq_prompts
    from physreason.data.structural_tokens import structural_tokens
    from physreason.errors import PhysReasonError
    from physreason.models import loading
    from physreason.train.memory_report import prompt_shape

    if not Path(config.data.dataset.name).expanduser().exists():
        return None
    try:
        tokenizer = loading.load_tokenizer(config.model)
        prompts = load_mcq_prompts(config.data.dataset, config.data.max_samples, structural_tokens(tokenizer))
        return prompt_shape(config, prompts, tokenizer)
    except (PhysReasonError, OSError, ValueError) as exc:
        console.print(
            f"the prompts of {config.data.dataset.name} were not read ({exc}): planned from the recipe's lengths, "
            "not theirs; `physreason grpo` reads them at start",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        return None


def _parameter_count(count: int) -> str:
    """A parameter count at a readable scale: '8.77 B', '3.4 M', '688,064'."""
    if count >= 1e9:
        return f"{count / 1e9:.2f} B"
    if count >= 1e6:
        return f"{count / 1e6:.1f} M"
    return f"{count:,}"
