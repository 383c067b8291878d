"""Checkpoint and export uploads to S3 ([train.ckpt] upload_s3) against moto's S3 server on 127.0.0.1.

The server runs in this process (moto's ThreadedMotoServer): stopping it refuses connections as a dead endpoint
does, and starting it again on the same port keeps the objects, as a real store's restart does.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
from collections import Counter
from pathlib import Path

import pytest

boto3 = pytest.importorskip("boto3")
pytest.importorskip("moto")
import requests
from hub_server import serve_hub

from physreason.config import load_config
from physreason.errors import ConfigError
from physreason.train.upload import PIN_DIR, RECORD, S3Target, Uploads, check_upload_settings

SECRET = "s3cr3t-never-printed"
PART = 5 * 1024**2  # S3's smallest multipart part


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Endpoint:
    """A TCP relay on 127.0.0.1:<port> in front of the S3 server, killable and restartable on the same port.

    kill() closes the listening socket and cuts every open connection, as a dead host does; moto's in-process
    store behind it keeps what it had, as a real store's restart does.
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._listener: socket.socket | None = None
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()

    def start(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(16)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def kill(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            cut, self._open = self._open, []
        for sock in [listener, *cut]:
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # killed
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            with self._lock:
                self._open += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(1 << 16):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                sink.shutdown(socket.SHUT_WR)


class S3Server:
    """moto's S3 server on 127.0.0.1, reached through an Endpoint (`url`) that tests kill and restart."""

    def __init__(self) -> None:
        # Imported here, not at collection: moto's server brings flask, whose context-bound module globals break
        # vLLM's kernel registration when the vLLM stage collects this file in the same process.
        from moto.server import ThreadedMotoServer

        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=_free_port(), verbose=False)
        self.server.start()
        self.direct = "http://{}:{}".format(*self.server.get_host_and_port())
        self.endpoint = Endpoint(self.server.get_host_and_port()[1])
        self.endpoint.start()
        self.url = self.endpoint.url

    def close(self) -> None:
        self.endpoint.kill()
        self.server.stop()

    def require_auth(self, on: bool) -> None:
        """Make the server check access keys (none exist, so every key is wrong) or accept any."""
        requests.post(f"{self.direct}/moto-api/reset-auth", data=b"0" if on else b"inf", timeout=10).raise_for_status()


@pytest.fixture(scope="module")
def s3_server():
    server = S3Server()
    yield server
    server.close()


@pytest.fixture
def hub(monkeypatch, tmp_path):
    yield from serve_hub(monkeypatch, tmp_path)


@pytest.fixture
def bucket(s3_server, monkeypatch, request) -> str:
    """A fresh bucket, and the AWS_* environment that points boto3 at the test server."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "physreason-test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.url)
    name = f"run-{request.node.name.replace('_', '-')[:40].lower().strip('-')}"
    boto3.client("s3").create_bucket(Bucket=name)
    return name


def _objects(bucket: str) -> dict[str, bytes]:
    client = boto3.client("s3")
    listed = client.list_objects_v2(Bucket=bucket).get("Contents", [])
    return {item["Key"]: client.get_object(Bucket=bucket, Key=item["Key"])["Body"].read() for item in listed}


def _counted_session() -> tuple[object, Counter]:
    """A boto3 session that counts its successful S3 calls: (operation, key) and (UploadPart, part number)."""
    session = boto3.session.Session()
    calls: Counter = Counter()

    def remember(params, context, **_):
        context["counted"] = params.get("PartNumber", params.get("Key"))

    def count(model, context, http_response=None, **_):
        if http_response is not None and http_response.status_code < 300:
            calls[(model.name, context.get("counted"))] += 1

    session.events.register("before-parameter-build.s3", remember)
    session.events.register("after-call.s3", count)
    return session, calls


def _write_step(run: Path, name: str = "checkpoints/step_2") -> Path:
    """A checkpoint-like folder: two small files and one of 11 MiB (three multipart parts of 5, 5 and 1 MiB)."""
    folder = run / name
    folder.mkdir(parents=True)
    (folder / ".metadata").write_bytes(b"metadata")
    (folder / "__0_0.distcp").write_bytes(os.urandom(11 * 1024**2))
    (folder / "trainer_rank0.pt").write_bytes(b"trainer state")
    return folder


def test_a_folder_is_uploaded_under_its_run_path_and_recorded(bucket, tmp_path):
    run = tmp_path / "run"
    folder = _write_step(run)
    uploads = Uploads(run, S3Target(bucket, "exp1"), part_size=PART, backoff_s=0.01)
    uploads.start()
    uploads.submit(folder, "s3")
    assert uploads.wait(60, show=False) == []
    uploads.close()

    stored = _objects(bucket)
    assert set(stored) == {f"exp1/checkpoints/step_2/{p.name}" for p in folder.iterdir()}
    for path in folder.iterdir():
        assert stored[f"exp1/checkpoints/step_2/{path.name}"] == path.read_bytes()
    record = json.loads((run / RECORD).read_text())
    assert record["pending"] == []
    assert all(entry["done"] for entry in record["s3"].values()) and len(record["s3"]) == 3
    assert not (run / PIN_DIR / "checkpoints" / "step_2").exists()  # the pin goes once the upload is done


def test_an_endpoint_that_dies_mid_upload_and_comes_back_gets_the_rest_without_resending(bucket, s3_server, tmp_path):
    run = tmp_path / "run"
    folder = _write_step(run)
    session, calls = _counted_session()
    killed, refused = threading.Event(), threading.Event()

    def kill_after_first_part(model, **_):
        if model.name == "UploadPart" and not killed.is_set():
            killed.set()
            s3_server.endpoint.kill()

    session.events.register("after-call.s3.UploadPart", kill_after_first_part)
    session.events.register("after-call-error.s3", lambda **_: refused.set())
    uploads = Uploads(run, S3Target(bucket, "exp"), part_size=PART, concurrency=1, retries=50, backoff_s=0.05,
                      session=session)  # fmt: skip
    uploads.start()
    uploads.submit(folder, "s3")
    try:
        assert refused.wait(60), "the uploader never met the stopped endpoint"
    finally:
        s3_server.endpoint.start()
    assert uploads.wait(60, show=False) == []
    uploads.close()

    key = "exp/checkpoints/step_2/__0_0.distcp"
    assert _objects(bucket)[key] == (folder / "__0_0.distcp").read_bytes()
    # the part sent before the endpoint died is not sent again; the file before it neither
    assert calls[("UploadPart", 1)] == 1 and calls[("UploadPart", 2)] == 1 and calls[("UploadPart", 3)] == 1
    assert calls[("PutObject", "exp/checkpoints/step_2/.metadata")] == 1
    assert calls[("CreateMultipartUpload", key)] == 1


def test_a_restarted_run_continues_the_recorded_multipart_upload_and_skips_finished_files(bucket, s3_server, tmp_path):
    run = tmp_path / "run"
    folder = _write_step(run)
    first, _ = _counted_session()

    def stop_after_first_part(model, **_):
        s3_server.endpoint.kill()

    first.events.register("after-call.s3.UploadPart", stop_after_first_part)
    earlier = Uploads(run, S3Target(bucket, "exp"), part_size=PART, concurrency=1, retries=0, session=first)
    earlier.start()
    earlier.submit(folder, "s3")
    left = earlier.wait(60, show=False)
    earlier.close()
    s3_server.endpoint.start()
    assert left == [("s3", "checkpoints/step_2")]
    assert any("exp/checkpoints/step_2/__0_0.distcp (part 2 of 3)" in line for line in earlier.failed)

    # The checkpoint's own folder is pruned meanwhile (max_keep): the pin still holds its files.
    for path in folder.iterdir():
        path.unlink()
    folder.rmdir()
    session, calls = _counted_session()
    later = Uploads(run, S3Target(bucket, "exp"), part_size=PART, backoff_s=0.01, session=session)
    later.start()  # picks up the queued folder from uploads.json
    assert later.wait(60, show=False) == []
    later.close()

    key = "exp/checkpoints/step_2/__0_0.distcp"
    assert set(calls) == {("ListParts", key), ("UploadPart", 2), ("UploadPart", 3), ("CompleteMultipartUpload", key),
                          ("PutObject", "exp/checkpoints/step_2/trainer_rank0.pt")}  # fmt: skip
    assert len(_objects(bucket)[key]) == 11 * 1024**2


def test_wrong_credentials_give_one_clear_line_without_the_secret(bucket, s3_server, tmp_path, caplog):
    run = tmp_path / "run"
    folder = _write_step(run)
    uploads = Uploads(run, S3Target(bucket, "exp"), part_size=PART, backoff_s=0.01)
    s3_server.require_auth(True)
    try:
        with caplog.at_level(logging.INFO):
            uploads.start()
            uploads.submit(folder, "s3")
            left = uploads.wait(60, show=False)
            uploads.close()
    finally:
        s3_server.require_auth(False)
    assert left == [("s3", "checkpoints/step_2")]  # queued still, for a resume with the right keys
    assert uploads.failed == [
        f"upload to s3://{bucket}/exp/checkpoints/step_2/.metadata failed: InvalidAccessKeyId (HTTP 403): "
        "check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN)"
    ]
    assert SECRET not in caplog.text and SECRET not in (run / RECORD).read_text()
    assert "retrying" not in caplog.text  # a refused key is not retried


def test_start_up_refuses_s3_uploads_without_credentials_or_bucket(tmp_path, monkeypatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    config = load_config(None, ["train.ckpt.upload_s3='all'", "train.ckpt.s3_bucket='b'"])
    with pytest.raises(ConfigError, match="no AWS credentials found. Set AWS_ACCESS_KEY_ID"):
        check_upload_settings(config)
    with pytest.raises(ConfigError, match="upload_s3 = 'all' needs s3_bucket"):
        load_config(None, ["train.ckpt.upload_s3='all'"])
    with pytest.raises(ConfigError, match="Input should be False, 'final' or 'all'.*got 'every'"):
        load_config(None, ["train.ckpt.upload_s3='every'", "train.ckpt.s3_bucket='b'"])


def test_start_up_checks_the_endpoint_credentials_and_bucket_in_one_call(bucket, s3_server, monkeypatch):
    setting = "train.ckpt.upload_s3='all'"
    config = load_config(None, [setting, f"train.ckpt.s3_bucket='{bucket}'"])
    check_upload_settings(config)  # reachable, keys accepted, bucket there
    with pytest.raises(ConfigError, match=r"s3://no-such-bucket at .* cannot be used \(checked before training\): NoSuchBucket"):
        check_upload_settings(load_config(None, [setting, "train.ckpt.s3_bucket='no-such-bucket'"]))
    s3_server.require_auth(True)
    try:
        with pytest.raises(ConfigError, match="InvalidAccessKeyId .*check AWS_ACCESS_KEY_ID") as refused:
            check_upload_settings(config)
    finally:
        s3_server.require_auth(False)
    assert SECRET not in str(refused.value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{_free_port()}")  # nothing listens there
    with pytest.raises(ConfigError, match=r"at http://127.0.0.1:\d+ cannot be used .*the endpoint did not answer"):
        check_upload_settings(config)


def test_an_sft_run_with_an_unreachable_endpoint_stops_before_training(tiny_model_dir, tmp_path, monkeypatch):
    from physreason.train.sft import run_sft

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "physreason-test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{_free_port()}")
    with pytest.raises(ConfigError, match="the endpoint did not answer"):
        run_sft(_sft_config(tiny_model_dir, tmp_path, "train.ckpt.s3_bucket='b'"))
    assert not (tmp_path / "run" / "checkpoints").exists()


def _keys_revoked_after_start(monkeypatch):
    # The start-up check would refuse the wrong keys; these tests are about keys that stop working mid-run.
    import physreason.train.upload as upload

    monkeypatch.setattr(upload, "check_s3_bucket", lambda *args, **kwargs: None)


def _sft_config(model: Path, tmp_path: Path, *extra: str):
    from setups import sft_overrides, write_chat_records

    data = write_chat_records(tmp_path, 4)
    return load_config(None, [
        *sft_overrides(model, data, tmp_path / "run", lr="1e-3", logger="['jsonl']"),
        "train.max_steps=2", "train.ckpt.save_freq=1", "train.ckpt.max_keep=1", "train.ckpt.export_safetensors=true",
        "train.ckpt.upload_s3='all'", "train.ckpt.s3_prefix='e2e'", *extra,
    ])  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("save_mode", ["sync", "async"])
def test_an_sft_run_uploads_every_checkpoint_and_export_even_those_max_keep_pruned(
    bucket, tiny_model_dir, tmp_path, save_mode
):
    """In async mode a checkpoint is queued once its background write is complete (never a half-written folder)."""
    from physreason.train.sft import run_sft

    config = _sft_config(tiny_model_dir, tmp_path, f"train.ckpt.s3_bucket='{bucket}'", f"train.ckpt.save_mode='{save_mode}'")
    run_sft(config)
    run = tmp_path / "run"
    stored = _objects(bucket)
    assert not (run / "checkpoints" / "step_1").exists()  # pruned locally (max_keep = 1) ...
    for step in ("step_1", "step_2"):  # ... and uploaded all the same
        assert f"e2e/checkpoints/{step}/.metadata" in stored
        assert f"e2e/safetensors/{step}/config.json" in stored
    for path in [*(run / "checkpoints" / "step_2").rglob("*"), *(run / "safetensors" / "step_2").rglob("*")]:
        if path.is_file():
            assert stored[f"e2e/{path.relative_to(run).as_posix()}"] == path.read_bytes()
    assert json.loads((run / RECORD).read_text())["pending"] == []
    assert not any(p.is_file() for p in (run / PIN_DIR).rglob("*"))


@pytest.mark.slow
def test_wrong_credentials_leave_training_running_and_a_resume_uploads_what_was_left(
    bucket, s3_server, tiny_model_dir, tmp_path, capsys, monkeypatch
):
    from physreason.train.sft import run_sft

    config = _sft_config(tiny_model_dir, tmp_path, f"train.ckpt.s3_bucket='{bucket}'")
    _keys_revoked_after_start(monkeypatch)
    s3_server.require_auth(True)
    try:
        result = run_sft(config)
    finally:
        s3_server.require_auth(False)
    assert len(result.losses) == 2 and result.last_checkpoint.name == "step_2"  # training went on to the end
    err = capsys.readouterr().err
    assert f"upload failed: upload to s3://{bucket}/e2e/checkpoints/step_1/.metadata failed: InvalidAccessKeyId" in err
    assert SECRET not in err
    run = tmp_path / "run"
    assert len(json.loads((run / RECORD).read_text())["pending"]) == 4  # two checkpoints, two exports
    assert _objects(bucket) == {}

    # The keys fixed, the finished run resumed: nothing left to train, the queued uploads go out.
    resumed = run_sft(_sft_config(tiny_model_dir, tmp_path, f"train.ckpt.s3_bucket='{bucket}'", "train.resume=true"))
    assert resumed.finished_before is not None
    stored = _objects(bucket)
    assert "e2e/checkpoints/step_1/.metadata" in stored and "e2e/safetensors/step_2/config.json" in stored
    assert json.loads((run / RECORD).read_text())["pending"] == []


@pytest.mark.slow
def test_final_uploads_send_only_the_last_checkpoint_and_export_to_s3_and_the_hub(bucket, hub, tiny_model_dir, tmp_path):
    from physreason.train.sft import run_sft

    run_sft(_sft_config(
        tiny_model_dir, tmp_path, f"train.ckpt.s3_bucket='{bucket}'", "train.ckpt.upload_s3='final'",
        "train.ckpt.max_keep=2", "train.ckpt.upload_hf=true", "train.ckpt.hf_repo_name='physical-ai/tiny-sft'",
    ))  # fmt: skip
    run = tmp_path / "run"
    assert {key.split("/")[1] + "/" + key.split("/")[2] for key in _objects(bucket)} == {
        "checkpoints/step_2", "safetensors/step_2"
    }
    repo = hub.repos["physical-ai/tiny-sft"]
    final = run / "safetensors" / "step_2"
    assert repo["files"] == {p.relative_to(final).as_posix(): p.read_bytes() for p in final.rglob("*") if p.is_file()}
    assert repo["commits"] == ["physreason: upload safetensors/step_2"]


@pytest.mark.slow
def test_the_sft_command_exits_1_naming_the_uploads_left_and_0_once_a_resume_sent_them(
    bucket, s3_server, tiny_model_dir, tmp_path
):
    import subprocess
    import sys

    from setups import sft_overrides, write_chat_records

    root = Path(__file__).resolve().parents[1]
    data = write_chat_records(tmp_path, 4)
    sets = [*sft_overrides(tiny_model_dir, data, tmp_path / "run", lr="1e-3", logger="['jsonl']"),
            "train.max_steps=1", "train.ckpt.upload_s3='final'", f"train.ckpt.s3_bucket='{bucket}'"]  # fmt: skip
    recipe = tmp_path / "recipe.toml"
    recipe.write_text("")  # every key from --set, as the in-process tests build theirs
    # Keys that stop working after the start-up check (which would refuse them): the check is switched off here.
    revoked = "import physreason.train.upload as u; u.check_s3_bucket = lambda *a, **k: None; from physreason.cli import main; main()"
    command = [sys.executable, "-c", revoked, "sft", "-c", str(recipe), *(a for key in sets for a in ("--set", key))]
    env = {**os.environ, "PYTHONPATH": str(root)}
    s3_server.require_auth(True)
    try:
        failed = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    finally:
        s3_server.require_auth(False)
    assert failed.returncode == 1, failed.stderr
    last = failed.stderr.strip().splitlines()[-1]
    assert last.startswith("error: training finished, but 2 upload(s) did not: checkpoints/step_1 (S3), "), last
    assert "--set train.resume=true" in last and "Traceback" not in failed.stderr and SECRET not in failed.stderr

    resumed = subprocess.run([*command, "--set", "train.resume=true"], capture_output=True, text=True, timeout=300,
                             env=env)
    assert resumed.returncode == 0, resumed.stderr
    assert "e2e" not in _objects(bucket) and "run/checkpoints/step_1/.metadata" in _objects(bucket)
