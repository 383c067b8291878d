"""`physreason infer`: ask a model about videos or images, or run a resumable batch (one process or Ray Data)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.panel import Panel

from physreason.cli import recipe_options as opt
from physreason.cli.output_options import hidden_alias
from physreason.errors import PhysReasonError
from physreason.progress import make_console

if TYPE_CHECKING:
    from physreason.chat.style import Prompting
    from physreason.config import Config, SamplingConfig

console = make_console()


def infer(
    ctx: typer.Context,
    model: opt.Model = None,
    video: list[Path] = typer.Option(
        [], "--video", metavar="<path>", help="Video file or file:// URL (repeatable). No -v: most tools mean verbose."
    ),
    image: list[Path] = typer.Option(
        [], "--image", "-i", metavar="<path>", help="Image file: jpg, png, webp (repeatable)."
    ),
    question: str | None = typer.Option(None, "--question", "-q", help="What to ask about the media."),
    jsonl: Path | None = typer.Option(
        None, "--jsonl", help='Batch input: one {"id", "question", "video"|"image", "video_start"?, "video_end"?} per line.'
    ),
    parquet: Path | None = typer.Option(
        None, "--parquet", help="Batch input: a Parquet file or folder with columns id, question, video|image."
    ),
    out: Path | None = typer.Option(
        None, "--out", help="Results file: JSONL, or a folder of Parquet parts if it ends in .parquet. A batch's "
        "rerun skips ids already there; one --video/--image question adds its record (id: the first media path)."
    ),
    retry_failed: bool | None = typer.Option(
        None, "--retry-failed", help="Batch: run the requests whose earlier result is an error again."
    ),
    overwrite: bool = typer.Option(
        False,
        "--overwrite",
        help="Delete OUT's earlier results first (only an output of physreason infer: one with its settings file). "
        "Without it a rerun adds to OUT only if it uses the same model and settings (stored in OUT.settings.json, "
        "or _settings.json in a Parquet folder).",
    ),
    force: bool = hidden_alias("--force", flag=True),
    num_gpus: int | None = typer.Option(
        None, "--num-gpus", help="Batch on Ray Data: num_gpus / tp engine replicas [default: one engine, this process]."
    ),
    ray_address: str | None = typer.Option(
        None, "--ray-address", help="Ray cluster to join (auto or host:port) [default: RAY_ADDRESS, else start one]."
    ),
    media_root: Path | None = typer.Option(
        None, help="Folder batch media paths are relative to (default: the JSONL's folder)."
    ),
    config: Path | None = typer.Option(
        None, "--config", "-c", help="TOML recipe with [model], [engine], [vision], [generation]."
    ),
    overrides: list[str] = typer.Option(
        [], "--set", metavar="KEY=VALUE", help="Override a config key: --set generation.top_p=0.9 (repeatable)."
    ),
    engine: str | None = typer.Option(None, help="Engine: auto (vLLM when installed), vllm or hf."),
    lora: Path | None = typer.Option(
        None, "--lora", help="PEFT LoRA adapter folder served on top of --model (e.g. <run>/safetensors/step_N/adapter)."
    ),
    fps: opt.Fps = None,
    nframes: int | None = typer.Option(
        None, help="Sample this many frames per video instead of --fps (rounded to even, as qwen-vl-utils does)."
    ),
    video_start: float | None = typer.Option(
        None, help="Seconds: sample videos from this time on (a --jsonl line's video_start wins)."
    ),
    video_end: float | None = typer.Option(
        None, help="Seconds: sample videos up to this time (a --jsonl line's video_end wins)."
    ),
    max_pixels: int | None = typer.Option(None, help="Largest pixels per frame after resizing."),
    total_pixels: int | None = typer.Option(None, help="Pixel budget of a whole video, shared over its frames."),
    timestamps: bool | None = typer.Option(
        None, "--timestamps/--no-timestamps", help="Draw each frame's time under it."
    ),
    reasoning: bool | None = opt.reasoning_option("Ask for <think> reasoning before the answer"),
    prompt_style: opt.PromptStyle = None,
    temperature: opt.Temperature = None,
    top_p: opt.TopP = None,
    top_k: int | None = typer.Option(None, help="Keep the k likeliest tokens; -1 keeps all [default: -1; Reason2 20]."),
    repetition_penalty: opt.RepetitionPenalty = None,
    presence_penalty: opt.PresencePenalty = None,
    frequency_penalty: float | None = typer.Option(None, help="Penalty per repeat of a token in the completion."),
    max_tokens: opt.MaxTokens = None,
    seed: int | None = typer.Option(None, help="Sampling seed [default: none; Reason2 1234 / 3407 by mode]."),
    n: int | None = typer.Option(None, "-n", help="Completions per request."),
    dtype: opt.Dtype = None,
    tensor_parallel_size: opt.TensorParallelSize = None,
    gpu_memory_utilization: opt.GpuMemoryUtilization = None,
    max_model_len: opt.MaxModelLen = None,
    enforce_eager: opt.EnforceEager = None,
    as_json: bool = typer.Option(False, "--json", help="Print results as JSON instead of panels."),
    print_prompt: bool = typer.Option(
        False,
        "--print-prompt",
        help="Print what the model would be given (the rendered prompt, each video's sampled frame times and "
        "frame sizes, visual tokens) and exit without loading the model or generating.",
    ),
) -> None:
    """Ask a model about videos/images; prints the reasoning and the answer.

    Exit codes: 0 every request answered; 1 an inference failed (a batch: at least one request of IN has an
    error in OUT; the others are written, and --retry-failed runs the failed ones again); 2 a usage error or a
    problem the message names (bad flag, path, config key, request record); 130 Ctrl-C (results so far kept).
    """
    from physreason.config import load_config
    from physreason.engines import create_engine
    from physreason.infer import build_request, result_record, run_batch, run_ray_batch
    from physreason.infer.batch import output_lock, prepare_single_out, write_single_result
    from physreason.infer.settings import answer_settings
    from physreason.models.inputs import checked_vision_factor, patch_factor, prompting_for
    from physreason.models.source import model_fingerprint
    from physreason.rewards.extract import answer_region

    overwrite = overwrite or force
    if fps is not None and nframes is not None:
        raise typer.BadParameter("give --fps or --nframes, not both", param_hint="'--nframes'")
    cfg = load_config(config, overrides, opt.recipe_values(ctx.params))
    if jsonl is not None and parquet is not None:
        raise PhysReasonError("give --jsonl or --parquet, not both")
    batch = jsonl if jsonl is not None else parquet
    if batch is None and question is None:
        raise PhysReasonError("give --question with --video/--image, or --jsonl|--parquet IN --out OUT for a batch")
    if batch is not None and out is None:
        flag = "--jsonl" if jsonl is not None else "--parquet"
        raise PhysReasonError(f"{flag} needs --out: the file results are appended to (and resumed from)")
    if print_prompt and batch is not None:
        raise PhysReasonError("--print-prompt shows one question's prompt: give --question with --video/--image")
    if batch is None and not video and not image:
        # on stderr: with --json, stdout is the JSON alone
        make_console(stderr=True).print("[yellow]no --video or --image given: asking a text-only question[/]")

    if batch is not None or out is not None:
        checked_vision_factor(cfg)  # a bad pixel setting fails here, before OUT holds a result made with it
        prompting, sampling = prompting_for(cfg)
        _startup(cfg, prompting, sampling, {"input": batch, "output": out}, stderr=False)
        # The style, mode and sampling as resolved for this checkpoint, so `auto` cannot hide a change of answers.
        resolved = {f"generation.{key}": value for key, value in sampling.model_dump(mode="json").items()}
        settings = answer_settings(cfg, **resolved, **{f"resolved.{k}": v for k, v in prompting.describe().items()})
        # The model as it is on disk (or its hub commit), not as typed: `m/` is `m`, a new model saved at `m` is not.
        settings |= model_fingerprint(cfg.model.model_name_or_path, cfg.model.revision)
    if batch is not None:
        if cfg.infer.num_gpus is not None:
            summary = run_ray_batch(cfg, batch, out, media_root=media_root, settings=settings, overwrite=overwrite)
        else:
            summary = run_batch(
                lambda: create_engine(cfg.model, cfg.engine),
                batch,
                out,
                sampling=sampling,
                vision=cfg.vision,
                prompting=prompting,
                media_root=media_root,
                batch_size=cfg.engine.batch_size,
                retry_failed=cfg.infer.retry_failed,
                settings=settings,
                overwrite=overwrite,
                decode_workers=cfg.infer.decode_workers,
            )
        console.print(summary.describe(out), soft_wrap=True, highlight=False)
        if summary.failed or summary.failed_before:
            raise typer.Exit(1)  # scripts see that OUT is incomplete; the line above says how to retry
        return
    # Media are decoded before the model loads, so a bad path fails in a second, not after a minute.
    factor = patch_factor(cfg.model.model_name_or_path, cfg.model.revision)
    prompting, sampling = prompting_for(cfg)
    request = build_request(
        question, videos=video, images=image, vision=cfg.vision, prompting=prompting, request_id="0", factor=factor
    )
    # Before the model loads: which model, style, mode, dtype and sampling the answer below comes from.
    _startup(cfg, prompting, sampling, {}, stderr=as_json)
    if print_prompt:
        from physreason.infer.prompt_view import describe_prompt

        typer.echo(describe_prompt(request, cfg.model))
        return
    rid = str((video or image or ["question"])[0])
    with contextlib.ExitStack() as held:
        if out is not None:  # the one result goes to OUT in the batch format; checked before the model loads
            held.enter_context(output_lock(out))
            prepare_single_out(out, rid, settings, overwrite)
        generator = held.enter_context(create_engine(cfg.model, cfg.engine))
        (result,) = generator.generate([request], sampling, logprobs=False)
        record = result_record(result, prompting.style, prompting.reasoning)
        if out is not None:
            write_single_result(out, {**record, "id": rid})
            console.print(f"wrote the result of {rid} to {out}", soft_wrap=True, highlight=False)
    if as_json:
        typer.echo(json.dumps(record, ensure_ascii=False, indent=2))
    elif result.error:
        typer.echo(f"error: {result.error}", err=True)
    else:
        for k, output in enumerate(record["outputs"]):
            title = f"completion {k + 1}" if len(record["outputs"]) > 1 else "completion"
            if output["reasoning"] is not None:
                console.print(Panel(output["reasoning"].strip() or "(empty)", title=f"{title}: reasoning", expand=True))
            answer = output["answer"]
            if answer is None:  # the text the rewards and evaluation read as the answer, or none at all
                region = answer_region(output["text"])[0]
                answer = "(none: the reasoning never ended)" if region is None else region
            console.print(Panel(answer.strip() or "(empty)", title=f"{title}: answer", border_style="green"))
            if output["format_problems"]:
                console.print(f"[yellow]format: {'; '.join(output['format_problems'])}[/]")
    if record.get("error"):
        raise typer.Exit(1)


def _startup(cfg: Config, prompting: Prompting, sampling: SamplingConfig, extra: dict[str, object], *, stderr: bool) -> None:
    """infer's start-up summary: model, family, prompt style and mode, dtype/device/engine, sampling, then `extra`."""
    from physreason.engines.factory import resolve_backend
    from physreason.startup import (
        describe_device,
        describe_family,
        describe_model,
        describe_prompting,
        describe_sampling,
        print_startup,
    )

    items: dict[str, object] = {
        "model": describe_model(cfg.model),
        "family": describe_family(cfg.model),
        "lora": cfg.engine.lora,
        "prompt": describe_prompting(prompting),
        "device": describe_device(cfg.model.dtype, resolve_backend(cfg.engine), cfg.engine.tensor_parallel_size),
        "sampling": describe_sampling(sampling),
    }
    print_startup("physreason infer", items | extra, stderr=stderr)
