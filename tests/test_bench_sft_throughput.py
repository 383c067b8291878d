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
    # each row's synchronised split: one line, the window holding exactly the profiled optimizer steps
    assert done.stdout.count("synchronised split of ") == 2
    for run in runs.values():
        split = run["profile_split"]
        assert split["optimizer_steps_in_window"] == split["profiled_steps"] == 2
        assert set(split["phase_wall_ms"]) <= set(["forward", "backward", "clip", "optimizer.step", "zero_grad"])
        assert split["line"] in done.stdout


def _toy_step(device):
    """A step shaped like the bench's: forward, backward, clip, AdamW, zero_grad, timed with the device synchronised
    when `timings` is given (harness.Laps)."""
    import harness

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inputs = torch.randn(8, 16)

    def step(timings=None):
        laps = harness.Laps(timings, device)
        loss = model(inputs).square().mean()
        laps.lap("forward")
        loss.backward()
        laps.lap("backward")
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        laps.lap("clip")
        optimizer.step()
        laps.lap("optimizer.step")
        optimizer.zero_grad(set_to_none=True)
        laps.lap("zero_grad")

    return step


def test_profile_times_each_phase_and_counts_the_optimizer_steps_in_the_window(sft_bench, tmp_path, capsys):
    """--profile's synchronised split: every phase timed in each profiled step, the window holding exactly the
    profiled optimizer steps (the divisor of the per-step figures), and one line printed beside the profiler's total."""
    import argparse

    device = torch.device("cpu")
    step = _toy_step(device)
    step()  # a warm-up step outside the window, as the timed steps are
    args = argparse.Namespace(profile=tmp_path, profile_steps=3)
    split = sft_bench.profile(step, args, "toy row", device, 0.25)
    assert split["profiled_steps"] == 3 and split["optimizer_steps_in_window"] == 3
    assert list(split["phase_wall_ms"]) == list(sft_bench.SPLIT_PHASES)
    assert all(ms > 0 for ms in split["phase_wall_ms"].values())
    # the phases are laps inside the step's wall
    assert sum(split["phase_wall_ms"].values()) <= split["step_wall_ms"]
    assert split["device_time"] == "cpu" and split["kernel_ms_per_step"] > 0 and split["timed_step_ms"] == 250.0
    printed = capsys.readouterr().out
    assert split["line"] in printed and "3 optimizer steps in the profiler window" in split["line"]
    assert "forward " in split["line"] and "zero_grad " in split["line"]
    assert (tmp_path / "toy_row.trace.json").stat().st_size > 0


def test_profile_without_the_option_steps_nothing(sft_bench):
    import argparse

    calls = []
    assert sft_bench.profile(calls.append, argparse.Namespace(profile=None, profile_steps=2), "row", None) is None
    assert calls == []


def _split(**changes):
    split = {"label": "row", "device_time": "cuda", "profiled_steps": 2, "optimizer_steps_in_window": 2,
             "step_wall_ms": 400.0, "phase_wall_ms": {"forward": 120.0, "backward": 250.0, "clip": 5.0,
                                                       "optimizer.step": 25.0, "zero_grad": 0.1},
             "kernel_ms_per_step": 380.0, "device_events_ms_per_step": 380.0, "device_busy_ms_per_step": 370.0,
             "longest_device_event_ms": 12.0, "timed_step_ms": 395.0}  # fmt: skip
    return {**split, **changes}


def test_split_line_flags_a_kernel_total_above_the_steps_wall(sft_bench):
    """The H200 profile of issue #46: 2,259 ms of kernels a step beside a 0.4 s step cannot be one step's breakdown."""
    plain = sft_bench.split_line(_split())
    assert "step 400.0 ms wall" in plain and "GPU kernel total 380.0 ms a step" in plain
    assert "device busy 370.0 ms" in plain and "longest device event 12.0 ms" in plain
    assert "(timed step 395.0 ms)" in plain and sft_bench.NOT_PER_STEP not in plain
    flagged = sft_bench.split_line(_split(kernel_ms_per_step=2259.0, device_events_ms_per_step=2259.0))
    assert flagged.endswith(sft_bench.NOT_PER_STEP)
    assert "not a per-step breakdown" in sft_bench.NOT_PER_STEP


