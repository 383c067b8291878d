"""bench/host_adamw.py: each host AdamW it times computes fused AdamW's weights, and a missing DeepSpeed is a row."""

from __future__ import annotations

import pytest
from setups import load_bench

pytestmark = pytest.mark.timeout(120)

bench = load_bench("host_adamw")


def test_the_shapes_are_the_3b_blocks_and_add_up_to_about_the_elements_asked():
    shapes = bench.shapes_for(200_000_000)
    assert shapes[: len(bench.BLOCK)] == bench.BLOCK
    total = sum(bench.torch.Size(s).numel() for s in shapes)
    assert 200_000_000 - 11008 * 2048 < total <= 200_000_000
    assert bench.shapes_for(1) == [bench.BLOCK[0]]  # at least one tensor


def test_every_row_steps_to_fused_adamws_weights_and_a_missing_deepspeed_says_so(tmp_path):
    data = bench.main(["--elements", "3e5", "--steps", "2", "--warmup", "1", "--impls", "fused-clip", "default",
                       "deepspeed", "--json", str(tmp_path / "r.json")])  # fmt: skip
    rows = {row["impl"]: row for row in data["rows"]}
    assert data["rows"][0]["impl"] == "fused"  # the baseline is added first
    assert "vs_fused" not in rows["fused"] and rows["fused"]["seconds"] > 0
    # the clip's coefficient as grad_scale gives fused AdamW's weights on the clipped gradients
    assert rows["fused-clip"]["weights_max_rel_diff"] < 1e-6
    assert rows["default"]["weights_max_rel_diff"] < 1e-5  # torch's single-tensor path: the same update
    assert rows["default"]["vs_fused"] > 0 and len(rows["default"]["times"]) == 2
    if "error" in rows["deepspeed"]:
        assert "deepspeed" in rows["deepspeed"]["error"]
    else:
        assert rows["deepspeed"]["weights_max_rel_diff"] < 1e-5
    assert (tmp_path / "r.json").exists()
