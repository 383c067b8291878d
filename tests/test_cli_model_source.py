"""A wrong model folder or an unreachable hub: one line naming the model, exit 2, no retries, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HUB_ID = "nvidia/Cosmos-Reason1-7B"


def run_cli(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    return subprocess.run(
        [sys.executable, "-m", "physreason", *args], capture_output=True, text=True, timeout=300, cwd=cwd,
        env=environment,
    )


def no_model_folder(tmp_path: Path) -> Path:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "clips.jsonl").write_text("{}\n")
    return tmp_path


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (("infer", "-m", "./nope", "-q", "x"), "'./nope': no such folder"),
        (("infer", "-m", "./data", "-q", "x"), "'./data' has no config.json"),
        (("eval", "-m", "./nope", "-d", "data/clips.jsonl"), "'./nope': no such folder"),
        (("sft", "-c", str(ROOT / "configs/sft_tiny.toml"), "--set", "model.model_name_or_path=./nope"), "'./nope'"),
        (("grpo", "-c", str(ROOT / "configs/grpo_tiny.toml"), "--set", "model.model_name_or_path=./nope"), "'./nope'"),
    ],
)
def test_a_folder_that_is_no_model_is_one_line_naming_it_and_exit_2(tmp_path, args, named):
    result = run_cli(*args, cwd=no_model_folder(tmp_path))
    assert result.returncode == 2, result.stderr
    assert named in result.stderr and "a model folder needs config.json" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_config_without_model_type_is_named(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text('{"hidden_size": 8}')
    result = run_cli("infer", "-m", "./m", "-q", "x", cwd=tmp_path)
    assert result.returncode == 2 and "names no model_type" in result.stderr and "Traceback" not in result.stderr


def test_offline_hub_id_fails_at_once_naming_hf_hub_offline(tmp_path):
    result = run_cli("infer", "-q", "x", cwd=tmp_path, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    assert result.returncode == 2, result.stderr
    assert f"'{HUB_ID}' is a hub id that is not in the local cache, and HF_HUB_OFFLINE is set" in result.stderr
    assert "Traceback" not in result.stderr


def test_unreachable_hub_is_one_request_without_retries(tmp_path):
    # Port 9 (discard) refuses at once here: huggingface_hub alone would log "Retrying in 1s [Retry 1/5]" and back off.
    env = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "0"}
    result = run_cli("infer", "-q", "x", cwd=tmp_path, **env)
    assert result.returncode == 2, result.stderr
    assert f"'{HUB_ID}': cannot reach http://127.0.0.1:9" in result.stderr and "not in the local cache" in result.stderr
    assert "Retry" not in result.stderr and "Traceback" not in result.stderr


def test_unreachable_hub_probe_is_made_once_and_never_retried(monkeypatch, tmp_path):
    from huggingface_hub.utils import _http

    from physreason.errors import ConfigError
    from physreason.models import source

    calls = []

    class Refusing:
        def head(self, url, **kwargs):
            calls.append(url)
            raise ConnectionRefusedError(111, "Connection refused")

    monkeypatch.setattr(_http, "get_session", lambda: Refusing())
    monkeypatch.setattr("huggingface_hub.utils.get_session", lambda: Refusing())
    monkeypatch.setattr(source, "hub_offline", lambda: False)
    monkeypatch.setattr(source, "_cached", lambda name, revision: False)
    with pytest.raises(ConfigError, match="cannot reach"):
        source.check_model_source("someone/some-model")
    assert len(calls) == 1


def test_unreachable_hub_with_a_cached_model_goes_offline_instead_of_retrying(monkeypatch):
    from physreason.models import source

    monkeypatch.setattr(source, "hub_offline", lambda: False)
    monkeypatch.setattr(source, "_cached", lambda name, revision: True)
    monkeypatch.setattr(source, "probe_hub", lambda name, revision: (None, "cannot reach the hub"))
    went = []
    monkeypatch.setattr(source, "go_offline", lambda: went.append(True))
    source.check_model_source("someone/cached-model")
    assert went == [True]


NO_NETWORK = """
import socket, sys
def refuse(*args, **kwargs):
    raise AssertionError("network used: " + repr(args))
