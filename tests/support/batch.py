"""The Batch API as the openai client uses it: request lines, files, waiting for a batch to end."""

from __future__ import annotations

import json
import time

from openai import OpenAI


def client(url: str, tenant: str = "team-a") -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60,
                  default_headers={"x-kvfleet-tenant": tenant})


def request_line(custom_id: str, model: str, content: str = "Say hi", max_tokens: int = 4,
                 url: str = "/v1/chat/completions") -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url,
            "body": {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                     "temperature": 0}}


def jsonl(lines: list) -> bytes:
    return b"".join((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines)


def wait_done(c: OpenAI, batch_id: str, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while True:
        batch = c.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}: {batch.request_counts}"
        time.sleep(0.3)


def output_lines(c: OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in c.files.content(file_id).text.splitlines()]
