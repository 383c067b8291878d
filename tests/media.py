"""Synthetic media for tests: tiny mp4 clips (PyAV) and images."""

from __future__ import annotations

from pathlib import Path

import av
import numpy as np
from PIL import Image


def write_clip(path: Path, n_frames: int = 16, fps: int = 8, size: tuple[int, int] = (96, 128), seed: int = 0) -> Path:
    """A falling white square on a coloured background, H.264 in mp4."""
    height, width = size
    rng = np.random.default_rng(seed)
    background = rng.integers(0, 120, size=3, dtype=np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(n_frames):
            frame = np.empty((height, width, 3), np.uint8)
            frame[:] = background
            top = int((height - 12) * i / max(n_frames - 1, 1))
            frame[top : top + 12, width // 2 - 6 : width // 2 + 6] = 255
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return path


def write_image(path: Path, size: tuple[int, int] = (80, 100), seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rng.integers(0, 256, size=(*size, 3), dtype=np.uint8)).save(path)
    return path
