"""Symbolic links and uploads: nothing outside a checkpoint is ever written to or sent.

physreason never writes a link into a checkpoint or an export, nor at the pin's staging name (<pin>.tmp). A link put
in any of those places is never followed: the staging name's link is removed, and a folder holding a link is not
uploaded (one error line naming the link, recorded in Uploads.failed), without stopping training: submit() is called
from the save paths and must not raise. No network here: a fake boto3 session records what S3 would receive, and
hub_server's FakeHub stands in for the Hub.
"""

from __future__ import annotations

import errno
import json
import logging
import os
from pathlib import Path

import pytest
from hub_server import serve_hub

from physreason.train.upload import PIN_DIR, RECORD, S3Target, UploadFailed, Uploads

TOKEN_TEXT = b"hf_SECRET_TOKEN_of_the_user\n"


class _Client:
    def __init__(self, sent: dict[str, bytes]) -> None:
        self.sent = sent

    def put_object(self, Bucket, Key, Body):  # noqa: N803 (boto3's names)
        self.sent[Key] = Body.read()

    def create_multipart_upload(self, **_):
        return {"UploadId": "u1"}

    def upload_part(self, **kw):
        self.sent[kw["Key"]] = self.sent.get(kw["Key"], b"") + kw["Body"]
        return {"ETag": "e"}

    def complete_multipart_upload(self, **_):
        pass


class _Session:
    """A boto3 Session whose S3 client keeps what it is sent: sent[key] = bytes."""

    def __init__(self) -> None:
        self.sent: dict[str, bytes] = {}

    def client(self, *_, **__):
        return _Client(self.sent)


@pytest.fixture
def hub(monkeypatch, tmp_path):
    yield from serve_hub(monkeypatch, tmp_path)


@pytest.fixture
def secrets(tmp_path) -> Path:
    """A stand-in for ~/.cache/huggingface/token, outside every run folder."""
    token = tmp_path / "home" / ".cache" / "huggingface" / "token"
    token.parent.mkdir(parents=True)
    token.write_bytes(TOKEN_TEXT)
    return token


def _step(run: Path, name: str = "checkpoints/step_1") -> Path:
    folder = run / name
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"WEIGHTS")
    (folder / "config.json").write_text('{"checkpoint": "config from step_1"}\n')
    return folder


def _finish(uploads: Uploads) -> list[tuple[str, str]]:
    left = uploads.wait(30, show=False)
    uploads.close()
    return left


@pytest.mark.timeout(60)
def test_a_link_at_the_staging_name_is_removed_never_written_through(tmp_path, caplog):
    run = tmp_path / "run"
    step = _step(run)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "config.json").write_text("the user's own config.json\n")
    (run / PIN_DIR / "checkpoints").mkdir(parents=True)
    staging = run / PIN_DIR / "checkpoints" / "step_1.tmp"
    staging.symlink_to(outside, target_is_directory=True)

    session = _Session()
    uploads = Uploads(run, S3Target("bucket", "p"), session=session)
    with caplog.at_level(logging.WARNING):
        uploads.start()
        uploads.submit(step, "s3")  # raised ConfigError before (after writing through the link), ending training
        assert _finish(uploads) == []
    assert sorted(p.name for p in outside.iterdir()) == ["config.json"]  # nothing linked or copied in
    assert (outside / "config.json").read_text() == "the user's own config.json\n"
    assert f"{staging} is a link, where physreason builds a pinned copy: removed" in caplog.text
    assert not staging.exists() and not staging.is_symlink()
    assert not (run / PIN_DIR / "checkpoints" / "step_1").is_symlink()
    assert session.sent == {"p/checkpoints/step_1/config.json": b'{"checkpoint": "config from step_1"}\n',
                            "p/checkpoints/step_1/model.safetensors": b"WEIGHTS"}  # fmt: skip
    assert uploads.failed == []


