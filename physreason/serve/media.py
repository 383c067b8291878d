"""Which media a chat request may name: `file://` URLs only under the server's media root, http(s) URLs only from
the hosts the server was started with (`--media-domain`; none by default, so a caller cannot make the server fetch
from its own network: cloud metadata, internal services), data: URLs always.

vLLM checks the file rule too, but answers a missing file with a 500 and masks the paths in its messages, and
fetches any http(s) URL when it has no domain list; this check runs first (see `physreason.serve.middleware`) so
the caller gets a 400 that says what to fix.
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


ANY_DOMAIN = "*"  # --media-domain '*': http(s) media from any host


def remote_media_problem(url: str, domains: tuple[str, ...]) -> str | None:
    """Why the server will not fetch `url`, or None when it is no http(s) URL or its host is one of `domains`."""
    scheme = url.split(":", 1)[0].strip().lower() if ":" in url else ""
    if scheme not in ("http", "https"):
        return None
    if not domains:
        return (
            f"{_shown(url)}: this server fetches no remote media; send it as a data: URL, as a file:// URL under "
            "the server's --media-root, or start the server with --media-domain HOST for the hosts it may fetch from"
        )
    if ANY_DOMAIN in domains:
        return None
    if "\\" in url or any(c <= " " or c == "\x7f" for c in url):
        # backslashes and spaces are read differently by different URL parsers: the host checked here must be the
        # host the server's HTTP client connects to
        return f"{_shown(url)}: a media URL with backslashes or spaces is not fetched; send a plain URL"
    try:
        parsed = urlparse(url)
        host, _ = parsed.hostname, parsed.port  # .port raises on a port that is not a number in range
    except ValueError as exc:
        return f"{_shown(url)}: not a URL the server can read ({exc})"
    if "@" in parsed.netloc:
        return f"{_shown(url)}: a media URL with user info (@) is not fetched; send a plain URL"
    if host is None or ascii_host(host) not in domains:
        return f"{_shown(url)}: its host is not one the server fetches media from ({', '.join(domains)})"
    return None


def ascii_host(host: str) -> str | None:
    """A host name as HTTP clients send it: lower case, a non-ASCII name in its IDNA (xn--) form; None when it has
    none. A trailing dot stays: the server's HTTP client compares names with it."""
    try:
        return host.lower().encode("idna").decode("ascii")
    except UnicodeError:
        return None


def _shown(url: str) -> str:
    return url if len(url) <= 200 else url[:200] + "..."


def local_media_problem(url: str, media_root: Path | None) -> str | None:
    """Why the server cannot read `url`, or None when it is not a file URL or names a file under `media_root`."""
    if url[:5].lower() != "file:":
        return None
    if media_root is None:
        return (
            f"{url}: this server reads no local files; send the media as a data: URL (or an http(s) URL from a host "
            "given with --media-domain), or start the server with --media-root FOLDER"
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


def request_media_problem(
    request: dict[str, Any], media_root: Path | None, domains: tuple[str, ...] = ()
) -> str | None:
    """The first media URL in a request the server cannot or may not read, explained; None when all can be read."""
    for url in media_urls(request):
        problem = local_media_problem(url, media_root) or remote_media_problem(url, domains)
        if problem is not None:
            return problem
    return None


def media_domains(values: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """`--media-domain` values as host names (lower case), or ValueError saying what a value should be."""
    hosts = []
    for value in values:
        name = value.strip()
        host = name if name == ANY_DOMAIN else ascii_host(name)
        if host != ANY_DOMAIN and (
            not host or any(c in host for c in "/:@ ?#\\") or host.startswith(("*", ".")) or host.endswith(".")
        ):
            raise ValueError(
                f"--media-domain {value!r}: give a host name alone, as in --media-domain example.com "
                "(repeat it for several), or '*' for any host"
            )
        hosts.append(host)
    return tuple(dict.fromkeys(hosts))
