"""video_start / video_end (seconds) and nframes, per request and per record, with qwen-vl-utils' semantics.

The frame indices themselves are checked against qwen-vl-utils in test_vision_qwen_reference.py; these tests
check that every way in (infer flags, --jsonl lines, SFT, GRPO and benchmark records) reaches the sampler.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from media import write_clip

from physreason.config import VisionConfig, load_config
from physreason.data.mcq import parse_mcq_records
from physreason.data.video_range import record_video_range
from physreason.errors import ConfigError, InputError
from physreason.eval.benchmark import Benchmark, expand_qa_pairs
from physreason.eval.runner import build_eval_request
from physreason.train.rollout import mcq_request
from physreason.vision import load_video

SMALL_FLAGS = ["--max-pixels", str(56 * 84), "--total-pixels", str(56 * 84 * 8), "--set", "vision.min_pixels=3136"]
SMALL = VisionConfig(min_pixels=3136, max_pixels=56 * 84, total_pixels=56 * 84 * 8)


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "physreason", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture()
def clip(tmp_path) -> Path:
    return write_clip(tmp_path / "clip.mp4", n_frames=24, fps=8)  # 3 s


def infer_prompt_tokens(model: Path, clip: Path, *flags: str) -> int:
    result = cli("infer", "--model", str(model), "--dtype", "float32", "--video", str(clip), "--question", "Falling?",
                 "--max-tokens", "1", "--temperature", "0", "--json", *SMALL_FLAGS, *flags)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["prompt_tokens"]


@pytest.mark.slow
def test_infer_flags_select_a_time_range_or_a_frame_count(tiny_model_dir, clip):
    whole = infer_prompt_tokens(tiny_model_dir, clip)  # 3 s at 4 fps: 12 frames
    ranged = infer_prompt_tokens(tiny_model_dir, clip, "--video-start", "1", "--video-end", "2")  # 1 s: min_frames 4
    fixed = infer_prompt_tokens(tiny_model_dir, clip, "--nframes", "4")
    assert ranged == fixed < whole


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--video-start", "2.9", "--video-end", "3"], "video_start/video_end select too little"),
        (["--video-start", "5"], "video_start/video_end select too little"),
        (["--nframes", "100"], "lower vision.nframes"),
        (["--nframes", "4", "--fps", "2"], "give --fps or --nframes, not both"),
        (["--video-start", "2", "--video-end", "1"], "video_start (2.0) must be before video_end (1.0)"),
    ],
)
def test_infer_refuses_a_range_or_frame_count_it_cannot_sample(tiny_model_dir, clip, flags, message):
    result = cli("infer", "--model", str(tiny_model_dir), "--video", str(clip), "--question", "Falling?", *flags)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_jsonl_lines_carry_their_own_time_range(tiny_model_dir, clip, tmp_path):
    lines = [
        {"id": "whole", "question": "Falling?", "video": "clip.mp4"},
        {"id": "second", "question": "Falling?", "video": "clip.mp4", "video_start": 1, "video_end": 2.0},
        {"id": "bad", "question": "Falling?", "video": "clip.mp4", "video_start": "soon"},
    ]
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    result = cli("infer", "--model", str(tiny_model_dir), "--dtype", "float32", "--jsonl", str(requests), "--out",
                 str(out), "--max-tokens", "1", *SMALL_FLAGS)
    assert result.returncode == 1, result.stderr  # the batch finished with one failed request ("bad")
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert records["second"]["prompt_tokens"] < records["whole"]["prompt_tokens"]
    assert "request bad: video_start must be a number of seconds >= 0, got 'soon'" == records["bad"]["error"]


def test_record_range_replaces_the_configured_one(clip):
    configured = SMALL.model_copy(update={"video_start": 0.0, "video_end": 3.0})
    video = load_video(clip, configured.model_copy(update=record_video_range({"video_end": 1.5}, "r")))
    assert video.indices[-1] == 12 and video.source_num_frames == 13  # frames 0..floor(1.5 * 8)


@pytest.mark.parametrize(
    ("record", "message"),
    [({"video_start": -1}, "video_start must be a number"), ({"video_end": True}, "video_end must be a number"),
     ({"video_start": 2, "video_end": 2}, r"video_start \(2.0\) must be before video_end")],
)
def test_bad_record_range_names_the_record(record, message):
    with pytest.raises(InputError, match=f"data.jsonl:3: {message}"):
        record_video_range(record, "data.jsonl:3")


def test_config_refuses_an_empty_time_range():
    with pytest.raises(ConfigError, match="video_start"):
        load_config(None, ["vision.video_start=4", "vision.video_end=2"])


def test_grpo_prompts_sample_their_record_range(clip):
    records = [{"video": "clip.mp4", "video_start": 1.0, "video_end": 2.0,
                "qa_pairs": {"question": "Falling?", "index2ans": {"A": "yes", "B": "no"}, "answer": "A"}}]
    (prompt,) = parse_mcq_records(records, clip.parent, "mcq.json")
    request = mcq_request(prompt, SMALL)
    assert request.videos[0].indices == [8, 11, 13, 16]  # frames 8..16 (1 s to 2 s), 4 of them


def test_benchmark_samples_sample_their_record_range_and_count_a_bad_one_as_failed(clip):
    qa = {"question": "Falling?", "index2ans": {"A": "yes", "B": "no"}, "answer": "A"}
    records = [{"video": "clip.mp4", "video_end": 1.0, "qa_pairs": qa},
               {"video": "clip.mp4", "video_start": "later", "qa_pairs": qa}]
    ranged, bad = expand_qa_pairs(records, "bench.json")
    assert "video_start must be a number" in bad.error
    request = build_eval_request(ranged, Benchmark("bench", clip.parent, [ranged, bad]), SMALL, "reasoning")
    assert request.videos[0].indices == [0, 3, 5, 8]  # frames 0..8 (0 s to 1 s)
