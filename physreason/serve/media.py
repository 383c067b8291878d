"""Which local media a chat request may name: `file://` URLs only under the server's media root.

vLLM checks the same rule, but answers a missing file with a 500 and masks the paths in its messages;
this check runs first (see `physreason.serve.middleware`) so the caller gets a 400 that says what to fix.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

# OpenAI content-part types that carry a media URL ({"type": T, T: {"url": ...}}); vLLM adds video_url.
MEDIA_PART_TYPES = ("image_url", "video_url", "audio_url")


def media_urls(request: dict[str, Any]) -> Iterator[str]:
    """Every media URL in a Chat Completions request body, in message order."""
    for message in request.get("messages") or ():
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if not isinstance(part, dict):
                continue
            for kind in MEDIA_PART_TYPES:
                value = part.get(kind)
                url = value.get("url") if isinstance(value, dict) else value
                if isinstance(url, str):
                    yield url


def local_media_problem(url: str, media_root: Path | None) -> str | None:
    """Why the server cannot read `url`, or None when it is not a file URL or names a file under `media_root`."""
    if not url.startswith("file:"):
        return None
    if media_root is None:
        return (
            f"{url}: this server reads no local files; send the media as an http(s) or data: URL, "
            "or start the server with --media-root FOLDER"
        )
    parsed = urlparse(url)
    if parsed.netloc:
        return f"{url}: a file URL needs an absolute path after file://, as in file:///data/clip.mp4"
    path = Path(unquote(parsed.path))
    try:
        resolved = path.resolve()
    except (OSError, RuntimeError):
        resolved = path
    if not resolved.is_relative_to(media_root):
        return f"{url}: outside the server's media root; only files under it can be used"
    if not resolved.is_file():
        return f"{url}: no such file under the server's media root; check the path"
    return None


def request_media_problem(request: dict[str, Any], media_root: Path | None) -> str | None:
    """The first media URL in a request the server cannot read, explained; None when all can be read."""
    for url in media_urls(request):
        problem = local_media_problem(url, media_root)
        if problem is not None:
            return problem
    return None
