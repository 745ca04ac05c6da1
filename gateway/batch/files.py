"""Where the Batch API's file bodies live: a directory (local disk for `kvfleet up`; a PersistentVolume shared by the
gateway replicas on Kubernetes). A file is written to a temporary name and renamed into place, so a reader never
sees half of one; ids are checked before they touch a path.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import tempfile
from pathlib import Path

FILE_ID = re.compile(r"^file-[0-9a-f]{24}$")
BATCH_ID = re.compile(r"^batch_[0-9a-f]{24}$")


def new_file_id() -> str:
    return "file-" + secrets.token_hex(12)


def new_batch_id() -> str:
    return "batch_" + secrets.token_hex(12)


class FileStore:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, file_id: str) -> Path:
        if not FILE_ID.match(file_id):
            raise ValueError(f"not a file id: {file_id[:80]!r}")
        return self.root / f"{file_id}.jsonl"

    def put_from(self, file_id: str, source) -> int:  # noqa: ANN001 - a binary file object
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

    def put(self, file_id: str, data: bytes) -> int:
        import io

        return self.put_from(file_id, io.BytesIO(data))

    def read(self, file_id: str) -> bytes:
        return self.path(file_id).read_bytes()

    def delete(self, file_id: str) -> None:
        self.path(file_id).unlink(missing_ok=True)
