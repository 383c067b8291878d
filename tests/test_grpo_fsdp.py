"""GRPO under torchrun with FSDP2 (gloo on CPU): two processes train like one, and one process works too.

The policy is a tiny Qwen2.5-VL trained on text prompts, so its vision blocks (each its own FSDP
group) never take part in a forward: the case that crashed the colocated loop on a GPU with torch
2.11 ('FSDPParam' object has no attribute '_unsharded_param' in the root post-backward callback).
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import textwrap
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from setups import free_port, run_torchrun
from transformers import AutoModelForImageTextToText

from physreason.config import Config, EngineConfig, SamplingConfig, load_config
from physreason.engines import Engine, GenerationRequest, GenerationResult
from physreason.engines.hf import HFEngine
from physreason.models.tiny import save_tiny_model
from physreason.rewards import register_reward
from physreason.train.grpo import run_grpo

pytestmark = pytest.mark.cpu_only  # gloo children compared with an in-process run

TESTS = Path(__file__).resolve().parent

WORKER = textwrap.dedent(
    """
    import json, os, sys
    from pathlib import Path
    import torch.distributed as dist
    sys.path.insert(0, sys.argv[1])
    from test_grpo_fsdp import train_and_record
    from physreason.config import load_config
    train_and_record(load_config(None, json.loads(sys.argv[2])), Path(sys.argv[3]), int(os.environ["RANK"]))
    dist.destroy_process_group()
    """
)


@register_reward("test_distinct_chars")
def distinct_chars(completion: str, **sample) -> float:
    """Share of distinct characters: differs between random completions, so no group has zero advantages."""
    return len(set(completion)) / (1 + len(completion))


class PerPromptSeedEngine(Engine):
    """The hf engine, sampling each prompt alone with a seed from its messages and the weight version.

    Completions then depend on neither the rank nor the batch a prompt lands in, so runs with
    different process counts sample the same tokens while their weights agree.
    """

    def __init__(self, inner: HFEngine) -> None:
        self.inner = inner
        self.version = 0

    def generate(self, requests: list[GenerationRequest], sampling: SamplingConfig) -> list[GenerationResult]:
        results = []
        for request in requests:
            seed = random.Random(f"{self.version}:{json.dumps(request.messages)}").getrandbits(31)
            results += self.inner.generate([request], sampling.model_copy(update={"seed": seed}))
        return results

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.inner.update_weights(named_tensors)
        self.version += 1


def train_and_record(config: Config, out: Path, rank: int) -> None:
    """Run GRPO with a PerPromptSeedEngine; write the engine's final weights per rank and rank 0's record."""
    engine = PerPromptSeedEngine(HFEngine(config.model, EngineConfig(batch_size=16)))
    result = run_grpo(config, engine=engine)
    torch.save(engine.inner.model.state_dict(), out / f"engine_{rank}.pt")
    if rank == 0:
        record = {
            "rewards": result.rewards,
            "losses": [m["loss"] for m in result.metrics],
            "grad_norms": [m["policy/grad_norm"] for m in result.metrics],
        }
        (out / "record.json").write_text(json.dumps(record))


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory, vl_kind) -> Path:
    return save_tiny_model(vl_kind, tmp_path_factory.mktemp(f"tiny_{vl_kind}"))


@pytest.fixture(scope="module")
def text_mcq(tmp_path_factory) -> Path:
    records = [
        {"question": f"Which way does ball {i} go?", "options": ["up", "down", "left", "right"], "answer": "B"}
        for i in range(8)
    ]
    path = tmp_path_factory.mktemp("mcq") / "mcq.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records))
    return path


def _overrides(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    # 2 steps x 2 prompt groups of 4; micro-batches of 2 completions, so each rank accumulates gradients.
    return [
        f"model.model_name_or_path='{model}'",
        "model.dtype='float32'",
        f"data.dataset.name='{data}'",
        f"train.output_dir='{out}'",
        "train.max_steps=2",
        "train.train_batch_per_replica=8",
        "rollout.n_generation=4",
        "rollout.batch_size=2",
        "rollout.max_response_length=6",
        "grpo.mini_batch=2",
        "grpo.mu_iterations=2",
        "grpo.reward_function={test_distinct_chars = 1.0}",
        "train.optm_lr=1e-2",
        "train.optm_decay_type='constant'",
        "train.gradient_checkpointing=true",
        "train.ckpt.save_freq=2",
        "train.ckpt.export_safetensors=true",
        "logging.logger=['jsonl']",
        *extra,
    ]


def _torchrun(processes: int, overrides: list[str], out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    script = out / "worker.py"
    script.write_text(WORKER)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(processes),
        "--master-port",
        str(free_port()),  # a fixed port collides with any other torchrun on the machine
        str(script),
        str(TESTS),
        json.dumps(overrides),
        str(out),
    ]
    done = run_torchrun(command, {**os.environ, "OMP_NUM_THREADS": "1"}, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((out / "record.json").read_text())


def _engine_weights(out: Path, rank: int) -> dict[str, torch.Tensor]:
    return torch.load(out / f"engine_{rank}.pt", weights_only=True)


@pytest.mark.slow
def test_two_gloo_processes_with_fsdp2_match_one_process_in_rewards_losses_and_engine_weights(
    tiny_vl, text_mcq, tmp_path
):
    overrides = _overrides(tiny_vl, text_mcq, tmp_path / "one", "train.param_dtype='float32'")
    (tmp_path / "one").mkdir()
    train_and_record(load_config(None, overrides), tmp_path / "one", rank=0)
    one = json.loads((tmp_path / "one" / "record.json").read_text())
    two = _torchrun(
        2, _overrides(tiny_vl, text_mcq, tmp_path / "two", "train.param_dtype='float32'"), tmp_path / "two"
    )
    assert two["rewards"] == pytest.approx(one["rewards"], rel=1e-9)
    assert len(set(one["rewards"])) == 2  # the second step sampled with the updated weights
    assert torch.allclose(torch.tensor(two["losses"]), torch.tensor(one["losses"]), rtol=1e-4, atol=1e-6)
    assert all(loss != 0.0 for loss in one["losses"])
    reference = _engine_weights(tmp_path / "one", 0)
    initial = load_file(tiny_vl / "model.safetensors")
    assert (reference["lm_head.weight"] - initial["lm_head.weight"]).abs().max() > 5e-3  # lr 1e-2, 4 Adam steps
    pushed = [_engine_weights(tmp_path / "two", rank) for rank in (0, 1)]
    assert pushed[0].keys() == pushed[1].keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(pushed[0][name], pushed[1][name]), name
        # Adam turns summation-order noise in near-zero gradients into differences far below one step (lr).
        assert torch.allclose(pushed[0][name], tensor, atol=1e-3), name


@pytest.mark.slow
def test_one_process_under_torchrun_trains_a_bf16_vision_language_policy_on_text_prompts(tiny_vl, text_mcq, tmp_path):
    # bf16 compute with fp32 gradient reduction, micro-batches and mu_iterations=2: the failing GPU case,
    # here with a KL reference (a second FSDP2 model that only runs forwards without gradients).
    overrides = _overrides(
        tiny_vl,
        text_mcq,
        tmp_path,
        "train.param_dtype='bfloat16'",
        "train.fsdp_reduce_dtype='float32'",
        "grpo.kl_beta=0.05",
    )
    record = _torchrun(1, overrides, tmp_path)
    assert len(record["losses"]) == 2 and all(math.isfinite(loss) and loss != 0.0 for loss in record["losses"])
    pushed = _engine_weights(tmp_path, 0)
    initial = load_file(tiny_vl / "model.safetensors")
    assert not torch.equal(pushed["lm_head.weight"], initial["lm_head.weight"])
    exported = AutoModelForImageTextToText.from_pretrained(tmp_path / "safetensors" / "step_2").state_dict()
    assert exported.keys() == pushed.keys()
    for name, tensor in exported.items():
        assert torch.equal(pushed[name], tensor), name  # the engine holds exactly the policy's final weights
