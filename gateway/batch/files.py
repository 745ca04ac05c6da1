"""Where the Batch API's file bodies live: a directory (local disk for `kvfleet up`; a PersistentVolume shared by the
gateway replicas on Kubernetes), or an S3-compatible object store named by URL (`s3://bucket/prefix`). A file is
never seen half written: in a directory it is written to a temporary name and renamed into place; an object store's
PUT (multipart for a large one) makes the object appear whole. Ids are checked before they touch a path or a key.
Every failure of the store is an OSError (FileNotFoundError: no such file), so callers treat both stores alike.
"""

from __future__ import annotations

import datetime
import os
import re
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import BinaryIO, Protocol

FILE_ID = re.compile(r"^file-[0-9a-f]{24}$")
BATCH_ID = re.compile(r"^batch_[0-9a-f]{24}$")


def new_file_id() -> str:
    return "file-" + secrets.token_hex(12)


def new_batch_id() -> str:
    return "batch_" + secrets.token_hex(12)


def check_id(file_id: str) -> str:
    if not FILE_ID.match(file_id):
        raise ValueError(f"not a file id: {file_id[:80]!r}")
    return file_id


class FileStore(Protocol):
    def put_from(self, file_id: str, source: BinaryIO) -> int:
        """Copies `source` (from its current position) into the store as file_id; its size in bytes."""
        ...

    def read(self, file_id: str) -> bytes: ...

    def delete(self, file_id: str) -> None:
        """Removes the file; nothing to do when it is not there."""
        ...


def open_store(location: str) -> FileStore:
    """A directory, or an object store for an `s3://` URL."""
    if "://" in location:
        return ObjectStore(location)
    return DirectoryStore(location)


def check_store(location: str) -> None:
    """Opens the store and reads it once: a ValueError saying what to change when it cannot be used (a directory that
    cannot be made, a bucket that does not exist, a wrong endpoint or credentials), at start, not at the first
    upload."""
    try:
        store = open_store(location)
        if isinstance(store, ObjectStore):
            store.check()
    except OSError as err:
        what = "--batch-store" if "://" in location else "--batch-dir"
        hint = ("check the bucket's name, AWS_ENDPOINT_URL, AWS_REGION and the credentials" if "://" in location
                else "give a directory this process may write")
        raise ValueError(f"{what} {location[:200]}: {err}; {hint}") from None


def put_bytes(store: FileStore, file_id: str, data: bytes) -> int:
    import io

    return store.put_from(file_id, io.BytesIO(data))


class DirectoryStore:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, file_id: str) -> Path:
        return self.root / f"{check_id(file_id)}.jsonl"

    def put_from(self, file_id: str, source: BinaryIO) -> int:
        """Copies `source` into the store as file_id; its size in bytes."""
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".upload-")
        try:
            with os.fdopen(fd, "wb") as out:
                shutil.copyfileobj(source, out, 1 << 20)
                out.flush()
                os.fsync(out.fileno())
                size = out.tell()
            os.replace(tmp, self.path(file_id))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return size

    def read(self, file_id: str) -> bytes:
        return self.path(file_id).read_bytes()

    def delete(self, file_id: str) -> None:
        self.path(file_id).unlink(missing_ok=True)


class ObjectStore:
    """An S3-compatible bucket (AWS S3, MinIO, Ceph RGW, GCS's and R2's S3 APIs...) through obstore (Apache Arrow's
    object_store). The URL names the bucket and a prefix; the endpoint, region and credentials come from the usual
    environment variables (AWS_ENDPOINT_URL, AWS_REGION, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN;
    AWS_ALLOW_HTTP=true for a plain-HTTP endpoint), or a pod's web identity / instance role."""

    def __init__(self, url: str) -> None:
        from obstore.store import from_url

        scheme, _, rest = url.partition("://")
        bucket = rest.split("/", 1)[0]
        if scheme != "s3" or not bucket:
            raise ValueError(f"--batch-store takes s3://BUCKET[/PREFIX], not {url[:200]!r}")
        self.url = url
        try:
            # a few quick retries, not obstore's default of 10 over up to 3 minutes: a client waits on an upload, and
            # a store that stays away is a 503 it can retry (the runner retries on its own)
            self.store = from_url(url, retry_config={
                "max_retries": 3, "retry_timeout": datetime.timedelta(seconds=15),
                "backoff": {"init_backoff": datetime.timedelta(milliseconds=100),
                            "max_backoff": datetime.timedelta(seconds=2), "base": 2.0}})
        except Exception as err:  # noqa: BLE001 - obstore's configuration errors: say which
            raise ValueError(f"--batch-store {url[:200]}: {err}") from None

    def check(self) -> None:
        """Reads the bucket once (a listing of at most one key): an OSError naming what failed if it cannot."""
        import obstore

        self._call(lambda: next(iter(obstore.list(self.store, chunk_size=1)), None))

    def put_from(self, file_id: str, source: BinaryIO) -> int:
        import obstore

        start = source.tell()
        size = source.seek(0, os.SEEK_END) - start
        source.seek(start)
        self._call(lambda: obstore.put(self.store, f"{check_id(file_id)}.jsonl", source))
        return size

    def read(self, file_id: str) -> bytes:
        import obstore

        return self._call(lambda: bytes(obstore.get(self.store, f"{check_id(file_id)}.jsonl").bytes()))

    def delete(self, file_id: str) -> None:
        import obstore

        self._call(lambda: obstore.delete(self.store, f"{check_id(file_id)}.jsonl"))

    def _call(self, do):  # noqa: ANN001, ANN202 - a thunk and its value
        from obstore.exceptions import BaseError

        try:
            return do()
        except FileNotFoundError:
            raise
        except BaseError as err:  # the store away, refused credentials, a missing bucket: an OSError as a disk's
            raise OSError(f"the object store {self.url} failed: {str(err).splitlines()[0][:300]}") from None
