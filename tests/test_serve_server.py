"""`physreason serve` without vLLM: the server command, the default system prompt, media checks, the CLI."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from physreason.chat.prompts import REASONING_SYSTEM_PROMPT
from physreason.chat.style import Prompting
from physreason.config import load_config
from physreason.models.tiny import build_tiny_tokenizer
from physreason.serve.media import local_media_problem, media_domains, remote_media_problem, request_media_problem
from physreason.serve.middleware import MEDIA_DOMAINS_ENV, MEDIA_ROOT_ENV, MediaPathCheck
from physreason.serve.server import NO_MEDIA_DOMAIN, ServeOptions, build_server_command, with_prompt_style


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "physreason", *args], capture_output=True, text=True, timeout=300, env=env
    )


def arg(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_server_binds_loopback_with_cosmos_sampling_defaults_and_the_physreason_parser(tmp_path):
    command = build_server_command(load_config(None, []), ServeOptions(), tmp_path / "t.jinja")
    argv = command.argv
    assert arg(argv, "--host") == "127.0.0.1"
    assert arg(argv, "--reasoning-parser") == "physreason"
    assert Path(arg(argv, "--reasoning-parser-plugin")).name == "vllm_plugin.py"
    assert arg(argv, "--generation-config") == "vllm"  # the model's own defaults do not mix in
    assert arg(argv, "--runner") == "generate"
    assert json.loads(arg(argv, "--override-generation-config")) == {
        "temperature": 0.6, "top_p": 0.95, "repetition_penalty": 1.05, "max_new_tokens": 4096,
    }  # fmt: skip
    assert json.loads(arg(argv, "--media-io-kwargs")) == {"video": {"fps": 4.0, "num_frames": 768}}
    assert arg(argv, "--chat-template") == str(tmp_path / "t.jinja")
    assert "--allowed-local-media-path" not in argv and "--api-key" not in argv and "--trust-remote-code" not in argv
    # vLLM fetches any host without a list: by default it gets one no host is on, so no endpoint fetches remote media
    assert arg(argv, "--allowed-media-domains") == NO_MEDIA_DOMAIN and NO_MEDIA_DOMAIN.endswith(".invalid")
    assert command.env[MEDIA_DOMAINS_ENV] == ""  # set even when empty: a value in the caller's shell must not count
    assert command.env["VLLM_MEDIA_URL_ALLOW_REDIRECTS"] == "0"


def test_recipe_and_options_reach_the_command_and_the_key_stays_off_the_command_line(tmp_path):
    cfg = load_config(None, ["generation.temperature=0.2", "vision.fps=2", "model.model_name_or_path=\"/m\""])
    options = ServeOptions(host="0.0.0.0", api_key="s3cret", media_root=tmp_path, extra_args=("--max-num-seqs", "8"))
    command = build_server_command(cfg, options, tmp_path / "t.jinja")
    assert arg(command.argv, "--model") == "/m" and arg(command.argv, "--host") == "0.0.0.0"
    assert json.loads(arg(command.argv, "--override-generation-config"))["temperature"] == 0.2
    assert json.loads(arg(command.argv, "--media-io-kwargs"))["video"]["fps"] == 2.0
    assert arg(command.argv, "--allowed-local-media-path") == str(tmp_path)
    assert command.argv[-2:] == ["--max-num-seqs", "8"]
    assert "s3cret" not in command.shown()
    assert command.env == {
        "VLLM_API_KEY": "s3cret", MEDIA_ROOT_ENV: str(tmp_path), MEDIA_DOMAINS_ENV: "",
        "VLLM_MEDIA_URL_ALLOW_REDIRECTS": "0",
    }  # fmt: skip


def test_media_domains_reach_vllm_and_the_middleware_and_any_host_lifts_the_list(tmp_path):
    cfg = load_config(None, [])
    command = build_server_command(cfg, ServeOptions(media_domains=("cdn.example.com", "10.0.0.5")), None)
    argv = command.argv
    at = argv.index("--allowed-media-domains")
    assert argv[at + 1 : at + 3] == ["cdn.example.com", "10.0.0.5"]
    assert command.env[MEDIA_DOMAINS_ENV] == "cdn.example.com,10.0.0.5"
    # vLLM checks the first URL's host only and follows redirects anywhere: off while hosts are listed
    assert command.env["VLLM_MEDIA_URL_ALLOW_REDIRECTS"] == "0"
    anywhere = build_server_command(cfg, ServeOptions(media_domains=("*",)), None)
    assert "--allowed-media-domains" not in anywhere.argv and anywhere.env[MEDIA_DOMAINS_ENV] == "*"
    assert "VLLM_MEDIA_URL_ALLOW_REDIRECTS" not in anywhere.env
    assert media_domains(["CDN.example.com", "cdn.example.com", "*", "bücher.de"]) == (
        "cdn.example.com", "*", "xn--bcher-kva.de",
    )  # fmt: skip
    bad_names = ("https://cdn.example.com", "cdn.example.com/clips", "", "*.example.com", "user@host", "x.org.", "a..b")
    for bad in bad_names:
        with pytest.raises(ValueError, match="host name alone"):
            media_domains([bad])


def test_remote_media_only_from_the_servers_hosts_and_never_through_ambiguous_urls():
    hosts = ("cdn.example.com",)
    assert remote_media_problem("data:video/mp4;base64,AAAA", ()) is None
    assert remote_media_problem("file:///data/clip.mp4", ()) is None  # the file rule's business
    assert "fetches no remote media" in remote_media_problem("http://169.254.169.254/latest/meta-data", ())
    assert "--media-domain" in remote_media_problem("HTTPS://cdn.example.com/a.mp4", ())
    assert remote_media_problem("https://CDN.example.com:443/a.mp4", hosts) is None
    assert "not one the server fetches media from" in remote_media_problem("https://localhost:8080/x.mp4", hosts)
    assert "not one the server fetches media from" in remote_media_problem("https://cdn.example.com.evil.io/x", hosts)
    for tricky, says in (
        ("https://cdn.example.com@169.254.169.254/x.mp4", "user info"),
        ("https://169.254.169.254\\@cdn.example.com/x.mp4", "backslashes or spaces"),
        ("https://cdn.example.com /x.mp4", "backslashes or spaces"),
        ("http://[::1/x", "not a URL the server can read"),
        ("https://cdn.example.com:99999/x.mp4", "not a URL the server can read"),
        ("https://cdn.example.com./x.mp4", "not one the server fetches"),  # vLLM compares the name with its dot
    ):
        assert says in (remote_media_problem(tricky, hosts) or ""), tricky
    assert remote_media_problem("https://BÜCHER.de/x.mp4", ("xn--bcher-kva.de",)) is None  # as vLLM's client sends it
    assert remote_media_problem("https://169.254.169.254/x", ("*",)) is None  # the operator asked for any host
    request = video_request("https://internal.corp/clip.mp4")
    assert "fetches no remote media" in request_media_problem(request, None)
    assert request_media_problem(video_request("https://cdn.example.com/clip.mp4"), None, hosts) is None


def test_an_fp8_kv_cache_reaches_the_server_command_and_auto_leaves_vllms_default():
    assert "--kv-cache-dtype" not in build_server_command(load_config(None), ServeOptions(), None).argv
    argv = build_server_command(load_config(None, ["engine.kv_cache_dtype=fp8"]), ServeOptions(), None).argv
    assert arg(argv, "--kv-cache-dtype") == "fp8"


def test_a_fixed_kv_cache_size_reaches_the_server_in_bytes_and_none_leaves_vllms_profiling():
    assert "--kv-cache-memory-bytes" not in build_server_command(load_config(None), ServeOptions(), None).argv
    argv = build_server_command(load_config(None, ["engine.kv_cache_memory_gib=1.5"]), ServeOptions(), None).argv
    assert arg(argv, "--kv-cache-memory-bytes") == str(3 * 2**29)


def test_a_conversation_without_system_message_gets_the_cosmos_reason_prompt():
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = with_prompt_style(tokenizer.chat_template, Prompting(system_prompt=REASONING_SYSTEM_PROMPT))
    user = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Is it falling?"}]}]
    prompt = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    assert prompt.startswith(f"<|im_start|>system\n{REASONING_SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n")
    assert "<|vision_start|><|video_pad|><|vision_end|>Is it falling?" in prompt
    own = [{"role": "system", "content": "Be brief."}, *user]
    prompt = tokenizer.apply_chat_template(own, tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>") and REASONING_SYSTEM_PROMPT not in prompt


def video_request(url: str) -> dict:
    content = [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "What happens?"}]
    return {"model": "m", "messages": [{"role": "user", "content": content}]}


def test_local_media_must_be_an_existing_file_under_the_media_root(tmp_path):
    root = tmp_path / "media"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "clip.mp4").write_bytes(b"x")
    (tmp_path / "secret.txt").write_text("x")
    assert local_media_problem(f"file://{root}/sub/clip.mp4", root) is None
    assert local_media_problem("https://example.com/clip.mp4", root) is None
    assert "outside the server's media root" in local_media_problem(f"file://{root}/../secret.txt", root)
    assert "outside the server's media root" in local_media_problem(f"file://{tmp_path}/secret.txt", root)
    assert "no such file" in local_media_problem(f"file://{root}/sub/missing.mp4", root)
    assert "absolute path" in local_media_problem("file://sub/clip.mp4", root)
    assert "--media-root" in local_media_problem(f"file://{root}/sub/clip.mp4", None)
    assert "outside the server's media root" in local_media_problem(f"FILE://{tmp_path}/secret.txt", root)
    assert "no such file" in request_media_problem(video_request(f"file://{root}/nope.mp4"), root)


async def call_middleware(body: dict, env: dict, monkeypatch, headers=()) -> tuple[int, dict | None, bool]:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    reached = {}

    async def app(scope, receive, send):
        body, more = b"", True
        while more:
            message = await receive()
            body, more = body + message["body"], message.get("more_body", False)
        reached["body"] = json.loads(body)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    sent = []
    raw = json.dumps(body).encode()
    chunks = [{"type": "http.request", "body": raw[:10], "more_body": True}, {"type": "http.request", "body": raw[10:]}]

    async def receive():
        return chunks.pop(0)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": list(headers)}
    await MediaPathCheck(app)(scope, receive, send)
    error = json.loads(sent[1]["body"]) if sent[0]["status"] == 400 else None
    assert "body" not in reached or reached["body"] == body  # the app reads the body unchanged
    return sent[0]["status"], error, "body" in reached


def test_middleware_answers_a_missing_file_with_a_400_and_passes_good_requests_on(tmp_path, monkeypatch):
    (tmp_path / "clip.mp4").write_bytes(b"x")
    env = {MEDIA_ROOT_ENV: str(tmp_path)}
    status, error, reached = asyncio.run(call_middleware(video_request(f"file://{tmp_path}/gone.mp4"), env, monkeypatch))
    assert (status, reached) == (400, False)
    assert error["error"]["code"] == 400 and "no such file" in error["error"]["message"]
    assert asyncio.run(call_middleware(video_request(f"file://{tmp_path}/clip.mp4"), env, monkeypatch))[::2] == (200, True)


def test_middleware_answers_remote_media_from_another_host_with_a_400(monkeypatch):
    monkeypatch.delenv(MEDIA_DOMAINS_ENV, raising=False)
    status, error, reached = asyncio.run(call_middleware(video_request("http://10.0.0.1/admin"), {}, monkeypatch))
    assert (status, reached) == (400, False) and "fetches no remote media" in error["error"]["message"]
    env = {MEDIA_DOMAINS_ENV: "cdn.example.com"}
    good = video_request("https://cdn.example.com/clip.mp4")
    assert asyncio.run(call_middleware(good, env, monkeypatch))[::2] == (200, True)
    assert asyncio.run(call_middleware(video_request("http://10.0.0.1/admin"), env, monkeypatch))[0] == 400
    # JSON may escape the slashes: the body is still read as a request
    escaped = json.loads(json.dumps(video_request("http://10.0.0.1/admin")).replace("/", "\\/"))
    assert asyncio.run(call_middleware(escaped, env, monkeypatch))[0] == 400


def test_middleware_leaves_callers_without_the_api_key_to_vllms_401(tmp_path, monkeypatch):
    env = {MEDIA_ROOT_ENV: str(tmp_path), "VLLM_API_KEY": "k"}
    request = video_request(f"file://{tmp_path}/gone.mp4")
    assert asyncio.run(call_middleware(request, env, monkeypatch))[::2] == (200, True)  # vLLM answers it (401)
    keyed = [(b"authorization", b"Bearer k")]
    assert asyncio.run(call_middleware(request, env, monkeypatch, keyed))[0] == 400


def test_middleware_reads_no_body_of_a_caller_without_the_api_key(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "k")
    read, seen = [], {}

    async def receive():
        read.append(1)
        return {"type": "http.request", "body": b"x" * 1024, "more_body": True}  # a body that never ends

    async def app(scope, receive_, send):
        seen["read before the app"] = len(read)  # vLLM's own key check answers 401 from here

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}
    asyncio.run(MediaPathCheck(app)(scope, receive, None))
    assert seen == {"read before the app": 0}


def test_serve_help_names_the_options():
    result = run_cli("serve", "--help")
    assert result.returncode == 0
    for option in ("--model", "--host", "--api-key", "--media-root", "--print-command", "127.0.0.1"):
        assert option in result.stdout


def test_print_command_shows_the_vllm_command_for_a_local_model(tiny_model_dir, tmp_path):
    env = {**__import__("os").environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    result = run_cli(
        "serve", "-m", str(tiny_model_dir), "--media-root", str(tmp_path), "--print-command", "--", "--max-num-seqs", "4",
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert "--allowed-local-media-path " + str(tmp_path) in result.stdout and "--max-num-seqs 4" in result.stdout
    (template,) = (tmp_path / "cache" / "physreason" / "serve").glob("chat-template-*.jinja")
    assert REASONING_SYSTEM_PROMPT.splitlines()[0] in template.read_text()


def test_a_media_domain_with_a_scheme_is_a_usage_error_and_a_host_reaches_the_command(tiny_model_dir, tmp_path):
    env = {**__import__("os").environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    result = run_cli("serve", "-m", str(tiny_model_dir), "--media-domain", "https://x.org", "--print-command", env=env)
    assert result.returncode == 2 and "host name alone" in result.stderr and "Traceback" not in result.stderr
    result = run_cli("serve", "-m", str(tiny_model_dir), "--media-domain", "x.org", "--print-command", env=env)
    assert result.returncode == 0, result.stderr
    assert "--allowed-media-domains x.org" in result.stdout and f"{MEDIA_DOMAINS_ENV}=x.org" in result.stdout


def test_a_missing_media_root_is_a_usage_error(tiny_model_dir, tmp_path):
    result = run_cli("serve", "-m", str(tiny_model_dir), "--media-root", str(tmp_path / "nope"), "--print-command")
    assert result.returncode == 2 and "not an existing folder" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_serve_without_vllm_says_how_to_install_it_and_exits_2(tiny_model_dir):
    result = run_cli("serve", "-m", str(tiny_model_dir))
    assert result.returncode == 2
    assert "vLLM is not installed" in result.stderr and "pip install" in result.stderr
    assert "Traceback" not in result.stderr
