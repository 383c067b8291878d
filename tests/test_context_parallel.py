"""Context parallelism (models/context_parallel.py): a model split over 2 or 4 gloo ranks equals the model whole.

Tolerance: float32 everywhere; losses and log-probs within 1e-6 relative (summation order), every parameter's
gradient within 1e-5 of that parameter's largest gradient entry: on video rows of both families, with tensor
parallelism (tp 2 x cp 2), with LoRA adapters, and on text-only rows (VL models without pixels, text-only models).
Whole SFT runs (cp with resume at another cp size, tp 2 x cp 2, LoRA) match one process's losses within 1e-5.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from setups import free_port, run_torchrun

from physreason.errors import ConfigError
from physreason.models.context_parallel import SequenceShard, check_heads, full_attention_mask, split_patch_units

WORKER = Path(__file__).with_name("cp_worker.py")


def run_worker(tmp_path: Path, nproc: int, cases: list[str], port: int) -> dict:
    """Run tests/cp_worker.py on `nproc` gloo ranks for each "kind:layout" case; rank 0's results by case."""
    out = tmp_path / f"cp{nproc}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(free_port()),
               str(WORKER), ",".join(cases), str(out)]  # fmt: skip
    done = run_torchrun(command, env)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


def assert_split_equals_whole(case: str, result: dict, vision: bool = True) -> None:
    whole, split = result["losses"]
    assert split == pytest.approx(whole, rel=1e-6), case
    assert result["missing"] == [], case  # the same parameters get gradients
    assert result["grads"] > 0, case
    if vision:
        assert result["tower_grad"] > 0, case  # the vision tower is in the backward
    else:
        assert result["tower_grad"] == 0, case  # text rows: the tower takes no part
    worst = max(result["grad_rel"].items(), key=lambda item: item[1])
    assert worst[1] <= 1e-5, (case, worst)
    if "logprob_diff" in result:
        assert result["logprob_diff"] <= 1e-5 and result["entropy_diff"] <= 1e-5, case


@pytest.mark.slow
def test_cp2_sft_and_grpo_losses_and_gradients_equal_one_process_for_both_families(tmp_path):
    # SFT padded and packed rows, and GRPO policy log-probs (shared visuals; packed completions), on video rows
    cases = ["qwen2_5_vl:padded", "qwen3_vl:padded", "qwen3_vl_moe:packed", "qwen2_5_vl:grpo", "qwen3_vl:grpo_packed"]
    results = run_worker(tmp_path, 2, cases, 29611)
    for case in cases:
        assert_split_equals_whole(case, results[case])


@pytest.mark.slow
def test_cp4_losses_and_gradients_equal_one_process_with_repeated_kv_heads(tmp_path):
    # the tiny models have 4 query and 2 KV heads: cp 4 gives each rank one query head and a copy of its KV head
    cases = ["qwen2_5_vl:packed", "qwen3_vl:padded", "qwen3_vl_moe:grpo"]
    results = run_worker(tmp_path, 4, cases, 29612)
    for case in cases:
        assert_split_equals_whole(case, results[case])


@pytest.mark.slow
def test_tp2_x_cp2_losses_and_gradients_equal_one_process(tmp_path):
    # 4 ranks: heads split over tp pairs (2 query heads, 1 KV head each), each pair's sequence over cp 2 (its one KV
    # head repeated); tensor-parallel gradients gathered, then summed over the cp group as FSDP2 would
    cases = ["qwen2_5_vl:padded:tp2", "qwen3_vl:packed:tp2", "qwen3_vl_moe:grpo_packed:tp2"]
    results = run_worker(tmp_path, 4, cases, 29613)
    for case in cases:
        assert_split_equals_whole(case, results[case])


@pytest.mark.slow
def test_cp2_with_lora_adapters_equals_one_process(tmp_path):
    # adapters on the language and vision blocks (B initialised non-zero, so A gets a gradient too)
    cases = ["qwen2_5_vl:packed:lora", "qwen3_vl:grpo:lora"]
    results = run_worker(tmp_path, 2, cases, 29614)
    for case in cases:
        assert_split_equals_whole(case, results[case])
        assert results[case]["trained"] == ["lora"], case  # only adapters train: the frozen base has no gradient


