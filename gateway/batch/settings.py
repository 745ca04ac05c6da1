"""The Batch API's settings (`kvfleet gateway --batch-dir DIR` or `--batch-store URL`), one place for their defaults."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_FILE_BYTES = 100 * 1024 * 1024
DEFAULT_MAX_LINES = 50_000  # requests in one input file (OpenAI's)
DEFAULT_MAX_ACTIVE = 16  # a tenant's unfinished batches
DEFAULT_FILE_TTL_S = 30 * 24 * 3600  # files without expires_after are deleted this long after they are made
DEFAULT_SHARE = 0.25  # of each engine's batch slots, the most batch work holds (gateway/batch/capacity.py)


@dataclass(frozen=True)
class BatchSettings:
    store: str  # the file store: a directory (local disk, a PersistentVolume every replica mounts) or an s3:// URL
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES  # an upload over it: 413
    max_lines: int = DEFAULT_MAX_LINES
    max_active: int = DEFAULT_MAX_ACTIVE
    share: float = DEFAULT_SHARE
    max_tokens: int | None = None  # a tenant's tokens enqueued in unfinished batches (a key's batch_tokens= wins)
    file_ttl_s: int = DEFAULT_FILE_TTL_S  # 0: files are kept until deleted

    def __post_init__(self) -> None:
        for flag, value in (("--batch-max-file-bytes", self.max_file_bytes), ("--batch-max-lines", self.max_lines),
                            ("--batch-max-active", self.max_active)):
            if value < 1:
                raise ValueError(f"{flag} must be at least 1, not {value}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"--batch-max-tokens must be at least 1, not {self.max_tokens}")
        if self.file_ttl_s < 0:
            raise ValueError(f"--batch-file-ttl must be 0 (keep) or a number of seconds, not {self.file_ttl_s}")
        if not 0 < self.share <= 1:
            raise ValueError(f"--batch-share must be a fraction in (0, 1], not {self.share}")
