"""An S3 endpoint that never answers holds nothing past the end-of-run wait ([train.ckpt] upload_wait_s)."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import textwrap
import threading

import pytest

pytest.importorskip("boto3")

from physreason.train.upload import Uploads  # noqa: E402

_UPLOAD_TO_A_BLACK_HOLE = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from physreason.train.upload import S3Target, Uploads

    run = Path(sys.argv[1])
    folder = run / "checkpoints" / "step_2"
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(os.urandom(11 * 1024**2))  # a multipart upload: parts on 2 threads
    uploads = Uploads(run, S3Target("bucket", "exp"), part_size=5 * 1024**2, concurrency=2, retries=5, backoff_s=0.01)
    uploads.start()
    uploads.submit(folder, "s3")
    for _ in range(1200):  # until the endpoint has started the multipart upload: its parts are what hang
        if "u1" in (run / "uploads.json").read_text():
            break
        time.sleep(0.05)
    print("left", uploads.wait(1, show=False), flush=True)
    uploads.close()
    """
)

_STARTED = (
    b'<?xml version="1.0" encoding="UTF-8"?><InitiateMultipartUploadResult xmlns="http://s3.amazonaws.com/doc/'
    b'2006-03-01/"><Bucket>bucket</Bucket><Key>exp/checkpoints/step_2/__0_0.distcp</Key><UploadId>u1</UploadId>'
    b"</InitiateMultipartUploadResult>"
)


class _GoesDark:
    """An S3 endpoint that starts a multipart upload, then never answers again (a network partition mid-upload)."""

    def __init__(self) -> None:
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return
            self.held.append(connection)
            threading.Thread(target=self._serve, args=(connection,), daemon=True).start()

    @staticmethod
    def _serve(connection: socket.socket) -> None:
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = connection.recv(65536)
            if not chunk:
                return
            head += chunk
        if head.startswith(b"POST"):  # CreateMultipartUpload: the one call that is answered
            connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/xml\r\nConnection: close\r\n"
                               b"Content-Length: %d\r\n\r\n%s" % (len(_STARTED), _STARTED))  # fmt: skip
        # Anything else (the parts): held open, never read again, never answered.

    def close(self) -> None:
        self.listener.close()
        for connection in self.held:
            connection.close()


def test_an_endpoint_that_goes_dark_mid_upload_keeps_the_run_no_longer_than_upload_wait_s(tmp_path):
    endpoint = _GoesDark()
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": endpoint.url, "PYTHONPATH": os.getcwd()}  # fmt: skip
    try:
        # Before: the part threads were joined at exit, each waiting out 6 tries of botocore's 60 s timeout.
        done = subprocess.run([sys.executable, "-c", _UPLOAD_TO_A_BLACK_HOLE, str(tmp_path / "run")],
                              capture_output=True, text=True, timeout=100, env=env)  # fmt: skip
    finally:
        endpoint.close()
    assert done.returncode == 0, done.stderr
    assert "left [('s3', 'checkpoints/step_2')]" in done.stdout
    record = json.loads((tmp_path / "run" / "uploads.json").read_text())
    assert record["pending"] == [["s3", "checkpoints/step_2"]]  # still queued for a resume, its upload id kept
    assert any(entry.get("upload_id") == "u1" for entry in record["s3"].values())


def test_the_wait_past_which_nothing_is_retried_is_said_at_start(tmp_path, caplog):
    uploads = Uploads(tmp_path, None, "org/model")
    with caplog.at_level(logging.INFO, logger="physreason.train.upload"):
        uploads.start(wait_s=90)
    uploads.close()
    assert "waits for them at most 90 s (train.ckpt.upload_wait_s)" in caplog.text


def test_no_retry_starts_once_the_end_of_run_wait_is_over(tmp_path):
    from physreason.train.upload import UploadFailed

    uploads = Uploads(tmp_path, None, "org/model", retries=5, backoff_s=0.01)
    tries = []

    def refused() -> None:
        tries.append(1)
        raise ConnectionError("no answer")

    uploads.wait(0, show=False)  # the end of the run's wait is over
    with pytest.raises(UploadFailed, match="upload to somewhere stopped.*upload_wait_s.*queued for a resume"):
        uploads._retrying(refused, "somewhere", lambda exc: (str(exc), True))
    assert tries == []