@pytest.mark.slow
def test_cp2_text_only_rows_equal_one_process_for_vision_and_text_models(tmp_path):
    # rows without pixels on the VL families (M-RoPE positions of text), and the text-only Qwen families
    cases = ["qwen2_5_vl:padded:text", "qwen3_vl:packed:text", "qwen3_vl:grpo:text", "qwen2:padded", "qwen3:grpo_packed",
             "qwen3_moe:packed"]  # fmt: skip
    results = run_worker(tmp_path, 2, cases, 29615)
    for case in cases:
        assert_split_equals_whole(case, results[case], vision=False)


def test_sequence_shards_pad_to_a_multiple_of_cp_and_tile_it():
    shards = [SequenceShard.of(10, 4, rank) for rank in range(4)]
    assert [(s.start, s.stop) for s in shards] == [(0, 3), (3, 6), (6, 9), (9, 12)]
    tensor = torch.arange(10)[None]  # [1, 10]
    assert torch.cat([s.take(tensor, dim=1, fill=-1) for s in shards], dim=1).tolist() == [list(range(10)) + [-1, -1]]


def test_patch_units_are_split_contiguously_and_balanced():
    grid = torch.tensor([[4, 4, 6], [1, 8, 8]])  # a video of 4 temporal patches of 24, then an image of 64 patches
    assert split_patch_units(grid, 2) == [(0, 4), (4, 5)]
    assert split_patch_units(grid, 4) == [(0, 2), (2, 4), (4, 5), (5, 5)]  # the last rank gets none
    assert split_patch_units(torch.tensor([[8, 2, 2]]), 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]


def test_full_mask_separates_packed_samples_and_hides_padding():
    shard = SequenceShard.of(5, 2, 0)  # padded to 6
    positions = torch.tensor([[0, 1, 2, 0, 1]])  # two packed samples
    mask = full_attention_mask(None, positions, 1, shard, torch.device("cpu"))[0, 0]
    assert mask[4].tolist() == [False, False, False, True, True, False]
    assert mask[5].tolist() == [False] * 5 + [True]  # cp's padding sees only itself
    padded = full_attention_mask(torch.tensor([[1, 1, 1, 0, 0]]), None, 1, shard, torch.device("cpu"))[0, 0]
    assert padded[2].tolist() == [True, True, True, False, False, False]
    assert full_attention_mask(None, torch.arange(5)[None], 1, shard, torch.device("cpu")) is None  # plain causal


def test_cp_that_does_not_divide_the_heads_is_refused_naming_both():
    check_heads(28, 4, 4)  # Qwen2.5-VL-7B: 28 query heads, 4 KV heads (repeated to 4 per rank... one each)
    check_heads(32, 8, 2, tp_size=2)
    with pytest.raises(ConfigError, match=r"cp_size = 8 must divide the language model's 28 query heads.*\[1, 2, 4, 7, 14, 28\]"):
        check_heads(28, 4, 8)


def write_video_records(folder: Path, count: int = 4) -> Path:
    """`count` conversations about one short clip (8 frames sampled: 4 temporal patches per row)."""
    from media import write_clip
    from setups import ANSWER

    write_clip(folder / "clips" / "fall.mp4", n_frames=16, fps=8, size=(56, 84))
    records = [
        {"conversations": [{"role": "user", "content": f"Does the square fall {i}?"}, {"role": "assistant", "content": ANSWER}],
         "video": "clips/fall.mp4"}
        for i in range(count)
    ]  # fmt: skip
    path = folder / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def cp_overrides(model: Path, data: Path, out: Path, steps: int, cp: int) -> list[str]:
    """2 rows of video per step in micro-batches of 1, float32, a constant learning rate, a checkpoint every step."""
    return [
        f"model.model_name_or_path='{model}'", f"data.dataset.name='{data}'", f"train.output_dir='{out}'",
        "train.train_batch_per_replica=2", "train.mini_batch=1", f"train.max_steps={steps}", "train.optm_lr=2e-3",
        "train.optm_warmup_steps=0", "train.optm_decay_type='constant'", "train.param_dtype='float32'",
        "data.num_workers=0", "data.val_fraction=0", "logging.logger=['jsonl']", "vision.nframes=8",
        "train.ckpt.save_freq=1", "train.ckpt.max_keep=2", "train.ckpt.export_safetensors=false",
        f"policy.parallelism.cp_size={cp}", "train.resume=true",
    ]  # fmt: skip