@pytest.mark.timeout(60)
def test_a_name_taken_in_the_staging_folder_is_not_copied_over(tmp_path, monkeypatch):
    """os.link failing with EEXIST (a link raced in at the name) is a failed pin, not a reason to copy over it."""
    run = tmp_path / "run"
    step = _step(run)
    victim = tmp_path / "victim"
    victim.write_text("victim\n")
    real_link = os.link

    def link_raced(src, dst, *, src_dir_fd=None, dst_dir_fd=None, follow_symlinks=True):
        os.symlink(victim, dst, dir_fd=dst_dir_fd)
        raise FileExistsError(errno.EEXIST, "File exists", str(dst))

    monkeypatch.setattr(os, "link", link_raced)
    uploads = Uploads(run, S3Target("bucket", "p"), session=_Session())
    uploads.submit(step, "s3")  # not started: pin and record only
    monkeypatch.setattr(os, "link", real_link)
    assert victim.read_text() == "victim\n"
    assert len(uploads.failed) == 1 and "upload of checkpoints/step_1 to S3 not queued" in uploads.failed[0]
    assert uploads.pending() == []
    assert not (run / PIN_DIR / "checkpoints" / "step_1.tmp").exists()


@pytest.mark.timeout(60)
def test_a_filesystem_without_hard_links_gets_a_copy_with_its_times(tmp_path, monkeypatch):
    run = tmp_path / "run"
    step = _step(run)
    (step / "adapter").mkdir()
    (step / "adapter" / "adapter_model.safetensors").write_bytes(b"ADAPTER")

    def no_hard_links(src, dst, **_):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", no_hard_links)
    Uploads(run, S3Target("bucket", "p"), session=_Session()).submit(step, "s3")
    pin = run / PIN_DIR / "checkpoints" / "step_1"
    for path in (step / "model.safetensors", step / "adapter" / "adapter_model.safetensors"):
        copy = pin / path.relative_to(step)
        assert copy.read_bytes() == path.read_bytes() and not os.path.samefile(copy, path)
        assert copy.stat().st_mtime_ns == path.stat().st_mtime_ns  # the S3 record matches a file by size and time
        assert copy.stat().st_mode == path.stat().st_mode


@pytest.mark.timeout(60)
def test_a_pin_is_hard_links_of_every_file_in_every_folder(tmp_path):
    run = tmp_path / "run"
    step = _step(run, "safetensors/step_1")
    (step / "adapter" / "inner").mkdir(parents=True)
    (step / "adapter" / "adapter_model.safetensors").write_bytes(b"ADAPTER")
    session = _Session()
    uploads = Uploads(run, S3Target("bucket", "p"), session=session)
    uploads.start()
    uploads.submit(step, "s3")
    pin = run / PIN_DIR / "safetensors" / "step_1"
    assert (pin / "adapter" / "inner").is_dir()
    assert os.path.samefile(pin / "adapter" / "adapter_model.safetensors", step / "adapter" / "adapter_model.safetensors")
    assert _finish(uploads) == []
    assert session.sent["p/safetensors/step_1/adapter/adapter_model.safetensors"] == b"ADAPTER"
    assert len(session.sent) == 3 and uploads.failed == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("link", ["file", "folder"])
def test_a_checkpoint_holding_a_link_is_not_uploaded_and_training_goes_on(tmp_path, secrets, link, caplog):
    run = tmp_path / "run"
    step = _step(run)
    planted = step / ("tokenizer_config.json" if link == "file" else "extra")
    planted.symlink_to(secrets if link == "file" else secrets.parent, target_is_directory=link == "folder")
    session = _Session()
    uploads = Uploads(run, S3Target("bucket", "p"), session=session)
    with caplog.at_level(logging.ERROR):
        uploads.start()
        uploads.submit(step, "s3")  # returns: a save path calls it
        assert _finish(uploads) == []
    assert session.sent == {}  # not the token, and not the rest of the folder either
    assert uploads.failed == [
        f"upload of checkpoints/step_1 to S3 not queued: {planted} is a symbolic link, which physreason never writes "
        "into a checkpoint or export: the folder is not uploaded (nothing of it is sent). Look at who put it there; "
        "delete it, then save or resume again"
    ]
    assert uploads.failed[0] in caplog.text
    assert uploads.pending() == []  # not queued: nothing of it was pinned
    assert not (run / PIN_DIR / "checkpoints" / "step_1").exists()
    assert secrets.read_bytes() == TOKEN_TEXT


