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


def serve_command() -> list[str]:
    """The argv prefix that runs `vllm serve` with this interpreter.

    `vllm.entrypoints.cli.main` is the `vllm` console script's module in 0.26 and 0.32 (the older
    `vllm.entrypoints.openai.api_server` entry is deprecated in 0.32); running it with `sys.executable`
    keeps the server in the same environment as physreason, whatever is first on PATH.
    """
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve"]


def reasoning_parser_plugin() -> str:
    """The `--reasoning-parser-plugin` value that registers physreason's parser: the plugin's file path.

    0.26 imports the plugin only by file path (0.32 tries a module name first, then a path), so a path
    works in both. vLLM imports it in the API server process, and in 0.32 in the engine core too.
    """
    from pathlib import Path

    return str(Path(__file__).with_name("vllm_plugin.py"))
