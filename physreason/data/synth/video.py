"""Write frames as an H.264 / yuv420p mp4 with PyAV, atomically (a crash never leaves a half-written clip)."""

from __future__ import annotations

import os
import tempfile
from fractions import Fraction
from pathlib import Path

import av
import numpy as np

# The process's file-creation mask, read once at import (os.umask can only be read by setting it).
_UMASK = os.umask(0o022)
os.umask(_UMASK)


def write_mp4(frames: np.ndarray, path: Path, fps: int, crf: int = 18) -> None:
    """Encode [T, H, W, 3] uint8 frames (H and W even) at `fps` into `path`; the file appears only when complete."""
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"frames must be [T, H, W, 3] uint8, got {frames.shape} {frames.dtype}")
    path.parent.mkdir(parents=True, exist_ok=True)
    # a name of this call's own, created here: two generators writing one folder (benches side by side) never write
    # into the same partial file, and a link planted at a fixed name is never written through
    descriptor, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    os.fchmod(descriptor, 0o666 & ~_UMASK)  # as a plain file would be (mkstemp's own is readable by its owner only)
    os.close(descriptor)
    partial = Path(name)
    try:
        _encode(frames, partial, fps, crf)
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def _encode(frames: np.ndarray, partial: Path, fps: int, crf: int) -> None:
    with av.open(str(partial), mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=Fraction(fps))
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv420p"
        # One encoder thread: workers already run in parallel, and x264 is deterministic this way.
        stream.codec_context.thread_count = 1
        stream.options = {"crf": str(crf), "preset": "veryfast"}
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
