"""bench/profiling.py and the SFT bench's video rows on CPU: phase attribution, categories, vision FLOPs, budgets."""

from __future__ import annotations

import pytest
import torch
from setups import load_bench
from torch import nn

from physreason.train import phases


@pytest.fixture(scope="module")
def profiling():
    return load_bench("profiling")


@pytest.fixture(scope="module")
def sft_bench():
    return load_bench("sft_throughput")


class _Toy(nn.Module):
    """A model laid out like transformers' VL models: model.visual (the tower) inside model's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.visual = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32))
        self.model.decoder = nn.Linear(32, 32)
        self.lm_head = nn.Linear(32, 64, bias=False)

    def forward(self, pixels: torch.Tensor, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with phases.phase(phases.LANGUAGE_MODEL):
            hidden = self.model.decoder(torch.cat([self.model.visual(pixels), tokens]))  # [n, 32]
        with phases.phase(phases.LOSS):
            return nn.functional.cross_entropy(self.lm_head(hidden), targets)


def test_work_is_attributed_to_the_phase_whose_forward_made_it_backward_included(profiling, tmp_path):
    torch.manual_seed(0)
    model = _Toy()
    assert phases.mark_vision_tower(model) and phases.mark_vision_tower(model)  # hooks installed once
    optimizer = torch.optim.AdamW(model.parameters())
    pixels, tokens, targets = torch.randn(64, 32), torch.randn(64, 32), torch.randint(0, 64, (128,))
    with profiling.Profiled(tmp_path, "toy", torch.device("cpu")) as profiler:
        for _ in range(2):
            loss = model(pixels, tokens, targets)
            with phases.phase(phases.BACKWARD):
                loss.backward()
            with phases.phase(phases.OPTIMIZER):
                optimizer.step()
                optimizer.zero_grad()
            profiler.step()
    result = profiler.result
    assert (tmp_path / "toy.trace.json").is_file() and (tmp_path / "toy.profile.json").is_file()
    for phase in ("vision_tower", "language_model", "loss"):
        assert result.by_phase[f"{phase} (forward)"] > 0, phase
        assert result.by_phase[f"{phase} (backward)"] > 0, phase  # placed through autograd sequence numbers
    assert result.by_phase["optimizer (forward)"] > 0
    categories = result.by_category
    assert categories["vision tower"] > 0 and categories["loss/logits"] > 0 and categories["optimizer"] > 0
    assert categories["GEMMs"] > 0  # the decoder's linear, outside the tower and the loss
    assert categories["communication"] == 0
    assert sum(categories.values()) == pytest.approx(sum(result.by_phase.values()))
    text = profiling.format_breakdown(result, steps=2)
    assert "vision tower" in text and "ms/step" in text


@pytest.mark.parametrize(
    "name, phase, callers, expected",
    [
        ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "language_model", (), "communication"),
        ("void at::native::elementwise_kernel<128, 4>", None, ("aten::copy_", "FSDP::all_gather_copy_out"),
         "communication"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "vision_tower", (), "vision tower"),
        ("void flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>", "language_model", (), "attention"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", None, (), "attention"),
        ("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NTT", "language_model", (), "GEMMs"),
        ("void at::native::(anonymous namespace)::cunn_SoftMaxForward", "loss", (), "loss/logits"),
        ("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "optimizer", (), "optimizer"),
        ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "language_model", (), "other"),
    ],
)  # fmt: skip
def test_kernels_fall_into_their_categories(profiling, name, phase, callers, expected):
    assert profiling.category(name, phase, callers) == expected


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