def test_split_line_says_when_the_window_held_another_number_of_optimizer_steps(sft_bench):
    assert "the window held" not in sft_bench.split_line(_split())
    line = sft_bench.split_line(_split(optimizer_steps_in_window=5))
    assert "the window held 5 optimizer steps: per-step figures divide by that" in line


def test_a_row_repeated_in_rows_keeps_each_run_in_the_json(tmp_path):
    """Alternating orders repeat a row: the JSON keeps both runs (it kept the last one only, 2026-11-28)."""
    import json
    import os
    import subprocess
    import sys

    from setups import BENCH, free_port

    env = {**os.environ, "PYTHONPATH": str(BENCH.parent), "OUT": str(tmp_path), "OMP_NUM_THREADS": "1",
           "MASTER_PORT": str(free_port())}  # fmt: skip
    command = [sys.executable, str(BENCH / "sft_throughput.py"), "--tiny", "--seq-len", "32", "--steps", "1",
               "--warmup", "0", "--skip-baseline", "--rows=--ce-chunk 16; --ce-chunk 16"]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = json.loads((tmp_path / "sft_throughput.json").read_text())["runs"]
    label = "physreason --ce-chunk 16 --seq-len 32"
    assert list(runs) == [label, f"{label} #2"]
    assert all(run["tokens_per_s"] > 0 for run in runs.values())


@pytest.mark.timeout(120)
def test_vision_recompute_beside_no_recompute_is_refused_before_any_row_runs(sft_bench, capsys):
    """`--ac-every 0 --vision-ac-every 2` recomputed nothing and ran as the `--ac-every 0` row under another label
    (2026-11-29); a later row with that pair fails the command before the first row runs."""
    parser = sft_bench.build_parser()
    base = parser.parse_args(["--tiny"])
    assert sft_bench.row_args(parser, base, "--ac-every 2 --vision-ac-every 0").vision_ac_every == 0
    assert sft_bench.row_args(parser, base, "--ac-every 0").ac_every == 0
    with pytest.raises(SystemExit):
        sft_bench.row_args(parser, base, "--ac-every 0 --vision-ac-every 2")
    assert "--vision-ac-every 2 needs --ac-every 1 or more" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sft_bench.check_recompute(parser, parser.parse_args(["--ac-every", "-1"]))


@pytest.mark.timeout(120)
def test_a_bad_later_row_fails_the_command_before_the_first_row(monkeypatch, sft_bench, capsys):
    monkeypatch.setattr("sys.argv", ["sft_throughput.py", "--tiny", "--skip-baseline", "--rows=--ac-every 1; --ac-every 0 --vision-ac-every 0"])
    ran = []
    monkeypatch.setattr(sft_bench, "measure", lambda *a, **k: ran.append(a))
    monkeypatch.setattr(sft_bench.harness, "init_world", lambda: (_ for _ in ()).throw(AssertionError("started")))
    with pytest.raises(SystemExit):
        sft_bench.main()
    assert ran == []
    assert "needs --ac-every 1 or more" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_the_sweeps_rows_are_checked_before_the_first_runs_too(monkeypatch, sft_bench, capsys):
    monkeypatch.setattr("sys.argv", ["sft_throughput.py", "--tiny", "--skip-baseline", "--sweep", "--vision-ac-every", "2"])
    monkeypatch.setattr(sft_bench.harness, "init_world", lambda: (_ for _ in ()).throw(AssertionError("started")))
    with pytest.raises(SystemExit):
        sft_bench.main()
    assert "needs --ac-every 1 or more" in capsys.readouterr().err
