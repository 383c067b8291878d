"""One source per rollout setting: GRPO's rollouts take their size from [rollout], and conflicting keys are errors."""

from __future__ import annotations

import pytest

from physreason.config import load_config
from physreason.distributed import rollout_replica
from physreason.errors import ConfigError
from physreason.train.rollout import rollout_engine_config, rollout_sampling, rollout_settings


@pytest.mark.parametrize(
    ("key", "use"),
    [("rollout.sampling_config.max_tokens=512", "rollout.max_response_length"),
     ("rollout.sampling_config.n=4", "rollout.n_generation")],
)
def test_rollout_sampling_length_and_group_size_are_refused_naming_the_rollout_key(key, use):
    with pytest.raises(ConfigError, match=use):
        load_config(None, [key])


def test_rollout_sampling_length_in_a_recipe_file_is_refused(tmp_path):
    recipe = tmp_path / "grpo.toml"
    recipe.write_text("[rollout]\nmax_response_length = 64\n\n[rollout.sampling_config]\nmax_tokens = 128\n")
    with pytest.raises(ConfigError, match="rollout.sampling_config.max_tokens.*rollout.max_response_length"):
        load_config(recipe)


def test_rollout_samples_n_generation_completions_of_max_response_length():
    config = load_config(None, ["rollout.n_generation=3", "rollout.max_response_length=77",
                                "rollout.sampling_config.temperature=0.7", "train.seed=5"])
    sampling = rollout_sampling(config)
    assert (sampling.n, sampling.max_tokens, sampling.temperature) == (3, 77, 0.7)
    settings = rollout_settings(config, groups_needed=2, prompts_per_round=4, max_rounds=1, processor_params=None)
    assert settings.sampling == sampling and settings.seed == 5


@pytest.mark.parametrize(("engine_tp", "rollout_tp"), [(1, 2), (2, 2), (1, 1)])
def test_rollout_engine_spans_the_rollout_tp_size(engine_tp, rollout_tp):
    config = load_config(None, [f"engine.tensor_parallel_size={engine_tp}", f"rollout.parallelism.tp_size={rollout_tp}"])
    assert rollout_engine_config(config).tensor_parallel_size == rollout_tp


def test_engine_tp_that_disagrees_with_the_rollout_tp_is_refused_naming_the_rollout_key():
    config = load_config(None, ["engine.tensor_parallel_size=4", "rollout.parallelism.tp_size=2"])
    with pytest.raises(ConfigError, match="set that key") as error:
        rollout_engine_config(config)
    assert "rollout.parallelism.tp_size" in str(error.value)


def test_disaggregated_rollout_replica_refuses_a_conflicting_engine_tp_before_loading_anything():
    config = load_config(None, ["model.model_name_or_path='unused'", "engine.backend='hf'",
                                "engine.tensor_parallel_size=2", "rollout.parallelism.tp_size=1"])
    with pytest.raises(ConfigError, match="rollout.parallelism.tp_size"):
        rollout_replica.build_engine(config)


def test_batch_sized_cuda_graphs_of_vllm_rollouts_are_sized_by_a_rounds_completions():
    """A round's generate call sends rollout.batch_size prompts x n_generation completions: graphs sized by
    engine.batch_size would leave its decode steps uncaptured; an hf engine keeps its batch size (its chunks)."""
    plain = rollout_engine_config(load_config(None, ["engine.cuda_graph_sizes=vllm", "engine.backend='vllm'"]))
    assert (plain.cuda_graph_sizes, plain.batch_size) == ("vllm", 8)
    settings = ["engine.cuda_graph_sizes=batch", "rollout.batch_size=6", "rollout.n_generation=8"]
    vllm = rollout_engine_config(load_config(None, [*settings, "engine.backend='vllm'"]))
    assert (vllm.cuda_graph_sizes, vllm.batch_size) == ("batch", 48)
    assert rollout_engine_config(load_config(None, [*settings, "engine.backend='hf'"])).batch_size == 8


def test_a_group_of_one_and_an_overlong_buffer_past_the_limit_are_refused_with_the_recipe():
    """Both used to pass load_config: a group of one trains on zero advantages for the whole run; the buffer was
    refused only after the engine had started and the policy had loaded."""
    with pytest.raises(ConfigError, match="rollout.n_generation = 1.*use 2 or more"):
        load_config(None, ["rollout.n_generation=1"])
    with pytest.raises(ConfigError, match=r"grpo.overlong_buffer_length \(300\) exceeds rollout.max_response_length"):
        load_config(None, ["grpo.overlong_buffer_length=300", "rollout.max_response_length=256"])
    assert load_config(None, ["rollout.n_generation=2"]).rollout.n_generation == 2
