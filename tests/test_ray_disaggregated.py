"""Disaggregated GRPO on a local Ray session: 1 policy rank + rollout replicas, tiny qwen2, hf engine, gloo weight channels."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from physreason.config import Config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_session():
    """One Ray session for the module: 4 logical CPUs hold 1 policy rank and up to 3 rollout replicas."""
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def recipe_factory(tmp_path_factory, ray_session):
    from physreason.models.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("disaggregated")
    model = save_tiny_model("qwen2", root / "tiny-qwen2")
    data = root / "mcq.jsonl"
    records = [
        {"id": f"q{i}", "question": f"Which word is number {i}?", "options": ["one", "two", "three"], "answer": "ABC"[i % 3]}
        for i in range(12)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in records))

    def make(name: str, **train) -> Config:
        return Config.model_validate({
            "model": {"model_name_or_path": str(model), "model_max_length": 256, "dtype": "float32"},
            "engine": {"backend": "hf", "batch_size": 8},
            "data": {"dataset": {"name": str(data)}, "num_workers": 0},
            "train": {
                "output_dir": str(root / name),
                "train_batch_per_replica": 8,  # 2 prompt groups of 4 completions per step
                "optm_lr": 1e-3,
                "optm_decay_type": "constant",
                "param_dtype": "float32",
                "gradient_checkpointing": False,
                "ckpt": {"save_freq": 2, "max_keep": 2, "export_safetensors": False},
                "log_freq": 1,  # the tests read every step's metrics
                **train,
            },
            "rollout": {
                "n_generation": 4,
                "max_response_length": 12,
                "batch_size": 2,
                "sampling_config": {"temperature": 1.0, "top_p": 1.0, "repetition_penalty": 1.0},
                "parallelism": {"n_init_replicas": 2},
            },
            "grpo": {"mode": "disaggregated", "allowed_outdated_steps": 1, "mini_batch": 8},
            "logging": {"logger": ["jsonl"]},
        })

    return make


def _staleness(result) -> list[int]:
    # The update that makes step s runs on weights s - 1.
    return [step - 1 - version for step, version, _ in result.group_versions]


def test_training_progresses_within_the_staleness_bound(recipe_factory):
    from physreason.distributed.controller import run_disaggregated

    config = recipe_factory("progress", max_steps=4)
    config.grpo.dynamic_sampling = True  # every trained group has rewards that differ, so every step has a gradient
    result = run_disaggregated(config)

    assert len(result.metrics) == 4
    assert all(m["policy/grad_norm"] > 0 for m in result.metrics)
    assert len(result.group_versions) == 4 * 2
    assert 0 <= min(_staleness(result)) and max(_staleness(result)) <= config.grpo.allowed_outdated_steps
    # Versions advance: the last step trained on groups made with weights newer than the first.
    assert max(v for _, v, _ in result.group_versions) >= 2
    assert result.last_checkpoint is not None and result.last_checkpoint.name == "step_4"
    assert any("policy ranks on GPUs" in event for event in result.events)
    assert any("rollout replica 0 loaded its engine" in event for event in result.events)
    lines = (Path(config.train.output_dir) / "logs" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4]
    # The figures bench/rl_disaggregated.py reports: each side's idle fraction and the weight push's time and rate.
    assert all(0.0 <= m["time/policy_idle_frac"] <= 1.0 and 0.0 <= m["time/rollout_idle_frac"] <= 1.0
               for m in result.metrics)
    pushed = [m for m in result.metrics if m["time/publish_s"] > 0]
    assert pushed and all(m["sync/gbytes_per_s"] > 0 for m in pushed)


def test_lost_replica_is_replaced_and_joiners_start_from_current_weights(recipe_factory):
    from physreason.distributed.controller import run_disaggregated

    def chaos(controller, step: int) -> None:
        if step == 2:
            ray.kill(controller.rollout_handle(0), no_restart=True)
            controller.add_rollout_replica()
        if step == 3:
            # Let the replacement and the added replica finish loading, then retire the last original replica,
            # so the groups of the remaining steps must come from replicas that joined mid-run (which replica
            # wins a race for work is otherwise up to timing).
            for replica in list(controller.replicas.values()):
                ray.get(replica.handle.ready.remote())
            ray.kill(controller.rollout_handle(1), no_restart=True)

    config = recipe_factory("chaos", max_steps=9)
    config.grpo.allowed_outdated_steps = 0  # fully on-policy: every group was made with the weights it trains
    config.rollout.replica_timeout_s = 120.0  # a replica hung by a kill mid-transfer is replaced, not waited on
    result = run_disaggregated(config, on_step=chaos)

    assert len(result.metrics) == 9
    assert any("rollout replica 0 lost" in event for event in result.events)
    assert max(_staleness(result)) == 0 and min(_staleness(result)) == 0
    newcomers = {replica for _, _, replica in result.group_versions if replica >= 2}
    assert newcomers, f"no group came from a replica started mid-run: {result.events}"
    for replica in newcomers:
        first = min(version for _, version, r in result.group_versions if r == replica)
        assert first >= 2, f"replica {replica} generated with weights of step {first}, before it joined at step 2"
    assert all(replica != 0 for step, _, replica in result.group_versions if step > 3)
    assert any("rollout replica 1 lost" in event for event in result.events)
    # Every prompt a lost replica was generating went out again to a live replica: none is lost.
    for before, draw in result.redrawn:
        assert any(draw in call for call in result.dispatched[before:]), f"draw {draw} was never handed out again"


def test_a_replica_past_its_timeout_is_handled_as_lost_naming_the_setting(recipe_factory):
    from physreason.distributed.controller import run_disaggregated
    from physreason.errors import PhysReasonError

    config = recipe_factory("hung", max_steps=2)
    # Shorter than any call can take: every replica's connect or first generate runs past it, so every
    # replica is lost before it produces, and the third in a row stops the run.
    config.rollout.replica_timeout_s = 0.001
    with pytest.raises(PhysReasonError, match=r"3 rollout replicas in a row were lost before producing a batch; last: "
                       r"(connect|generate) gave no answer within rollout.replica_timeout_s = 0.001 s"):
        run_disaggregated(config)


def test_policy_failure_resumes_from_last_checkpoint(recipe_factory):
    from physreason.distributed.controller import run_disaggregated

    killed = []

    def kill_policy(controller, step: int) -> None:
        if step == 3 and not killed:
            killed.append(step)
            ray.kill(controller.policy[0], no_restart=True)

    config = recipe_factory("restart", max_steps=5)
    result = run_disaggregated(config, on_step=kill_policy)

    assert result.policy_restarts == 1
    assert any("resumed from" in event and event.endswith("step_2") for event in result.events)
    # Step 3 is trained twice: once before the failure, once after resuming from step 2.
    steps = [json.loads(line)["step"] for line in (Path(config.train.output_dir) / "logs" / "metrics.jsonl").open()]
    assert steps == [1, 2, 3, 3, 4, 5]
    assert result.last_checkpoint is not None and result.last_checkpoint.name == "step_5"


def test_context_parallel_policy_ranks_train_on_one_share(recipe_factory):
    # cp_size 2 on CPU: a policy replica of 2 gloo ranks (the module's 4 CPUs: 2 policy ranks, 2 rollout replicas) that
    # split every row of the one data-parallel share the controller sends both of them (policy_shares)
    from physreason.distributed.controller import run_disaggregated

    config = recipe_factory("cp", max_steps=2)
    config.grpo.dynamic_sampling = True  # every trained group has rewards that differ, so every step has a gradient
    config.policy.parallelism.cp_size = 2
    result = run_disaggregated(config)

    assert any(event.endswith("policy ranks on GPUs [[], []]") for event in result.events)  # two policy ranks
    assert len(result.metrics) == 2
    assert all(m["policy/grad_norm"] > 0 for m in result.metrics)
    assert result.last_checkpoint is not None and result.last_checkpoint.name == "step_2"
