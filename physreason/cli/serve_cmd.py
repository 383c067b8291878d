"""`physreason serve`: an OpenAI-compatible server (vLLM's) that splits reasoning from the answer."""

from __future__ import annotations

from pathlib import Path

import typer

from physreason.cli import recipe_options as opt
from physreason.errors import PhysReasonError
from physreason.progress import make_console

err_console = make_console(stderr=True)


def serve(
    ctx: typer.Context,
    model: opt.Model = None,
    config: Path | None = typer.Option(
        None, "--config", "-c", help="TOML recipe: [model], [engine], [vision] and [generation] are used."
    ),
    overrides: list[str] = typer.Option([], "--set", metavar="KEY=VALUE", help="Override a config key: --set generation.top_p=0.9."),
    host: str = typer.Option("127.0.0.1", help="Address to bind; 0.0.0.0 exposes the server to the network."),
    port: int = typer.Option(8000, help="Port to listen on."),
    api_key: str | None = typer.Option(
        None,
        envvar="PHYSREASON_API_KEY",
        help="Require this bearer key on every request (or set PHYSREASON_API_KEY); passed to vLLM in its environment.",
    ),
    media_root: Path | None = typer.Option(
        None, help="Folder whose files (file:// URLs) requests may use; without it no local file can be named."
    ),
    media_domain: list[str] = typer.Option(
        [],
        "--media-domain",
        metavar="HOST",
        help="Host whose http(s) media URLs the server may fetch (repeat for several; '*' for any). Without it the "
        "server fetches no remote media: requests send data: URLs or files under --media-root.",
    ),
    served_model_name: str | None = typer.Option(
        None, help="Model name clients send in requests [default: the --model value]."
    ),
    system_prompt: str | None = typer.Option(
        None, help="System prompt for requests that send none [default: the prompt style's for the mode]."
    ),
    reasoning: bool | None = opt.reasoning_option(
        'Default mode of requests (each may send chat_template_kwargs {"reasoning": ...})'
    ),
    prompt_style: opt.PromptStyle = None,
    chat_template: Path | None = typer.Option(
        None, help="Jinja chat template file to use instead of the model's own (it gets the default system prompt too)."
    ),
    fps: opt.Fps = None,
    temperature: opt.Temperature = None,
    top_p: opt.TopP = None,
    repetition_penalty: opt.RepetitionPenalty = None,
    presence_penalty: opt.PresencePenalty = None,
    max_tokens: opt.MaxTokens = None,
    dtype: opt.Dtype = None,
    tensor_parallel_size: opt.TensorParallelSize = None,
    gpu_memory_utilization: opt.GpuMemoryUtilization = None,
    max_model_len: opt.MaxModelLen = None,
    enforce_eager: opt.EnforceEager = None,
    print_command: bool = typer.Option(
        False, "--print-command", help="Print the vllm serve command and exit without starting it."
    ),
    vllm_args: list[str] | None = typer.Argument(
        None,
        metavar="VLLM_ARGS",
        help="Further vllm serve arguments, after --: physreason serve -m M -- --max-num-seqs 64"
    ),
) -> None:
    """Serve a model over vLLM's OpenAI-compatible API: <think> text in `reasoning`, the <answer> in `content`.

    The sampling options set the defaults of requests that send none.
    """
    from physreason.config import load_config
    from physreason.models.inputs import prompting_for
    from physreason.serve.server import (
        ServeOptions,
        build_server_command,
        chat_template_file,
        exec_server,
        model_chat_template,
        resolve_media_root,
        vllm_missing_message,
        with_prompt_style,
    )

    if not print_command and (missing := vllm_missing_message()):
        raise PhysReasonError(missing)
    cfg = load_config(config, overrides, opt.recipe_values(ctx.params))
    prompting, sampling = prompting_for(cfg)
    options = ServeOptions(
        host=host,
        port=port,
        served_model_name=served_model_name,
        api_key=api_key or None,
        media_root=resolve_media_root(media_root),
        media_domains=_media_domains(media_domain),
        prompting=prompting,
        extra_args=tuple(vllm_args or ()),
    )
    if chat_template is not None:
        if not chat_template.is_file():
            raise PhysReasonError(f"--chat-template {chat_template}: no such file")
        template = chat_template.read_text()
    else:
        template = model_chat_template(cfg, local_only=print_command)
    template_path = chat_template_file(with_prompt_style(template, prompting)) if template is not None else None
    command = build_server_command(cfg, options, template_path, sampling)
    if print_command:
        if template_path is None:
            err_console.print(
                f"note: the tokenizer of {cfg.model.model_name_or_path} is not downloaded, so this command has no "
                "--chat-template and requests without a system message get none; `physreason serve` (or this command "
                "once the model is in the cache) adds the default system prompt",
                highlight=False,
                soft_wrap=True,
            )
        typer.echo(command.shown())
        return
    if host not in ("127.0.0.1", "localhost", "::1") and not options.api_key:
        err_console.print(f"[yellow]warning: serving on {host} without --api-key: anyone who can reach it may use it[/]")
    err_console.print(f"starting: {command.shown()}", highlight=False, soft_wrap=True)
    exec_server(command)


def _media_domains(values: list[str]) -> tuple[str, ...]:
    from physreason.errors import InputError
    from physreason.serve.media import media_domains

    try:
        return media_domains(values)
    except ValueError as exc:
        raise InputError(str(exc)) from None
