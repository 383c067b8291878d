"""The final export's upload to the Hugging Face Hub ([train.ckpt] upload_hf) through huggingface_hub, against a local Hub.

The Hub cannot be reached from here: FakeHub speaks the part of the Hub's HTTP API that huggingface_hub's
create_repo and upload_folder use without hf_xet (whoami, repo create, preupload, LFS batch + basic PUT, commit),
and HF_ENDPOINT points at it. The Xet transfer that upload_folder takes when hf_xet is installed is not covered.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

pytest.importorskip("huggingface_hub")
import huggingface_hub.constants as hub_constants

from physreason.config import load_config
from physreason.errors import ConfigError
from physreason.train.upload import RECORD, Uploads, check_upload_settings

TOKEN = "hf_physreason_test_token"


class FakeHub(ThreadingHTTPServer):
    """An in-memory Hub: repos[repo_id] = {"private": bool, "files": {path: bytes}, "commits": [summary, ...]}."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _HubHandler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self.repos: dict[str, dict] = {}
        self.lfs: dict[str, bytes] = {}
        self.paths: list[str] = []


class _HubHandler(BaseHTTPRequestHandler):
    server: FakeHub

    def log_message(self, *args) -> None:  # quiet: the test asserts on what arrived
        pass

    def _reply(self, status: int, body: object = None) -> None:
        data = json.dumps(body if body is not None else {}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length", 0)))

    def _authorized(self) -> bool:
        if self.headers.get("Authorization") == f"Bearer {TOKEN}":
            return True
        self._body()
        self._reply(401, {"error": "Invalid credentials in Authorization header"})
        return False

    def do_GET(self) -> None:
        self.server.paths.append(f"GET {self.path}")
        if not self._authorized():
            return
        if self.path == "/api/whoami-v2":
            return self._reply(200, {"name": "tester", "type": "user", "orgs": []})
        self._reply(404, {"error": "not found"})

    def do_PUT(self) -> None:
        self.server.paths.append(f"PUT {self.path}")
        if self.path.startswith("/lfs-upload/"):  # the basic LFS transfer: the whole object in one PUT
            self.server.lfs[self.path.rsplit("/", 1)[1]] = self._body()
            return self._reply(200)
        self._reply(404, {"error": "not found"})

    def do_POST(self) -> None:
        path = self.path.split("?")[0]
        self.server.paths.append(f"POST {path}")
        if not self._authorized():
            return
        body = self._body()
        repos = self.server.repos
        if path == "/api/repos/create":
            request = json.loads(body)
            repo_id = f"{request['organization'] or 'tester'}/{request['name']}"
            if repo_id in repos:
                return self._reply(409, {"error": "You already created this model repo"})
            repos[repo_id] = {"private": request.get("visibility") == "private", "files": {}, "commits": []}
            return self._reply(200, {"url": f"{self.server.url}/{repo_id}", "name": repo_id})
        if path.endswith(".git/info/lfs/objects/batch"):
            objects = json.loads(body)["objects"]
            return self._reply(200, {"transfer": "basic", "objects": [
                {"oid": o["oid"], "size": o["size"], "actions": {"upload": {"href": f"{self.server.url}/lfs-upload/{o['oid']}"}}}
                for o in objects
            ]})  # fmt: skip
        parts = path.split("/")  # /api/models/<ns>/<name>/{preupload,commit}/<revision>
        repo_id = "/".join(parts[3:5])
        if len(parts) != 7 or repo_id not in repos:
            return self._reply(404, {"error": f"Repository {repo_id} not found"})
        if parts[5] == "preupload":
            files = json.loads(body)["files"]
            return self._reply(200, {"files": [
                {"path": f["path"], "uploadMode": "lfs" if f["path"].endswith(".safetensors") else "regular",
                 "shouldIgnore": False}
                for f in files
            ]})  # fmt: skip
        if parts[5] == "commit":
            repo = repos[repo_id]
            for line in body.decode().splitlines():
                item = json.loads(line)
                value = item["value"]
                if item["key"] == "header":
                    repo["commits"].append(value["summary"])
                elif item["key"] == "file":
                    repo["files"][value["path"]] = base64.b64decode(value["content"])
                elif item["key"] == "lfsFile":
                    data = self.server.lfs[value["oid"]]
                    assert hashlib.sha256(data).hexdigest() == value["oid"]
                    repo["files"][value["path"]] = data
            oid = hashlib.sha1(body).hexdigest()
            return self._reply(200, {"commitUrl": f"{self.server.url}/{repo_id}/commit/{oid}", "commitOid": oid})
        self._reply(404, {"error": "not found"})


@pytest.fixture
def hub(monkeypatch, tmp_path):
    server = FakeHub()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    # conftest keeps the Hub offline for every other test; the Xet transfer needs a Xet server this test lacks.
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub_constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(hub_constants, "HF_TOKEN_PATH", str(tmp_path / "no-token-file"))
    yield server
    server.shutdown()
    server.server_close()


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


@pytest.mark.slow
def test_an_sft_run_uploads_only_its_final_export_to_the_hub(hub, tiny_model_dir, tmp_path):
    from setups import sft_overrides, write_chat_records

    from physreason.train.sft import run_sft

    data = write_chat_records(tmp_path, 4)
    run = tmp_path / "run"
    run_sft(load_config(None, [
        *sft_overrides(tiny_model_dir, data, run, lr="1e-3", logger="['jsonl']"),
        "train.max_steps=2", "train.ckpt.save_freq=1", "train.ckpt.max_keep=2", "train.ckpt.export_safetensors=true",
        "train.ckpt.upload_hf=true", "train.ckpt.hf_repo_name='physical-ai/tiny-sft'",
    ]))  # fmt: skip
    repo = hub.repos["physical-ai/tiny-sft"]
    final = run / "safetensors" / "step_2"
    assert repo["files"] == {p.relative_to(final).as_posix(): p.read_bytes() for p in final.rglob("*") if p.is_file()}
    assert repo["commits"] == ["physreason: upload safetensors/step_2"]  # step_1's export is not sent
