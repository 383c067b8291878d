"""load_video against qwen-vl-utils 0.0.14 (decord reader), the reference Qwen2.5-VL video preprocessing.

Matches, in every case of fixtures/vision/qwen_reference.py (short and long clips, 25 and 30 fps, the
min_frames floor, the max_frames cap, a 3-frame clip, a tight total_pixels budget, a budget share below
min_pixels, upscaling to min_pixels, HD frames capped by max_pixels, video_start/video_end ranges, a fixed
nframes, odd nframes rounded to even): the kept frame indices, the frame size,
the reported sample fps and source fps/frame count, and the pixels themselves (identical when run live; the
recorded per-frame channel means agree within half a level, which leaves room for other FFmpeg builds).
Deliberate differences, not exercised here: a 1-frame video gives 2 copies of its frame (qwen-vl-utils raises);
a max_pixels above 768 * 28 * 28 is honoured (qwen-vl-utils silently caps it there).

The recorded fixture runs everywhere; the live comparison runs where qwen_vl_utils and decord are installed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fixtures.vision.media import write_clip
from fixtures.vision.qwen_reference import CASES, FIXTURE, import_qwen_vl_utils, run_reference

from physreason.config.schema import VisionConfig
from physreason.vision import load_video

RECORDED = json.loads(FIXTURE.read_text())["cases"]


def _load(case: dict[str, Any], folder: Path) -> tuple[Path, Any]:
    frames, fps, height, width = case["clip"]
    path = write_clip(folder / f"{case['name']}.mp4", frames, fps=fps, height=height, width=width)
    return path, load_video(path, VisionConfig(**case["vision"]))


def test_fixture_covers_every_reference_case():
    assert [case["name"] for case in RECORDED] == [case["name"] for case in CASES]


@pytest.mark.parametrize("case", RECORDED, ids=[case["name"] for case in RECORDED])
def test_sampling_and_sizes_match_recorded_qwen_vl_utils(case: dict[str, Any], tmp_path: Path):
    reference = case["qwen_vl_utils"]
    _, video = _load(case, tmp_path)
    assert video.indices == reference["indices"]
    assert list(video.frames.shape[1:3]) == reference["size"]
    assert video.sample_fps == pytest.approx(reference["sample_fps"], rel=1e-12)
    assert video.source_num_frames == reference["total_frames"]
    assert video.source_fps == pytest.approx(reference["source_fps"])
    means = video.frames.astype(np.float64).mean(axis=(1, 2))  # [T, 3]
    np.testing.assert_allclose(means, reference["frame_channel_means"], atol=0.5)


@pytest.mark.parametrize("case", CASES, ids=[case["name"] for case in CASES])
def test_frames_identical_to_live_qwen_vl_utils(case: dict[str, Any], tmp_path: Path):
    try:
        import_qwen_vl_utils()
    except ImportError as error:
        pytest.skip(f"qwen-vl-utils reference unavailable: {error}")
    path, video = _load(case, tmp_path)
    reference_frames, reference = run_reference(path, case["vision"])
    assert video.indices == reference["indices"]
    assert video.sample_fps == pytest.approx(reference["sample_fps"], rel=1e-12)
    np.testing.assert_array_equal(video.frames.transpose(0, 3, 1, 2), reference_frames.numpy().astype(np.uint8))
