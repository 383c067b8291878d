"""Moving a run's checkpoints and exports off the machine: S3 ([train.ckpt] upload_s3) and the Hugging Face Hub (upload_hf).

One background thread on the main process uploads; training never waits for it, except at the end of a run
(at most [train.ckpt] upload_wait_s). Failures are logged as one line each (bucket/key or repo, and what to do) and
never stop training; credentials are never printed.

Links: physreason never writes a symbolic link (or a FIFO, a device) into a checkpoint or an export, so a folder
holding one is not uploaded at all: one error line names the path, training goes on. Every file is opened without
following links (O_NOFOLLOW, folder by folder from the pinned folder down), so what is sent is a regular file inside
the folder, never a file a link points at (a Hub token, SSH keys).

Pinning: a folder queued for upload is first hard-linked file by file under <run>/.uploads/<folder> (no copy: the
same data on disk; a copy where the filesystem has no hard links). max_keep pruning then deletes the checkpoint's
own name at once, and the data stays until its upload has finished and the pin is removed.

Record: <run>/uploads.json (written atomically) lists the folders still queued and every S3 object and Hub commit
already made, so a restarted run (train.resume = true) picks up what is queued and never sends a finished file twice.
Granularity: a file is done or not; a file of at least `part_size` bytes goes as an S3 multipart upload whose upload
id is recorded, so after a restart only the parts the server does not list yet are sent.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import queue
import re
import shutil
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from physreason.errors import ConfigError
from physreason.files import replace_folder, write_atomic

log = logging.getLogger(__name__)

RECORD = "uploads.json"
PIN_DIR = ".uploads"
# The folders a run queues (train/loop.py): a checkpoint and its export. A record naming anything else ('.', a
# folder through a link) would have its pin deleted once "uploaded": every other pin, or a folder outside the run.
QUEUED_FOLDER = re.compile(r"(checkpoints|safetensors)/step_\d+")
PART_SIZE = 64 * 1024**2  # S3 needs parts of at least 5 MiB (all but the last) and at most 10,000 of them
_MIN_PART = 5 * 1024**2
_MAX_PARTS = 10_000
# S3 answers that retrying cannot fix: the settings or the credentials must change.
_PERMANENT_S3 = {
    "AccessDenied", "AllAccessDisabled", "ExpiredToken", "InvalidAccessKeyId", "InvalidBucketName", "InvalidToken",
    "NoSuchBucket", "SignatureDoesNotMatch", "TokenRefreshRequired", "AuthorizationHeaderMalformed",
}  # fmt: skip


class UploadFailed(Exception):
    """One upload gave up; the message names the destination and what to do (never a credential)."""


@dataclass(frozen=True)
class S3Target:
    """Where upload_s3 writes: s3://<bucket>/<prefix>/<path under the run folder>."""

    bucket: str
    prefix: str

    def key(self, relative: str) -> str:
        return f"{self.prefix}/{relative}" if self.prefix else relative

    def url(self, relative: str) -> str:
        return f"s3://{self.bucket}/{self.key(relative)}"


def s3_target(config: Any) -> S3Target | None:
    """The S3 destination of a run's config, or None when upload_s3 is off."""
    ckpt = config.train.ckpt
    if not ckpt.upload_s3:
        return None
    prefix = ckpt.s3_prefix if ckpt.s3_prefix is not None else Path(config.train.output_dir).resolve().name
    return S3Target(ckpt.s3_bucket, prefix.strip("/"))


def check_upload_settings(config: Any) -> None:
    """Raise ConfigError before training starts when an upload is asked for but cannot work here.

    upload_s3 needs boto3 (physreason[s3]) and credentials boto3 can find; upload_hf needs a Hub token.
    """
    ckpt = config.train.ckpt
    if ckpt.upload_s3:
        try:
            import boto3
        except ImportError as exc:
            raise ConfigError(
                f"train.ckpt.upload_s3 = '{ckpt.upload_s3}' needs boto3: pip install 'physreason[s3]'"
            ) from exc
        if boto3.session.Session().get_credentials() is None:
            raise ConfigError(
                f"train.ckpt.upload_s3 = '{ckpt.upload_s3}': no AWS credentials found. Set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY (AWS_ENDPOINT_URL for an S3-compatible store other than AWS), or a profile"
            )
        check_s3_bucket(ckpt.s3_bucket, f"train.ckpt.upload_s3 = '{ckpt.upload_s3}'")
    if ckpt.upload_hf:
        from huggingface_hub import get_token

        if not get_token():
            raise ConfigError(
                f"train.ckpt.upload_hf = true uploads the final export to {ckpt.hf_repo_name!r}, but no Hub token "
                "was found: set HF_TOKEN to a token with write access (or run `hf auth login`)"
            )


