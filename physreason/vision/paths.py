"""Turn a media reference (local path or file:// URL) into an existing local file, or say what to do."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlparse

from physreason.errors import InputError


def local_media_file(source: str | Path, kind: str) -> Path:
    """Return the local file that `source` names; raise InputError if it is a remote URL or does not exist.

    `kind` ("video" or "image") only words the error messages.
    """
    text = str(source)
    if text.startswith(("http://", "https://")):
        raise InputError(f"{kind} {text}: remote URLs are not fetched; download the file and pass its local path")
    if text.startswith("file://"):
        parsed = urlparse(text)
        # file://relative/x.mp4 puts "relative" in netloc; keep it so such paths stay relative as written.
        text = unquote(parsed.netloc + parsed.path)
    if "\0" in text:
        # The OS cannot name such a file: os calls raise ValueError instead of a per-request error.
        raise InputError(f"{kind} path {text!r} holds a NUL byte; no file can have that name, fix the path")
    path = Path(text).expanduser()
    if not path.exists():
        raise InputError(f"{kind} file not found: {path}; check the path (relative paths start at {Path.cwd()})")
    if not path.is_file():
        raise InputError(f"{kind} path is not a file: {path}; pass the {kind} file itself")
    return path
