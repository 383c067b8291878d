"""The upload queue's worker and submit() racing on one folder: a folder queued again just as its upload finishes is
uploaded again, never left listed as pending with no job behind it (a resume that finds nothing to train submits its
final checkpoint while the queued upload of that same checkpoint ends)."""

from __future__ import annotations

import threading

import pytest

from physreason.train.upload import S3Target, Uploads


@pytest.mark.timeout(60)
def test_a_folder_submitted_as_its_upload_ends_is_uploaded_again_not_left_pending(tmp_path, monkeypatch):
    folder = tmp_path / "checkpoints" / "step_1"
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(b"shard")
    uploads = Uploads(tmp_path, S3Target("bucket", "run"))
    sent: list[str] = []
    monkeypatch.setattr(uploads, "_upload_s3", sent.append)
    drop = uploads._drop_pending
    racers: list[threading.Thread] = []

    def drop_then_submit(kind: str, relative: str) -> None:
        drop(kind, relative)
        if not racers:  # the first upload's end: the same folder is submitted from another thread right here
            racer = threading.Thread(target=uploads.submit, args=(folder, "s3"))
            racer.start()
            racers.append(racer)  # after start: the test's thread joins it as soon as it is listed
            racer.join(0.5)  # it may finish now (the window being probed) or wait for the worker's lock

    monkeypatch.setattr(uploads, "_drop_pending", drop_then_submit)
    uploads.start()
    uploads.submit(folder, "s3")
    for _ in range(600):  # until the first upload has ended and its racing submit has started
        if racers:
            break
        threading.Event().wait(0.05)
    racers[0].join(30)
    assert not racers[0].is_alive()
    assert uploads.wait(30, show=False) == []  # nothing listed as pending once the queue is idle
    assert sent == ["checkpoints/step_1", "checkpoints/step_1"]  # the second submit was worked, not swallowed
    uploads.close()
