"""write_mp4: a clip appears only when complete, through a partial file of the call's own."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from physreason.data.synth.video import write_mp4
from physreason.vision import load_video

pytestmark = pytest.mark.timeout(120)


def frames(value: int) -> np.ndarray:
    return np.full((4, 32, 48, 3), value, dtype=np.uint8)


def test_two_writers_of_one_clip_never_share_a_partial_file(tmp_path):
    path = tmp_path / "clips" / "a.mp4"
    errors = []

    def write(value: int) -> None:
        try:
            for _ in range(5):
                write_mp4(frames(value), path, fps=4)
        except Exception as exc:  # noqa: BLE001 - the test reports whatever a writer raised
            errors.append(exc)

    writers = [threading.Thread(target=write, args=(v,)) for v in (40, 200)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join()
    assert errors == []
    assert [p.name for p in path.parent.iterdir()] == ["a.mp4"]  # no partial file left
    assert load_video(path).frames.shape[0] > 0
    umask = os.umask(0o022)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # as a plain file is created


def test_a_failed_write_leaves_no_partial_file(tmp_path):
    import av

    with pytest.raises(av.FFmpegError):
        write_mp4(frames(1)[:, :31], tmp_path / "odd.mp4", fps=4)  # odd height: x264 refuses yuv420p
    assert list(tmp_path.iterdir()) == []
