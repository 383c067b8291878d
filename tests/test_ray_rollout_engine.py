"""The rollout replica's engine: vLLM gets an executor that stays on the GPUs Ray gave the actor."""

from __future__ import annotations

import pytest

from physreason.config import Config
from physreason.distributed import rollout_replica


class RecordingEngine:
    """Stands in for VLLMEngine: records how it was built."""

    def __init__(self, model, engine, **llm_overrides) -> None:
        self.engine_config = engine
        self.llm_overrides = llm_overrides


@pytest.mark.parametrize(("tp", "executor"), [(1, "uni"), (2, "mp")])
def test_vllm_rollout_engine_runs_in_process_on_one_gpu_and_in_local_workers_on_several(monkeypatch, tp, executor):
    import physreason.engines.vllm as vllm_engine
    from physreason.engines import factory

    monkeypatch.setattr(vllm_engine, "VLLMEngine", RecordingEngine)
    monkeypatch.setattr(factory, "vllm_installed", lambda: True)
    config = Config.model_validate({
        "model": {"model_name_or_path": "unused"},
        "engine": {"backend": "vllm"},
        "rollout": {"parallelism": {"tp_size": tp}},
    })

    engine = rollout_replica.build_engine(config)

    assert engine.llm_overrides == {"distributed_executor_backend": executor}
    assert engine.engine_config.tensor_parallel_size == tp


def test_rollout_engine_uses_the_engine_factory_so_a_missing_vllm_is_a_config_error(monkeypatch):
    from physreason.engines import factory
    from physreason.errors import ConfigError

    monkeypatch.setattr(factory, "vllm_installed", lambda: False)
    config = Config.model_validate({"model": {"model_name_or_path": "unused"}, "engine": {"backend": "vllm"}})

    with pytest.raises(ConfigError, match="vLLM is not installed"):
        rollout_replica.build_engine(config)