socket.socket.connect = refuse
socket.create_connection = refuse
socket.getaddrinfo = refuse
from physreason.cli import main
sys.argv = ["physreason", *sys.argv[1:]]
main()
"""


def test_serve_print_command_of_a_hub_recipe_needs_no_network(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "0",
           "XDG_CACHE_HOME": str(tmp_path / "cache"), "PHYSREASON_API_KEY": "s3cret"}
    result = subprocess.run(
        [sys.executable, "-c", NO_NETWORK, "serve", "--config", str(ROOT / "configs/infer-cosmos-reason1-7b.toml"),
         "--print-command"],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert result.returncode == 0, result.stderr
    assert f"--model {HUB_ID}" in result.stdout and "network used" not in result.stderr
    assert result.stdout.startswith("VLLM_API_KEY=*** ") and "s3cret" not in result.stdout
    assert "is not downloaded, so this command has no --chat-template" in result.stderr


def test_eval_of_an_unreachable_hub_id_is_one_line_without_retries(tmp_path):
    # eval read the checkpoint's config.json for its prompt style before checking the source: five retries per file.
    (tmp_path / "q.jsonl").write_text('{"question": "q?", "video": "a.mp4", "options": {"A": "x", "B": "y"}, "answer": "A"}\n')
    env = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "0"}
    result = run_cli("eval", "-m", "nvidia/Cosmos-Reason2-8B", "-d", "q.jsonl", "--no-progress", cwd=tmp_path, **env)
    assert result.returncode == 2, result.stderr
    assert "'nvidia/Cosmos-Reason2-8B': cannot reach http://127.0.0.1:9" in result.stderr
    assert "Retry" not in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "results").exists()


def test_a_model_folder_without_weights_is_one_line_naming_what_is_missing(tmp_path, tiny_model_dir):
    import shutil

    from physreason.config import ModelConfig
    from physreason.errors import ConfigError
    from physreason.models.loading import load_model

    half = tmp_path / "half"
    shutil.copytree(tiny_model_dir, half, ignore=shutil.ignore_patterns("*.safetensors"))
    result = run_cli("infer", "-m", str(half), "-q", "x", "--engine", "hf", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert f"'{half}' has config.json but no weights" in result.stderr
    assert "Traceback" not in result.stderr
    with pytest.raises(ConfigError, match="has config.json but no weights"):  # what sft, grpo and export load with
        load_model(ModelConfig(model_name_or_path=str(half)))


def test_a_sharded_model_folder_names_its_missing_shards(tmp_path):
    import json

    from physreason.errors import ConfigError
    from physreason.models.source import check_model_weights

    (tmp_path / "config.json").write_text('{"model_type": "qwen2"}')
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"x")
    with pytest.raises(ConfigError, match=r"names 2 weight files and 1 are missing \(model-00002-of-00002"):
        check_model_weights(str(tmp_path))
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"x")
    check_model_weights(str(tmp_path))


def test_plan_of_a_shipped_recipe_needs_no_network(tmp_path):
    recipe = ROOT / "configs" / "cosmos-reason2-8b-sft.toml"
    result = run_cli("plan", str(recipe), "--gpus", "8", cwd=tmp_path, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    assert result.returncode == 0, result.stderr
    assert "planning with the published shape physreason ships for it" in result.stderr
    assert "nvidia/Cosmos-Reason2-8B: 8.77 B parameters, 36 blocks of hidden 4096" in result.stdout


def test_every_shipped_recipe_model_has_its_published_shape():
    import tomllib

    from physreason.models.sizes import shape_from_hf_config, shipped_config

    named = {tomllib.loads(p.read_text())["model"]["model_name_or_path"] for p in (ROOT / "configs").glob("*.toml")}
    hub_ids = {name for name in named if not name.startswith(".")}
    assert hub_ids == {"nvidia/Cosmos-Reason1-7B", "nvidia/Cosmos-Reason2-2B", "nvidia/Cosmos-Reason2-8B"}
    counts = {name: round(shape_from_hf_config(shipped_config(name)).total_params / 1e9, 2) for name in hub_ids}
    assert counts == {"nvidia/Cosmos-Reason1-7B": 8.29, "nvidia/Cosmos-Reason2-2B": 2.13, "nvidia/Cosmos-Reason2-8B": 8.77}
    assert shipped_config("someone/Other-VL-7B") is None


def test_plan_of_another_hub_model_offline_is_still_refused(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text('[model]\nmodel_name_or_path = "someone/Other-VL-7B"\n')
    result = run_cli("plan", str(recipe), cwd=tmp_path, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    assert result.returncode == 2 and "'someone/Other-VL-7B' is a hub id that is not in the local cache" in result.stderr
    assert "ships" not in result.stderr


def edited_config(tiny_model_dir: Path, folder: Path, section: str, key: str, value: object) -> Path:
    """A model folder holding the tiny model's config.json with one size set to `value` (layer_types dropped, as
    transformers derives it from num_hidden_layers)."""
    import json

    config = json.loads((tiny_model_dir / "config.json").read_text())
    config[section][key] = value
    config[section].pop("layer_types", None)
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [
        ("text_config", "num_attention_heads", 0),  # divided by in transformers' attention
        ("text_config", "hidden_size", -4),  # a tensor of negative size
        ("text_config", "num_hidden_layers", 20_000),  # builds for seconds; 2,000,000 ran for minutes
        ("vision_config", "patch_size", 0),  # the plan divides pixels by it
        ("vision_config", "depth", -1),
    ],
)
def test_a_config_size_no_model_can_have_is_named_before_anything_is_built(tmp_path, tiny_model_dir, section, key, value):
    from physreason.config import load_config
    from physreason.errors import ConfigError
    from physreason.models.sizes import read_model_shape

    folder = edited_config(tiny_model_dir, tmp_path / "m", section, key, value)
    config = load_config(None, [f"model.model_name_or_path='{folder}'"])
    with pytest.raises(ConfigError) as raised:
        read_model_shape(config.model)
    assert str(raised.value).startswith(f"{folder / 'config.json'}: {section}.{key} = {value} is not a whole number from 1 to ")


@pytest.mark.parametrize(("key", "value"), [("hidden_size", "128"), ("vocab_size", 1e308)])
def test_a_config_field_transformers_refuses_is_named_with_its_file(tmp_path, tiny_model_dir, key, value):
    from physreason.config import load_config
    from physreason.errors import ConfigError
    from physreason.models.sizes import read_model_shape

    folder = edited_config(tiny_model_dir, tmp_path / "m", "text_config", key, value)
    config = load_config(None, [f"model.model_name_or_path='{folder}'"])
    with pytest.raises(ConfigError) as raised:
        read_model_shape(config.model)
    message = str(raised.value)
    assert message.startswith(f"{folder / 'config.json'} cannot be read as a model config")
    assert f"'{key}'" in message and "\n" not in message


def test_plan_of_a_model_whose_config_has_a_zero_patch_size_is_one_line(tmp_path, tiny_model_dir):
    folder = edited_config(tiny_model_dir, tmp_path / "m", "vision_config", "patch_size", 0)
    result = run_cli("plan", str(ROOT / "configs" / "sft_tiny.toml"), "-m", str(folder), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert f"{folder / 'config.json'}: vision_config.patch_size = 0 is not a whole number" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_size_of_a_flat_config_is_named_as_the_file_writes_it(tmp_path, tiny_model_dir):
    import json

    from physreason.config import load_config
    from physreason.errors import ConfigError
    from physreason.models.sizes import read_model_shape

    # Qwen2.5-VL's published config.json (Cosmos-Reason1's) keeps the text model's keys at the top level
    config = json.loads((tiny_model_dir / "config.json").read_text())
    flat = {**{k: v for k, v in config.items() if k != "text_config"}, **config["text_config"]}
    flat["num_attention_heads"] = 0
    folder = tmp_path / "flat"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(flat))
    with pytest.raises(ConfigError) as raised:
        read_model_shape(load_config(None, [f"model.model_name_or_path='{folder}'"]).model)
    assert str(raised.value).startswith(f"{folder / 'config.json'}: num_attention_heads = 0 is not a whole number")
