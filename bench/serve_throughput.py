"""Requests/s of `physreason serve` against plain vLLM serving on the same model and requests (GPU; --tiny on CPU).

Both servers, the requests and why each continues an open `<think>`: bench/RESULTS.md ("How the scripts measure").
One JSON line per round and a summary (median requests/s of each, ratio, overhead %).
    python bench/serve_throughput.py --model /models/Cosmos-Reason1-7B            # GPU
    python bench/serve_throughput.py --tiny                                      # CPU dry run, tiny random model
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from harness import Report, add_json, device_line, free_port

# Arguments only the physreason server has; removing them gives the plain vLLM server.
PHYSREASON_ONLY = ("--reasoning-parser", "--reasoning-parser-plugin", "--middleware")


def server_commands(args: argparse.Namespace, workdir: Path) -> dict[str, tuple[list[str], dict[str, str]]]:
    """{"vllm": (argv, env), "physreason": (argv, env)}: the same server, without and with physreason's parts."""
    from physreason.config import load_config
    from physreason.models.inputs import prompting_for
    from physreason.serve.server import (
        ServeOptions,
        build_server_command,
        chat_template_file,
        model_chat_template,
        with_prompt_style,
    )

    sets = [f'model.model_name_or_path="{args.model}"', f"generation.max_tokens={args.max_tokens}"]
    if args.tiny:
        sets += ['model.dtype="float32"', "engine.max_model_len=2048", "engine.enforce_eager=true"]
    cfg = load_config(None, sets)
    prompting, sampling = prompting_for(cfg)  # the prompt style and sampling `physreason serve` would use
    options = ServeOptions(prompting=prompting, extra_args=("--max-num-seqs", str(args.concurrency), *args.vllm_args))
    template = chat_template_file(with_prompt_style(model_chat_template(cfg), prompting), workdir)
    ours = build_server_command(cfg, options, template, sampling)
    plain, skip = [], False
    for token in ours.argv:
        if skip:
            skip = False
        elif token in PHYSREASON_ONLY:
            skip = True
        else:
            plain.append(token)
    return {"vllm": (plain, {}), "physreason": (ours.argv, ours.env)}


def start(argv: list[str], env: dict[str, str], port: int, log: Path) -> subprocess.Popen:
    argv = [*argv, "--port", str(port)]  # the later --port wins in vLLM's argparse
    process = subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ, **env})
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline and process.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return process
        except OSError:
            time.sleep(1)
    process.kill()
    sys.exit(f"server did not start; see {log}")


async def run_round(base_url: str, model: str, args: argparse.Namespace) -> dict:
    """Send the round's requests; returns wall time and the tokens generated."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused")
    gate = asyncio.Semaphore(args.concurrency)
    messages = [{"role": "user", "content": "Describe what happens when the ball hits the floor."}]
    extra: dict = {"ignore_eos": True, "min_tokens": args.max_tokens}
    if args.open_think:
        messages.append({"role": "assistant", "content": "<think>\n"})
        extra.update(add_generation_prompt=False, continue_final_message=True)

    async def one(k: int) -> int:
        async with gate:
            kwargs = dict(model=model, messages=messages, max_tokens=args.max_tokens, seed=k, extra_body=extra)
            if not args.stream:
                response = await client.chat.completions.create(**kwargs)
                return response.usage.completion_tokens
            stream = await client.chat.completions.create(
                **kwargs, stream=True, stream_options={"include_usage": True}
            )
            tokens = 0
            async for chunk in stream:
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            return tokens

    start_time = time.perf_counter()
    tokens = await asyncio.gather(*(one(k) for k in range(args.requests)))
    seconds = time.perf_counter() - start_time
    await client.close()
    return {"seconds": seconds, "requests": args.requests, "tokens": sum(tokens)}


def measure(name: str, argv: list[str], env: dict[str, str], args: argparse.Namespace, workdir: Path,
            report: Report) -> list[float]:  # fmt: skip
    port = free_port()
    process = start(argv, env, port, workdir / f"{name}.log")
    base_url = f"http://127.0.0.1:{port}/v1"
    rates = []
    try:
        asyncio.run(run_round(base_url, args.model, argparse.Namespace(**{**vars(args), "requests": args.concurrency})))
        for round_index in range(args.rounds):
            result = asyncio.run(run_round(base_url, args.model, args))
            rate = result["requests"] / result["seconds"]
            rates.append(rate)
            report.row(dict(server=name, round=round_index, requests_per_s=round(rate, 3),
                            tokens_per_s=round(result["tokens"] / result["seconds"], 1), **result))  # fmt: skip
    finally:
        process.terminate()
        process.wait(timeout=120)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model folder or hub id (GPU run)")
    parser.add_argument("--tiny", action="store_true", help="CPU dry run on a tiny random Qwen2.5-VL built here")
    parser.add_argument("--requests", type=int, default=512, help="requests per round")
    parser.add_argument("--concurrency", type=int, default=64, help="requests in flight (also --max-num-seqs)")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens each request generates")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per server (the median is reported)")
    parser.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--open-think", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("vllm_args", nargs="*", help="more vLLM server arguments, after --")
    add_json(parser)
    args = parser.parse_args()
    if args.tiny:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        args.requests, args.concurrency, args.max_tokens, args.rounds = 8, 4, 16, 1
    elif not args.model:
        parser.error("give --model (GPU) or --tiny (CPU dry run)")
    with tempfile.TemporaryDirectory(prefix="serve-bench-") as tmp:
        workdir = Path(tmp)
        if args.tiny:
            from physreason.models.tiny import save_tiny_model

            args.model = str(save_tiny_model("qwen2_5_vl", workdir / "tiny"))
        commands = server_commands(args, workdir)
        report = Report("serve_throughput.json", args.json, **device_line(model=args.model, stream=args.stream))
        rates = {name: measure(name, argv, env, args, workdir, report) for name, (argv, env) in commands.items()}
    plain, ours = statistics.median(rates["vllm"]), statistics.median(rates["physreason"])
    summary = dict(summary=True, model=args.model, stream=args.stream, open_think=args.open_think,
                   vllm_requests_per_s=round(plain, 3), physreason_requests_per_s=round(ours, 3), ratio=round(ours / plain, 4),
                   overhead_percent=round(100 * (1 - ours / plain), 2))  # fmt: skip
    report.row(summary)


if __name__ == "__main__":
    main()
