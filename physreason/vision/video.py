"""Decode a video with PyAV, keeping only the frames sampled at the target fps, resized to the pixel budget."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import torch
import torch.nn.functional as F

from physreason.config.schema import VisionConfig
from physreason.cpu import decode_threads
from physreason.errors import InputError
from physreason.vision.overlay import overlay_timestamps
from physreason.vision.paths import local_media_file
from physreason.vision.resize import (
    MAX_ASPECT_RATIO,
    PATCH_FACTOR,
    pixel_budgets,
    smart_resize,
    video_frame_max_pixels,
)
from physreason.vision.sampling import fixed_num_frames, frame_range, num_sampled_frames, sample_indices

logger = logging.getLogger(__name__)

TEMPORAL_PATCH_SIZE = 2


@dataclass
class VideoFrames:
    """Frames sampled from one video, ready for a Qwen-VL video processor, with where they came from."""

    frames: np.ndarray
    """uint8 [T, H, W, 3]; T even (temporal patch 2); H and W multiples of the patch factor (28 for Qwen2.5-VL,
    32 for Qwen3-VL; H includes the timestamp bar)."""
    timestamps: list[float]
    """Seconds of each sampled frame in the source, from its presentation time (first frame = 0)."""
    indices: list[int]
    """Source frame indices kept, in order (a 1-frame video repeats index 0)."""
    sample_fps: float
    """Frames per second actually sampled: T / duration, as qwen-vl-utils reports it (the model's `fps`)."""
    source_fps: float
    """Average frame rate of the source stream."""
    source_num_frames: int
    """Frames sampled from: the whole stream, or the frames within video_start..video_end (as qwen-vl-utils
    reports `total_num_frames`)."""
    duration: float
    """Seconds: source_num_frames / source_fps."""
    source_size: tuple[int, int]
    """(height, width) of the source frames before resizing."""
    path: str
    """The local file the frames came from."""
    bar_height: int = 0
    """Rows of the timestamp bar under each frame (overlay_timestamps); 0 without one."""

    @property
    def frame_size(self) -> tuple[int, int]:
        """(height, width) of a frame as the model sees it, without the timestamp bar: the size Cosmos-Reason1's
        pixel coordinates are written in."""
        return self.frames.shape[1] - self.bar_height, self.frames.shape[2]


@dataclass(frozen=True)
class _StreamInfo:
    """What the container header says about the first video stream."""

    num_frames: int
    fps: float
    height: int
    width: int


def _fix_hint(path: Path) -> str:
    return f"re-encode it, e.g. `ffmpeg -i {path} -c:v libx264 -pix_fmt yuv420p fixed.mp4`, or drop this sample"


# FFmpeg demuxers whose file names other files or streams (a playlist's segments, a concat list, a session
# description): checking the named file's path against the data root would say nothing about what is then read.
REFERRING_FORMATS = frozenset({"hls", "applehttp", "concat", "dash", "sdp", "rtsp", "rtp", "tee", "ffmetadata"})


# The FFmpeg demuxers a video file is opened with (FFmpeg's format_whitelist): the containers of video files (mp4 and
# mov, mkv and webm, avi, MPEG transport and program streams, flv, ogg, asf/wmv, ivf, y4m, mxf, dv, nut, rm) and raw
# streams (h264, hevc, MPEG-1/2 and MPEG-4 video, AV1 obu, mjpeg, gif).
# Anything else (a playlist, a concat list, a session description) is refused before FFmpeg reads a byte of what it
# names: the hls demuxer opens its first segment while it is being probed, wherever that segment is.
VIDEO_DEMUXERS = ("mov,mp4,matroska,webm,avi,mpegts,mpeg,flv,ogg,asf,ivf,yuv4mpegpipe,mxf,dv,nut,rm,h264,hevc,"
                  "mpegvideo,m4v,obu,mjpeg,gif")


def _open(path: Path) -> av.container.InputContainer:
    try:
        container = av.open(str(path), mode="r", container_options={"format_whitelist": VIDEO_DEMUXERS})
    except av.FFmpegError as error:
        raise InputError(
            f"video {path}: cannot be opened as a video ({error}); if it is a truncated or damaged video, "
            + _fix_hint(path)
            + "; otherwise pass a video file (mp4, mkv, webm, mov, avi, ts, ...): playlists and lists naming other "
            "files (m3u8, ffconcat, sdp) are not read"
        ) from error
    names = set(container.format.name.split(","))
    if names & REFERRING_FORMATS:
        container.close()
        raise InputError(
            f"video {path}: is a {container.format.name} file, which names other files or streams to read (a playlist "
            "or list), not a video: media must be video files inside the data root (mp4, mkv, webm, mov); "
            "join the pieces into one file, e.g. with ffmpeg"
        )
    return container


def _probe(path: Path) -> _StreamInfo:
    """Read frame count, frame rate and size of the first video stream; count packets when the header has none."""
    with _open(path) as container:
        if not container.streams.video:
            raise InputError(
                f"video {path}: has no video stream (no frames, audio only, or not a video); "
                "pass a video file with frames"
            )
        stream = container.streams.video[0]
        rate = stream.average_rate or stream.guessed_rate
        fps = float(rate) if rate else 0.0
        height, width = stream.codec_context.height, stream.codec_context.width
        num_frames = stream.frames
        if num_frames <= 0:
            # mkv/webm headers carry no frame count: count packets (demux only, no decoding).
            try:
                num_frames = sum(1 for packet in container.demux(stream) if packet.size > 0)
            except av.FFmpegError as error:
                raise InputError(
                    f"video {path}: unreadable while counting frames ({error}); " + _fix_hint(path)
                ) from error
    if num_frames <= 0:
        raise InputError(f"video {path}: contains no frames; record or export the video again")
    if fps <= 0:
        raise InputError(f"video {path}: has no frame rate in its header; " + _fix_hint(path))
    if height <= 0 or width <= 0:
        raise InputError(f"video {path}: has no frame size in its header; " + _fix_hint(path))
    return _StreamInfo(num_frames=num_frames, fps=fps, height=height, width=width)


def _resize_frame(rgb: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 [h, w, 3] -> uint8 [height, width, 3] with antialiased bicubic.

    torch's native uint8 kernel: the one torchvision's resize runs for uint8 tensors on CPU, as qwen-vl-utils
    calls it, and within 2 levels of PIL's bicubic (used for images).
    """
    if rgb.shape[:2] == (height, width):
        return rgb
    chw = torch.from_numpy(rgb).permute(2, 0, 1)[None]  # [1, 3, h, w], channels-last in memory
    resized = F.interpolate(chw, size=(height, width), mode="bicubic", antialias=True)  # [1, 3, height, width]
    return resized[0].permute(1, 2, 0).numpy()


def _decode_sampled(
    path: Path, info: _StreamInfo, indices: list[int], height: int, width: int
) -> tuple[np.ndarray, list[float]]:
    """Decode the stream once, converting and resizing only the frames at `indices` (sorted) as they pass.

    Peak memory is the output plus the few frames the decoder's threads hold, whatever the video's length.
    """
    frames = np.empty((len(indices), height, width, 3), dtype=np.uint8)  # [T, H, W, 3]
    timestamps: list[float] = []
    position = 0
    first_pts: int | None = None
    decoded = 0
    with _open(path) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        threads = decode_threads()
        if threads:  # FFmpeg's default is a thread per core of the whole host, however many processes share it
            stream.thread_count = threads
        time_base = stream.time_base or Fraction(1, 1)
        try:
            for decoded, frame in enumerate(container.decode(stream)):
                if first_pts is None and frame.pts is not None:
                    first_pts = frame.pts
                if decoded != indices[position]:
                    continue
                resized = _resize_frame(frame.to_ndarray(format="rgb24"), height, width)
                if frame.pts is not None and first_pts is not None:
                    seconds = float((frame.pts - first_pts) * time_base)
                else:
                    seconds = decoded / info.fps
                while position < len(indices) and indices[position] == decoded:
                    frames[position] = resized
                    timestamps.append(seconds)
                    position += 1
                if position == len(indices):
                    break
        except av.FFmpegError as error:
            raise InputError(
                f"video {path}: decoding failed after {decoded} frames ({error}); it is corrupt: " + _fix_hint(path)
            ) from error
    if position < len(indices):
        raise InputError(
            f"video {path}: header says {info.num_frames} frames but decoding stopped before frame "
            f"{indices[position]}; the file is truncated or damaged: " + _fix_hint(path)
        )
    return frames, timestamps


def load_video(source: str | Path, config: VisionConfig | None = None, factor: int = PATCH_FACTOR) -> VideoFrames:
    """Return the frames of the video at `source` (path or file:// URL) sampled and resized for a Qwen-VL model.

    Sampling follows qwen-vl-utils: duration * config.fps frames, within [min_frames, max_frames] and the
    source's count, rounded down to an even number (or config.nframes rounded to even), at evenly spaced
    indices from the first to the last frame of the video, or of config.video_start..video_end (seconds).
    Each frame is resized by smart_resize to sides that are multiples of `factor` (patch x merge: 28 for
    Qwen2.5-VL, 32 for Qwen3-VL) within [min_pixels, max_pixels] and its share of total_pixels (a share per
    pair of frames, see video_frame_max_pixels; pixel_budgets fills unset budgets). With config.timestamps,
    a bar `factor` pixels high with each frame's time is added under it (overlay_timestamps).
    A 1-frame video gives 2 copies of its frame (qwen-vl-utils rejects it); a warning says so.
    Raises InputError naming the file for a missing, corrupt, truncated, frameless or non-video file, a time
    range with fewer than two frames, or an nframes above the frames available.
    """
    config = config or VisionConfig()
    budgets = pixel_budgets(config, factor)
    path = local_media_file(source, "video")
    info = _probe(path)
    if max(info.height, info.width) / min(info.height, info.width) > MAX_ASPECT_RATIO:
        raise InputError(
            f"video {path}: {info.width}x{info.height} is flatter than 1:{MAX_ASPECT_RATIO}, which Qwen-VL "
            "models cannot take; crop it"
        )

    try:
        first, last = frame_range(info.num_frames, info.fps, config.video_start, config.video_end)
    except ValueError as error:
        raise InputError(f"video {path}: video_start/video_end select too little: {error}; widen the range") from error
    available = last - first + 1
    if config.nframes is not None:
        try:
            num_frames = fixed_num_frames(config.nframes, available, TEMPORAL_PATCH_SIZE)
        except ValueError as error:
            raise InputError(
                f"video {path}: {error} (frames in the video or its video_start..video_end range); "
                "lower vision.nframes or leave it unset to sample by fps"
            ) from error
    else:
        num_frames = num_sampled_frames(
            available, info.fps, config.fps, config.min_frames, config.max_frames, TEMPORAL_PATCH_SIZE
        )
    if available < TEMPORAL_PATCH_SIZE:
        logger.warning(
            "video %s has %d frame(s); repeating to %d frames, the least Qwen2.5-VL takes (a temporal patch)",
            path,
            available,
            num_frames,
        )
    indices = sample_indices(available, num_frames, first)
    max_pixels = video_frame_max_pixels(
        num_frames, budgets.min_pixels, budgets.max_pixels, budgets.total_pixels, TEMPORAL_PATCH_SIZE
    )
    height, width = smart_resize(info.height, info.width, factor, min_pixels=budgets.min_pixels, max_pixels=max_pixels)
    frames, timestamps = _decode_sampled(path, info, indices, height, width)

    duration = available / info.fps
    sample_fps = num_frames / duration
    if config.timestamps:
        frames = overlay_timestamps(frames, sample_fps, bar_height=factor)
    return VideoFrames(
        frames=frames,
        timestamps=timestamps,
        indices=indices,
        sample_fps=sample_fps,
        source_fps=info.fps,
        source_num_frames=available,
        duration=duration,
        source_size=(info.height, info.width),
        path=str(path),
        bar_height=factor if config.timestamps else 0,
    )