@pytest.mark.slow
@pytest.mark.cpu_only
def test_sft_under_cp_matches_one_process_and_resumes_at_another_cp_size(tmp_path, vl_kind):
    from setups import torchrun_sft

    from physreason.config import load_config
    from physreason.models.tiny import save_tiny_model
    from physreason.train.sft import run_sft

    model = save_tiny_model(vl_kind, tmp_path / "model")
    data = write_video_records(tmp_path)
    one = run_sft(load_config(None, cp_overrides(model, data, tmp_path / "one", 3, 1))).losses
    first = torchrun_sft(tmp_path, 2, 29621, cp_overrides(model, data, tmp_path / "cp", 2, 2))  # cp 2: steps 1-2
    last = torchrun_sft(tmp_path, 4, 29622, cp_overrides(model, data, tmp_path / "cp", 3, 4))  # resumed at cp 4: step 3
    assert len(one) == 3 and len(first) == 2 and len(last) == 1
    assert torch.allclose(torch.tensor(first + last), torch.tensor(one), rtol=1e-5, atol=1e-6), (first + last, one)


LORA = ["train.lora.enable=true", "train.lora.vision=true"]  # adapters on the language and vision blocks, base frozen


@pytest.mark.slow
@pytest.mark.cpu_only
@pytest.mark.parametrize(
    ("kind", "tp", "recipe"),
    [("qwen3_vl", 2, []), ("qwen2_5_vl", 1, LORA)],
    ids=["tp2_x_cp2", "lora_cp2"],
)
def test_sft_under_cp_with_tp_or_lora_matches_one_process(tmp_path, kind, tp, recipe):
    # tp 2: FSDP2 shards over dp x cp while each rank's decoder blocks are tensor-parallel over its pair
    from setups import torchrun_sft

    from physreason.config import load_config
    from physreason.models.tiny import save_tiny_model
    from physreason.train.sft import run_sft

    model = save_tiny_model(kind, tmp_path / "model")
    data = write_video_records(tmp_path)
    one = run_sft(load_config(None, cp_overrides(model, data, tmp_path / "one", 2, 1) + recipe)).losses
    split_recipe = cp_overrides(model, data, tmp_path / "cp", 2, 2) + recipe + [f"policy.parallelism.tp_size={tp}"]
    split = torchrun_sft(tmp_path, 2 * tp, 29623, split_recipe)
    assert len(one) == 2 and one[1] != one[0]  # the second step's loss shows the first step's update
    assert torch.allclose(torch.tensor(split), torch.tensor(one), rtol=1e-5, atol=1e-6), (split, one)


def test_cp_size_that_does_not_divide_the_processes_is_refused_naming_both():
    from physreason.models.parallelize import check_layout

    assert check_layout(8, 2, 2) == 2
    with pytest.raises(ConfigError, match=r"tp_size \(1\) x policy.parallelism.cp_size \(4\) = 4 must divide the number of processes \(6\)"):
        check_layout(6, 1, 4)


def test_disaggregated_policy_counts_cp_ranks_and_sends_a_cp_group_one_share():
    from physreason.config import Config
    from physreason.distributed.controller import policy_shares, policy_world_size
    from physreason.distributed.rollout_queue import ScoredGroup

    def recipe(tp: int, cp: int, dp_shard: int) -> Config:
        parallelism = {"tp_size": tp, "cp_size": cp, "dp_shard_size": dp_shard}
        return Config.model_validate({"model": {"model_name_or_path": "-"}, "policy": {"parallelism": parallelism}})

    assert policy_world_size(recipe(1, 2, 2), 0) == 4  # dp 2 x cp 2
    assert policy_world_size(recipe(1, 2, -1), 0) == 2  # CPU: one replica of cp ranks
    assert policy_world_size(recipe(2, 2, -1), 8) == 4  # 7 GPUs left by one rollout replica: whole tp x cp replicas only
    groups = [ScoredGroup([f"g{i}a", f"g{i}b"], 0, 0, i) for i in range(4)]  # samples stand in as names
    shares = policy_shares(groups, 4, 2)  # ranks (0, 1) and (2, 3): one cp group per data-parallel share
    assert shares == [["g0a", "g0b", "g2a", "g2b"]] * 2 + [["g1a", "g1b", "g3a", "g3b"]] * 2
