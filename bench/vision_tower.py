"""Vision tower time per clip: transformers' per-window sdpa loop vs physreason's grouped vision attention.

Model: the vision tower of Qwen2.5-VL-3B-Instruct (32 blocks, hidden 1280, 16 heads, full attention in blocks
7/15/23/31; random weights, built on the GPU, no download) in bf16. Input: --clips copies of one video of
--frames frames of --width x --height, each side rounded to the nearest multiple of 28 as the Qwen2.5-VL
processors do (256x192 becomes 252x196; no pixel budget applied: physreason's default video min_pixels would
upscale such frames, pass the resized size to emulate that), in 14-px patches, temporal patch 2: 12 frames give
a 6 x 14 x 18 grid, 1,512 patches in 36 windows of 112 px (4 distinct lengths). One tower, same weights; the
two settings switch the vision config's attention implementation and run interleaved, --runs times each after
--warmup. "fwd+bwd" is forward and backward of a fixed projection of the merged features (training),
"fwd" is a forward under no_grad (engines). Prints a markdown table of medians (ms per clip) with the speed-up
and the largest feature difference between the two paths; writes JSON to $OUT/vision_tower.json when OUT is set.
Run:  python3 bench/vision_tower.py [--clips 1,8] [--runs 5] [--checkpointing]
CPU:  python3 bench/vision_tower.py --tiny   (a 2-block float32 tower, to check the script)
"""

from __future__ import annotations

import argparse
import math
import statistics

import harness
import torch
from shapes import qwen25_vl_3b

from physreason.models.vision_attention import registered_name, use_grouped_vision_attention

NATIVE = "sdpa"


