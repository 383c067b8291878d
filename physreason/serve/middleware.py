"""ASGI middleware for vLLM's server (`--middleware`): answer unreadable local media, and remote media from a host the
server may not fetch from, with a clear 400.

vLLM adds middleware given by import path around its app, outside its own API-key check, so this one
looks at a request only when it carries the server's key (or the server has none): callers without
the key learn nothing about the files, and get vLLM's 401 as before. Only Chat Completions bodies that
mention `url` (every media part does) are parsed; every other request passes through untouched (vLLM's own domain
list, `--allowed-media-domains`, refuses remote media on the other endpoints).
"""

from __future__ import annotations

import hmac
import json
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from physreason.serve.media import request_media_problem

MEDIA_ROOT_ENV = "PHYSREASON_SERVE_MEDIA_ROOT"  # set by `physreason serve` for the server process
MEDIA_DOMAINS_ENV = "PHYSREASON_SERVE_MEDIA_DOMAINS"  # comma-separated hosts ("*": any) of remote media; unset: none
API_KEY_ENV = "VLLM_API_KEY"

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class MediaPathCheck:
    """Rejects Chat Completions requests whose `file://` or http(s) media the server may not or cannot read (400)."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app
        root = os.environ.get(MEDIA_ROOT_ENV)
        self.media_root = Path(root) if root else None
        self.media_domains = tuple(host for host in os.environ.get(MEDIA_DOMAINS_ENV, "").split(",") if host)
        self.api_key = os.environ.get(API_KEY_ENV) or None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or scope.get("method") != "POST" or not scope["path"].endswith("/chat/completions")
                or not self._authorized(scope)):  # checked before the body is read: a caller without the key gets
            await self.app(scope, receive, send)  # vLLM's 401, and no body of theirs is held here
            return
        body, messages = await _read_body(receive)
        problem = None
        if b"url" in body:  # every media part is {"type": "..._url", "..._url": {"url": ...}}
            try:
                request = json.loads(body)
            except ValueError:
                request = None  # vLLM reports malformed JSON itself
            if isinstance(request, dict):
                problem = request_media_problem(request, self.media_root, self.media_domains)
        if problem is not None:
            await _send_error(send, problem)
            return
        await self.app(scope, _replay(messages, receive), send)

    def _authorized(self, scope: Scope) -> bool:
        if self.api_key is None:
            return True
        headers = dict(scope.get("headers") or ())
        given = headers.get(b"authorization", b"").decode("latin-1")
        return hmac.compare_digest(given, f"Bearer {self.api_key}")


async def _read_body(receive: Receive) -> tuple[bytes, list[dict[str, Any]]]:
    """The whole request body, and the ASGI messages it came in (to hand on unchanged)."""
    chunks, messages = [], []
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks), messages


def _replay(messages: list[dict[str, Any]], receive: Receive) -> Receive:
    """A `receive` that hands out the messages already read, then reads on."""
    pending = list(messages)

    async def replay() -> dict[str, Any]:
        return pending.pop(0) if pending else await receive()

    return replay


async def _send_error(send: Send, message: str) -> None:
    """A 400 in the OpenAI error layout vLLM uses."""
    body = json.dumps({"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 400, "headers": headers})
    await send({"type": "http.response.body", "body": body})
