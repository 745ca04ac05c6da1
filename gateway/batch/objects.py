"""The Batch API's objects and request checks, as OpenAI defines them (pure): a batch's public form from its stored
fields, the completion window, metadata, and list pagination."""

from __future__ import annotations

import json
import re

from kvfleet.fleet.errors import APIError

STATUSES = ("validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled")
RUNNING = ("validating", "in_progress")  # a cancel or the window's end still changes these
FINISHED = ("failed", "completed", "expired", "cancelled")
WINDOW = re.compile(r"^([1-9][0-9]{0,4})(m|h)$")
MIN_WINDOW_S, MAX_WINDOW_S = 60, 7 * 24 * 3600
MAX_METADATA, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
DEFAULT_LIMIT, MAX_LIMIT = 20, 100
MIN_EXPIRY_S, MAX_EXPIRY_S = 3600, 30 * 24 * 3600  # OpenAI's expires_after: one hour to 30 days


def expiry_seconds(anchor: object, seconds: object, param: str) -> int:
    """OpenAI's `expires_after` ({"anchor": "created_at", "seconds": N}): N, from one hour to 30 days. A multipart
    upload sends both as text fields."""
    try:
        value = int(seconds) if isinstance(seconds, (int, str)) and not isinstance(seconds, bool) else 0
    except ValueError:
        value = 0
    if anchor != "created_at" or not MIN_EXPIRY_S <= value <= MAX_EXPIRY_S:
        raise APIError(400, f"{param} must be {{\"anchor\": \"created_at\", \"seconds\": N}} with N from "
                            f"{MIN_EXPIRY_S} (an hour) to {MAX_EXPIRY_S} (30 days)", param=param)
    return value


def window_seconds(window: object) -> int:
    """`completion_window`: OpenAI's "24h", or any whole minutes or hours from 1m to 168h."""
    match = WINDOW.match(window) if isinstance(window, str) else None
    seconds = int(match[1]) * (60 if match[2] == "m" else 3600) if match else 0
    if not MIN_WINDOW_S <= seconds <= MAX_WINDOW_S:
        raise APIError(400, f"completion_window must be a duration such as \"24h\" (whole minutes or hours, 1m to "
                            f"168h), not {window!r:.40}", param="completion_window")
    return seconds


def check_metadata(metadata: object) -> dict[str, str] | None:
    if metadata is None:
        return None
    if (not isinstance(metadata, dict) or len(metadata) > MAX_METADATA
            or not all(isinstance(k, str) and isinstance(v, str) and len(k) <= MAX_METADATA_KEY
                       and len(v) <= MAX_METADATA_VALUE for k, v in metadata.items())):
        raise APIError(400, f"metadata must be an object of at most {MAX_METADATA} string pairs (keys up to "
                            f"{MAX_METADATA_KEY} characters, values up to {MAX_METADATA_VALUE})", param="metadata")
    return metadata


def list_limit(limit: object) -> int:
    try:
        value = DEFAULT_LIMIT if limit is None else int(limit)
    except (TypeError, ValueError):
        value = 0
    if not 1 <= value <= MAX_LIMIT:
        raise APIError(400, f"limit must be a whole number from 1 to {MAX_LIMIT}, not {limit!r:.20}", param="limit")
    return value


def page(items: list[dict], after: str | None, limit: int) -> dict:
    """OpenAI's list object over items in list order, starting after the id `after`."""
    start = 0
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise APIError(400, f"after {after[:80]!r} is not an id in this list", param="after")
        start = ids.index(after) + 1
    data = items[start:start + limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": start + limit < len(items)}


def public_batch(batch_id: str, fields: dict[str, str], completed: int, failed: int) -> dict:
    """The Batch object from its stored fields and its answer counts."""
    record = json.loads(fields["record"])

    def at(status: str) -> int | None:
        value = fields.get(f"{status}_at")
        return int(value) if value is not None else None

    errors = json.loads(fields["errors"]) if fields.get("errors") else None
    return {
        "id": batch_id, "object": "batch", "endpoint": record["endpoint"], "errors": errors,
        "input_file_id": record["input_file_id"], "completion_window": record["completion_window"],
        "status": fields["status"], "output_file_id": fields.get("output_file_id"),
        "error_file_id": fields.get("error_file_id"), "created_at": record["created_at"],
        "in_progress_at": at("in_progress"), "expires_at": record["expires_at"], "finalizing_at": at("finalizing"),
        "completed_at": at("completed"), "failed_at": at("failed"), "expired_at": at("expired"),
        "cancelling_at": at("cancelling"), "cancelled_at": at("cancelled"),
        "request_counts": {"total": int(fields.get("total", 0)), "completed": completed, "failed": failed},
        "metadata": record.get("metadata"),
    }
