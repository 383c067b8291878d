"""The final export's upload to the Hugging Face Hub ([train.ckpt] upload_hf) through huggingface_hub, against a local Hub.

The Hub cannot be reached from here: hub_server.FakeHub answers huggingface_hub's upload calls, HF_ENDPOINT points at it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from hub_server import serve_hub

from physreason.config import load_config
from physreason.errors import ConfigError
from physreason.train.upload import RECORD, Uploads, check_upload_settings


@pytest.fixture
def hub(monkeypatch, tmp_path):
    yield from serve_hub(monkeypatch, tmp_path)


def _export(run: Path, step: int = 2) -> Path:
    folder = run / "safetensors" / f"step_{step}"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "qwen2"}')
    (folder / "model.safetensors").write_bytes(bytes(range(256)) * 4096)
    return folder


def test_the_export_arrives_in_a_private_repo_under_the_tokens_user_and_is_not_sent_twice(hub, tmp_path):
    run = tmp_path / "run"
    folder = _export(run)
    uploads = Uploads(run, hf_repo="tiny-sft", backoff_s=0.01)
    uploads.start()
    uploads.submit(folder, "hf")
    assert uploads.wait(60, show=False) == []
    uploads.close()

    repo = hub.repos["tester/tiny-sft"]
    assert repo["private"]
    assert repo["files"] == {p.name: p.read_bytes() for p in folder.iterdir()}
    assert any(p.startswith("PUT /lfs-upload/") for p in hub.paths)  # the weights took the LFS route
    assert json.loads((run / RECORD).read_text())["hf"]["safetensors/step_2"]["resolved"] == "tester/tiny-sft"

    again = Uploads(run, hf_repo="tiny-sft")
    again.start()
    again.submit(folder, "hf")
    assert again.pending() == [] and len(repo["commits"]) == 1
    again.close()


def test_a_refused_token_gives_one_clear_line_without_the_token(hub, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("HF_TOKEN", "hf_wrong_token_value")
    run = tmp_path / "run"
    uploads = Uploads(run, hf_repo="org/model", backoff_s=0.01)
    with caplog.at_level(logging.INFO):
        uploads.start()
        uploads.submit(_export(run), "hf")
        assert uploads.wait(60, show=False) == [("hf", "safetensors/step_2")]
        uploads.close()
    assert uploads.failed == [
        f"upload to the Hub repo org/model ({hub.url}) failed: HTTP 401: check that HF_TOKEN is valid and may write "
        "to that repo"
    ]
    assert "hf_wrong_token_value" not in caplog.text and "hf_wrong_token_value" not in (run / RECORD).read_text()


def test_start_up_refuses_upload_hf_without_a_token_before_anything_is_written(hub, monkeypatch, tmp_path):
    from physreason.train.sft import run_sft

    monkeypatch.delenv("HF_TOKEN")
    config = load_config(None, [
        f"train.output_dir='{tmp_path / 'run'}'", "train.ckpt.upload_hf=true", "train.ckpt.hf_repo_name='org/m'",
    ])  # fmt: skip
    with pytest.raises(ConfigError, match="no Hub token was found: set HF_TOKEN"):
        check_upload_settings(config)
    with pytest.raises(ConfigError, match="no Hub token"):
        run_sft(config)  # refused in prepare_output, before the model is loaded
    assert not (tmp_path / "run").exists()
    with pytest.raises(ConfigError, match="upload_hf = true needs hf_repo_name"):
        load_config(None, ["train.ckpt.upload_hf=true"])
