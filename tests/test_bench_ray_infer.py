"""bench/ray_infer.py's summary and its --gpus option on CPU (the Ray runs themselves are GPU measurements)."""

from __future__ import annotations

import argparse
import json

import pytest
from setups import load_bench


@pytest.fixture(scope="module")
def bench():
    return load_bench("ray_infer")


def test_summary_gives_medians_and_each_ray_row_over_single_and_over_one_gpu(bench):
    rows = [
        {"path": "single", "round": 0, "end_to_end_s": 100.0, "clips_per_s": 10.0, "first_result_s": 5.0},
        {"path": "ray-1", "round": 0, "end_to_end_s": 110.0, "clips_per_s": 9.0, "first_result_s": 20.0},
        {"path": "ray-4", "round": 0, "end_to_end_s": 30.0, "clips_per_s": 36.0, "first_result_s": 21.0},
        {"path": "ray-4", "round": 1, "end_to_end_s": 40.0, "clips_per_s": 28.0, "first_result_s": 23.0},
        {"path": "single", "round": 1, "end_to_end_s": 120.0, "clips_per_s": 8.0, "first_result_s": 6.0},
        {"path": "ray-1", "round": 1, "end_to_end_s": 100.0, "clips_per_s": 7.0, "first_result_s": 19.0},
    ]
    summary = bench.summarize(rows)
    assert summary["single_clips_per_s_median"] == 9.0 and summary["ray-4_end_to_end_s_median"] == 35.0
    assert summary["ray-1_over_single"] == pytest.approx(8.0 / 9.0, abs=1e-3)
    assert summary["ray-4_over_single"] == pytest.approx(32.0 / 9.0, abs=1e-3)
    assert summary["ray-4_over_ray-1"] == 4.0 and "ray-1_over_ray-1" not in summary
    assert summary["single_steady_clips_per_s_median"] is None  # no row had it


def test_summary_without_one_gpu_or_single_gives_no_ratio_against_them(bench):
    summary = bench.summarize([{"path": "ray-2", "round": 0, "end_to_end_s": 10.0, "clips_per_s": 3.0}])
    assert summary["ray-2_clips_per_s_median"] == 3.0
    assert not [key for key in summary if "_over_" in key]


def test_gpus_takes_comma_separated_counts_and_refuses_others(bench):
    assert bench.gpu_counts("1,2,4") == [1, 2, 4]
    for bad in ("0", "", "1,x", "-1"):
        with pytest.raises(argparse.ArgumentTypeError, match="--gpus"):
            bench.gpu_counts(bad)


def test_append_keeps_rows_of_the_same_setup_and_refuses_another_machines(bench, tmp_path):
    setup = {"device": "NVIDIA H200", "gpus": 4, "engine": "vllm", "model": "/m", "clips": 1000, "clip": "2 s",
             "max_tokens": 64, "batch_size": 64}  # fmt: skip
    path = tmp_path / "ray_infer.json"
    assert bench.earlier_rows(path, setup) == []  # nothing measured yet
    path.write_text(json.dumps({**setup, "commit": "abc", "rows": [{"path": "single", "round": 0}]}))
    assert bench.earlier_rows(path, {**setup, "commit": "def"}) == [{"path": "single", "round": 0}]
    with pytest.raises(SystemExit, match="device 'NVIDIA H200'.*'NVIDIA H100'"):
        bench.earlier_rows(path, {**setup, "device": "NVIDIA H100"})
    with pytest.raises(SystemExit, match="clips 1000"):
        bench.earlier_rows(path, {**setup, "clips": 96})
    with pytest.raises(SystemExit, match="--json PATH or set OUT"):
        bench.earlier_rows(None, setup)