@pytest.mark.timeout(60)
def test_an_export_holding_a_link_is_not_sent_to_the_hub(hub, tmp_path, secrets):
    run = tmp_path / "run"
    export = _step(run, "safetensors/step_2")
    (export / "tokenizer.json").symlink_to(secrets)
    uploads = Uploads(run, hf_repo="org/model", backoff_s=0.01)
    uploads.start()
    uploads.submit(export, "hf")
    assert _finish(uploads) == []
    assert hub.repos.get("org/model", {}).get("files", {}) == {}
    assert len(uploads.failed) == 1 and f"{export / 'tokenizer.json'} is a symbolic link" in uploads.failed[0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["s3", "hf"])
def test_a_link_planted_in_a_queued_pin_is_not_followed_on_resume(hub, tmp_path, secrets, kind):
    run = tmp_path / "run"
    folder = "checkpoints/step_7" if kind == "s3" else "safetensors/step_7"
    pin = run / PIN_DIR / folder
    pin.mkdir(parents=True)
    (pin / "config.json").write_text("{}")
    (pin / "model.safetensors").symlink_to(secrets)
    (run / RECORD).write_text(json.dumps({"pending": [[kind, folder]], "s3": {}, "hf": {}}))
    session = _Session()
    uploads = Uploads(run, S3Target("bucket", "p") if kind == "s3" else None, "org/model" if kind == "hf" else None,
                      session=session, backoff_s=0.01)  # fmt: skip
    uploads.start()  # a resumed run (train.resume = true) queues what the record lists
    assert _finish(uploads) == [(kind, folder)]  # still queued: a resume sends it once the link is gone
    assert session.sent == {} and hub.repos.get("org/model", {}).get("files", {}) == {}
    where = "S3" if kind == "s3" else "the Hub"
    assert uploads.failed == [
        f"upload of {folder} to {where} refused: {pin / 'model.safetensors'} is a symbolic link, which physreason "
        "never writes into a checkpoint or export: the folder is not uploaded (nothing of it is sent). Look at who "
        "put it there; delete it, then save or resume again"
    ]
    assert secrets.read_bytes() == TOKEN_TEXT and (pin / "model.safetensors").is_symlink()

    (pin / "model.safetensors").unlink()  # the user deletes the link: the resume sends the rest
    (pin / "model.safetensors").write_bytes(b"WEIGHTS")
    again = Uploads(run, S3Target("bucket", "p") if kind == "s3" else None, "org/model" if kind == "hf" else None,
                    session=session, backoff_s=0.01)  # fmt: skip
    again.start()
    assert _finish(again) == [] and again.failed == []
    sent = session.sent if kind == "s3" else {f"{folder}/{k}": v for k, v in hub.repos["org/model"]["files"].items()}
    assert {key.removeprefix("p/"): value for key, value in sent.items()} == {
        f"{folder}/config.json": b"{}", f"{folder}/model.safetensors": b"WEIGHTS"
    }


def test_a_file_is_opened_without_following_a_link_on_its_way(tmp_path, secrets):
    """What a link swapped in after the folder was listed meets: the open refuses it, at the file or a folder above."""
    from physreason.train.upload import _open_regular

    root = tmp_path / "pin"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "real").write_bytes(b"real")
    (root / "token").symlink_to(secrets)
    (root / "linked").symlink_to(secrets.parent, target_is_directory=True)
    with _open_regular(root, "sub/real") as handle:
        assert handle.read() == b"real"
    for inside in ("token", "linked/token"):
        with pytest.raises(UploadFailed, match=f"^{root / inside} is a symbolic link"):
            _open_regular(root, inside)
    os.mkfifo(root / "fifo")
    with pytest.raises(UploadFailed, match="is not a regular file"):
        _open_regular(root, "fifo")  # and does not block waiting for a writer
