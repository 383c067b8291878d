"""A local stand-in for the Hugging Face Hub: the part of its HTTP API that huggingface_hub's upload uses.

huggingface_hub's create_repo and upload_folder without hf_xet call whoami, repo create, preupload, the LFS batch
API with a basic PUT transfer, and commit; FakeHub answers those from memory. The Xet transfer that upload_folder
takes when hf_xet is installed needs a Xet server and is not covered.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import huggingface_hub.constants as hub_constants
import pytest

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


def serve_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[FakeHub]:
    """Run a FakeHub and point huggingface_hub at it (HF_ENDPOINT, HF_TOKEN) for one test."""
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
