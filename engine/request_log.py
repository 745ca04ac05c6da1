"""One log line per finished request (ids, token counts, timings, finish reason; never the prompt text)."""

from __future__ import annotations

import json
import logging
import time

from kvfleet.engine.outputs import RequestOutput

log = logging.getLogger("kvfleet.requests")


def request_fields(out: RequestOutput) -> dict:
    m = out.metrics
    fields: dict = {"request_id": out.request_id, "prompt_tokens": len(out.prompt_token_ids),
                    "completion_tokens": out.num_output_tokens, "finish_reason": out.finish_reason}
    if m is not None and m.finished_time is not None:
        fields["queue_time_s"] = _seconds(m.first_scheduled_time, m.arrival_time)
        fields["ttft_s"] = _seconds(m.first_token_time, m.arrival_time)
        fields["total_s"] = _seconds(m.finished_time, m.arrival_time)
        fields["cached_tokens"] = m.num_cached_tokens
        fields["preemptions"] = m.num_preemptions
    if out.error:
        fields["error"] = out.error
    return fields


def log_finished(out: RequestOutput, prompt_text: str | None = None) -> None:
    """Log a finished request; the prompt text only when the operator asked for it (--log-prompts)."""
    fields = request_fields(out)
    if prompt_text is not None:
        fields["prompt"] = prompt_text
    log.info(" ".join(f"{k}={v!r}" if k == "prompt" else f"{k}={v}" for k, v in fields.items()),
             extra={"fields": fields})


def _seconds(end: float | None, start: float) -> float | None:
    return None if end is None else round(end - start, 4)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, plus a request's fields when it has them."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + "Z",
                 "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        entry.update(getattr(record, "fields", {}))
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)
