"""bench/rl_disaggregated.py's --layouts on CPU: the layouts it accepts, the recipe each gives the controller, and the
table it prints (the runs themselves are GPU measurements)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from setups import load_bench

from physreason.config import Config
from physreason.distributed.controller import policy_world_size
from physreason.train.grpo import groups_per_rank


@pytest.fixture(scope="module")
def bench():
    return load_bench("rl_disaggregated")


def test_layouts_parse_and_default_to_half_each_side(bench):
    assert bench.parse_layouts("2+2,1+3", 4) == [(2, 2), (1, 3)]
    assert bench.parse_layouts(None, 2) == [(1, 1)]  # the 2-GPU default of before
    assert bench.parse_layouts(None, 4) == [(2, 2)]


@pytest.mark.parametrize(("text", "needle"), [("2+1", "uses 3 GPUs but --gpus is 4"), ("2x2", "is not P+R"),
                                              ("0+4", "is not P+R")])  # fmt: skip
def test_layouts_that_do_not_fill_the_gpus_exit_2_naming_the_layout(bench, capsys, text, needle):
    with pytest.raises(SystemExit) as exit_:
        bench.parse_layouts(text, 4)
    assert exit_.value.code == 2 and needle in capsys.readouterr().err


def test_policy_ranks_that_do_not_split_the_prompts_exit_2(bench, capsys):
    bench.check_divisible([(2, 2), (1, 3)], 4, False, ["colocated", "disaggregated"])  # 8 prompts: 4, 2, 1 ranks
    with pytest.raises(SystemExit) as exit_:
        bench.check_divisible([(3, 1)], 4, False, ["disaggregated"])
    assert exit_.value.code == 2 and "disaggregated-3+1: 3 policy ranks" in capsys.readouterr().err


@pytest.mark.parametrize("tiny", [False, True])
def test_each_layout_gives_the_controller_p_policy_ranks_and_r_rollout_replicas(bench, tiny):
    args = argparse.Namespace(tiny=tiny, engine="vllm", steps=3, response_len=16, gpus=4, prompts=None)
    completions = set()
    for policy, rollout in [(2, 2), (1, 3)]:
        mode = bench.layout_mode(policy, rollout)
        config = Config.model_validate(bench.recipe(Path("/m"), Path("/d"), Path("/o"), mode, args))
        assert policy_world_size(config, 4.0) == policy  # Ray cluster of 4 GPUs
        assert (config.rollout.parallelism.n_init_replicas, config.rollout.parallelism.tp_size) == (rollout, 1)
        assert config.grpo.mode == "disaggregated" and config.train.output_dir.endswith(mode)
        groups_per_rank(config, policy)  # divisible: raises otherwise
        completions.add(config.train.train_batch_per_replica)
    colocated = Config.model_validate(bench.recipe(Path("/m"), Path("/d"), Path("/o"), "colocated", args))
    assert colocated.grpo.mode == "colocated" and groups_per_rank(colocated, 4) >= 1
    assert completions == {colocated.train.train_batch_per_replica}  # every mode trains the same batch


def test_table_names_the_layout_lists_every_gpu_and_gives_each_layout_over_colocated(bench):
    row = {"status": "ok", "steps": 6, "step_s_mean": 2.0, "gpu_idle_fraction": [0.12, 0.03, 0.4, 0.41],
           "gpu_mean_util": [80.0, 90.0, 50.0, 49.0]}  # fmt: skip
    results = [{**row, "mode": "colocated", "layout": "4 shared", "samples_per_s": 8.0},
               {**row, "mode": "disaggregated-2+2", "layout": "2+2", "samples_per_s": 4.0, "policy_idle_frac": 0.05},
               {**row, "mode": "disaggregated-1+3", "layout": "1+3", "samples_per_s": 10.0}]  # fmt: skip
    table = bench.markdown(results)
    assert "| disaggregated-2+2 | 2+2 | ok | 6 | 4.00 | 2.00 | 12% 3% 40% 41% | 80% 90% 50% 49% | 5% | n/a |" in table
    assert "disaggregated-2+2 / colocated samples/s: 0.50x" in table
    assert "disaggregated-1+3 / colocated samples/s: 1.25x" in table
    assert "colocated / colocated" not in table


def test_a_mode_killed_after_logging_every_step_is_not_reported_as_timed_out(bench):
    assert bench.run_status(None, 6, 6) == "all steps, then killed at exit"
    assert bench.run_status(None, 2, 6) == "timed out"
    assert bench.run_status(0, 6, 6) == "ok"
    assert bench.run_status(3, 1, 6) == "exit code 3"


def test_prompts_option_lets_three_policy_ranks_split_the_step(bench, capsys):
    bench.check_divisible([(3, 1), (2, 2), (1, 3)], 4, False, ["colocated", "disaggregated"], prompts=12)
    assert bench.batch_shape(False, 12) == (12, 8) and bench.batch_shape(True) == (4, 4)
    with pytest.raises(SystemExit) as exit_:
        bench.check_divisible([(3, 1)], 4, False, ["disaggregated"], prompts=8)
    assert exit_.value.code == 2 and "divides 8, or --prompts" in capsys.readouterr().err


def test_each_mode_trains_the_prompts_asked_for(bench):
    args = argparse.Namespace(tiny=False, engine="vllm", steps=3, response_len=16, gpus=4, prompts=12)
    cfg = bench.recipe(Path("/m"), Path("/d"), Path("/o"), "disaggregated-3+1", args)
    assert cfg["rollout"]["batch_size"] == 12 and cfg["train"]["train_batch_per_replica"] == 96
    assert cfg["engine"]["batch_size"] == 96 and cfg["policy"]["parallelism"]["dp_shard_size"] == 3
    for mode, ranks in (("disaggregated-3+1", 3), ("disaggregated-2+2", 2), ("colocated", 4)):
        config = Config.model_validate(bench.recipe(Path("/m"), Path("/d"), Path("/o"), mode, args))
        assert groups_per_rank(config, ranks) == 12 // ranks  # the recipe validates and splits: raises otherwise


def test_a_time_limit_too_short_for_every_mode_exits_2_before_anything_runs(bench, capsys):
    modes = ["colocated", "disaggregated-2+2", "disaggregated-3+1"]
    bench.check_time_share(modes, 750, 240)  # 250 s each
    bench.check_time_share(modes[:1], 550, 240)  # one mode a call has the whole limit
    with pytest.raises(SystemExit) as exit_:
        bench.check_time_share(modes, 550, 240)  # the call of 2026-11-28: 183 s each, no mode finished
    error = capsys.readouterr().err
    assert exit_.value.code == 2
    assert "--time-limit 550 s over 3 modes (colocated, disaggregated-2+2, disaggregated-3+1) gives each about 183 s" in error
    assert "run one mode a call" in error
