"""bench/sft_throughput.py on CPU: vision FLOPs, the video rows' budget and samples, and --profile."""

from __future__ import annotations

import pytest
import torch
from setups import load_bench


@pytest.fixture(scope="module")
def sft_bench():
    return load_bench("sft_throughput")


def test_vision_flops_equal_torch_flop_counter_on_the_tower(sft_bench):
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModel

    config = sft_bench.qwen3_vl_8b(True)
    config.vision_config._attn_implementation = "eager"  # matmuls the flop counter sees
    grid = (2, 4, 6)
    torch.manual_seed(0)
    tower = AutoModel.from_config(config.vision_config).eval()
    vision = config.vision_config
    patches = torch.randn(2 * 4 * 6, vision.in_channels * vision.temporal_patch_size * vision.patch_size**2)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        tower(patches, grid_thw=torch.tensor([grid]))
    assert sft_bench.vision_train_flops(config, grid) == 3 * counter.get_total_flops()


def test_video_row_at_reason2_budget_is_about_eleven_thousand_visual_tokens(sft_bench):
    config = sft_bench.qwen3_vl_8b(False)
    args = sft_bench.build_parser().parse_args(["--video-seconds", "10"])
    t, h, w = sft_bench.video_grid(config, args)
    assert (t, args.video_fps, args.video_total_pixels) == (20, 4.0, 11324620)  # 40 frames at 4 fps
    tokens = t * h * w // 4
    # qwen-vl-utils' budget counts a pair of frames per share: total_pixels / 32**2 tokens at most
    assert 0.9 * 11324620 / 1024 < tokens <= 11324620 / 1024


def test_video_sample_places_one_pad_per_visual_token_and_the_loss_on_the_answer(sft_bench):
    from physreason.data.collate import collate_padded
    from physreason.data.sft import IGNORE_INDEX

    config = sft_bench.qwen3_vl_8b(False)
    grid = (3, 4, 6)
    sample = sft_bench.video_sample(config, 200, grid, torch.Generator().manual_seed(0))
    assert sample.input_ids.shape == (200,) and sample.position_ids.shape == (3, 200)
    assert int((sample.input_ids == config.video_token_id).sum()) == 3 * 4 * 6 // 4
    assert int((sample.input_ids == config.vision_start_token_id).sum()) == 3
    assert sample.visuals.pixel_values_videos.shape[0] == 3 * 4 * 6
    answer = sample.labels != IGNORE_INDEX
    last_vision = int((sample.input_ids == config.vision_end_token_id).nonzero().max())
    assert not answer[: last_vision + 1].any() and answer[last_vision + 1 :].all()
    batch = collate_padded([sample], 0, mrope=True)
    assert batch.visual_kwargs["video_grid_thw"].tolist() == [list(grid)]
    with pytest.raises(ValueError, match="raise it"):
        sft_bench.video_sample(config, 50, grid, torch.Generator().manual_seed(0))


@pytest.mark.slow
def test_sft_bench_with_profile_writes_each_rows_trace_and_summary(tmp_path):
    """`sft_throughput.py --profile DIR` on CPU at tiny size, as a person runs it: both rows traced and summarised."""
    import json
    import os
    import subprocess
    import sys

    from setups import BENCH, free_port

    folder = tmp_path / "profiles"
    env = {**os.environ, "PYTHONPATH": str(BENCH.parent), "OUT": str(tmp_path), "OMP_NUM_THREADS": "1",
           "MASTER_PORT": str(free_port())}  # fmt: skip
    command = [sys.executable, str(BENCH / "sft_throughput.py"), "--tiny", "--seq-len", "32", "--steps", "1",
               "--warmup", "0", "--profile", str(folder), "--profile-steps", "2", "--rows=--chunked-ce --ce-chunk 16"]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    ours = "0-physreason_--chunked-ce_--ce-chunk_16_--seq-len_32"  # the row label, options off their default
    for name in ("transformers-baseline", ours):
        assert (folder / f"{name}.trace.json").stat().st_size > 0
        summary = json.loads((folder / f"{name}.profile.json").read_text())
        assert summary["device_time"] == "cpu" and summary["total_ms_per_step"] > 0
        by_category = summary["by_category_ms_per_step"]
        assert list(by_category) == ["communication", "optimizer", "loss/logits", "vision tower", "attention", "GEMMs",
                                     "other"]  # fmt: skip
        assert sum(by_category.values()) == pytest.approx(summary["total_ms_per_step"])
        assert by_category["optimizer"] > 0 and by_category["GEMMs"] > 0
    ours_summary = json.loads((folder / f"{ours}.profile.json").read_text())
    assert ours_summary["by_category_ms_per_step"]["loss/logits"] > 0  # the chunked loss runs inside its phase
    assert ours_summary["by_category_ms_per_step"]["communication"] > 0  # FSDP2's own work, even on one rank
    assert done.stdout.count("profile of ") == 2 and "CPU self time per step" in done.stdout
    runs = json.loads((tmp_path / "sft_throughput.json").read_text())["runs"]
    assert set(runs) == {"transformers baseline", "physreason --chunked-ce --ce-chunk 16 --seq-len 32"}
    assert all(run["tokens_per_s"] > 0 for run in runs.values())