def build_tower(tiny: bool, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The 3B vision tower (or a 2-block tiny one: a window block then a full block) with sdpa attention."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    vision = qwen25_vl_3b(tiny).vision_config
    if tiny:
        vision.depth, vision.fullatt_block_indexes = 2, [1]
    vision._attn_implementation = NATIVE
    with torch.device(device):
        tower = Qwen2_5_VisionTransformerPretrainedModel(vision).to(dtype)
    if not use_grouped_vision_attention(tower):
        raise SystemExit("grouped vision attention was not applied (see the warning above); nothing to compare")
    if any(block.attn.config is not tower.config for block in tower.blocks):
        raise SystemExit("the attention modules do not share the tower's config; the settings could not be switched")
    return tower


def video_grid(tower: torch.nn.Module, frames: int, height: int, width: int) -> tuple[int, int, int]:
    """(t, h, w) in patches of one video whose sides are rounded to the nearest multiple of patch x merge."""
    config = tower.config
    factor = config.patch_size * config.spatial_merge_size
    # physreason.vision.resize would need PyAV (its package imports the decoder), absent on the GPU machines
    sides = [max(factor, round(side / factor) * factor) // config.patch_size for side in (height, width)]
    return frames // config.temporal_patch_size, sides[0], sides[1]


def windows_per_video(tower: torch.nn.Module, grid: tuple[int, int, int]) -> int:
    """Attention windows of one video in the windowed blocks (the per-window loop's SDPA calls per block)."""
    config = tower.config
    units = config.window_size // config.spatial_merge_size // config.patch_size  # merged tokens per window side
    t, h, w = grid
    return t * math.ceil(h // config.spatial_merge_size / units) * math.ceil(w // config.spatial_merge_size / units)


def timed_pass(
    tower: torch.nn.Module,
    pixels: torch.Tensor,
    grid_thw: torch.Tensor,
    weights: torch.Tensor,
    backward: bool,
    device: torch.device,
) -> tuple[float, torch.Tensor]:
    """Seconds of one forward (+ backward) and the merged features."""
    tower.zero_grad(set_to_none=True)

    def run() -> torch.Tensor:
        with torch.set_grad_enabled(backward):
            features = tower(pixels, grid_thw=grid_thw).pooler_output  # [merged tokens, out_hidden]
            if backward:
                (features.float() * weights).sum().backward()
        return features.detach()

    return harness.timed(run, device)


def bench_setting(
    tower: torch.nn.Module,
    clips: int,
    grid: tuple[int, int, int],
    backward: bool,
    runs: int,
    warmup: int,
    device: torch.device,
    dtype: torch.dtype,
) -> dict:
    """Median ms per clip of both attention paths on `clips` copies of one video, their ratio and feature gap."""
    generator = torch.Generator().manual_seed(0)
    config = tower.config
    patch_dim = config.in_channels * config.temporal_patch_size * config.patch_size**2
    grid_thw = torch.tensor([grid] * clips, device=device)
    pixels = torch.randn(clips * math.prod(grid), patch_dim, generator=generator).to(device, dtype)  # [patches, dim]
    merged = clips * math.prod(grid) // config.spatial_merge_size**2
    weights = torch.randn(merged, config.out_hidden_size, generator=generator).to(device)  # [merged tokens, out]
    times: dict[str, list[float]] = {NATIVE: [], "grouped": []}
    features: dict[str, torch.Tensor] = {}
    names = {NATIVE: NATIVE, "grouped": registered_name(NATIVE)}
    for run in range(warmup + runs):
        for label, name in names.items():  # interleaved, so drifting clocks hit both settings alike
            tower.config._attn_implementation = name  # the one config object every attention module reads
            seconds, features[label] = timed_pass(tower, pixels, grid_thw, weights, backward, device)
            if run >= warmup:
                times[label].append(seconds)
    native_ms = statistics.median(times[NATIVE]) * 1e3 / clips
    grouped_ms = statistics.median(times["grouped"]) * 1e3 / clips
    return {
        "clips": clips,
        "pass": "fwd+bwd" if backward else "fwd",
        "native_ms_per_clip": native_ms,
        "grouped_ms_per_clip": grouped_ms,
        "speedup": native_ms / grouped_ms,
        "max_abs_diff": (features[NATIVE].float() - features["grouped"].float()).abs().max().item(),
        "feature_abs_max": features[NATIVE].float().abs().max().item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clips", default="1,8", help="comma-separated numbers of clips per tower call")
    parser.add_argument("--frames", type=int, default=12, help="frames per clip (3 s at 4 fps)")
    parser.add_argument("--height", type=int, default=192)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--runs", type=int, default=5, help="timed runs per setting (after --warmup)")
    parser.add_argument("--warmup", type=int, default=2)
    harness.add_json(parser)
    parser.add_argument("--checkpointing", action="store_true", help="recompute vision blocks in backward")
    parser.add_argument("--tiny", action="store_true", help="tiny float32 tower on CPU (checks the script)")
    args = parser.parse_args()

    import transformers

    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    tower = build_tower(args.tiny, device, dtype)
    if args.checkpointing:
        options = {"use_reentrant": False}
        if hasattr(tower, "activation_checkpointing_enable"):  # transformers >= 5.2x; 5.17 has the older name only
            tower.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
        else:
            tower.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)
    tower.train()
    grid = video_grid(tower, args.frames, args.height, args.width)
    info = harness.device_line(device, transformers=transformers.__version__, dtype=str(dtype), grid_thw=grid,
                               checkpointing=args.checkpointing)  # fmt: skip
    print(f"{math.prod(grid)} patches and {windows_per_video(tower, grid)} windows per clip, vision depth "
          f"{tower.config.depth}")  # fmt: skip
    report = harness.Report("vision_tower.json", args.json, **info)
    print("| clips | pass | per-window sdpa ms/clip | grouped ms/clip | speed-up | max abs diff (features max) |")
    print("|---|---|---|---|---|---|")
    for clips in (int(c) for c in args.clips.split(",")):
        for backward in (True, False):
            row = bench_setting(tower, clips, grid, backward, args.runs, args.warmup, device, dtype)
            report.row(row, f"| {clips} | {row['pass']} | {row['native_ms_per_clip']:.1f} | "
                       f"{row['grouped_ms_per_clip']:.1f} | {row['speedup']:.2f}x | {row['max_abs_diff']:.2e} "
                       f"({row['feature_abs_max']:.2e}) |")  # fmt: skip


if __name__ == "__main__":
    main()
