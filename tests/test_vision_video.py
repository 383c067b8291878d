"""load_video: sampling metadata, pixel budgets, timestamp overlay, streaming memory, and every bad input."""

from __future__ import annotations

import logging
from pathlib import Path

import av
import numpy as np
import pytest
from fixtures.vision.media import write_clip

from physreason.config.schema import VisionConfig
from physreason.errors import InputError
from physreason.vision import load_video, pixel_budgets, smart_resize
from physreason.vision import video as video_module
from physreason.vision.overlay import BAR_HEIGHT


@pytest.fixture(scope="module")
def clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 s at 30 fps, 64x96."""
    return write_clip(tmp_path_factory.mktemp("video") / "clip.mp4", 90, fps=30, height=64, width=96)


def test_video_sampled_at_4_fps_with_metadata(clip: Path):
    video = load_video(clip)
    assert video.frames.dtype == np.uint8
    assert video.frames.shape == (12, 280, 392, 3)  # 3 s * 4 fps; upscaled to min_pixels
    assert video.indices == [0, 8, 16, 24, 32, 40, 49, 57, 65, 73, 81, 89]
    assert video.timestamps == pytest.approx([i / 30 for i in video.indices])
    assert video.sample_fps == pytest.approx(4.0)
    assert (video.source_fps, video.source_num_frames, video.duration) == (30.0, 90, pytest.approx(3.0))
    assert video.source_size == (64, 96)
    assert video.path == str(clip)


def test_file_url_loads_the_same_frames_as_the_path(clip: Path):
    by_path = load_video(clip)
    by_url = load_video(f"file://{clip}")
    np.testing.assert_array_equal(by_url.frames, by_path.frames)


def test_kept_frames_are_the_sampled_source_frames_in_order(clip: Path):
    config = VisionConfig(min_pixels=64 * 96, max_pixels=64 * 96 * 4)
    video = load_video(clip, config)
    # The test clip's blue channel is 7 * index (mod 256): decoded frames are identified through coding noise.
    blue = video.frames[..., 2].astype(float).mean(axis=(1, 2))
    np.testing.assert_allclose(blue, [7 * i % 256 for i in video.indices], atol=4)


def test_total_pixels_budget_shrinks_frames_of_long_sampling(clip: Path):
    config = VisionConfig(fps=30.0, min_pixels=28 * 28, max_pixels=64 * 96 * 4, total_pixels=45 * 28 * 28)
    video = load_video(clip, config)
    num_frames, height, width, _ = video.frames.shape
    assert num_frames == 90
    assert height % 28 == 0 and width % 28 == 0
    assert num_frames * height * width <= 2 * config.total_pixels  # the budget counts pairs of frames


def test_huge_resolution_is_resized_down_by_the_budget(tmp_path: Path):
    path = write_clip(tmp_path / "huge.mp4", 4, fps=4, height=2160, width=3840)
    config = VisionConfig(total_pixels=2 * 128 * 28 * 28)
    video = load_video(path, config)
    assert video.source_size == (2160, 3840)
    assert video.frames.shape[0] == 4
    height, width = video.frames.shape[1:3]
    min_pixels = pixel_budgets(config).min_pixels  # unset: 128 tokens of 28 x 28 pixels
    assert min_pixels == 128 * 28 * 28
    assert height * width <= int(min_pixels * 1.05)  # budget share below min_pixels: floor of 1.05x
    assert (height, width) == smart_resize(2160, 3840, min_pixels=min_pixels, max_pixels=int(100352 * 1.05))


def test_one_frame_video_is_duplicated_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    path = write_clip(tmp_path / "one.mp4", 1)
    with caplog.at_level(logging.WARNING, logger="physreason.vision.video"):
        video = load_video(path)
    assert video.indices == [0, 0]
    np.testing.assert_array_equal(video.frames[0], video.frames[1])
    assert "1 frame" in caplog.text and str(path) in caplog.text


def test_mkv_without_frame_count_in_header_is_counted(tmp_path: Path):
    path = write_clip(tmp_path / "clip.mkv", 20, fps=30)
    video = load_video(path)
    assert video.source_num_frames == 20
    assert video.indices == [0, 6, 13, 19]


def test_timestamp_overlay_adds_a_black_bar_with_alternating_label(clip: Path):
    plain = load_video(clip)
    stamped = load_video(clip, VisionConfig(timestamps=True))
    num_frames, height, width, _ = plain.frames.shape
    assert stamped.frames.shape == (num_frames, height + BAR_HEIGHT, width, 3)
    assert (height + BAR_HEIGHT) % 28 == 0
    np.testing.assert_array_equal(stamped.frames[:, :height], plain.frames)
    bars = stamped.frames[:, height:].max(axis=-1)  # [T, 28, W]
    left, right = bars[:, :, : width // 2], bars[:, :, width // 2 :]
    for i in range(num_frames):
        lit, dark = (left[i], right[i]) if i % 2 == 0 else (right[i], left[i])
        assert (lit > 200).sum() > 20, f"frame {i}: no label in its half of the bar"
        assert dark.max() == 0, f"frame {i}: label spills into the other half"


def test_only_sampled_frames_are_converted_and_resized(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    # Memory stays at the output plus one frame because only sampled frames leave the decoder as RGB arrays.
    path = write_clip(tmp_path / "long.mp4", 120, fps=30, height=72, width=128)
    converted: list[tuple[int, ...]] = []
    original = video_module._resize_frame

    def counting_resize(rgb: np.ndarray, height: int, width: int) -> np.ndarray:
        converted.append(rgb.shape)
        return original(rgb, height, width)

    monkeypatch.setattr(video_module, "_resize_frame", counting_resize)
    video = load_video(path, VisionConfig(fps=1.0, min_frames=2))
    assert video.indices == [0, 40, 79, 119]
    assert converted == [(72, 128, 3)] * 4


def test_missing_file_names_the_path(tmp_path: Path):
    missing = tmp_path / "nope.mp4"
    with pytest.raises(InputError, match="not found.*nope.mp4"):
        load_video(missing)


def test_remote_url_asks_for_a_local_copy():
    with pytest.raises(InputError, match="download"):
        load_video("https://example.com/clip.mp4")


def test_non_video_file_is_rejected(tmp_path: Path):
    text = tmp_path / "notes.mp4"
    text.write_text("not a video\n" * 20)
    with pytest.raises(InputError, match=r"notes\.mp4.*cannot be opened as a video"):
        load_video(text)


def test_zero_frame_video_is_rejected(tmp_path: Path):
    path = tmp_path / "empty.mp4"
    container = av.open(str(path), mode="w")
    stream = container.add_stream("libx264", rate=30)
    stream.width, stream.height, stream.pix_fmt = 64, 64, "yuv420p"
    container.start_encoding()
    container.close()
    with pytest.raises(InputError, match=r"empty\.mp4.*(no frames|no video stream)"):
        load_video(path)


def test_truncated_mp4_is_rejected(clip: Path, tmp_path: Path):
    data = clip.read_bytes()
    truncated = tmp_path / "truncated.mp4"
    truncated.write_bytes(data[: len(data) // 2])  # index (moov) at the end is lost
    with pytest.raises(InputError, match=r"truncated\.mp4.*ffmpeg -i"):
        load_video(truncated)


def test_mp4_truncated_after_its_index_is_rejected(tmp_path: Path):
    path = tmp_path / "faststart.mp4"
    with av.open(str(path), mode="w", options={"movflags": "faststart"}) as container:
        stream = container.add_stream("libx264", rate=30)
        stream.width, stream.height, stream.pix_fmt = 64, 64, "yuv420p"
        noise = np.random.default_rng(0).integers(0, 256, (60, 64, 64, 3), dtype=np.uint8)
        for frame in noise:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    data = path.read_bytes()
    truncated = tmp_path / "cut.mp4"
    truncated.write_bytes(data[: len(data) // 2])  # the index survives, half the frames do not
    with pytest.raises(InputError, match=r"cut\.mp4: header says 60 frames.*truncated"):
        load_video(truncated)


def test_corrupt_mp4_is_rejected(clip: Path, tmp_path: Path):
    data = bytearray(clip.read_bytes())
    start = data.find(b"mdat") + 8
    data[start : start + 4096] = bytes(range(256)) * 16  # garbage over the first coded frames
    corrupt = tmp_path / "corrupt.mp4"
    corrupt.write_bytes(bytes(data))
    with pytest.raises(InputError, match=r"corrupt\.mp4: decoding failed"):
        load_video(corrupt)


def test_a_nul_byte_in_a_media_path_is_an_input_error(tmp_path):
    from physreason.errors import InputError
    from physreason.vision.paths import local_media_file

    with pytest.raises(InputError, match="NUL byte"):
        local_media_file(str(tmp_path / "a\x00.mp4"), "video")


@pytest.mark.parametrize("kind", ["hls", "concat"])
def test_a_playlist_in_the_data_root_never_reads_the_video_it_names_outside(tmp_path, kind):
    from physreason.data.loaders import media_path_in_root

    (tmp_path / "secret").mkdir()
    secret = write_clip(tmp_path / "secret" / "private.ts", num_frames=8, fps=8)
    root = tmp_path / "root"
    root.mkdir()
    if kind == "hls":
        text = (f"#EXTM3U\n#EXT-X-VERSION:3\n#EXT-X-TARGETDURATION:2\n#EXT-X-MEDIA-SEQUENCE:0\n#EXTINF:1.0,\n"
                f"file://{secret}\n#EXT-X-ENDLIST\n")  # fmt: skip
        name = "clip.m3u8"
    else:
        text, name = f"ffconcat version 1.0\nfile '{secret}'\n", "clip.ffconcat"
    (root / name).write_text(text)
    path = media_path_in_root(root, name, "video")
    # neither demuxer is among the video demuxers a video is opened with: refused before the playlist is read
    with pytest.raises(InputError, match=rf"video {path}: cannot be opened as a video"):
        load_video(path)


@pytest.mark.timeout(60)
def test_a_playlist_is_refused_before_ffmpeg_opens_the_segment_it_names(tmp_path):
    import os

    # the segment is a FIFO nothing writes to: opening it for reading would block until the test's timeout
    segment = tmp_path / "outside.ts"
    os.mkfifo(segment)
    root = tmp_path / "root"
    root.mkdir()
    (root / "clip.m3u8").write_text("#EXTM3U\n#EXT-X-VERSION:3\n#EXT-X-TARGETDURATION:2\n#EXT-X-MEDIA-SEQUENCE:0\n"
                                    f"#EXTINF:1.0,\nfile://{segment}\n#EXT-X-ENDLIST\n")  # fmt: skip
    with pytest.raises(InputError, match="cannot be opened as a video"):
        load_video(root / "clip.m3u8")