PROBE_TIMEOUT_S = 5.0


def check_s3_bucket(bucket: str, setting: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """One small ListObjectsV2 call, without retries and with a short timeout: ConfigError in seconds when the
    endpoint does not answer, the credentials are refused or the bucket is missing, instead of at the run's end.

    AccessDenied is let through: a key may be allowed to write and not to list, and the uploads then tell.
    """
    import boto3
    from botocore.config import Config
    from botocore.exceptions import ClientError

    config = Config(connect_timeout=timeout_s, read_timeout=timeout_s, retries={"max_attempts": 1, "mode": "standard"})
    client = boto3.session.Session().client("s3", config=config)
    try:
        client.list_objects_v2(Bucket=bucket, MaxKeys=1)
    except Exception as exc:  # botocore's errors, and the odd transport one beneath them
        code = str(exc.response.get("Error", {}).get("Code", "")) if isinstance(exc, ClientError) else ""
        if code in ("AccessDenied", "AllAccessDisabled"):
            return
        reason, _ = _s3_error_text(exc)
        raise ConfigError(
            f"{setting}: s3://{bucket} at {client.meta.endpoint_url} cannot be used (checked before training): {reason}"
        ) from None


def _s3_error_text(exc: Exception) -> tuple[str, bool]:
    """A one-line reason for a failed S3 call (with what to do) and whether retrying may help; never a credential.

    Only the error code and status are shown: S3's messages can quote the signed request.
    """
    from botocore.exceptions import BotoCoreError, ClientError, ConnectionError, HTTPClientError, NoCredentialsError

    if isinstance(exc, ClientError):
        code = str(exc.response.get("Error", {}).get("Code", "?"))
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        reason = f"{code} (HTTP {status})"
        if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken"):
            return f"{reason}: check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN)", False
        if code == "AccessDenied":
            return f"{reason}: these credentials may not write there; check the bucket policy and s3_prefix", False
        if code == "NoSuchBucket":
            return f"{reason}: create the bucket or fix train.ckpt.s3_bucket", False
        return reason, not (code in _PERMANENT_S3 or (400 <= status < 500 and status not in (408, 429)))
    if isinstance(exc, (ConnectionError, HTTPClientError)):
        return f"{type(exc).__name__}: the endpoint did not answer; check AWS_ENDPOINT_URL and the network", True
    if isinstance(exc, NoCredentialsError):
        return "no AWS credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY", False
    if isinstance(exc, BotoCoreError):
        return type(exc).__name__, False
    return f"{type(exc).__name__}: {exc}", False


def read_record(output_dir: Path) -> dict[str, Any]:
    """The run's upload record (`<output_dir>/uploads.json`), empty when there is none; ConfigError when corrupt."""
    path = output_dir / RECORD
    if not path.is_file():
        return {"pending": [], "s3": {}, "hf": {}}
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as exc:  # not JSON, not UTF-8, too deep
        raise ConfigError(
            f"{path} is not valid JSON ({exc}): it lists this run's uploads; delete it to upload everything again"
        ) from exc
    problem = _record_problem(record)
    if problem:
        raise ConfigError(
            f"{path} is not an upload record as a run writes it ({problem}): it lists this run's uploads; delete it "
            "to upload everything again"
        )
    for name, empty in (("pending", []), ("s3", {}), ("hf", {})):
        record.setdefault(name, empty)
    return record


def _record_problem(record: Any) -> str | None:
    """What makes a parsed uploads.json unlike the record a run writes, or None when it is alike."""
    if not isinstance(record, dict):
        return "not a JSON object"
    pending = record.get("pending", [])
    if not isinstance(pending, list):
        return "'pending' is not a list"
    for job in pending:
        if not (isinstance(job, list) and len(job) == 2 and job[0] in ("s3", "hf") and isinstance(job[1], str)):
            return f"'pending' holds {json.dumps(job)[:80]}, not a [kind, folder] pair of kind 's3' or 'hf'"
        if not QUEUED_FOLDER.fullmatch(job[1]):  # its pin is deleted once uploaded
            return f"'pending' names the folder {job[1]!r}, not a run's checkpoints/step_N or safetensors/step_N"
    for name in ("s3", "hf"):
        done = record.get(name, {})
        if not isinstance(done, dict) or not all(isinstance(entry, dict) for entry in done.values()):
            return f"{name!r} is not an object of objects"
    return None


def forget_folders(output_dir: Path, folders: set[str]) -> list[tuple[str, str]]:
    """Drop the run's queued uploads and Hub records of `folders` (names like "safetensors/step_4") and their pins:
    a resume from an earlier step abandoned them (train/checkpoint.py set_aside_later_steps). Left, a queued upload
    would send the abandoned weights under the step's name, and the Hub record would skip the new folder of that
    name as uploaded. S3 records are kept: they match a file by its size and modification time, which a new
    folder does not share. Returns the (kind, folder) jobs dropped. Call it before the run's Uploads start."""
    if not (output_dir / RECORD).is_file():
        return []
    record = read_record(output_dir)
    dropped = [tuple(job) for job in record["pending"] if job[1] in folders]
    hub = [name for name in record["hf"] if name in folders]
    if not dropped and not hub:
        return []
    record["pending"] = [job for job in record["pending"] if job[1] not in folders]
    record["hf"] = {name: entry for name, entry in record["hf"].items() if name not in folders}
    write_atomic(output_dir / RECORD, json.dumps(record, indent=1))
    for folder in {job[1] for job in dropped}:
        pin = output_dir / PIN_DIR / folder
        if QUEUED_FOLDER.fullmatch(folder) and not any(p.is_symlink() for p in (output_dir / PIN_DIR, pin.parent)):
            shutil.rmtree(pin, ignore_errors=True)  # hard links (or copies) of a folder that now lies aside
    return dropped  # type: ignore[return-value]


def pending_uploads(output_dir: Path) -> list[tuple[str, str]]:
    """(kind, folder) of every upload a run's record still lists as queued: 's3' or 'hf'."""
    return [tuple(job) for job in read_record(output_dir)["pending"]]  # type: ignore[misc]


class Uploads:
    """The upload queue of one run folder, worked by a background thread (start() once; finish()/close() at the end).

    submit() pins a folder and queues it; nothing it does waits for the network. `session` is the boto3 Session to
    build the S3 client from (None: a new one reading the environment).
    """

    def __init__(
        self,
        output_dir: str | Path,
        s3: S3Target | None = None,
        hf_repo: str | None = None,
        *,
        retries: int = 5,
        backoff_s: float = 2.0,
        part_size: int = PART_SIZE,
        concurrency: int = 4,
        session: Any = None,
    ) -> None:
        if part_size < _MIN_PART:
            raise ValueError(f"part_size {part_size} is below S3's minimum of {_MIN_PART} bytes")
        self.output = Path(output_dir)
        self.s3, self.hf_repo = s3, hf_repo
        self.retries, self.backoff_s = retries, backoff_s
        self.part_size, self.concurrency = part_size, concurrency
        self._session = session
        self._lock = threading.RLock()
        self._idle = threading.Condition(self._lock)
        self._queue: queue.Queue[tuple[str, str] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._active: set[tuple[str, str]] = set()  # queued or running in this process
        self.failed: list[str] = []  # one line per job that gave up in this process
        self.bytes_total = self.bytes_done = 0
        self._give_up_at: float | None = None  # set by wait(): no attempt starts, or retry waits, past it
        self._record = self._read_record()

    # ---- the record -------------------------------------------------------------------------------------------
    def _read_record(self) -> dict[str, Any]:
        return read_record(self.output)

    def _save_record(self) -> None:
        with self._lock:
            write_atomic(self.output / RECORD, json.dumps(self._record, indent=1))

    def _pin_path(self, folder: str) -> Path:
        """Where the pinned copy of the run's `folder` lies: <output>/.uploads/<folder>, refused (ConfigError) when a
        link on the way would put it elsewhere (it is deleted once uploaded)."""
        path = self.output / PIN_DIR
        for name in ("", *Path(folder).parts):
            path = path / name
            if path.is_symlink():
                raise ConfigError(
                    f"{path} is a link, where physreason keeps the pinned copies of queued uploads (deleted once "
                    "uploaded): delete the link, then run again"
                )
        return path

    def pending(self) -> list[tuple[str, str]]:
        """(kind, folder) of every job queued and not finished, this run's and an earlier process's: 's3' or 'hf'."""
        with self._lock:
            return [tuple(job) for job in self._record["pending"]]  # type: ignore[misc]

    # ---- queueing ---------------------------------------------------------------------------------------------
    def start(self, wait_s: float | None = None) -> None:
        """Start the worker thread and queue again what an earlier process of this run left pending.

        wait_s: [train.ckpt] upload_wait_s, said in one line: the most the end of the run will wait for uploads.
        """
        if wait_s is not None:
            log.info(
                "uploads run in the background; the end of the run waits for them at most %g s "
                "(train.ckpt.upload_wait_s), then names what is left queued for a resume (train.resume=true)",
                wait_s,
            )
        self._thread = threading.Thread(target=self._work, name="physreason-uploads", daemon=True)
        self._thread.start()
        for kind, folder in self.pending():
            if self._pin_path(folder).is_dir():
                self._enqueue(kind, folder)
            else:
                log.warning("upload of %s was queued by an earlier process but its pinned copy is gone: skipped", folder)
                self._drop_pending(kind, folder)

    def submit(self, folder: Path, kind: str) -> None:
        """Pin `folder` (under the run folder) and queue its upload to `kind` ('s3' or 'hf'); done ones are skipped.

        A folder that cannot be pinned (one holding a symbolic link, a link where the pin goes, a full disk) is not
        queued: one error line, kept in `failed` as the worker's failures are. Save paths call this, so that never
        raises; only a folder that is not the run's checkpoints/step_N or safetensors/step_N raises ValueError.
        """
        # by name, not resolved: checkpoints/ may be a link to a larger disk
        relative = Path(os.path.relpath(os.path.abspath(folder), os.path.abspath(self.output))).as_posix()
        if not QUEUED_FOLDER.fullmatch(relative):
            raise ValueError(f"{folder} is not a checkpoints/step_N or safetensors/step_N folder of {self.output}")
        with self._lock:
            pending = self._record["pending"]
            if [kind, relative] in pending:
                return
            if kind == "hf" and self._record["hf"].get(relative, {}).get("repo_id") == self.hf_repo:
                return
            # A pin another queued job reads from (an export bound for S3 and the Hub) is shared, not rebuilt.
            if not any(job[1] == relative for job in pending):
                try:
                    _pin(folder, self._pin_path(relative))
                except (UploadFailed, ConfigError, OSError) as exc:
                    # One folder not uploaded must not stop training (a save path calls this): said and recorded
                    # as the worker's failures are, and not queued: nothing of it was pinned.
                    line = f"upload of {relative} to {_destination(kind)} not queued: {exc}"
                    self.failed.append(line)
                    log.error("%s", line)
                    return
            pending.append([kind, relative])
            self._save_record()
        self._enqueue(kind, relative)

    def _enqueue(self, kind: str, folder: str) -> None:
        with self._lock:
            if (kind, folder) in self._active:
                return
            self._active.add((kind, folder))
            self.bytes_total += _folder_bytes(self._pin_path(folder))
        self._queue.put((kind, folder))

    def _drop_pending(self, kind: str, folder: str) -> None:
        with self._lock:
            self._record["pending"] = [job for job in self._record["pending"] if job != [kind, folder]]
            self._save_record()
            if not any(job[1] == folder for job in self._record["pending"]):
                shutil.rmtree(self._pin_path(folder), ignore_errors=True)

    def _add_done(self, count: int) -> None:
        with self._lock:
            self.bytes_done += count

    # ---- the worker -------------------------------------------------------------------------------------------
    def _work(self) -> None:
        while (job := self._queue.get()) is not None:
            kind, folder = job
            try:
                if kind == "s3":
                    self._upload_s3(folder)
                else:
                    self._upload_hf(folder)
                with self._lock:
                    # One step under the lock: a submit() of the same folder between the two would find it neither
                    # pending nor free to queue (still active) and stay listed as pending with no job behind it.
                    self._drop_pending(kind, folder)
                    self._active.discard(job)
                log.info("uploaded %s to %s", folder, self.s3.url(folder) if kind == "s3" else self.hf_repo)
            except (UploadFailed, ConfigError) as exc:
                with self._lock:
                    self.failed.append(str(exc))
                log.error("%s", exc)
            except Exception as exc:  # a bug or an unexpected library error must not end the thread silently
                with self._lock:
                    self.failed.append(f"upload of {folder} failed: {type(exc).__name__}: {exc}")
                log.exception("upload of %s failed", folder)
            finally:
                with self._lock:
                    self._active.discard(job)
                    self._idle.notify_all()

    def _retrying(self, action: Callable[[], Any], where: str, describe: Callable[[Exception], tuple[str, bool]]) -> Any:
        """Run `action`, retrying what may pass later with exponential backoff; raise UploadFailed naming `where`."""
        for attempt in range(self.retries + 1):
            self._stop_if_out_of_time(where, 0.0)
            try:
                return action()
            except Exception as exc:
                reason, transient = describe(exc)
                if not transient or attempt == self.retries:
                    tries = f" after {attempt + 1} tries" if transient else ""
                    raise UploadFailed(f"upload to {where} failed{tries}: {reason}") from exc
                delay = min(self.backoff_s * 2**attempt, 60.0)
                self._stop_if_out_of_time(where, delay, reason)
                log.warning("upload to %s: %s; retrying in %.1f s", where, reason, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")

    def _stop_if_out_of_time(self, where: str, delay: float, reason: str = "") -> None:
        """UploadFailed once the end-of-run wait (wait's timeout_s) is over, or would be before `delay` has passed.

        Without it, an endpoint that never answers holds each queued folder for all its retries (minutes each).
        """
        give_up_at = self._give_up_at
        if give_up_at is not None and time.monotonic() + delay >= give_up_at:
            said = f" ({reason})" if reason else ""
            raise UploadFailed(
                f"upload to {where} stopped{said}: the wait for uploads at the end of the run "
                "(train.ckpt.upload_wait_s) is over; it stays queued for a resume"
            )

    def _client(self) -> Any:
        import boto3
        from botocore.config import Config

        session = self._session or boto3.session.Session()
        # One attempt per call inside botocore: _retrying backs off over minutes, across an endpoint's restart.
        return session.client("s3", config=Config(retries={"max_attempts": 1, "mode": "standard"}))

    def _upload_s3(self, folder: str) -> None:
        assert self.s3 is not None
        client = self._client()
        pinned = self._pin_path(folder)
        for inside in self._files_to_send(folder, pinned, "S3"):
            with _open_regular(pinned, inside) as handle:
                self._upload_s3_file(client, folder, inside, handle)

    @staticmethod
    def _files_to_send(folder: str, pinned: Path, where: str) -> list[str]:
        """The regular files of the pin, relative to it; UploadFailed, before anything is sent, when it holds a link
        (put there after pinning, or in a pin an earlier process left queued)."""
        try:
            return _regular_files(pinned)[1]
        except UploadFailed as exc:
            raise UploadFailed(f"upload of {folder} to {where} refused: {exc}") from None

    def _upload_s3_file(self, client: Any, folder: str, inside: str, handle: Any) -> None:
        """Send one pinned file (`handle`, opened by _open_regular) as <folder>/<inside>, unless recorded as sent."""
        assert self.s3 is not None
        relative = f"{folder}/{inside}"
        info = os.fstat(handle.fileno())
        url = self.s3.url(relative)
        with self._lock:
            entry = self._record["s3"].get(url, {})
        if entry.get("size") != info.st_size or entry.get("mtime_ns") != info.st_mtime_ns:
            entry = {"size": info.st_size, "mtime_ns": info.st_mtime_ns, "done": False}
        if entry.get("done"):
            self._add_done(info.st_size)
            return
        if info.st_size >= self.part_size:
            self._multipart(client, handle.fileno(), relative, entry)
        else:
            def put() -> None:
                handle.seek(0)  # a retry sends the file from its start again
                client.put_object(Bucket=self.s3.bucket, Key=self.s3.key(relative), Body=handle)

            self._retrying(put, url, _s3_error_text)
            self._add_done(info.st_size)
        entry = {"size": info.st_size, "mtime_ns": info.st_mtime_ns, "done": True}
        with self._lock:
            self._record["s3"][url] = entry
            self._save_record()

    def _multipart(self, client: Any, source: int, relative: str, entry: dict[str, Any]) -> None:
        """Send the open file `source` (a descriptor) as an S3 multipart upload, continuing the recorded one: parts the
        server lists are not resent."""
        assert self.s3 is not None
        bucket, key, url = self.s3.bucket, self.s3.key(relative), self.s3.url(relative)
        size = entry["size"]
        part_size = max(self.part_size, -(-size // _MAX_PARTS))
        count = -(-size // part_size)
        upload_id, listed = entry.get("upload_id"), {}
        if upload_id is not None and entry.get("part_size") == part_size:
            listed = self._listed_parts(client, bucket, key, upload_id, url)
            if listed is None:
                upload_id, listed = None, {}
        if upload_id is None or entry.get("part_size") != part_size:
            created = self._retrying(
                lambda: client.create_multipart_upload(Bucket=bucket, Key=key), url, _s3_error_text
            )
            upload_id, listed = created["UploadId"], {}
            with self._lock:
                self._record["s3"][url] = {**entry, "upload_id": upload_id, "part_size": part_size}
                self._save_record()
        etags: dict[int, str] = {}
        for number, (etag, part_bytes) in listed.items():
            if part_bytes == min(part_size, size - (number - 1) * part_size):
                etags[number] = etag
                self._add_done(part_bytes)

        def send(number: int) -> None:
            data = _read_at(source, part_size, (number - 1) * part_size)
            answer = self._retrying(
                lambda: client.upload_part(Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=data),
                f"{url} (part {number} of {count})",
                _s3_error_text,
            )
            etags[number] = answer["ETag"]
            self._add_done(len(data))

        # The first failure ends the file; its sent parts stay listed for the next try.
        _in_parallel(send, [n for n in range(1, count + 1) if n not in etags], self.concurrency)
        parts = [{"PartNumber": n, "ETag": etags[n]} for n in sorted(etags)]
        self._retrying(
            lambda: client.complete_multipart_upload(
                Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
            ),
            url,
            _s3_error_text,
        )

    def _listed_parts(self, client: Any, bucket: str, key: str, upload_id: str, url: str) -> dict[int, tuple[str, int]] | None:
        """Parts of a recorded multipart upload the server holds (number -> (ETag, size)); None if it is gone."""
        from botocore.exceptions import ClientError

        parts: dict[int, tuple[str, int]] = {}
        marker = 0
        while True:
            try:
                page = self._retrying(
                    lambda marker=marker: client.list_parts(
                        Bucket=bucket, Key=key, UploadId=upload_id, PartNumberMarker=marker
                    ),
                    url,
                    _s3_error_text,
                )
            except UploadFailed as exc:
                cause = exc.__cause__
                if isinstance(cause, ClientError) and cause.response.get("Error", {}).get("Code") == "NoSuchUpload":
                    return None
                raise
            for part in page.get("Parts", []):
                parts[int(part["PartNumber"])] = (part["ETag"], int(part["Size"]))
            if not page.get("IsTruncated"):
                return parts
            marker = int(page["NextPartNumberMarker"])

    def _upload_hf(self, folder: str) -> None:
        from huggingface_hub import CommitOperationAdd, HfApi

        assert self.hf_repo is not None
        pinned = self._pin_path(folder)
        # Read at upload time, not at import: HF_ENDPOINT points at another Hub (a mirror, a test server).
        api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None)
        repo_id = self.hf_repo if "/" in self.hf_repo else None
        if repo_id is None:
            user = self._retrying(lambda: api.whoami()["name"], self.hf_repo, _hf_error_text)
            repo_id = f"{user}/{self.hf_repo}"
        where = f"the Hub repo {repo_id} ({api.endpoint})"
        files = _hub_files(self._files_to_send(folder, pinned, "the Hub"))
        self._retrying(lambda: api.create_repo(repo_id, private=True, exist_ok=True), where, _hf_error_text)
        with contextlib.ExitStack() as stack:
            handles = {inside: stack.enter_context(_open_regular(pinned, inside)) for inside in files}

            def commit_files() -> Any:
                # upload_folder's commit, of the files opened above: huggingface_hub (and hf_xet) read each through
                # /proc/self/fd, the very file opened, so a link put there since cannot make it read another
                return api.create_commit(
                    repo_id=repo_id,
                    operations=[CommitOperationAdd(inside, _reopenable(handle)) for inside, handle in handles.items()],
                    commit_message=f"physreason: upload {folder}",
                )

            commit = self._retrying(commit_files, where, _hf_error_text)
            self._add_done(sum(os.fstat(handle.fileno()).st_size for handle in handles.values()))
        with self._lock:
            self._record["hf"][folder] = {"repo_id": self.hf_repo, "resolved": repo_id, "commit": commit.oid}
            self._save_record()

    # ---- the end ----------------------------------------------------------------------------------------------
    def wait(self, timeout_s: float, show: bool = True) -> list[tuple[str, str]]:
        """Wait up to `timeout_s` for the queue to empty (a progress line when `show`); returns the jobs left."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            self._give_up_at = deadline  # the worker stops too: nothing holds a folder past the end of the wait
        progress = None
        try:
            with self._lock:
                busy = bool(self._active)
            if show and busy:
                from physreason.progress import LoggedProgress

                progress = LoggedProgress(transient=False)
                progress.start()
                task = progress.add_task("uploads", total=max(self.bytes_total, 1))
            while True:
                with self._lock:
                    if not self._active or time.monotonic() >= deadline:
                        break
                    self._idle.wait(timeout=min(1.0, max(deadline - time.monotonic(), 0.0)))
                    done, total = self.bytes_done, max(self.bytes_total, 1)
                if progress is not None:
                    progress.update(task, completed=done, total=total, postfix=f"{done / 1e9:.2f} of {total / 1e9:.2f} GB")
        except KeyboardInterrupt:
            log.warning("stopped waiting for uploads (Ctrl-C)")
        finally:
            if progress is not None:
                progress.stop()
        return self.pending()

    def close(self) -> None:
        """Stop the worker without waiting for the network (a daemon thread: the process may end with jobs left)."""
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)


def _in_parallel(action: Callable[[int], None], items: list[int], workers: int) -> None:
    """Run `action` on every item on up to `workers` threads; raise the first error (no new item starts after it).

    Daemon threads, unlike ThreadPoolExecutor's, which the interpreter joins at exit: a part hanging on an endpoint
    that never answers must not keep the process alive after the end-of-run wait (upload_wait_s) is over.
    """
    todo: queue.SimpleQueue[int] = queue.SimpleQueue()
    for item in items:
        todo.put(item)
    errors: list[BaseException] = []

    def work() -> None:
        while not errors:
            try:
                item = todo.get_nowait()
            except queue.Empty:
                return
            try:
                action(item)
            except BaseException as exc:  # handed to the caller's thread below
                errors.append(exc)

    threads = [threading.Thread(target=work, name="physreason-upload-part", daemon=True) for _ in range(min(workers, len(items)))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def _hf_error_text(exc: Exception) -> tuple[str, bool]:
    """A one-line reason for a failed Hub call and whether retrying may help; the token is never part of it."""
    from huggingface_hub.errors import HfHubHTTPError

    if isinstance(exc, HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else 0
        if status in (401, 403):
            return f"HTTP {status}: check that HF_TOKEN is valid and may write to that repo", False
        return f"HTTP {status}", status >= 500 or status in (408, 429)
    if type(exc).__module__.startswith(("httpx", "requests")) or isinstance(exc, OSError):
        return f"{type(exc).__name__}: the Hub did not answer; check HF_ENDPOINT and the network", True
    return f"{type(exc).__name__}: {exc}", False


def _destination(kind: str) -> str:
    return "S3" if kind == "s3" else "the Hub"


_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
# A hard link impossible here, not a name already taken: another filesystem (checkpoints/ linked to another disk),
# one without hard links, a file's link limit, a file the kernel's protected_hardlinks keeps from being linked.
_NO_HARD_LINK = {errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS}


def _link_refused(path: Path) -> UploadFailed:
    return UploadFailed(
        f"{path} is a symbolic link, which physreason never writes into a checkpoint or export: the folder is not "
        "uploaded (nothing of it is sent). Look at who put it there; delete it, then save or resume again"
    )


def _regular_files(folder: Path) -> tuple[list[str], list[str]]:
    """(folders, files) under `folder`, as sorted POSIX paths relative to it, walked without following any link.

    UploadFailed naming the first symbolic link (or FIFO, socket, device) met, `folder` itself included: physreason
    writes none of them into a checkpoint or export, and a link would send what it points at.
    """
    if folder.is_symlink():
        raise _link_refused(folder)
    folders: list[str] = []
    files: list[str] = []

    def walk(path: Path, prefix: str) -> None:
        with os.scandir(path) as entries:
            for entry in sorted(entries, key=lambda e: e.name):
                inside = prefix + entry.name
                if entry.is_symlink():
                    raise _link_refused(Path(entry.path))
                if entry.is_dir(follow_symlinks=False):
                    folders.append(inside)
                    walk(Path(entry.path), inside + "/")
                elif entry.is_file(follow_symlinks=False):
                    files.append(inside)
                else:
                    raise UploadFailed(
                        f"{entry.path} is not a regular file (a FIFO, socket or device), which physreason never "
                        "writes into a checkpoint or export: the folder is not uploaded. Delete it, then save or "
                        "resume again"
                    )

    walk(folder, "")
    return folders, files


def _open_folder(root: Path | int, parts: list[str]) -> int:
    """A descriptor of the folder `parts` under `root` (a path or an open folder's descriptor, left open), each step
    opened without following a link (OSError ELOOP at a link, ENOTDIR at a file)."""
    descriptor = os.open(root, _DIRECTORY) if isinstance(root, Path) else os.dup(root)
    try:
        for part in parts:
            inner = os.open(part, _DIRECTORY, dir_fd=descriptor)
            os.close(descriptor)
            descriptor = inner
    except BaseException:
        os.close(descriptor)
        raise
    return descriptor


def _open_regular(root: Path, inside: str) -> Any:
    """The regular file `inside` (a POSIX path relative to `root`) opened for reading (a binary file object), every
    step opened without following a link; UploadFailed naming it when a link or anything but a regular file is there.
    """
    *parents, name = inside.split("/")
    try:
        folder = _open_folder(root, parents)
        try:  # O_NONBLOCK: a FIFO put there must not block the open; no effect on a regular file
            descriptor = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=folder)
        finally:
            os.close(folder)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):  # EMLINK: FreeBSD's O_NOFOLLOW at a link
            raise _link_refused(root / inside) from None
        raise
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        raise UploadFailed(f"{root / inside} is not a regular file: the folder is not uploaded")
    os.set_blocking(descriptor, True)
    return os.fdopen(descriptor, "rb")


def _reopenable(handle: Any) -> Any:
    """What huggingface_hub is given to read an opened file: /proc/self/fd/<n> on Linux (a path it may reopen as often
    as it needs, hf_xet included, that is always this very file), else the file object (read over HTTP, not Xet)."""
    path = f"/proc/self/fd/{handle.fileno()}"
    if os.path.exists(path):
        return path
    handle.seek(0)
    return handle


def _hub_files(files: list[str]) -> list[str]:
    """`files` less those upload_folder leaves out by default (.git/, .cache/huggingface/)."""
    from huggingface_hub.utils import filter_repo_objects

    try:
        from huggingface_hub.hf_api import DEFAULT_IGNORE_PATTERNS
    except ImportError:  # not where it was
        DEFAULT_IGNORE_PATTERNS = [".git", ".git/*", "*/.git", "**/.git/**", ".cache/huggingface",
                                   ".cache/huggingface/*", "*/.cache/huggingface", "**/.cache/huggingface/**"]  # fmt: skip
    return list(filter_repo_objects(files, ignore_patterns=DEFAULT_IGNORE_PATTERNS))


def _read_at(descriptor: int, size: int, offset: int) -> bytes:
    """Up to `size` bytes of the open file at `offset` (os.pread: threads share the descriptor, not a position)."""
    chunks: list[bytes] = []
    while size > 0:
        chunk = os.pread(descriptor, min(size, 1 << 30), offset)
        if not chunk:
            break
        chunks.append(chunk)
        size -= len(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def _clear_staging(staging: Path) -> None:
    """Remove what lies at a pin's staging name: a link (or file) is unlinked, never followed; a folder deleted."""
    try:
        info = staging.lstat()
    except FileNotFoundError:
        return
    if stat.S_ISDIR(info.st_mode):
        shutil.rmtree(staging)  # a real folder; rmtree never follows the links inside it
        return
    if stat.S_ISLNK(info.st_mode):
        log.warning("%s is a link, where physreason builds a pinned copy: removed (never written through)", staging)
    staging.unlink()


def _pin(folder: Path, pinned: Path) -> None:
    """Hard-link every file of `folder` under `pinned` (copy where links are not possible); replaces an older pin.

    UploadFailed, and nothing pinned, when `folder` holds a symbolic link (or anything but folders and regular
    files). The staging folder is one this call creates; every file is opened and made without following a link.
    """
    staging = pinned.with_name(pinned.name + ".tmp")
    _clear_staging(staging)
    folders, files = _regular_files(folder)
    staging.parent.mkdir(parents=True, exist_ok=True)  # <run>/.uploads/<kind>: Uploads._pin_path refuses a link
    os.mkdir(staging)  # FileExistsError if anything appeared there since: never one this call did not create
    try:
        made = os.open(staging, _DIRECTORY)
        try:
            for inside in folders:
                *parents, name = inside.split("/")
                parent = _open_folder(made, parents)
                try:
                    os.mkdir(name, dir_fd=parent)
                finally:
                    os.close(parent)
            for inside in files:
                _pin_file(folder, inside, made)
        finally:
            os.close(made)
        replace_folder(staging, pinned)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _pin_file(folder: Path, inside: str, made: int) -> None:
    """Hard-link the regular file `folder`/`inside` to the same place under the open staging folder `made`; a copy
    (contents, mode and times, as shutil.copy2) only where the filesystem cannot hard-link it."""
    *parents, name = inside.split("/")
    with _open_regular(folder, inside) as source:
        info = os.fstat(source.fileno())
        parent = _open_folder(made, parents)
        try:
            try:
                os.link(folder / inside, name, dst_dir_fd=parent, follow_symlinks=False)
            except OSError as exc:
                if exc.errno not in _NO_HARD_LINK:
                    raise  # EEXIST and the like: never written over
            else:
                linked = os.stat(name, dir_fd=parent, follow_symlinks=False)
                if (linked.st_dev, linked.st_ino) == (info.st_dev, info.st_ino):
                    return
                os.unlink(name, dir_fd=parent)  # the name was swapped for another file (or a link) meanwhile
                raise _link_refused(folder / inside)
            target = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=parent)
            with os.fdopen(target, "wb") as copy:
                shutil.copyfileobj(source, copy, 1 << 20)
                os.fchmod(copy.fileno(), stat.S_IMODE(info.st_mode))
                copy.flush()
                os.utime(copy.fileno(), ns=(info.st_atime_ns, info.st_mtime_ns))
        finally:
            os.close(parent)


def _folder_bytes(folder: Path) -> int:
    """The bytes of the regular files under `folder`, for the progress line; a link is neither followed nor counted."""
    total = 0
    for root, _, names in os.walk(folder):  # never into a linked folder
        for name in names:
            info = os.lstat(os.path.join(root, name))
            if stat.S_ISREG(info.st_mode):
                total += info.st_size
    return total
