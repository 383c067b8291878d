"""Data-parallel SFT when one rank's micro-batch holds only skipped samples: every rank must still run as many
forwards as the others (each gathers FSDP2's shards with them), or the ranks wait on each other for ever."""

from __future__ import annotations

import json

import pytest
from setups import torchrun_sft

pytestmark = [pytest.mark.timeout(600), pytest.mark.cpu_only]


def test_a_rank_whose_only_sample_is_too_long_runs_a_filler_forward_and_the_step_completes(tmp_path, tiny_model_dir):
    short = {"conversations": [{"from": "human", "value": "Does the ball fall?"}, {"from": "gpt", "value": "Yes."}]}
    long = {"conversations": [{"from": "human", "value": "word " * 400}, {"from": "gpt", "value": "No."}]}
    data = tmp_path / "sft.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in (short, long, short, short)))  # rank 1 draws the long one first
    overrides = [
        f"model.model_name_or_path='{tiny_model_dir}'", f"data.dataset.name='{data}'", f"train.output_dir='{tmp_path / 'run'}'",
        "model.model_max_length=128", "train.train_batch_per_replica=2", "train.mini_batch=1", "train.max_steps=2",
        "train.optm_warmup_steps=0", "train.param_dtype='float32'", "data.num_workers=0", "data.val_fraction=0",
        "data.shuffle=false", "logging.logger=['jsonl']", "train.ckpt.enable_checkpoint=false",
    ]  # fmt: skip
    losses = torchrun_sft(tmp_path, 2, 0, overrides)  # before: rank 0 waited in a gather, rank 1 in the loss all-reduce
    assert len(losses) == 2 and all(loss > 0 for loss in losses)
    # the skip happened on rank 1; the run's log (written by rank 0) counts it: the counts are the global batch's
    last = json.loads((tmp_path / "run" / "logs" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 2 and last["skipped/no assistant tokens within model_max_length"] == 1.0
